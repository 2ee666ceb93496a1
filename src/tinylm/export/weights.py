"""The weight mapping between tinylm's `GPT` and the other formats: which architecture a model is, and how each tensor is named and laid out.

`architecture_for` says which of GPT-2, Llama, Qwen3, Qwen2, Mistral, Phi-3, Gemma 2 and Gemma 3
computes a configuration exactly (or refuses, naming each setting that does not map). A `TensorRule` says how one tensor
of theirs is made from ours; `hf_rules` lists them for a `transformers` checkpoint (GGUF's
`gguf_rules` builds on the same engine), and `convert_to_theirs` / `convert_to_ours` apply them.
docs/export.md has the name table, GPT-2's Conv1D transpose and the RoPE row layouts.

Usage::

    rules = hf_rules(model.config)                   # architecture_for picks gpt2, llama, ...
    tensors = convert_to_theirs(model.state_dict(), rules)
    state = convert_to_ours(tensors, rules, GPT(model.config).state_dict(), "their file")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from tinylm.config import FAMILY_NAMES, GPTConfig
from tinylm.errors import TinyLMError
from tinylm.export.hf_families import (GEMMA_SHAPED, GPT2_SHAPE, HF_CLASSES, MOE_SHAPED, NAMES, Architecture,
                                      gemma_family_problems, gemma_only_problems, llama_family_problems,
                                      llama_shaped, shape_problems)
from tinylm.export.hf_moe import dense_problem, moe_family_problems

# ----- which architecture ---------------------------------------------------------------------------


def architecture_problems(config: GPTConfig) -> dict[Architecture, list[str]]:
    """For each architecture, the settings of ``config`` it cannot express (empty: it fits exactly)."""
    gpt2 = shape_problems(config, "GPT-2", GPT2_SHAPE)
    if config.kv_heads != config.n_head:
        gpt2.append(f"n_kv_head = {config.kv_heads} (GPT-2 has no grouped-query attention: n_kv_head = n_head)")
    if config.head_dim * config.n_head != config.d_model:
        gpt2.append(f"d_head = {config.head_dim} (GPT-2's heads split d_model: d_model / n_head)")
    if config.qk_norm:
        gpt2.append("qk_norm = true (GPT-2 does not normalize q and k)")
    if config.qkv_bias:
        gpt2.append("qkv_bias = true (GPT-2's bias switch covers every projection)")
    if config.sliding_window is not None:
        gpt2.append(f"sliding_window = {config.sliding_window} (GPT-2 attends to the whole context)")
    if config.rope_scaling != "none":
        gpt2.append(f"rope_scaling = {config.rope_scaling!r} (GPT-2 has no RoPE)")
    gpt2 += gemma_only_problems(config, "GPT-2")
    # Llama, Qwen3 (QK-norm, no MLP biases), Qwen2 (q, k, v biases only), Mistral (a sliding window),
    # Phi-3 (Llama's network), Gemma 2 and 3: `tinylm.export.hf_families`; all have a dense MLP
    others = {**llama_family_problems(config), **gemma_family_problems(config)}
    gpt2 += dense_problem(config, "GPT-2")
    others = {arch: issues + dense_problem(config, NAMES[arch]) for arch, issues in others.items()}
    # Mixtral and Qwen2-MoE, the Mixture-of-Experts ones: `tinylm.export.hf_moe`
    others |= moe_family_problems(config)
    # the recipe's options that no architecture has (zero-init projections and an untied head's init
    # change only the starting weights, so they export)
    unsupported = []
    if config.value_embed:
        unsupported.append("value_embed = true (neither has value embeddings)")
    if config.bigram_hash:
        unsupported.append(f"bigram_hash = {config.bigram_hash} (neither has a bigram-hash embedding)")
    return {"gpt2": gpt2 + unsupported, **{arch: issues + unsupported for arch, issues in others.items()}}


def architecture_for(config: GPTConfig) -> Architecture:
    """The `transformers` (and llama.cpp) architecture that computes this model exactly: "gpt2", "llama",
    "qwen3", "qwen2", "mistral", "phi3", "gemma2", "gemma3" or, for a Mixture of Experts, "mixtral" or
    "qwen2_moe" (the first that fits, in that order, or the one ``export_as`` names).

    Anything else is a `TinyLMError` that lists, for the closer architecture first, what does not map.
    The refusal weighs GPT-2 against the Llama-shaped architecture the model's switches point to:
    Qwen3 for ``qk_norm``, Qwen2 for ``qkv_bias``, Mistral for ``sliding_window``, else Llama (they
    differ in those switches, so the others would only add them to the list).
    """
    if config.family != "gpt":
        raise TinyLMError(f"{FAMILY_NAMES[config.family]} model cannot be exported: the transformers and llama.cpp formats hold "
                          "Transformers (family gpt) only; sample, evaluate and serve it with tinylm itself")
    problems = architecture_problems(config)
    if config.export_as != "auto":
        wanted = config.export_as
        if problems[wanted]:
            raise TinyLMError(f"this model cannot be exported as export_as = {wanted!r}: {HF_CLASSES[wanted]} cannot "
                              f"express {', '.join(problems[wanted])}; set export_as = 'auto' to take the "
                              "architecture that fits")
        return wanted
    for arch, issues in problems.items():
        if not issues:
            return arch
    if config.moe_experts:
        detail = "; ".join(f"as {HF_CLASSES[arch]}: {', '.join(problems[arch])}" for arch in MOE_SHAPED)
        raise TinyLMError(
            f"this Mixture-of-Experts model cannot be exported: neither Mixtral nor Qwen2-MoE computes it ({detail}). "
            "Export needs SwiGLU experts behind a softmax router in a Llama-style block (RoPE, RMSNorm, pre-norm, no "
            "biases): Mixtral (the chosen experts' scores renormalised, no shared expert) or Qwen2-MoE (either, a "
            "shared expert, qkv_bias)"
        )
    candidates: tuple[Architecture, ...] = ("gpt2", llama_shaped(config))
    ranked = sorted(candidates, key=lambda arch: len(problems[arch]))
    detail = "; ".join(f"as {HF_CLASSES[arch]}: {', '.join(problems[arch])}" for arch in ranked)
    raise TinyLMError(
        f"this model cannot be exported: neither GPT-2 nor {NAMES[candidates[1]]} computes it ({detail}). Export "
        "needs a GPT-2-style configuration (learned positions, LayerNorm, GELU, pre-norm), a Llama-style one "
        "(RoPE, RMSNorm, SwiGLU, pre-norm) or one of its variants without biases: Qwen3 (qk_norm), Qwen2 "
        "(qkv_bias) or Mistral (sliding_window), or a Gemma-style one (RoPE, RMSNorm, GeGLU, sandwich norms, "
        "embed_scale; Gemma 3 with qk_norm)"
    )



# ----- the weight map -------------------------------------------------------------------------------

# How one tensor of theirs is made from ours. Each takes our tensors (stacked along dim 0 first, which
# is the output dimension of an nn.Linear weight, so q, k, v stack into one fused projection) and has
# an inverse, `to_ours`, that `convert_to_ours` applies on import.
Transform = Literal["copy", "conv1d", "rope_interleave", "gain_offset", "stack", "double"]


@dataclass(frozen=True)
class TensorRule:
    """One tensor of the other format: its name, the tinylm parameter(s) it holds, and how it is laid out.

    - ``theirs``: the name in their file ("transformer.h.0.attn.c_attn.weight").
    - ``ours``: the tinylm state-dict names, stacked along dim 0 in this order (one name for most).
    - ``transform``: "copy" (as is), "conv1d" (GPT-2's (in, out) layout: a 2-D matrix is transposed,
      a bias is not), "rope_interleave" (llama.cpp's rotary layout: see `tinylm.export.gguf`),
      "gain_offset" (Gemma's norms scale by 1 + w, ours by g: w = g - 1), "stack" (our tensors along a
      new first dimension, llama.cpp's (E, out, in) experts), "double" (times 2: a Qwen2-MoE shared
      expert's W_2, behind a gate of 1/2; see `tinylm.export.hf_moe`).
    - ``heads``: for "rope_interleave", the number of heads the rows fall into.
    """

    theirs: str
    ours: tuple[str, ...]
    transform: Transform = "copy"
    heads: int = 0


def rope_interleave(w: Tensor, heads: int) -> Tensor:
    """Reorder each head's rows from rotate-half pairs (i, i + d_h/2) to neighbour pairs (2i, 2i + 1).

    ``w`` is (heads * d_h, ...) (a W_q or W_k weight, or its bias). Row i of a head moves to 2i and
    row i + d_h/2 to 2i + 1; the same permutation of q's and k's coordinates leaves every dot
    product q . k unchanged, and turns our rotation into the one that rotates neighbours.
    """
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_deinterleave(w: Tensor, heads: int) -> Tensor:
    """The inverse of `rope_interleave`: neighbour pairs back to rotate-half pairs."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_theirs(rule: TensorRule, tensors: Sequence[Tensor]) -> Tensor:
    """Our tensor(s) for ``rule`` -> their tensor."""
    if rule.transform == "stack":
        return torch.stack(list(tensors)).contiguous()
    t = tensors[0] if len(tensors) == 1 else torch.cat(list(tensors), dim=0)
    if rule.transform == "conv1d" and t.dim() == 2:
        t = t.T  # (out, in) -> GPT-2's (in, out)
    elif rule.transform == "rope_interleave":
        t = rope_interleave(t, rule.heads)
    elif rule.transform == "gain_offset":
        t = t - 1.0
    elif rule.transform == "double":
        t = t * 2.0  # exact: a power of two
    return t.contiguous()


def to_ours(rule: TensorRule, t: Tensor, sizes: Sequence[int]) -> list[Tensor]:
    """Their tensor for ``rule`` -> our tensor(s), split along dim 0 into ``sizes`` rows (the inverse of `to_theirs`)."""
    if rule.transform == "stack":
        return [part.contiguous() for part in t.unbind(0)]
    if rule.transform == "conv1d" and t.dim() == 2:
        t = t.T
    elif rule.transform == "rope_interleave":
        t = rope_deinterleave(t, rule.heads)
    elif rule.transform == "gain_offset":
        t = t + 1.0  # what Gemma's norm multiplies by, computed once here instead of at every step
    elif rule.transform == "double":
        t = t / 2.0
    return [part.contiguous() for part in torch.split(t, list(sizes), dim=0)]


def hf_rules(config: GPTConfig, arch: Architecture | None = None) -> list[TensorRule]:
    """The tensors of the `transformers` checkpoint of ``config``, in file order, with where each comes from.

    GPT-2 rules always include the biases (GPT-2 has them everywhere; `export_hf` writes zeros for
    a ``bias = false`` model). The Llama-shaped ones share Llama's names, with biases where our model
    has them (all projections with ``bias``, q, k and v with Qwen2's ``qkv_bias``), plus each layer's
    q_norm and k_norm for Qwen3, and Mixtral's and Qwen2-MoE's experts in place of the MLP (`_moe_rules`).
    An untied output head is one more rule; a tied one is E itself.
    """
    arch = arch or architecture_for(config)
    rules: list[TensorRule] = []
    if arch == "gpt2":
        kinds = ("weight", "bias")
        rules += [TensorRule("transformer.wte.weight", ("E.weight",)),
                  TensorRule("transformer.wpe.weight", ("pos_emb.P.weight",))]
        for i in range(config.n_layer):
            h, b = f"transformer.h.{i}.", f"blocks.{i}."
            for k in kinds:
                rules.append(TensorRule(f"{h}ln_1.{k}", (f"{b}norm_1.{k}",)))
            for k in kinds:
                rules.append(TensorRule(f"{h}attn.c_attn.{k}", tuple(f"{b}attn.{w}.{k}" for w in ("W_q", "W_k", "W_v")),
                                        "conv1d"))
            for k in kinds:
                rules.append(TensorRule(f"{h}attn.c_proj.{k}", (f"{b}attn.W_o.{k}",), "conv1d"))
            for k in kinds:
                rules.append(TensorRule(f"{h}ln_2.{k}", (f"{b}norm_2.{k}",)))
            for k in kinds:
                rules.append(TensorRule(f"{h}mlp.c_fc.{k}", (f"{b}mlp.W_1.{k}",), "conv1d"))
            for k in kinds:
                rules.append(TensorRule(f"{h}mlp.c_proj.{k}", (f"{b}mlp.W_2.{k}",), "conv1d"))
        rules += [TensorRule(f"transformer.ln_f.{k}", (f"norm_f.{k}",)) for k in kinds]
    elif arch == "phi3":  # Llama's tensors, with q, k, v stacked in one matrix and gate, up in another
        rules.append(TensorRule("model.embed_tokens.weight", ("E.weight",)))
        for i in range(config.n_layer):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            rules += [TensorRule(f"{h}input_layernorm.weight", (f"{b}norm_1.weight",)),
                      TensorRule(f"{h}self_attn.qkv_proj.weight", tuple(f"{b}attn.{w}.weight" for w in ("W_q", "W_k", "W_v"))),
                      TensorRule(f"{h}self_attn.o_proj.weight", (f"{b}attn.W_o.weight",)),
                      TensorRule(f"{h}post_attention_layernorm.weight", (f"{b}norm_2.weight",)),
                      # gate first: Phi-3 computes up * silu(gate) from the two halves of x W_gate_up
                      TensorRule(f"{h}mlp.gate_up_proj.weight", (f"{b}mlp.W_1.weight", f"{b}mlp.W_3.weight")),
                      TensorRule(f"{h}mlp.down_proj.weight", (f"{b}mlp.W_2.weight",))]
        rules.append(TensorRule("model.norm.weight", ("norm_f.weight",)))
    elif arch in GEMMA_SHAPED:
        rules.append(TensorRule("model.embed_tokens.weight", ("E.weight",)))
        for i in range(config.n_layer):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            rules.append(TensorRule(f"{h}input_layernorm.weight", (f"{b}norm_1.weight",), "gain_offset"))
            rules += [TensorRule(f"{h}self_attn.{theirs}.weight", (f"{b}attn.{ours}.weight",))
                      for theirs, ours in (("q_proj", "W_q"), ("k_proj", "W_k"), ("v_proj", "W_v"), ("o_proj", "W_o"))]
            if arch == "gemma3":
                rules += [TensorRule(f"{h}self_attn.{n}.weight", (f"{b}attn.{n}.weight",), "gain_offset")
                          for n in ("q_norm", "k_norm")]
            # the four norms: input and output of attention, then of the MLP
            rules += [TensorRule(f"{h}post_attention_layernorm.weight", (f"{b}norm_1_out.weight",), "gain_offset"),
                      TensorRule(f"{h}pre_feedforward_layernorm.weight", (f"{b}norm_2.weight",), "gain_offset"),
                      TensorRule(f"{h}post_feedforward_layernorm.weight", (f"{b}norm_2_out.weight",), "gain_offset")]
            # GeGLU: (GELU(x W_1) * x W_3) W_2, and Gemma's down(gelu(gate(x)) * up(x))
            rules += [TensorRule(f"{h}mlp.{theirs}.weight", (f"{b}mlp.{ours}.weight",))
                      for theirs, ours in (("gate_proj", "W_1"), ("up_proj", "W_3"), ("down_proj", "W_2"))]
        rules.append(TensorRule("model.norm.weight", ("norm_f.weight",), "gain_offset"))
    else:
        kinds = ("weight", "bias") if config.bias else ("weight",)
        qkv_kinds = ("weight", "bias") if config.bias or config.qkv_bias else ("weight",)
        rules.append(TensorRule("model.embed_tokens.weight", ("E.weight",)))
        for i in range(config.n_layer):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            rules.append(TensorRule(f"{h}input_layernorm.weight", (f"{b}norm_1.weight",)))
            for theirs, ours in (("q_proj", "W_q"), ("k_proj", "W_k"), ("v_proj", "W_v"), ("o_proj", "W_o")):
                rules += [TensorRule(f"{h}self_attn.{theirs}.{k}", (f"{b}attn.{ours}.{k}",))
                          for k in (kinds if ours == "W_o" else qkv_kinds)]
            if arch == "qwen3":  # one gain of d_h per layer for q and one for k, shared by all heads
                rules += [TensorRule(f"{h}self_attn.{n}.weight", (f"{b}attn.{n}.weight",)) for n in ("q_norm", "k_norm")]
            rules.append(TensorRule(f"{h}post_attention_layernorm.weight", (f"{b}norm_2.weight",)))
            if arch in MOE_SHAPED:
                rules += _moe_rules(config, arch, h, b)
                continue
            # SwiGLU: (SiLU(x W_1) * x W_3) W_2, and Llama's down(silu(gate(x)) * up(x))
            for theirs, ours in (("gate_proj", "W_1"), ("up_proj", "W_3"), ("down_proj", "W_2")):
                rules += [TensorRule(f"{h}mlp.{theirs}.{k}", (f"{b}mlp.{ours}.{k}",)) for k in kinds]
        rules.append(TensorRule("model.norm.weight", ("norm_f.weight",)))
    if not config.tie_embeddings:
        rules.append(TensorRule("lm_head.weight", ("lm_head.weight",)))
    return rules


def _moe_rules(config: GPTConfig, arch: Architecture, h: str, b: str) -> list[TensorRule]:
    """A Mixture-of-Experts MLP as Mixtral's ``block_sparse_moe`` or Qwen2-MoE's ``mlp``: the router (their ``gate``,
    E x d), each expert's SwiGLU matrices and Qwen2-MoE's shared expert (its W_2 doubled: `tinylm.export.hf_moe`)."""
    if arch == "mixtral":
        m, names = f"{h}block_sparse_moe.", (("w1", "W_1"), ("w3", "W_3"), ("w2", "W_2"))
    else:
        m, names = f"{h}mlp.", (("gate_proj", "W_1"), ("up_proj", "W_3"), ("down_proj", "W_2"))
    rules = [TensorRule(f"{m}gate.weight", (f"{b}mlp.router.weight",))]
    for e in range(config.moe_experts):
        rules += [TensorRule(f"{m}experts.{e}.{theirs}.weight", (f"{b}mlp.experts.{e}.{ours}.weight",))
                  for theirs, ours in names]
    if config.moe_shared_experts:  # Qwen2-MoE only (architecture_for)
        rules += [TensorRule(f"{m}shared_expert.{theirs}.weight", (f"{b}mlp.shared.{ours}.weight",),
                             "double" if ours == "W_2" else "copy") for theirs, ours in names]
    return rules


def convert_to_theirs(state: Mapping[str, Tensor], rules: Sequence[TensorRule]) -> dict[str, Tensor]:
    """Their tensors, by name, from our state dict (CPU, contiguous); a missing bias becomes zeros.

    A bias absent from ``state`` is a ``bias = false`` model written to a format that always has
    biases (GPT-2): zeros of the size of the matching weight's output, the same function.
    """
    out: dict[str, Tensor] = {}
    for rule in rules:
        parts = []
        for name in rule.ours:
            if name in state:
                parts.append(state[name].detach().cpu())
            elif name.endswith(".bias") and name.removesuffix(".bias") + ".weight" in state:
                weight = state[name.removesuffix(".bias") + ".weight"]
                parts.append(torch.zeros(weight.shape[0], dtype=weight.dtype))
            else:
                raise TinyLMError(
                    f"the model has no parameter {name!r}, which {rule.theirs!r} is made from: the model's "
                    f"parameters do not follow its configuration (names: {', '.join(list(state)[:6])}, ...)"
                )
        out[rule.theirs] = to_theirs(rule, parts)
    return out


def convert_to_ours(
    theirs: Mapping[str, Tensor], rules: Sequence[TensorRule], expected: Mapping[str, Tensor], source: str
) -> dict[str, Tensor]:
    """Our state dict from their tensors; ``expected`` (a fresh model's state dict) gives every shape.

    Every rule's tensor must be present with the shape the configuration implies; a tensor of
    theirs that no rule reads is an error too (it would be silently dropped otherwise).
    """
    ours: dict[str, Tensor] = {}
    for rule in rules:
        if rule.theirs not in theirs:
            raise TinyLMError(f"{source} has no tensor {rule.theirs!r}, which its config.json implies; the "
                              "checkpoint is incomplete or of another architecture")
        sizes = [expected[name].shape[0] for name in rule.ours]
        want = to_theirs(rule, [expected[name] for name in rule.ours]).shape
        t = theirs[rule.theirs]
        if t.shape != want:
            raise TinyLMError(f"{source}: tensor {rule.theirs!r} is {tuple(t.shape)}, but config.json implies "
                              f"{tuple(want)}")
        for name, part in zip(rule.ours, to_ours(rule, t, sizes)):
            ours[name] = part
    unused = sorted(set(theirs) - {rule.theirs for rule in rules})
    if unused:
        raise TinyLMError(f"{source} has tensors tinylm would not use ({', '.join(unused[:4])}"
                          f"{', ...' if len(unused) > 4 else ''}): its config.json and weights disagree, or it "
                          "is a variant of the architecture that tinylm does not compute")
    return ours



__all__ = [
    "Architecture", "Transform", "TensorRule", "architecture_for", "architecture_problems", "hf_rules",
    "rope_interleave", "rope_deinterleave", "to_theirs", "to_ours", "convert_to_theirs", "convert_to_ours",
]
