"""Gemma 2, Gemma 3 (text) and Phi-3 checkpoints, with `transformers` and llama.cpp as the oracles.

Tiny random checkpoints built by `transformers`' own classes and ``save_pretrained`` must import with the
same logits (float32), the same greedy tokens as ``generate`` through tinylm's cached decoding (well past
the window, so the windowed and whole-context layers both count), export back to the same class with the
same logits and configuration, and run in llama.cpp with the same greedy tokens. Every Gemma option
changes the logits (so each is tested), and what does not map is refused by one line that names the key.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from exportkit import PROMPT, edit_config, greedy, imported_fixture, randomize, save

from tinylm.errors import TinyLMError
from tinylm.export import export_gguf, export_hf, import_hf
from tinylm.generate.engine import Engine
from tinylm.generate.sampling import SamplingParams

import transformers
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Phi3Config,
    Phi3ForCausalLM,
)

ATOL = 1e-4
WINDOW = 6
SHAPE = dict(vocab_size=302, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=297, eos_token_id=298, pad_token_id=299)


def hf_gemma2(**changes) -> Gemma2ForCausalLM:
    """Layer 0 windowed, layer 1 whole (Gemma 2's alternation); caps low enough to bind; q.k / sqrt(12), d_h 8.

    Untied: random weights with a tied head (and scaled embeddings) predict the last token again and again, which
    would make the greedy checks too easy; the llama.cpp test has the tied head llama.cpp's gemma2 graph needs.
    """
    torch.manual_seed(0)
    config = Gemma2Config(**{**SHAPE, "head_dim": 8, "query_pre_attn_scalar": 12, "sliding_window": WINDOW,
                             "attn_logit_softcapping": 2.0, "final_logit_softcapping": 8.0, "tie_word_embeddings": False,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}, **changes})
    return randomize(Gemma2ForCausalLM(config))


def hf_gemma3(**changes) -> Gemma3ForCausalLM:
    """QK-norm, an untied head, and the windowed layer rotating with its own base (50) against the whole one's."""
    torch.manual_seed(0)
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}
    config = Gemma3TextConfig(**{**SHAPE, "head_dim": 8, "query_pre_attn_scalar": 12, "sliding_window": WINDOW,
                                 "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": rope,
                                 "tie_word_embeddings": False, **changes})
    return randomize(Gemma3ForCausalLM(config))


def hf_phi3(**changes) -> Phi3ForCausalLM:
    torch.manual_seed(0)
    return randomize(Phi3ForCausalLM(Phi3Config(**{**SHAPE, "rope_parameters": {"rope_type": "default",
                                                                                  "rope_theta": 500.0}, **changes})))


MAKERS = {"gemma2": hf_gemma2, "gemma3": hf_gemma3, "phi3": hf_phi3}
CLASSES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}


imported = imported_fixture(MAKERS)


def test_the_checkpoint_imports_with_the_same_logits_and_greedy_tokens_as_generate(imported, tokenizer):
    name, hf, model = imported
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    assert ids.size(1) > 4 * WINDOW
    with torch.no_grad():
        ours, theirs = model(ids)[0], hf(ids).logits
        assert ours.abs().max() > 1.0
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
        start = tokenizer.encode("def ")
        expected = hf.generate(torch.tensor([start]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                               pad_token_id=0, attention_mask=torch.ones(1, len(start), dtype=torch.long))[0].tolist()
    # the engine: a prefill, then one cached step per token, 40 of them: the window slides past most of it
    [completion] = Engine(model, SamplingParams(max_new_tokens=40, temperature=0, stop_ids=[])).generate([start])
    assert start + completion.token_ids == expected
    assert len(set(expected[len(start):])) > 5


# each Gemma option, turned off on the same weights: the logits move (so the parity above tests every one)
SWITCHES = {
    "gemma2": dict(embed_scale=False, attn_softcap=None, logit_softcap=None, attn_scale_dim=None,
                   sliding_window_pattern=None, norm_position="pre", mlp="swiglu"),
    "gemma3": dict(qk_norm=False, rope_local_theta=None, sliding_window_pattern=None),
}


@pytest.mark.parametrize("option", [(name, key) for name, switches in SWITCHES.items() for key in switches],
                         ids=lambda o: f"{o[0]}-{o[1]}")
def test_without_each_gemma_option_the_logits_differ(option, tokenizer, tmp_path):
    name, key = option
    hf = MAKERS[name]().eval()
    save(hf, tmp_path, tokenizer)
    model, _, config = import_hf(tmp_path)
    other = type(model)(dataclasses.replace(config, **{key: SWITCHES[name][key]})).eval()
    other.load_state_dict(model.state_dict(), strict=False)  # sandwich -> pre drops the output norms
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        assert (other(ids)[0] - hf(ids).logits).abs().max() > 1e-2


def test_export_back_gives_the_same_class_logits_and_config(imported, tokenizer, tmp_path):
    name, hf, model = imported
    export_hf(model, tokenizer, tmp_path / "back")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again).__name__ == CLASSES[name]
    assert getattr(again.config, "layer_types", None) == getattr(hf.config, "layer_types", None)
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)
    assert import_hf(tmp_path / "back")[2] == model.config
    if name == "phi3":  # fused again as Phi-3 stores them
        from safetensors import safe_open

        with safe_open(tmp_path / "back" / "model.safetensors", framework="pt") as f:
            assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= set(f.keys())


def test_older_gemma3_files_with_rope_local_base_freq_and_a_pattern_import_the_same(tmp_path, tokenizer):
    """config.json files written before layer_types and per-layer rope_parameters: sliding_window_pattern, rope_theta
    and rope_local_base_freq say the same."""
    hf = hf_gemma3().eval()
    save(hf, tmp_path, tokenizer)
    model = import_hf(tmp_path)[0]
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        del config[key]
    config.update(sliding_window_pattern=2, rope_theta=1000.0, rope_local_base_freq=50.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert import_hf(tmp_path)[2] == model.config


# ----- llama.cpp ------------------------------------------------------------------------------------------


# what llama.cpp's graphs fix: Gemma's scores divided by sqrt(d_h), Gemma 2's head tied; Phi-3 without a window
GGUF_MAKERS = {
    "gemma2": lambda: hf_gemma2(query_pre_attn_scalar=8, tie_word_embeddings=True),
    "gemma3": lambda: hf_gemma3(query_pre_attn_scalar=8, layer_types=None),  # llama.cpp's: 5 windowed in 6
    "phi3": hf_phi3,
}


@pytest.mark.parametrize("name", list(GGUF_MAKERS))
def test_llama_cpp_runs_the_gguf_export_with_our_greedy_tokens(tmp_path, tokenizer, name):
    import llama_cpp  # noqa: F401  (in the test extra: absent, this fails rather than skips)
    from llama_cpp import Llama

    hf = GGUF_MAKERS[name]().eval()
    save(hf, tmp_path / "hf", tokenizer)
    model, _, config = import_hf(tmp_path / "hf")
    export_gguf(model, tokenizer, tmp_path / "m.gguf")
    llm = Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=config.block_size, logits_all=True, n_threads=1,
                type_k=0, type_v=0, verbose=False)
    start = tokenizer.encode(PROMPT)[:8]
    llm.eval(start)
    tokens = list(start)
    for _ in range(30):  # past the window of 6
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    with torch.no_grad():
        assert tokens == greedy(lambda x: model(x)[0], start, steps=30)
        ours = model(torch.tensor([tokens]))[0][0]
        torch.testing.assert_close(ours, hf(torch.tensor([tokens])).logits[0], atol=ATOL, rtol=0)
        ours = ours.numpy()
    # ggml's GELU reads a float16 table: Gemma's scores agree to about 1e-2, Phi-3's (SiLU) closely
    np.testing.assert_allclose(np.array(llm.scores[: len(tokens)]), ours, atol=3e-2 if name != "phi3" else 1e-3,
                               rtol=0)


@pytest.mark.parametrize(
    "name, changes, message",
    [
        ("gemma2", dict(query_pre_attn_scalar=12), r"attn_scale_dim = 12 differs from d_h = 8, and llama.cpp's gemma2 "
                                                   r"graph divides the scores by sqrt\(d_h\)"),
        ("gemma2", dict(attn_logit_softcapping=None), r"attn_softcap is unset, and llama.cpp's gemma2 graph always caps"),
        ("gemma3", dict(layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8),
         r"sliding_window_pattern = 2 windows other layers than llama.cpp's gemma3 graph"),
        ("phi3", dict(sliding_window=WINDOW), r"sliding_window = 6 is shorter than block_size = 64, and llama.cpp's "
                                              r"phi3 graph attends to the whole context"),
    ],
    ids=["gemma2-query-scalar", "gemma2-no-cap", "gemma3-pattern", "phi3-window"],
)
def test_what_llama_cpp_fixes_otherwise_is_refused_in_one_line(tmp_path, tokenizer, name, changes, message):
    save(MAKERS[name](**changes).eval(), tmp_path / "hf", tokenizer)
    model, _, _ = import_hf(tmp_path / "hf")
    with pytest.raises(TinyLMError, match=message) as info:
        export_gguf(model, tokenizer, tmp_path / "m.gguf")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "m.gguf").exists()


# ----- what maps and what does not ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, changes, message",
    [
        ("phi3", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 500.0, "short_factor": [1.0] * 4,
                                       "long_factor": [2.0] * 4}),
         r"its RoPE is scaled \('longrope'\); .*\(key rope_parameters.rope_type\)"),
        ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}),
         r"partial_rotary_factor is 0.5, and tinylm rotates every coordinate of a head"),
        ("gemma2", dict(hidden_activation="gelu"), r"hidden_activation is 'gelu', and tinylm's GeGLU gates with GELU's "
                                                   r"tanh form"),
        ("gemma3", dict(num_hidden_layers=3, layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
         r"layer_types puts its whole-context layers at no regular interval"),
        ("gemma3", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                         "sliding_attention": {"rope_type": "linear", "rope_theta": 10.0,
                                                               "factor": 2.0}}),
         r"rope_parameters.sliding_attention scales RoPE \('linear'\)"),
        ("gemma3", dict(use_bidirectional_attention=True), r"use_bidirectional_attention is true"),
    ],
    ids=["phi3-longrope", "phi3-partial-rotary", "gemma2-erf-gelu", "gemma3-irregular-layers", "gemma3-local-scaling",
         "gemma3-bidirectional"],
)
def test_variants_that_do_not_map_are_one_line_naming_the_key(tmp_path, tokenizer, name, changes, message):
    save(MAKERS[name]().eval(), tmp_path, tokenizer)
    edit_config(tmp_path, **changes)
    with pytest.raises(TinyLMError, match=message) as info:
        import_hf(tmp_path)
    assert "\n" not in str(info.value) and "config.json" in str(info.value)


def test_export_as_names_an_architecture_that_must_fit(tmp_path, tokenizer):
    """A Phi-3 import is Llama's network: set to 'auto' it exports as Llama; asked as Gemma 2, the refusal says why."""
    save(hf_phi3().eval(), tmp_path / "hf", tokenizer)
    model, _, config = import_hf(tmp_path / "hf")
    assert config.export_as == "phi3"
    model.config = dataclasses.replace(config, export_as="auto")
    export_hf(model, tokenizer, tmp_path / "llama")
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    model.config = dataclasses.replace(config, export_as="gemma2")
    with pytest.raises(TinyLMError, match=r"cannot be exported as export_as = 'gemma2': Gemma2ForCausalLM cannot "
                                          r"express norm_position = 'pre' \(Gemma 2 normalizes each sublayer's input "
                                          r"and output: 'sandwich'\)"):
        export_hf(model, tokenizer, tmp_path / "gemma")


def test_the_accounting_counts_every_imported_parameter(imported):
    """Four norms a block for Gemma, three MLP matrices for GeGLU: `count_params` is the model's own count."""
    from tinylm.model.memory import count_params

    _, hf, model = imported
    assert count_params(model.config) == sum(p.numel() for p in model.parameters()) == hf.num_parameters()


@pytest.mark.parametrize("changes, message", [
    (dict(sliding_window_pattern=2), r"sliding_window_pattern = 2 is a setting of the windowed layers, and "
                                     r"sliding_window is unset"),
    (dict(rope_local_theta=10.0), r"rope_local_theta = 10.0 is a setting of the windowed layers"),
    (dict(sliding_window=4, sliding_window_pattern=1), r"sliding_window_pattern = 1 would give every layer the whole "
                                                       r"context"),
    (dict(sliding_window=4, rope_local_theta=10.0, positions="learned"), r"rope_local_theta is RoPE's base on the "
                                                                         r"windowed layers, but positions = 'learned'"),
    (dict(attn_softcap=0.0), r"attn_softcap must be a positive number"),
    (dict(attn_scale_dim=-4), r"attn_scale_dim must be a positive number"),
    (dict(export_as="bert"), r"export_as must be one of 'auto', 'gpt2'"),
])
def test_the_gemma_settings_are_checked_in_one_line(changes, message):
    from tinylm.config import GPTConfig

    with pytest.raises(TinyLMError, match=message) as info:
        GPTConfig(**{**dict(vocab_size=10, block_size=16, n_layer=2, d_model=16, n_head=2, positions="rope"), **changes})
    assert "\n" not in str(info.value)
