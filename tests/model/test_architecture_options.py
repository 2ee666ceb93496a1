"""The [model] options that other architectures' checkpoints need: qkv_bias (Qwen2), sliding_window (Mistral)
and rope_scaling (Llama 3.1's "llama3", and "linear").

Each is checked for what it computes against a reference (the attention tests pin the window's mask to the
definition; here the whole model's cached pass against its full pass), for its validation messages, and
for surviving config.toml.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tinylm.config import Config, GPTConfig, build_config, dump_toml, load_config_file
from tinylm.errors import TinyLMError
from tinylm.generate.cache import KVCache
from tinylm.model import GPT

LLAMA3 = dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
              rope_original_context=16)


def config(**changes) -> GPTConfig:
    base = GPTConfig(vocab_size=61, block_size=48, n_layer=2, d_model=32, n_head=4, n_kv_head=2, mlp="swiglu",
                     norm="rmsnorm", positions="rope", bias=False, init_std=0.3)
    return dataclasses.replace(base, **changes)


def build(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg).eval()


def test_qkv_bias_puts_biases_on_q_k_v_only():
    model = build(config(qkv_bias=True))
    names = {n for n, _ in model.named_parameters() if n.endswith(".bias")}
    assert names == {f"blocks.{i}.attn.{w}.bias" for i in range(2) for w in ("W_q", "W_k", "W_v")}
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(idx)[0]
        model.blocks[0].attn.W_k.bias.normal_()
        assert not torch.allclose(model(idx)[0], before, atol=1e-3)  # the bias is used


@pytest.mark.parametrize("attention", ["sdpa", "reference", "tiled"])
def test_a_windowed_model_cached_step_by_step_equals_its_full_pass(attention):
    model = build(config(sliding_window=5, attention=attention, tile_size=4, **LLAMA3))
    idx = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx)[0]
        cache = KVCache.for_model(model, 2, 30)
        steps = [model(idx[:, :7], kv_cache=cache)[0]]
        steps += [model(idx[:, t:t + 1], kv_cache=cache)[0] for t in range(7, 30)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
        # the window matters: without it the late positions come out differently
        unwindowed = build(config(attention=attention, tile_size=4, **LLAMA3))
        assert not torch.allclose(unwindowed(idx)[0][:, 20:], full[:, 20:], atol=1e-3)
        torch.testing.assert_close(unwindowed(idx)[0][:, :5], full[:, :5], atol=1e-5, rtol=0)


def test_a_window_as_long_as_the_context_is_no_window():
    idx = torch.randint(0, 61, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(build(config(sliding_window=48))(idx)[0], build(config())(idx)[0], atol=0, rtol=0)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(bias=True, qkv_bias=True), "qkv_bias puts biases on W_q, W_k and W_v of a bias = false model"),
        (dict(sliding_window=0), "sliding_window must be a positive integer"),
        (dict(rope_scaling="linear"), "rope_scaling = 'linear' needs rope_factor"),
        (dict(rope_scaling="llama3", rope_factor=8.0), "rope_scaling = 'llama3' needs rope_low_freq_factor"),
        (dict(rope_factor=8.0), "rope_factor is a setting of rope_scaling 'linear' or 'llama3', and rope_scaling is "
                                "'none'"),
        (dict(rope_scaling="linear", rope_factor=2.0, rope_original_context=8), "rope_original_context is a setting "
                                                                                  "of rope_scaling 'llama3'"),
        (dict(rope_scaling="linear", rope_factor=0.0), "rope_factor must be a positive number"),
        ({**LLAMA3, "rope_high_freq_factor": 1.0}, r"rope_high_freq_factor \(1.0\) must be larger than"),
        (dict(positions="learned", rope_scaling="linear", rope_factor=2.0), "rope_scaling = 'linear' rescales "
                                                                             "RoPE's frequencies, but positions"),
    ],
)
def test_each_bad_setting_is_one_line_that_names_it(bad, match):
    with pytest.raises(TinyLMError, match=match) as info:
        config(**bad)
    assert "\n" not in str(info.value)


def test_the_options_round_trip_through_config_toml(tmp_path):
    cfg = Config(model=config(qkv_bias=True, sliding_window=7, **LLAMA3))
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(cfg.to_dict()))
    assert build_config(load_config_file(path)).model == cfg.model
    plain = Config(model=config()).to_dict()["model"]  # unset options stay out of the file
    assert not {"sliding_window", "rope_factor", "rope_original_context"} & set(plain)
