"""Llama 3.1 (llama3 RoPE scaling), Qwen2 (q, k, v biases) and Mistral (a sliding window) checkpoints, with
`transformers` and llama.cpp as the oracles.

Tiny random checkpoints built by `transformers`' own classes and ``save_pretrained`` must import with the
same logits (within 1e-4, float32), the same greedy tokens through tinylm's cached decoding (for Mistral,
well past the window, so the cache's window is what is tested), export back to the same architecture with
the same logits, and run in llama.cpp with the same greedy tokens where llama.cpp can run them. What does
not map is refused by one line that names the config key.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from exportkit import PROMPT, edit_config, greedy, imported_fixture, randomize, save

from tinylm.errors import TinyLMError
from tinylm.export import architecture_for, export_gguf, export_hf, import_hf
from tinylm.generate.engine import Engine
from tinylm.generate.sampling import SamplingParams

import transformers
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ATOL = 1e-4
WINDOW = 6  # Mistral's and the windowed Qwen2's: shorter than every sequence below
# head size 8, theta 100: wavelengths 6.3, 20, 63 and 199 positions; against an original context of 32
# with factors 1 and 4 (bounds 8 and 32) the first pair keeps its frequency, the second blends, the
# last two are divided by the factor: every branch of llama3's rule is used
LLAMA3 = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
SHAPE = dict(vocab_size=302, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=297,
             eos_token_id=298)


def hf_llama3(**changes) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return randomize(LlamaForCausalLM(LlamaConfig(**{**SHAPE, "rope_parameters": dict(LLAMA3), **changes})))


def hf_qwen2(**changes) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    rope = {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}
    return randomize(Qwen2ForCausalLM(Qwen2Config(**{**SHAPE, "rope_parameters": rope, **changes})))


def hf_mistral(**changes) -> MistralForCausalLM:
    torch.manual_seed(0)
    config = MistralConfig(**{**SHAPE, "sliding_window": WINDOW, "rope_parameters": {"rope_type": "default",
                                                                                       "rope_theta": 1000.0},
                              **changes})
    return randomize(MistralForCausalLM(config))


MAKERS = {
    "llama3-gqa": hf_llama3,
    "qwen2-linear-rope": hf_qwen2,
    "qwen2-windowed-tied": lambda: hf_qwen2(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
                                            tie_word_embeddings=True),
    "mistral-windowed": hf_mistral,
}
CLASSES = {"llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def cached_greedy(model, start: list[int], steps: int) -> list[int]:
    """tinylm's engine: prefill, then one cached step per token (no stop id, nothing excluded)."""
    params = SamplingParams(max_new_tokens=steps, temperature=0, stop_ids=[])
    [completion] = Engine(model, params).generate([start])
    return start + completion.token_ids


imported = imported_fixture(MAKERS)


def test_the_checkpoint_imports_with_the_same_logits_and_cached_greedy_tokens(imported, tokenizer):
    name, hf, model = imported
    config = model.config
    assert config.qkv_bias == name.startswith("qwen2") and not config.bias
    assert config.sliding_window == (WINDOW if "windowed" in name else None)
    assert config.rope_scaling == {"llama3": "llama3", "qwen2": "linear", "mistral": "none"}[name.split("-")[0]]
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    assert ids.size(1) > 4 * WINDOW
    with torch.no_grad():
        ours, theirs = model(ids)[0], hf(ids).logits
        assert ours.abs().max() > 1.0
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
        # 40 new tokens after a 3-token prompt: the window slides past most of the sequence
        start = tokenizer.encode("def ")
        expected = greedy(lambda x: hf(x).logits, start, steps=40)
    assert cached_greedy(model, start, 40) == expected
    assert len(set(expected[len(start):])) > 5


def test_without_the_family_switch_the_logits_differ(imported, tokenizer):
    """The checks above can fail: the same weights without the scaling, the window or the q, k, v biases compute
    something else."""
    name, hf, model = imported
    switch = {"llama3": dict(rope_scaling="none", rope_factor=None, rope_low_freq_factor=None,
                             rope_high_freq_factor=None, rope_original_context=None),
              "qwen2": dict(sliding_window=None) if "windowed" in name else dict(rope_scaling="none", rope_factor=None),
              "mistral": dict(sliding_window=None)}[name.split("-")[0]]
    other = type(model)(dataclasses.replace(model.config, **switch)).eval()
    other.load_state_dict(model.state_dict())
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        assert (other(ids)[0] - hf(ids).logits).abs().max() > 1e-2


def test_export_back_gives_the_same_architecture_and_logits(imported, tokenizer, tmp_path):
    name, hf, model = imported
    export_hf(model, tokenizer, tmp_path / "back")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again).__name__ == CLASSES[name.split("-")[0]]
    assert getattr(again.config, "sliding_window", None) == getattr(hf.config, "sliding_window", None)
    assert again.config.rope_parameters == hf.config.rope_parameters
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)
    assert import_hf(tmp_path / "back")[2] == model.config


# ----- llama.cpp ------------------------------------------------------------------------------------------


def llama_cpp_greedy(path, n_ctx: int, start: list[int], steps: int = 20) -> tuple[list[int], np.ndarray]:
    from llama_cpp import Llama

    # a float32 KV cache (GGML_TYPE_F32 = 0), so the logits can be compared closely
    llm = Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, n_threads=1, type_k=0, type_v=0, verbose=False)
    llm.eval(start)
    tokens = list(start)
    for _ in range(steps):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    return tokens, np.array(llm.scores[: len(tokens)])


@pytest.mark.parametrize("name", ["llama3-gqa", "qwen2-linear-rope", "mistral-wide-window"])
def test_llama_cpp_runs_the_gguf_export_with_our_greedy_tokens(tmp_path, tokenizer, name):
    import llama_cpp  # noqa: F401  (in the test extra: absent, this fails rather than skips)
    hf = hf_mistral(sliding_window=64) if name.startswith("mistral") else MAKERS[name]()
    save(hf.eval(), tmp_path / "hf", tokenizer)
    model, _, config = import_hf(tmp_path / "hf")
    export_gguf(model, tokenizer, tmp_path / "m.gguf")
    start = tokenizer.encode("def ")
    tokens, scores = llama_cpp_greedy(tmp_path / "m.gguf", config.block_size, start)
    with torch.no_grad():
        assert tokens == greedy(lambda x: model(x)[0], start)
        ours = model(torch.tensor([tokens]))[0][0].numpy()
    np.testing.assert_allclose(scores, ours, atol=1e-3, rtol=0)


def test_llama3_scaling_without_rope_freqs_is_another_model_in_llama_cpp(tmp_path, tokenizer, monkeypatch):
    """The rope_freqs tensor is what carries the scaling into llama.cpp: left out, the scores move."""
    import llama_cpp  # noqa: F401  (in the test extra: absent, this fails rather than skips)
    from tinylm.export import gguf as gguf_export

    save(hf_llama3().eval(), tmp_path / "hf", tokenizer)
    model, _, config = import_hf(tmp_path / "hf")
    monkeypatch.setattr(gguf_export, "rope_freqs", lambda c: np.ones(c.head_dim // 2, dtype=np.float32))
    export_gguf(model, tokenizer, tmp_path / "m.gguf")
    tokens = tokenizer.encode(PROMPT)[:40]
    _, scores = llama_cpp_greedy(tmp_path / "m.gguf", config.block_size, tokens, steps=0)
    with torch.no_grad():
        assert np.abs(scores - model(torch.tensor([tokens]))[0][0].numpy()).max() > 1e-2


def test_a_window_llama_cpp_cannot_run_is_refused_in_one_line(tmp_path, tokenizer):
    save(hf_mistral().eval(), tmp_path / "hf", tokenizer)
    model, _, _ = import_hf(tmp_path / "hf")
    with pytest.raises(TinyLMError) as info:
        export_gguf(model, tokenizer, tmp_path / "m.gguf")
    assert str(info.value) == (
        "this model exports to transformers but not to llama.cpp: sliding_window = 6 is shorter than block_size = "
        "64, and llama.cpp's llama graph attends to the whole context")
    assert not (tmp_path / "m.gguf").exists()


# ----- what maps and what does not ------------------------------------------------------------------------


def test_architecture_for_follows_the_switches():
    base = import_config(hf_llama3())
    plain = dataclasses.replace(base, rope_scaling="none", rope_factor=None, rope_low_freq_factor=None,
                                rope_high_freq_factor=None, rope_original_context=None)
    assert architecture_for(base) == architecture_for(plain) == "llama"
    assert architecture_for(dataclasses.replace(plain, bias=False, qkv_bias=True)) == "qwen2"
    assert architecture_for(dataclasses.replace(plain, qkv_bias=True, sliding_window=8)) == "qwen2"
    assert architecture_for(dataclasses.replace(plain, sliding_window=8)) == "mistral"
    with pytest.raises(TinyLMError, match=r"neither GPT-2 nor Mistral computes it .*as MistralForCausalLM: bias = "
                                          r"true \(Mistral's MLP has no biases\)"):
        architecture_for(dataclasses.replace(plain, sliding_window=8, bias=True))
    with pytest.raises(TinyLMError, match=r"neither GPT-2 nor Qwen3 .*sliding_window = 8 \(Qwen3 attends to the "
                                          r"whole context; Mistral and Qwen2 have a window\)"):
        architecture_for(dataclasses.replace(plain, sliding_window=8, qk_norm=True))


def import_config(hf):
    from tinylm.export import config_from_hf

    return config_from_hf(hf.config.to_dict())[0]


@pytest.mark.parametrize(
    "make, changes, message",
    [
        # save_pretrained writes the layer_types it derived, which transformers then reads instead
        (hf_qwen2, dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=None),
         r"max_window_layers gives a sliding window to some layers only \(1 of 2\)"),
        (hf_qwen2, dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention",
                                                                                 "sliding_attention"]),
         r"layer_types gives a sliding window to some layers only"),
        (hf_mistral, dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0}),
         r"its RoPE is scaled \('yarn'\); tinylm computes the plain rotation and the 'linear' and 'llama3' scalings"),
        (hf_llama3, dict(rope_parameters={k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}),
         r"its 'llama3' RoPE scaling has no 'original_max_position_embeddings'"),
        (hf_mistral, dict(sliding_window=0), r"sliding_window must be a positive integer"),
    ],
    ids=["qwen2-some-layers", "qwen2-layer-types", "yarn", "llama3-no-context", "window-0"],
)
def test_variants_that_do_not_map_are_one_line_naming_the_key(tmp_path, tokenizer, make, changes, message):
    save(make().eval(), tmp_path / "hf", tokenizer)
    edit_config(tmp_path / "hf", **changes)
    with pytest.raises(TinyLMError, match=message) as info:
        import_hf(tmp_path / "hf")
    assert "\n" not in str(info.value) and "config.json" in str(info.value)


def test_missing_keys_mean_what_transformers_reads_them_as(tmp_path, tokenizer):
    """A config.json without sliding_window is a 4096 window to MistralConfig; with Qwen2's window off (or on only
    from max_window_layers = depth on) no layer has one."""
    save(hf_mistral().eval(), tmp_path / "mistral", tokenizer)
    config = json.loads((tmp_path / "mistral" / "config.json").read_text())
    del config["sliding_window"]
    (tmp_path / "mistral" / "config.json").write_text(json.dumps(config))
    assert MistralConfig.from_dict(config).sliding_window == 4096
    assert import_hf(tmp_path / "mistral")[2].sliding_window == 4096
    save(hf_qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=2).eval(), tmp_path / "qwen2", tokenizer)
    assert import_hf(tmp_path / "qwen2")[2].sliding_window is None


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3"])
def test_a_head_size_of_its_own_is_d_head(tmp_path, tokenizer, name):
    """head_dim 16 with hidden_size 32 and 4 heads (Qwen3's and Mistral NeMo's shape): the heads span 64
    dimensions, W_o maps them back to 32; same logits, back to the same config, and llama.cpp runs it."""
    if name == "qwen3":
        hf = randomize(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **{**SHAPE, "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}})))
    else:
        hf = {"mistral": hf_mistral, "qwen2": hf_qwen2}[name](head_dim=16, sliding_window=64)
    save(hf.eval(), tmp_path / "hf", tokenizer)
    model, _, config = import_hf(tmp_path / "hf")
    assert config.d_head == 16 and config.head_dim * config.n_head == 64 != config.d_model
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        assert (model(ids)[0] - hf(ids).logits).abs().max().item() < ATOL
    export_hf(model, tokenizer, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["head_dim"] == 16
    assert import_hf(tmp_path / "back")[2] == config
    import llama_cpp  # noqa: F401  (in the test extra: absent, this fails rather than skips)
    if name == "qwen2":  # llama.cpp's qwen2 graph takes the head size from n_embd / n_head: refused in one line
        with pytest.raises(TinyLMError, match="d_head = 16 differs from d_model / n_head.*qwen2 graph"):
            export_gguf(model, tokenizer, tmp_path / "m.gguf")
        return
    export_gguf(model, tokenizer, tmp_path / "m.gguf")
    start = tokenizer.encode("def ")
    tokens, _ = llama_cpp_greedy(tmp_path / "m.gguf", config.block_size, start)
    with torch.no_grad():
        assert tokens == greedy(lambda x: model(x)[0], start)
