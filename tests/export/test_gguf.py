"""GGUF export for llama.cpp: read back with `gguf`'s own reader, run by a llama.cpp-style reference, and by llama.cpp.

Three kinds of evidence:

1. The file read back with ``gguf.GGUFReader`` holds exactly our tensors once the documented
   layout changes are undone *by hand in the test* (q, k, v rows split out of GPT-2's fused
   attn_qkv; Llama's W_q and W_k rows put back from neighbour pairs to rotate-half pairs; Qwen3's
   as they are, with the q and k norm gains), and the metadata llama.cpp reads (hyperparameters,
   tokenizer) with the values we expect.
2. `gguf_reference.GGUFModel` runs the file the way llama.cpp's graphs do (neighbour-pair RoPE for
   llama, QK-norm then rotate-half RoPE for qwen3, its tensor names and metadata keys, nothing
   from tinylm's model code) and must give our logits and our greedy tokens.
3. llama.cpp itself, through `llama-cpp-python`, where it is installed: same token ids for text,
   same greedy continuation. Skipped otherwise, with the reason.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import torch
from exportkit import CONFIGS, PROMPT, greedy, make_tokenizer, tiny_model

import tinylm.export.gguf as gguf_export
from tinylm.errors import TinyLMError
from tinylm.export import export_gguf
from tinylm.export.weights import rope_deinterleave, rope_interleave
from tinylm.tokenizers import CharTokenizer
from tinylm.tokenizers.formats import to_hf_tokenizer_json

import gguf
from gguf_reference import GGUFModel  # noqa: E402  (imports gguf)


def read(path) -> tuple[dict, dict[str, np.ndarray], dict[str, int]]:
    reader = gguf.GGUFReader(path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    types = {t.name: int(t.tensor_type) for t in reader.tensors}
    return meta, tensors, types


def neighbours_to_halves(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo the q/k row order, written out: in each head, rows 0, 2, 4, ... are the first half, rows 1, 3, ... the second."""
    rows = w.reshape(heads, -1, *w.shape[1:])  # (heads, hs, ...)
    return np.concatenate([rows[:, 0::2], rows[:, 1::2]], axis=1).reshape(w.shape)


# ----- the file as read back ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_file_holds_our_tensors_after_the_documented_reshapes(tmp_path, tokenizer, name):
    model = tiny_model(name)
    c = model.config
    export_gguf(model, tokenizer, tmp_path / "m.gguf")
    meta, t, types = read(tmp_path / "m.gguf")
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    expected: dict[str, np.ndarray] = {"token_embd.weight": state["E.weight"], "output_norm.weight": state["norm_f.weight"]}
    if not c.tie_embeddings:
        expected["output.weight"] = state["lm_head.weight"]
    zero = lambda n: np.zeros(n, dtype=np.float32)  # noqa: E731
    if name.startswith("gpt2"):
        expected["position_embd.weight"] = state["pos_emb.P.weight"]
        expected["output_norm.bias"] = state.get("norm_f.bias", zero(c.d_model))
        for i in range(c.n_layer):
            b, g = f"blocks.{i}.", f"blk.{i}."
            q, k, v = np.split(t[g + "attn_qkv.weight"], [c.d_model, 2 * c.d_model])  # rows q; k; v
            assert np.array_equal(q, state[b + "attn.W_q.weight"]) and np.array_equal(k, state[b + "attn.W_k.weight"])
            assert np.array_equal(v, state[b + "attn.W_v.weight"])
            qkv_bias = [state.get(b + f"attn.{w}.bias", zero(c.d_model)) for w in ("W_q", "W_k", "W_v")]
            expected[g + "attn_qkv.weight"] = t[g + "attn_qkv.weight"]
            expected[g + "attn_qkv.bias"] = np.concatenate(qkv_bias)
            for ours, theirs in (("norm_1", "attn_norm"), ("attn.W_o", "attn_output"), ("norm_2", "ffn_norm"),
                                 ("mlp.W_1", "ffn_up"), ("mlp.W_2", "ffn_down")):
                expected[g + theirs + ".weight"] = state[b + ours + ".weight"]
                expected[g + theirs + ".bias"] = state.get(b + ours + ".bias", zero(state[b + ours + ".weight"].shape[0]))
    else:
        for i in range(c.n_layer):
            b, g = f"blocks.{i}.", f"blk.{i}."
            for kind in ("weight", "bias") if c.bias else ("weight",):
                expected[g + f"attn_q.{kind}"] = state[b + f"attn.W_q.{kind}"]
                expected[g + f"attn_k.{kind}"] = state[b + f"attn.W_k.{kind}"]
                if name.startswith("llama"):  # llama.cpp's llama graph rotates neighbours; its qwen3 graph, halves
                    t[g + f"attn_q.{kind}"] = neighbours_to_halves(t[g + f"attn_q.{kind}"], c.n_head)
                    t[g + f"attn_k.{kind}"] = neighbours_to_halves(t[g + f"attn_k.{kind}"], c.kv_heads)
                for ours, theirs in (("attn.W_v", "attn_v"), ("attn.W_o", "attn_output"), ("mlp.W_1", "ffn_gate"),
                                     ("mlp.W_3", "ffn_up"), ("mlp.W_2", "ffn_down")):
                    expected[g + f"{theirs}.{kind}"] = state[b + f"{ours}.{kind}"]
            expected[g + "attn_norm.weight"] = state[b + "norm_1.weight"]
            expected[g + "ffn_norm.weight"] = state[b + "norm_2.weight"]
            if name.startswith("qwen3"):
                expected[g + "attn_q_norm.weight"] = state[b + "attn.q_norm.weight"]  # (d_h,): one gain per coordinate
                expected[g + "attn_k_norm.weight"] = state[b + "attn.k_norm.weight"]
    assert set(t) == set(expected)
    for key, value in expected.items():
        assert t[key].dtype == np.float32 and types[key] == int(gguf.GGMLQuantizationType.F32)
        assert np.array_equal(t[key], value), key


@pytest.mark.parametrize("name", ["gpt2", "llama-mha-bias-untied", "qwen3-mha-untied"])
def test_every_tensor_is_one_gguf_lists_for_the_architecture(tmp_path, tokenizer, name):
    export_gguf(tiny_model(name), tokenizer, tmp_path / "m.gguf")
    meta, t, _ = read(tmp_path / "m.gguf")
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == meta["general.architecture"])
    known = {gguf.TENSOR_NAMES[k].format(bid=i) for k in gguf.MODEL_TENSORS[arch] for i in range(2)}
    assert {n.rsplit(".", 1)[0] for n in t} <= known


def test_without_the_gguf_package_the_error_says_what_to_install(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    with pytest.raises(TinyLMError, match="needs the `gguf` package .*pip install gguf"):
        export_gguf(tiny_model("gpt2"), tokenizer, tmp_path / "m.gguf")


def test_the_q_and_k_permutation_is_llama_cpps_on_a_worked_example():
    """Two heads of size 4: rotate-half pairs (0, 2), (1, 3) become neighbour pairs (0, 1), (2, 3)."""
    w = torch.arange(8.0)[:, None].expand(8, 3)  # row r holds r
    assert rope_interleave(w, heads=2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert torch.equal(rope_deinterleave(rope_interleave(w, 2), 2), w)
    assert np.array_equal(neighbours_to_halves(rope_interleave(w, 2).numpy(), 2), w.numpy())


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "qwen3-gqa"])
def test_the_metadata_llama_cpp_reads(tmp_path, tokenizer, name):
    model = tiny_model(name)
    c = model.config
    export_gguf(model, tokenizer, tmp_path / "m.gguf", name="tiny-test")
    meta, _, _ = read(tmp_path / "m.gguf")
    arch = name.split("-")[0]
    expected = {
        "general.architecture": arch, "general.name": "tiny-test", "general.file_type": 0,
        f"{arch}.vocab_size": c.vocab_size, f"{arch}.context_length": 64, f"{arch}.embedding_length": 32,
        f"{arch}.block_count": 2, f"{arch}.feed_forward_length": c.hidden_dim, f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": c.kv_heads,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "dbrx",
        # the BOS llama.cpp puts before a prompt: the separator tinylm puts there for a packed run
        "tokenizer.ggml.bos_token_id": tokenizer.eos_id, "tokenizer.ggml.eos_token_id": tokenizer.eos_id,
        "tokenizer.ggml.padding_token_id": tokenizer.pad_id,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False,
    }
    if arch == "gpt2":
        expected["gpt2.attention.layer_norm_epsilon"] = pytest.approx(1e-5)
    else:
        expected.update({f"{arch}.attention.layer_norm_rms_epsilon": pytest.approx(1e-6),
                         f"{arch}.rope.freq_base": 500.0, f"{arch}.rope.dimension_count": 8,
                         f"{arch}.attention.key_length": 8, f"{arch}.attention.value_length": 8})
    for key, value in expected.items():
        assert meta[key] == value, key
    # the tokens and merges are tokenizer.json's (which the `tokenizers` tests check against HF)
    hf = to_hf_tokenizer_json(tokenizer)
    by_id = {i: s for s, i in hf["model"]["vocab"].items()} | {a["id"]: a["content"] for a in hf["added_tokens"]}
    assert meta["tokenizer.ggml.tokens"] == [by_id[i] for i in range(tokenizer.vocab_size)]
    assert meta["tokenizer.ggml.tokens"][32] == "Ġ" and meta["tokenizer.ggml.tokens"][10] == "Ċ"
    assert meta["tokenizer.ggml.merges"] == hf["model"]["merges"]
    control, normal = int(gguf.TokenType.CONTROL), int(gguf.TokenType.NORMAL)
    assert meta["tokenizer.ggml.token_type"] == [normal] * tokenizer.base_vocab_size + [control] * 5


def test_a_model_with_more_rows_than_tokens_pads_the_token_list(tmp_path, tokenizer):
    model = tiny_model("llama-gqa", vocab_size=tokenizer.vocab_size + 3)
    export_gguf(model, tokenizer, tmp_path / "m.gguf")
    meta, t, _ = read(tmp_path / "m.gguf")
    assert len(meta["tokenizer.ggml.tokens"]) == t["token_embd.weight"].shape[0] == tokenizer.vocab_size + 3
    assert meta["tokenizer.ggml.tokens"][-1] == f"[PAD{tokenizer.vocab_size + 2}]"
    assert meta["tokenizer.ggml.token_type"][-3:] == [int(gguf.TokenType.UNUSED)] * 3


def test_f16_stores_matrices_in_half_precision_and_vectors_in_float32(tmp_path, tokenizer):
    model = tiny_model("llama-mha-bias-untied")
    export_gguf(model, tokenizer, tmp_path / "m.gguf", dtype="f16")
    meta, t, types = read(tmp_path / "m.gguf")
    assert meta["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_F16)
    assert types["token_embd.weight"] == int(gguf.GGMLQuantizationType.F16)
    assert np.array_equal(t["blk.0.ffn_down.weight"], model.blocks[0].mlp.W_2.weight.detach().numpy().astype(np.float16))
    assert types["blk.0.attn_norm.weight"] == types["blk.0.attn_v.bias"] == int(gguf.GGMLQuantizationType.F32)


# ----- the file run like llama.cpp runs it -----------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_llama_cpp_style_reference_run_of_the_file_gives_our_logits_and_greedy_tokens(tmp_path, tokenizer, name):
    model = tiny_model(name).double()  # float64 on both sides, so the only differences are real ones
    export_gguf(model, tokenizer, tmp_path / "m.gguf")
    ref = GGUFModel(tmp_path / "m.gguf")
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0][0]
        # tinylm computes its RoPE angles in float32, hence the looser tolerance for llama
        atol = 1e-9 if name.startswith("gpt2") else 1e-4
        torch.testing.assert_close(ref.logits(ids), ours, atol=atol, rtol=0)
        start = tokenizer.encode("def ")
        assert greedy(lambda x: ref.logits(x[0].tolist())[None], start) == greedy(lambda x: model(x)[0], start)


def test_without_the_q_k_permutation_the_reference_disagrees(tmp_path, tokenizer, monkeypatch):
    """The permutation is needed: written as is, llama.cpp's neighbour-pair RoPE would compute another model."""
    import tinylm.export.weights as weights

    model = tiny_model("llama-gqa").double()
    monkeypatch.setattr(weights, "rope_interleave", lambda w, heads: w)
    export_gguf(model, tokenizer, tmp_path / "m.gguf")
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        assert (GGUFModel(tmp_path / "m.gguf").logits(ids) - model(torch.tensor([ids]))[0][0]).abs().max() > 0.1


def test_qwen3_q_and_k_are_not_permuted_and_the_reference_disagrees_if_they_were(tmp_path, tokenizer, monkeypatch):
    """llama.cpp's qwen3 graph rotates halves, as we do: given llama's neighbour permutation, it computes another model."""
    model = tiny_model("qwen3-gqa").double()
    ids = tokenizer.encode(PROMPT)
    export_gguf(model, tokenizer, tmp_path / "right.gguf")
    original = gguf_export.gguf_rules
    heads = {"attn_q.weight": model.config.n_head, "attn_k.weight": model.config.kv_heads}

    def as_llama(config, arch):  # the same rules, with the permutation of q's and k's rows that llama gets
        rules = []
        for rule in original(config, arch):
            kind = rule.theirs.split(".", 2)[-1]  # "attn_q.weight" of "blk.0.attn_q.weight"
            rules.append(dataclasses.replace(rule, transform="rope_interleave", heads=heads[kind]) if kind in heads
                         else rule)
        return rules

    monkeypatch.setattr(gguf_export, "gguf_rules", as_llama)
    export_gguf(model, tokenizer, tmp_path / "permuted.gguf")
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0][0]
        assert (GGUFModel(tmp_path / "right.gguf").logits(ids) - ours).abs().max() < 1e-4
        assert (GGUFModel(tmp_path / "permuted.gguf").logits(ids) - ours).abs().max() > 0.1


def test_export_run_writes_a_runs_model_as_gguf(tmp_path, tokenizer):
    from tinylm.export import export_hf, export_run, import_hf_into_run

    model = tiny_model("llama-gqa").double()
    export_hf(model, tokenizer, tmp_path / "hf")
    import_hf_into_run(tmp_path / "hf", tmp_path / "my-run")
    path = export_run(tmp_path / "my-run", tmp_path / "m.gguf", "gguf", dtype="f32")
    ref = GGUFModel(path)
    assert ref.meta["general.name"] == "my-run"
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        torch.testing.assert_close(ref.logits(ids), model(torch.tensor([ids]))[0][0], atol=1e-4, rtol=0)
    with pytest.raises(TinyLMError, match="options of the gguf format"):
        export_run(tmp_path / "my-run", tmp_path / "hf2", "hf", dtype="f16")


# ----- refusals ---------------------------------------------------------------------------------------


def test_refusals(tmp_path, tokenizer):
    with pytest.raises(TinyLMError, match="positions = 'sinusoidal'"):
        export_gguf(tiny_model("gpt2", positions="sinusoidal"), tokenizer, tmp_path / "a.gguf")
    for option, words in ((dict(logit_softcap=15.0), "logit_softcap = 15 \\(Llama does not cap its logits"),
                          (dict(value_embed=True), "value_embed = true \\(neither"),
                          (dict(bigram_hash=8), "bigram_hash = 8 \\(neither"),
                          # llama.cpp's qwen3 graph has no biases at all, and transformers' Qwen3 none in its MLP
                          (dict(qk_norm=True, bias=True), "bias = true \\(Qwen3's MLP has no biases\\)"),
                          (dict(qk_norm=True, positions="learned"), "positions = 'learned' \\(Qwen3 rotates")):
        with pytest.raises(TinyLMError, match=words):
            export_gguf(tiny_model("llama-gqa", **option), tokenizer, tmp_path / "a.gguf")
    char = CharTokenizer.train("abc")
    with pytest.raises(TinyLMError, match="a char tokenizer cannot go into a GGUF file"):
        export_gguf(tiny_model("gpt2", vocab_size=char.vocab_size), char, tmp_path / "b.gguf")
    with pytest.raises(TinyLMError, match="the tokenizer has 302 tokens but the model only 300"):
        export_gguf(tiny_model("gpt2", vocab_size=300), tokenizer, tmp_path / "c.gguf")
    with pytest.raises(TinyLMError, match="is a folder"):
        export_gguf(tiny_model("gpt2"), tokenizer, tmp_path)
    export_gguf(tiny_model("gpt2"), tokenizer, tmp_path / "d.gguf")
    with pytest.raises(TinyLMError, match="already exists"):
        export_gguf(tiny_model("gpt2"), tokenizer, tmp_path / "d.gguf")
    assert not list(tmp_path.glob("[abc].gguf")) and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("pattern, pre", [("gpt2", "gpt-2"), ("gpt4", "dbrx")])
def test_the_pre_tokenizer_is_chosen_from_the_split_pattern(tmp_path, pattern, pre):
    tok = make_tokenizer(pattern)
    export_gguf(tiny_model("gpt2"), tok, tmp_path / "m.gguf")
    assert read(tmp_path / "m.gguf")[0]["tokenizer.ggml.pre"] == pre


def test_a_pattern_llama_cpp_does_not_know_is_refused_unless_named(tmp_path):
    tok = make_tokenizer("none")
    with pytest.raises(TinyLMError, match="pattern 'none', which llama.cpp has no pre-tokenizer for"):
        export_gguf(tiny_model("gpt2"), tok, tmp_path / "m.gguf")
    export_gguf(tiny_model("gpt2"), tok, tmp_path / "m.gguf", pre_tokenizer="default")
    assert read(tmp_path / "m.gguf")[0]["tokenizer.ggml.pre"] == "default"


# ----- llama.cpp itself ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "llama-mha-bias-untied", "qwen3-gqa", "qwen3-mha-untied"])
def test_llama_cpp_tokenizes_like_us_and_continues_greedily_like_us(tmp_path, tokenizer, name):
    from llama_cpp import Llama

    model = tiny_model(name)
    export_gguf(model, tokenizer, tmp_path / "m.gguf")
    # a float32 KV cache (GGML_TYPE_F32 = 0; the default is float16), so the logits can be compared closely
    llm = Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=model.config.block_size, logits_all=True,
                n_threads=1, type_k=0, type_v=0, verbose=False)
    for text in (PROMPT, "Hello, world!  It's 2024...\n\n\ttabs and naïve café 中文 🙂 x"):
        assert llm.tokenize(text.encode("utf-8"), add_bos=False, special=False) == tokenizer.encode(text)

    start = tokenizer.encode("def ")
    llm.reset()
    llm.eval(start)
    tokens = list(start)
    for _ in range(20):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    with torch.no_grad():
        assert tokens == greedy(lambda x: model(x)[0], start)
        ours = model(torch.tensor([tokens]))[0][0].numpy()
    # ggml's CPU GELU reads a float16 table, so GPT-2 logits differ in the third decimal; the tokens are the test
    np.testing.assert_allclose(llm.scores[: len(tokens)], ours, atol=2e-2, rtol=0)

