"""GGUF files for llama.cpp: a tinylm model and its tokenizer in one file, written with the `gguf` package.

`export_gguf` writes the hyperparameters, the tokenizer (`tinylm.export.gguf_vocab`) and the
tensors (`gguf_rules`, on the rule engine of `tinylm.export.weights`) of a GPT-2, Llama, Qwen3,
Qwen2, Mistral-shaped, Phi-3, Gemma 2 or Gemma 3 model as llama.cpp's "gpt2", "llama", "qwen3", "qwen2",
"phi3", "gemma2" or "gemma3" graph, and a Mixtral-shaped Mixture of Experts as its "llama" graph with
``expert_count`` experts stacked into 3-D tensors; `gguf_problems` refuses what llama.cpp cannot
run (a Qwen2-MoE-only model among them). Llama's W_q and W_k rows are permuted to llama.cpp's
neighbour-pair RoPE, Qwen3's are not: docs/export.md tells that story and has the tensor-name table.

Usage::

    export_gguf(run.model, run.tokenizer, "model.gguf")            # float32
    export_gguf(run.model, run.tokenizer, "model-f16.gguf", dtype="f16")
    export_gguf(run.model, run.tokenizer, "model-q8_0.gguf", dtype="q8_0")   # 8-bit blocks, ~1/4 the size

The matrices take the file type; which tensors stay float32 (vectors, learned positions) and the
float16 fallback for a q8_0 matrix whose rows are not whole 32-value blocks follow llama.cpp's own
converter (`convert_hf_to_gguf.py`), and the blocks are made by the `gguf` package's quantizer, the
same arithmetic as ggml's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from tinylm.atomic import atomic_path, disk_writes
from tinylm.config import GPTConfig
from tinylm.errors import TinyLMError
from tinylm.export.hf import declared_start
from tinylm.export.hf_families import GEMMA_SHAPED
from tinylm.export.hf_moe import moe_family_problems
from tinylm.export.weights import Architecture, TensorRule, architecture_for, convert_to_theirs
from tinylm.model.gpt import GPT
from tinylm.model.positions import RopeScaling, rope_inverse_frequencies
from tinylm.tokenizers.base import Tokenizer
from tinylm.export.gguf_vocab import LLAMA_CPP_PRE, _require_gguf, check_tokenizer, tokenizer_metadata, write_tokenizer


GGUFDtype = Literal["f32", "f16", "q8_0"]
GGUF_DTYPES: tuple[str, ...] = ("f32", "f16", "q8_0")

# llama.cpp's graph for each architecture, where the name differs (its converter writes Mistral and Mixtral as Llama)
LLAMA_CPP_ARCH: dict[str, str] = {"mistral": "llama", "mixtral": "llama", "qwen2_moe": "qwen2moe"}

# llama.cpp fixes which Gemma layers are windowed: every N-th one sees the whole context
LLAMA_CPP_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}


def _name(tensor: str, block: int | None = None, kind: str = "weight") -> str:
    """llama.cpp's name for a tensor, from gguf's own table: ("ATTN_Q", 3) -> "blk.3.attn_q.weight"."""
    g = _require_gguf()
    base = g.TENSOR_NAMES[g.MODEL_TENSOR[tensor]]
    return f"{base.format(bid=block) if block is not None else base}.{kind}"


def llama_cpp_arch(config: GPTConfig) -> str:
    """llama.cpp's name for the graph that runs ``config``: "gpt2", "llama", "qwen3" or "qwen2"."""
    arch = architecture_for(config)
    return LLAMA_CPP_ARCH.get(arch, arch)


def gguf_problems(config: GPTConfig) -> list[str]:
    """What llama.cpp cannot run of a model that `transformers` can (empty: the file computes the model)."""
    arch = llama_cpp_arch(config)
    problems = []
    if arch in GEMMA_SHAPED:
        return _gemma_problems(config, arch)
    if arch == "qwen2moe":
        return [_qwen2moe_problem(config)]
    if config.sliding_window is not None and config.sliding_window < config.block_size:
        problems.append(f"sliding_window = {config.sliding_window} is shorter than block_size = {config.block_size}, "
                        f"and llama.cpp's {arch} graph attends to the whole context")
    if config.d_head is not None and config.head_dim * config.n_head != config.d_model and arch == "qwen2":
        # llama.cpp's qwen2 graph sizes q, k and v from n_embd / n_head and refuses the file (measured)
        problems.append(f"d_head = {config.d_head} differs from d_model / n_head, and llama.cpp's qwen2 graph "
                        "takes its head size from those")
    if config.rope_scaling == "llama3" and arch != "llama":
        problems.append(f"rope_scaling = 'llama3' needs llama.cpp's rope_freqs tensor, which its {arch} graph "
                        "does not read")
    return problems


def _qwen2moe_problem(config: GPTConfig) -> str:
    """Why a Mixture of Experts that only Qwen2-MoE computes does not run in llama.cpp, naming the settings that make it so.

    llama.cpp runs Mixtral's layout as its llama graph; its qwen2moe graph computes the shared expert's gate
    sigmoid(x w) as silu(x w) / (x w), which is 0 / 0 at the w = 0 that stands for tinylm's ungated shared
    expert (`tinylm.export.hf_moe`), and a model without one is written as one gated by w = 0 too.
    """
    settings = ", ".join(moe_family_problems(config)["mixtral"])
    return (f"llama.cpp runs a Mixture of Experts as Mixtral (its llama graph), which cannot express {settings}; its "
            "qwen2moe graph computes the shared expert's gate sigmoid(x w) as silu(x w) / (x w), not a number at the "
            "w = 0 that tinylm's ungated (or absent) shared expert is exported as")


def _gemma_problems(config: GPTConfig, arch: str) -> list[str]:
    """What llama.cpp's gemma2 and gemma3 graphs fix that ``config`` sets otherwise."""
    problems = []
    every = LLAMA_CPP_GEMMA_PATTERN[arch]
    windowed = [config.layer_window(i) is not None for i in range(config.n_layer)]
    theirs = [(i + 1) % every != 0 for i in range(config.n_layer)]
    # without a window (or one as long as the context) the pattern changes nothing
    if config.sliding_window is not None and config.sliding_window < config.block_size and windowed != theirs:
        problems.append(f"sliding_window_pattern = {config.sliding_window_pattern} windows other layers than llama.cpp's "
                        f"{arch} graph, which gives every {every}th layer the whole context")
    if config.attn_scale_dim is not None and config.attn_scale_dim != config.head_dim:
        problems.append(f"attn_scale_dim = {config.attn_scale_dim} differs from d_h = {config.head_dim}, and "
                        f"llama.cpp's {arch} graph divides the scores by sqrt(d_h)")
    if arch == "gemma2":
        for name in ("attn_softcap", "logit_softcap"):
            if getattr(config, name) is None:
                problems.append(f"{name} is unset, and llama.cpp's gemma2 graph always caps (at 50 and 30 "
                                "when the file says nothing)")
        if not config.tie_embeddings:
            problems.append("tie_embeddings = false, and llama.cpp's gemma2 graph reads the embedding as its head")
    elif config.attn_softcap is not None:
        problems.append(f"attn_softcap = {config.attn_softcap:g}, and llama.cpp's gemma3 graph does not cap scores")
    if config.rope_scaling == "llama3":
        problems.append(f"rope_scaling = 'llama3' needs llama.cpp's rope_freqs tensor, which its {arch} graph "
                        "does not read")
    return problems


def rope_freqs(config: GPTConfig) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for llama3 scaling: the d_h/2 divisors omega_plain / omega_scaled, float32."""
    plain = rope_inverse_frequencies(config.head_dim, config.rope_theta)
    scaled = rope_inverse_frequencies(config.head_dim, config.rope_theta, RopeScaling.of(config))
    return (plain / scaled).numpy().astype(np.float32)


def gguf_rules(config: GPTConfig, arch: Architecture | None = None) -> list[TensorRule]:
    """The GGUF tensors of ``config`` made from its parameters, in file order, and which each is made from.

    (A llama3-scaled RoPE adds one tensor computed from the configuration, `rope_freqs`.)
    """
    arch = arch or architecture_for(config)
    arch = LLAMA_CPP_ARCH.get(arch, arch)
    rules = [TensorRule(_name("TOKEN_EMBD"), ("E.weight",))]
    if arch == "gpt2":
        rules.append(TensorRule(_name("POS_EMBD"), ("pos_emb.P.weight",)))
    for i in range(config.n_layer):
        rules += _block_rules(config, arch, i)
    final_norm_kinds = ("weight", "bias") if arch == "gpt2" else ("weight",)
    rules += [TensorRule(_name("OUTPUT_NORM", kind=k), (f"norm_f.{k}",)) for k in final_norm_kinds]
    # llama.cpp's phi3 graph needs an output tensor even when the head is E; the others read E then
    if arch == "phi3" or not config.tie_embeddings:
        rules.append(TensorRule(_name("OUTPUT"), ("E.weight" if config.tie_embeddings else "lm_head.weight",)))
    return rules


def _block_rules(config: GPTConfig, arch: str, i: int) -> list[TensorRule]:
    """The tensors of transformer block ``i``, in the order of llama.cpp's ``arch`` graph."""
    if arch == "gpt2":
        return _gpt2_block_rules(i)
    if arch == "phi3":
        return _phi3_block_rules(i)
    if arch in GEMMA_SHAPED:
        return _gemma_block_rules(arch, i)
    return _llama_block_rules(config, arch, i)


def _gpt2_block_rules(i: int) -> list[TensorRule]:
    """GPT-2's block: every weight with its bias (llama.cpp's GPT-2 graph requires each), q, k and v fused."""
    R, b = TensorRule, f"blocks.{i}."
    rules = []
    for k in ("weight", "bias"):
        rules += [R(_name("ATTN_NORM", i, k), (f"{b}norm_1.{k}",)),
                  # fused: the rows of W_q, W_k, W_v stacked, out = d + 2 n_kv d_h
                  R(_name("ATTN_QKV", i, k), tuple(f"{b}attn.{w}.{k}" for w in ("W_q", "W_k", "W_v"))),
                  R(_name("ATTN_OUT", i, k), (f"{b}attn.W_o.{k}",)),
                  R(_name("FFN_NORM", i, k), (f"{b}norm_2.{k}",)),
                  R(_name("FFN_UP", i, k), (f"{b}mlp.W_1.{k}",)),
                  R(_name("FFN_DOWN", i, k), (f"{b}mlp.W_2.{k}",))]
    return rules


def _phi3_block_rules(i: int) -> list[TensorRule]:
    """Phi-3's block, fused as Phi-3's own files: q, k, v rows in one matrix, gate then up in ffn_up."""
    R, b = TensorRule, f"blocks.{i}."
    return [R(_name("ATTN_NORM", i), (f"{b}norm_1.weight",)),
            R(_name("ATTN_QKV", i), tuple(f"{b}attn.{w}.weight" for w in ("W_q", "W_k", "W_v"))),
            R(_name("ATTN_OUT", i), (f"{b}attn.W_o.weight",)),
            R(_name("FFN_NORM", i), (f"{b}norm_2.weight",)),
            R(_name("FFN_UP", i), (f"{b}mlp.W_1.weight", f"{b}mlp.W_3.weight")),
            R(_name("FFN_DOWN", i), (f"{b}mlp.W_2.weight",))]


def _gemma_block_rules(arch: str, i: int) -> list[TensorRule]:
    """Gemma 2's and 3's block, with a norm after attention and after the MLP (and q, k norms in Gemma 3).

    The norms' gains go in as we hold them, 1 + w (llama.cpp's converter adds the 1 too); RoPE rotates halves.
    """
    R, b = TensorRule, f"blocks.{i}."
    rules = [R(_name("ATTN_NORM", i), (f"{b}norm_1.weight",)),
             R(_name("ATTN_Q", i), (f"{b}attn.W_q.weight",)),
             R(_name("ATTN_K", i), (f"{b}attn.W_k.weight",)),
             R(_name("ATTN_V", i), (f"{b}attn.W_v.weight",)),
             R(_name("ATTN_OUT", i), (f"{b}attn.W_o.weight",))]
    if arch == "gemma3":
        rules += [R(_name("ATTN_Q_NORM", i), (f"{b}attn.q_norm.weight",)),
                  R(_name("ATTN_K_NORM", i), (f"{b}attn.k_norm.weight",))]
    rules += [R(_name("ATTN_POST_NORM", i), (f"{b}norm_1_out.weight",)),
              R(_name("FFN_NORM", i), (f"{b}norm_2.weight",)),
              R(_name("FFN_GATE", i), (f"{b}mlp.W_1.weight",)),
              R(_name("FFN_UP", i), (f"{b}mlp.W_3.weight",)),
              R(_name("FFN_DOWN", i), (f"{b}mlp.W_2.weight",)),
              R(_name("FFN_POST_NORM", i), (f"{b}norm_2_out.weight",))]
    return rules


def _llama_block_rules(config: GPTConfig, arch: str, i: int) -> list[TensorRule]:
    """The block of llama.cpp's llama, qwen3, qwen2 and qwen2moe graphs: q, k, v apart, a gated MLP or experts."""
    R, b = TensorRule, f"blocks.{i}."
    kinds = ("weight", "bias") if config.bias else ("weight",)  # only llama has them (architecture_for)
    qkv_kinds = ("weight", "bias") if config.bias or config.qkv_bias else ("weight",)  # qwen2: q, k, v
    # llama.cpp rotates neighbours in its llama graph (so q and k rows are permuted) and halves,
    # as we do, in its qwen3 and qwen2 graphs (so they go in as they are): see the module docstring
    qk = "rope_interleave" if arch == "llama" else "copy"
    rules = [R(_name("ATTN_NORM", i), (f"{b}norm_1.weight",))]
    for k in qkv_kinds:
        rules += [R(_name("ATTN_Q", i, k), (f"{b}attn.W_q.{k}",), qk, config.n_head),
                  R(_name("ATTN_K", i, k), (f"{b}attn.W_k.{k}",), qk, config.kv_heads),
                  R(_name("ATTN_V", i, k), (f"{b}attn.W_v.{k}",))]
    rules += [R(_name("ATTN_OUT", i, k), (f"{b}attn.W_o.{k}",)) for k in kinds]
    if arch == "qwen3":  # (d_h,) gains, applied to every head before RoPE; not permuted either
        rules += [R(_name("ATTN_Q_NORM", i), (f"{b}attn.q_norm.weight",)),
                  R(_name("ATTN_K_NORM", i), (f"{b}attn.k_norm.weight",))]
    rules.append(R(_name("FFN_NORM", i), (f"{b}norm_2.weight",)))
    if config.moe_experts:
        return rules + _moe_rules(config, i)
    for k in kinds:
        rules += [R(_name("FFN_GATE", i, k), (f"{b}mlp.W_1.{k}",)),
                  R(_name("FFN_UP", i, k), (f"{b}mlp.W_3.{k}",)),
                  R(_name("FFN_DOWN", i, k), (f"{b}mlp.W_2.{k}",))]
    return rules


def _moe_rules(config: GPTConfig, i: int) -> list[TensorRule]:
    """A Mixture-of-Experts MLP as llama.cpp's llama graph holds Mixtral's: the router (``ffn_gate_inp``, E x d), then
    each of the experts' three matrices stacked into one (E, out, in) tensor (``ffn_gate_exps``, ``ffn_up_exps``,
    ``ffn_down_exps``)."""
    R, b = TensorRule, f"blocks.{i}."
    experts = range(config.moe_experts)
    rules = [R(_name("FFN_GATE_INP", i), (f"{b}mlp.router.weight",))]
    for tensor, ours in (("FFN_GATE_EXP", "W_1"), ("FFN_UP_EXP", "W_3"), ("FFN_DOWN_EXP", "W_2")):
        rules.append(R(_name(tensor, i), tuple(f"{b}mlp.experts.{e}.{ours}.weight" for e in experts), "stack"))
    return rules


def export_gguf(
    model: GPT,
    tokenizer: Tokenizer,
    path: str | os.PathLike,
    *,
    dtype: GGUFDtype = "f32",
    name: str = "tinylm",
    pre_tokenizer: str | None = None,
    overwrite: bool = False,
    start_ids: Sequence[int] | None = None,
) -> Path:
    """Write ``model`` and its byte-level BPE ``tokenizer`` as a GGUF file for llama.cpp; returns the path.

    ``dtype`` "f32" (exact), "f16" (matrices in half precision) or "q8_0" (matrices in blocks of 32
    int8 values with a float16 scale; see the module docstring for what stays float32); ``name`` goes in
    general.name; ``pre_tokenizer`` overrides the llama.cpp pre-tokenizer name chosen from the
    tokenizer's split pattern (see the module docstring). ``start_ids`` is what the model's texts start
    with (a run's `tinylm.run.Run.start_ids`; by default `tinylm.export.hf.declared_start`'s): the file
    names it the BOS llama.cpp adds to a prompt.
    """
    g = _require_gguf()
    config = model.config
    arch = llama_cpp_arch(config)
    _check_exportable(config, tokenizer, dtype, pre_tokenizer)  # before anything is written
    start = declared_start(tokenizer, start_ids)
    path = Path(path)
    _check_destination(path, overwrite)

    tensors = convert_to_theirs(model.state_dict(), gguf_rules(config, arch))
    existed = path.exists()
    intact = f"the {path.name} there before is intact" if existed else "nothing half-written is left"
    with disk_writes(f"the export to {path}", intact, retry="export again"), atomic_path(path) as tmp:
        writer = g.GGUFWriter(tmp, arch)
        _add_file_description(writer, name, dtype)
        _add_hyperparameters(writer, config, arch)
        write_tokenizer(writer, tokenizer, config.vocab_size, pre_tokenizer, start)
        _add_tensors(writer, config, tensors, dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return path


def _check_exportable(config: GPTConfig, tokenizer: Tokenizer, dtype: str, pre_tokenizer: str | None) -> None:
    """Refuse a model llama.cpp cannot run, a tokenizer that is not the model's or not GGUF's, an unknown dtype."""
    problems = gguf_problems(config)
    if problems:
        raise TinyLMError(f"this model exports to transformers but not to llama.cpp: {'; '.join(problems)}")
    if tokenizer.vocab_size > config.vocab_size:
        raise TinyLMError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size} "
                          "rows of embeddings: they are not a pair")
    if dtype not in GGUF_DTYPES:
        raise TinyLMError(f"unknown GGUF dtype {dtype!r}; expected one of {', '.join(GGUF_DTYPES)}")
    check_tokenizer(tokenizer, pre_tokenizer)


def _check_destination(path: Path, overwrite: bool) -> None:
    if path.is_dir():
        raise TinyLMError(f"{path} is a folder; give the GGUF file to write, e.g. {path / 'model.gguf'}")
    if path.exists() and not overwrite:
        raise TinyLMError(f"{path} already exists; choose another --out or overwrite it explicitly (--force)")


def _add_file_description(writer: Any, name: str, dtype: GGUFDtype) -> None:
    """general.name, the file type and the quantization version."""
    g = _require_gguf()
    writer.add_name(name)
    file_type = {"f32": g.LlamaFileType.ALL_F32, "f16": g.LlamaFileType.MOSTLY_F16,
                 "q8_0": g.LlamaFileType.MOSTLY_Q8_0}[dtype]
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(g.GGML_QUANT_VERSION)


def _add_hyperparameters(writer: Any, config: GPTConfig, arch: str) -> None:
    """The hyperparameters llama.cpp reads as "<arch>.<key>"."""
    g = _require_gguf()
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.n_layer)
    # llama's graph sizes a Mixture of Experts' experts by feed_forward_length, as Mixtral's files do
    writer.add_feed_forward_length(config.moe_hidden_dim if config.moe_experts else config.hidden_dim)
    if config.moe_experts:
        writer.add_expert_count(config.moe_experts)
        writer.add_expert_used_count(config.moe_top_k)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.kv_heads)
    if arch == "gpt2":
        writer.add_layer_norm_eps(config.norm_eps)
    else:  # llama, qwen3 and qwen2 read the same keys (qwen3's q and k norms use the rms eps too)
        writer.add_layer_norm_rms_eps(config.norm_eps)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_rope_dimension_count(config.head_dim)  # every coordinate of a head is rotated
        writer.add_rope_freq_base(config.rope_theta)
        if config.rope_scaling == "linear":
            writer.add_rope_scaling_type(g.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(config.rope_factor)
    if arch in GEMMA_SHAPED:
        _add_gemma_hyperparameters(writer, config)


def _add_gemma_hyperparameters(writer: Any, config: GPTConfig) -> None:
    """Gemma's window, soft caps and the windowed layers' RoPE base."""
    # no window: one as long as the context (gemma2's graph always windows its even layers)
    writer.add_sliding_window(config.sliding_window or config.block_size)
    if config.attn_softcap is not None:
        writer.add_attn_logit_softcapping(config.attn_softcap)
    if config.logit_softcap is not None:
        writer.add_final_logit_softcapping(config.logit_softcap)
    # the windowed layers' base (llama.cpp's gemma3 graph takes 10000 when the file says nothing)
    writer.add_rope_freq_base_swa(config.rope_local_theta or config.rope_theta)


def _add_tensors(writer: Any, config: GPTConfig, tensors: dict[str, torch.Tensor], dtype: GGUFDtype) -> None:
    """The tensors, each in the file type ``dtype`` (or float32 or float16, as llama.cpp's converter keeps it)."""
    if config.rope_scaling == "llama3":  # a vector: float32 in every file type
        writer.add_tensor(_name("ROPE_FREQS"), rope_freqs(config))
    for tensor_name, t in tensors.items():
        data, qtype = _encode(tensor_name, t, dtype)
        writer.add_tensor(tensor_name, data, raw_dtype=qtype)


def _router_suffix() -> str:
    """The end of every layer's router tensor name: ".ffn_gate_inp.weight"."""
    return "." + _name("FFN_GATE_INP", 0).split(".", 2)[2]


def _encode(tensor_name: str, t: torch.Tensor, dtype: GGUFDtype):
    """The bytes of one tensor in the file type ``dtype`` and the GGML type they are in, as llama.cpp's converter picks it."""
    g = _require_gguf()
    types = g.GGMLQuantizationType
    x = t.detach().to(torch.float32).cpu().numpy()
    qtype = {"f32": types.F32, "f16": types.F16, "q8_0": types.Q8_0}[dtype]
    # vectors (norms, biases), learned positions and MoE routers stay float32 in every file type, as the converter
    # keeps them (a router in half precision could send a token to other experts)
    if x.ndim < 2 or tensor_name == _name("POS_EMBD") or tensor_name.endswith(_router_suffix()):
        qtype = types.F32
    try:
        return g.quants.quantize(x, qtype), qtype
    except g.quants.QuantError:  # rows that are not whole blocks (q8_0: 32 values): float16, the converter's fallback
        return g.quants.quantize(x, types.F16), types.F16


__all__ = ["GGUF_DTYPES", "LLAMA_CPP_PRE", "LLAMA_CPP_ARCH", "llama_cpp_arch", "gguf_problems", "rope_freqs", "gguf_rules",
           "tokenizer_metadata", "export_gguf"]
