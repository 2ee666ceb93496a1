"""Quantized GGUF export (q8_0, and f16 beside it): read back with `gguf`'s reader and run by llama.cpp.

Evidence:

1. ``gguf.GGUFReader`` sees the tensor types llama.cpp's own converter would write (matrices
   Q8_0, vectors and learned positions F32, a matrix whose rows are not whole 32-value blocks F16)
   and the q8_0 file type; the blocks it reads back are q8_0 worked out in this test from the
   definition (scale = max |x| / 127 stored as float16, x / scale rounded half away from zero), and
   within q8_0's error bound of our weights.
2. llama.cpp (llama-cpp-python) runs the files on a small Llama trained in the test for 60 steps
   on textwrap's source, so its next-token distributions are real ones: the f16 file's greedy
   tokens are our float32 model's; the q8_0 file picks our argmax at >= 90% of the 64 positions of
   that greedy text and its logits stay within the tolerance derived in
   `test_llama_cpp_runs_q8_0_close_to_our_model`.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from exportkit import greedy, tiny_config

from tinylm.errors import TinyLMError
from tinylm.export import export_gguf
from tinylm.model import GPT

import gguf

STEPS = 64  # greedy tokens compared


def q8_0_by_hand(w: np.ndarray) -> np.ndarray:
    """q8_0 from its definition (ggml-quants.c, quantize_row_q8_0_ref): per 32 values, d = amax / 127, q = roundf(x / d)."""
    blocks = w.astype(np.float32).reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / 127
    y = np.divide(blocks, d, out=np.zeros_like(blocks), where=d > 0)
    q = np.sign(y) * np.floor(np.abs(y) + 0.5)  # C's roundf: half away from zero
    return (q * d.astype(np.float16).astype(np.float32)).reshape(w.shape)


def read(path) -> tuple[dict, dict[str, np.ndarray], dict[str, str]]:
    """Metadata, every tensor dequantized to float32 by gguf's reader, and each tensor's GGML type name."""
    reader = gguf.GGUFReader(path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    values = {t.name: gguf.quants.dequantize(np.array(t.data), t.tensor_type).astype(np.float32)
              for t in reader.tensors}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    return meta, values, types


@pytest.fixture(scope="module")
def trained(tokenizer) -> GPT:
    """A Llama of width 64 (d_ff 80: ffn_down's rows are 80 values, not whole q8_0 blocks), trained 60 steps."""
    torch.manual_seed(0)
    config = dataclasses.replace(tiny_config("llama-mha-bias-untied"), d_model=64, n_head=2, block_size=128,
                                 bias=False)
    model = GPT(config)
    ids = torch.tensor(tokenizer.encode(inspect.getsource(textwrap)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        starts = torch.randint(0, len(ids) - 65, (16,))
        batch = torch.stack([ids[s:s + 65] for s in starts])  # (16, 65)
        logits = model(batch[:, :-1])[0]  # (16, 64, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def llama_cpp_scores(path, tokens: list[int], n_ctx: int) -> np.ndarray:
    """llama.cpp's logits at every position of ``tokens`` (one pass, float32 KV cache so only the weights differ)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, n_threads=1, type_k=0, type_v=0, verbose=False)
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)])


def fake_q8_0(model: GPT) -> GPT:
    """Our model with every matrix the q8_0 file holds replaced by its q8_0 values (by hand), vectors untouched."""
    copy = dataclasses.replace(model.config)
    out = GPT(copy)
    out.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in out.parameters():
            if p.dim() == 2 and p.shape[-1] % 32 == 0:
                p.copy_(torch.from_numpy(q8_0_by_hand(p.numpy())))
            elif p.dim() == 2:  # the float16 fallback
                p.copy_(p.half().float())
    return out.eval()


# ----- the file as read back ------------------------------------------------------------------------


def test_q8_0_file_types_and_blocks_are_q8_0_worked_by_hand(tmp_path, tokenizer, trained):
    export_gguf(trained, tokenizer, tmp_path / "m.gguf", dtype="q8_0")
    meta, values, types = read(tmp_path / "m.gguf")
    assert meta["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert types["token_embd.weight"] == types["output.weight"] == types["blk.1.attn_q.weight"] == "Q8_0"
    assert types["blk.0.ffn_gate.weight"] == types["blk.0.ffn_up.weight"] == "Q8_0"  # rows of d_model = 64
    assert types["blk.0.ffn_down.weight"] == "F16"  # rows of d_ff = 80: not whole blocks, llama.cpp's fallback
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32"
    for name, ours in (("blk.0.ffn_up.weight", trained.blocks[0].mlp.W_3.weight),
                       ("blk.1.attn_output.weight", trained.blocks[1].attn.W_o.weight),
                       ("output.weight", trained.lm_head.weight)):
        w = ours.detach().numpy()
        np.testing.assert_array_equal(values[name], q8_0_by_hand(w))
        # the error bound: half a step (amax / 254) plus the float16 scale's rounding (amax * 2^-11)
        amax = np.abs(w.reshape(-1, 32)).max(axis=1, keepdims=True)
        assert (np.abs(values[name] - w).reshape(-1, 32) <= amax / 254 + amax * 2.0 ** -11).all()
        assert not np.array_equal(values[name], w)  # it was quantized, not copied
    down = trained.blocks[0].mlp.W_2.weight.detach().numpy()
    np.testing.assert_array_equal(values["blk.0.ffn_down.weight"], down.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(values["output_norm.weight"], trained.norm_f.weight.detach().numpy())


def test_gpt2_learned_positions_stay_float32_as_llama_cpp_converter_keeps_them(tmp_path, tokenizer):
    from exportkit import tiny_model

    model = tiny_model("gpt2")
    for dtype in ("f16", "q8_0"):
        export_gguf(model, tokenizer, tmp_path / f"{dtype}.gguf", dtype=dtype)
        _, values, types = read(tmp_path / f"{dtype}.gguf")
        assert types["position_embd.weight"] == "F32" and types["blk.0.attn_qkv.bias"] == "F32"
        assert types["blk.0.attn_qkv.weight"] == dtype.upper()
        np.testing.assert_array_equal(values["position_embd.weight"], model.pos_emb.P.weight.detach().numpy())


def test_an_unknown_dtype_is_refused_before_anything_is_written(tmp_path, tokenizer, trained):
    with pytest.raises(TinyLMError, match="unknown GGUF dtype 'q4_0'; expected one of f32, f16, q8_0"):
        export_gguf(trained, tokenizer, tmp_path / "m.gguf", dtype="q4_0")
    assert not (tmp_path / "m.gguf").exists()


# ----- llama.cpp runs the files ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ours(tokenizer, trained) -> tuple[list[int], np.ndarray]:
    """Our float32 model's greedy text from "def " and its logits at every position."""
    start = tokenizer.encode("def ")
    with torch.no_grad():
        tokens = greedy(lambda x: trained(x)[0], start, steps=STEPS)
        return tokens, trained(torch.tensor([tokens]))[0][0].numpy()


def test_llama_cpp_f16_gives_our_greedy_tokens(tmp_path, tokenizer, trained, ours):
    import llama_cpp  # noqa: F401  (in the test extra: absent, this fails rather than skips)
    from test_hf_families import llama_cpp_greedy

    export_gguf(trained, tokenizer, tmp_path / "m.gguf", dtype="f16")
    tokens, _ = ours
    start = tokenizer.encode("def ")
    assert llama_cpp_greedy(tmp_path / "m.gguf", trained.config.block_size, start, steps=STEPS)[0] == tokens


def test_llama_cpp_runs_q8_0_close_to_our_model(tmp_path, tokenizer, trained, ours):
    import llama_cpp  # noqa: F401  (in the test extra: absent, this fails rather than skips)
    export_gguf(trained, tokenizer, tmp_path / "m.gguf", dtype="q8_0")
    tokens, logits = ours
    scores = llama_cpp_scores(tmp_path / "m.gguf", tokens, trained.config.block_size)
    n = len(tokenizer.encode("def "))
    # teacher-forced: at each position of our greedy text, llama.cpp's q8_0 argmax vs ours
    agree = (scores[n - 1:-1].argmax(-1) == logits[n - 1:-1].argmax(-1)).mean()
    # the tolerance: what q8_0 weights alone do to our logits (fake_q8_0), times 3, since llama.cpp
    # also rounds the activations to q8_0 blocks before each q8_0 matmul (an error of the same kind)
    with torch.no_grad():
        weights_only = np.abs(fake_q8_0(trained)(torch.tensor([tokens]))[0][0].numpy() - logits).max()
    error = np.abs(scores - logits).max()
    print(f"q8_0: argmax agreement {agree:.3f}, max |logit error| {error:.4f}, weights-only {weights_only:.4f}")
    assert agree >= 0.9
    assert error <= 3 * weights_only
    assert error > 1e-4  # llama.cpp did run the quantized weights, not float32 ones


def test_the_export_command_takes_quant_and_still_takes_dtype(tmp_path, tokenizer, trained, capsys):
    from tinylm.cli import main
    from tinylm.export import export_hf, import_hf_into_run

    export_hf(trained, tokenizer, tmp_path / "hf")
    import_hf_into_run(tmp_path / "hf", tmp_path / "run")
    for flag, value, file_type in (("--quant", "q8_0", "MOSTLY_Q8_0"), ("--dtype", "f16", "MOSTLY_F16")):
        out = tmp_path / f"{value}.gguf"
        assert main(["export", "--run", str(tmp_path / "run"), "--format", "gguf", flag, value, "--out", str(out)]) == 0
        assert read(out)[0]["general.file_type"] == int(gguf.LlamaFileType[file_type])
    capsys.readouterr()
    assert main(["export", "--run", str(tmp_path / "run"), "--format", "hf", "--quant", "q8_0",
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--quant/--dtype applies to --format gguf only" in err and len(err.strip().splitlines()) == 1
