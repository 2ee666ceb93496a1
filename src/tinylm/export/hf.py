"""Hugging Face `transformers` checkpoints: export a tinylm model as GPT-2, Llama, Qwen3, Qwen2 or Mistral, and import one back.

A tinylm `GPT` is one family of models with switches (positions, norm, MLP, heads); `transformers`
has one class per architecture. Three of its classes compute exactly what some settings of ours
compute, so those settings export to them and nothing else does:

==============  ==============================  ============================  ==============================
tinylm setting  GPT2LMHeadModel ("gpt2")        LlamaForCausalLM ("llama")    Qwen3ForCausalLM ("qwen3")
==============  ==============================  ============================  ==============================
positions       "learned" (``wpe``)             "rope", base ``rope_theta``   as Llama
norm            "layernorm", eps                "rmsnorm", ``rms_norm_eps``   as Llama
                ``layer_norm_epsilon``
mlp             "gelu" (tanh form, "gelu_new")  "swiglu" (SiLU, gated)        as Llama
n_kv_head       = n_head (no GQA)               any divisor                   as Llama
                                                (``num_key_value_heads``)
qk_norm         false                           false                         true (``q_norm``, ``k_norm``,
                                                                              eps ``rms_norm_eps``)
bias            always there: ``bias = false``  ``attention_bias`` =          false: its MLP has none
                is written as zero biases       ``mlp_bias`` = ``bias``       (``attention_bias: false``)
norm_position   "pre"                           "pre"                         "pre"
tie_embeddings  ``tie_word_embeddings``         ``tie_word_embeddings``       ``tie_word_embeddings``
==============  ==============================  ============================  ==============================

Qwen2 (biases on q, k and v alone: ``qkv_bias``) and Mistral (a ``sliding_window``) are Llama variants
too, and any of the Llama-shaped four may scale its RoPE ("linear", "llama3": ``rope_scaling``);
`tinylm.export.hf_families` has their table and their config.json fields.

Qwen3 is Llama plus QK-norm: each head's q and k go through an RMSNorm over d_h (one gain vector
per layer for q and one for k, shared by the heads) before RoPE, which is what our ``qk_norm``
computes. tinylm has one ``bias`` switch for every projection, MLP included, and Qwen3's MLP has
no biases, so a biased QK-norm model is refused rather than exported with its MLP biases dropped.
Its config.json turns the sliding window off and writes ``head_dim`` (Qwen3Config's default is 128).

`architecture_for` picks the one a configuration fits and refuses the rest (sinusoidal or no
positions, post-norm, LayerNorm with RoPE, GQA with learned positions, QK-norm with biases, ...) with a message
naming each setting that does not map. A refused model is not "approximately" exportable: a
checkpoint that loads but computes something else is worse than none.

How the weights are named, per block ``i`` (ours on the left, then GPT-2's, then Llama's and
Qwen3's; see `hf_rules` for the table the code uses)::

    E                       transformer.wte              model.embed_tokens
    pos_emb.P               transformer.wpe              -
    blocks.i.norm_1         transformer.h.i.ln_1         model.layers.i.input_layernorm
    attn.W_q, W_k, W_v      transformer.h.i.attn.c_attn  self_attn.q_proj, k_proj, v_proj
                            (one fused matrix)
    attn.q_norm, k_norm     -                            self_attn.q_norm, k_norm (Qwen3 only)
    attn.W_o                transformer.h.i.attn.c_proj  self_attn.o_proj
    blocks.i.norm_2         transformer.h.i.ln_2         post_attention_layernorm
    mlp.W_1                 transformer.h.i.mlp.c_fc     mlp.gate_proj
    mlp.W_3 (SwiGLU only)   -                            mlp.up_proj
    mlp.W_2                 transformer.h.i.mlp.c_proj   mlp.down_proj
    norm_f                  transformer.ln_f             model.norm
    lm_head                 lm_head (untied only)        lm_head (untied only)

Three things to know when reading the table:

- **GPT-2's Conv1D is transposed.** OpenAI wrote GPT-2 in TensorFlow with ``x @ W + b`` and W
  stored (in, out); `transformers` kept that layout in a layer it calls ``Conv1D``. PyTorch's
  ``nn.Linear`` (ours, and Llama's) stores W as (out, in) and computes ``x @ W.T + b``. So every
  GPT-2 projection is our ``weight.T``; ``c_attn`` is q, k and v side by side: the rows of
  W_q, W_k, W_v stacked (out = 3d), then transposed.
- **RoPE needs no permutation here.** Our rotary layout pairs coordinate i of a head with
  i + d_h/2 ("rotate half"), which is what `transformers`' Llama and Qwen3 do; Meta's original Llama
  code paired neighbours (2i, 2i+1), which is why `transformers`' own Llama converter permutes
  W_q and W_k. Our weights go in as they are. (llama.cpp is the other way round: see
  `tinylm.export.gguf`.)
- **Tied weights are written once.** With ``tie_embeddings`` the output head *is* E; the file
  holds ``transformer.wte.weight`` (or ``model.embed_tokens.weight``) only, and
  ``tie_word_embeddings: true`` in config.json tells `transformers` to reuse it, as its own
  ``save_pretrained`` does. An untied head is written as ``lm_head.weight``.

Epsilon: both sides add eps inside the square root (LayerNorm: (x - mean) / sqrt(var + eps);
RMSNorm: x / sqrt(mean(x^2) + eps)), so ``norm_eps`` maps to ``layer_norm_epsilon`` or
``rms_norm_eps`` unchanged. Biases: GPT-2 has them everywhere, so a ``bias = false`` model is
written with zero biases (the same function, exactly) and comes back from `import_hf` as a
``bias = true`` model whose biases are zero.

Besides the weights, `export_hf` writes what `AutoTokenizer` and ``generate`` need:
tokenizer.json (`tinylm.tokenizers.formats`, same ids as ours), tokenizer_config.json and
special_tokens_map.json (naming bos, eos and pad, and ``clean_up_tokenization_spaces: false``
so decoding gives our text back byte for byte), and generation_config.json (bos, eos, pad ids, and the ids
no sample takes as ``suppress_tokens``).
No BOS is added by the tokenizer: tinylm puts the start token itself (see `tinylm.run.start_ids`).

Import is the reverse: `import_hf` reads config.json, model.safetensors (or a sharded
``model.safetensors.index.json``; never pickle files) and tokenizer.json into a `GPT`, a
`BPETokenizer` and a `GPTConfig`; `import_hf_into_run` writes them as a tinylm run directory
that `sample`, `eval`, `serve` and ``train --init-from`` read. The tokenizer must be in tinylm's
id layout (the 256 bytes at ids 0..255, merge r at 256 + r, then bos, eos, pad); OpenAI's GPT-2
tokenizer orders its first 256 ids differently and has one special token, so real GPT-2 weights
would need their embedding rows renumbered first, which this module does not do yet.

Usage::

    export_hf(run.model, run.tokenizer, "out/hf")       # then AutoModelForCausalLM.from_pretrained("out/hf")
    model, tokenizer, config = import_hf("out/hf")
    import_hf_into_run("out/hf", "runs/imported")
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from torch import Tensor

from tinylm.atomic import atomic_path, atomic_write_text
from tinylm.config import FAMILY_NAMES, Config, GPTConfig, dump_toml
from tinylm.errors import TinyLMError
from tinylm.export.hf_families import (
    HF_CLASSES,
    NAMES,
    Architecture,
    default_rule,
    llama_family_config,
    llama_family_fields,
    llama_family_problems,
    llama_shaped,
    refusal,
    required,
)
from tinylm.model.gpt import GPT
from tinylm.run import CONFIG_FILE as RUN_CONFIG_FILE
from tinylm.run import (
    RUN_FILE,
    checkpoint_path,
    copy_checkpoint,
    save_checkpoint,
    save_safetensors,
    write_run_info,
)
from tinylm.run import TOKENIZER_FILE as RUN_TOKENIZER_FILE
from tinylm.tokenizers.base import BOS, EOS, PAD, Tokenizer, generation_excluded
from tinylm.tokenizers.bpe import BPETokenizer
from tinylm.tokenizers.files import export_tokenizer
from tinylm.tokenizers.hf_files import read_hf_tokenizer
from tinylm.tokenizers.imported import ImportedTokenizer

# what `from_pretrained` reads; `export_hf` writes all of them
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's map: tensor -> shard file
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
EXPORTED_FILES = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_FILE,
                  GENERATION_CONFIG_FILE)

# GELU activations of GPT-2 configs that are the tanh form we compute (the erf form "gelu" is not)
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


# ----- which architecture ---------------------------------------------------------------------------


def architecture_problems(config: GPTConfig) -> dict[Architecture, list[str]]:
    """For each architecture, the settings of ``config`` it cannot express (empty: it fits exactly)."""
    gpt2: list[str] = []
    if config.norm_position != "pre":
        gpt2.append(f"norm_position = {config.norm_position!r} (GPT-2 normalizes each sublayer's input: 'pre')")
    if config.positions != "learned":
        gpt2.append(f"positions = {config.positions!r} (GPT-2 learns a position table: 'learned')")
    if config.norm != "layernorm":
        gpt2.append(f"norm = {config.norm!r} (GPT-2 uses 'layernorm')")
    if config.mlp != "gelu":
        gpt2.append(f"mlp = {config.mlp!r} (GPT-2's MLP is 'gelu')")
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
    # Llama, Qwen3 (QK-norm, no MLP biases), Qwen2 (q, k, v biases only) and Mistral (a sliding window):
    # `tinylm.export.hf_families`
    others = llama_family_problems(config)
    # the recipe's options that no architecture has (zero-init projections and an untied head's init
    # change only the starting weights, so they export)
    unsupported = []
    if config.logit_softcap is not None:
        unsupported.append(f"logit_softcap = {config.logit_softcap:g} (neither caps its logits)")
    if config.value_embed:
        unsupported.append("value_embed = true (neither has value embeddings)")
    if config.bigram_hash:
        unsupported.append(f"bigram_hash = {config.bigram_hash} (neither has a bigram-hash embedding)")
    return {"gpt2": gpt2 + unsupported, **{arch: issues + unsupported for arch, issues in others.items()}}


def architecture_for(config: GPTConfig) -> Architecture:
    """The `transformers` (and llama.cpp) architecture that computes this model exactly: "gpt2", "llama",
    "qwen3", "qwen2" or "mistral" (the first that fits, in that order).

    Anything else is a `TinyLMError` that lists, for the closer architecture first, what does not map.
    The refusal weighs GPT-2 against the Llama-shaped architecture the model's switches point to:
    Qwen3 for ``qk_norm``, Qwen2 for ``qkv_bias``, Mistral for ``sliding_window``, else Llama (they
    differ in those switches, so the others would only add them to the list).
    """
    if config.family != "gpt":
        raise TinyLMError(f"{FAMILY_NAMES[config.family]} model cannot be exported: the transformers and llama.cpp formats hold "
                          "Transformers (family gpt) only; sample, evaluate and serve it with tinylm itself")
    problems = architecture_problems(config)
    for arch, issues in problems.items():
        if not issues:
            return arch
    candidates: tuple[Architecture, ...] = ("gpt2", llama_shaped(config))
    ranked = sorted(candidates, key=lambda arch: len(problems[arch]))
    detail = "; ".join(f"as {HF_CLASSES[arch]}: {', '.join(problems[arch])}" for arch in ranked)
    raise TinyLMError(
        f"this model cannot be exported: neither GPT-2 nor {NAMES[candidates[1]]} computes it ({detail}). Export "
        "needs a GPT-2-style configuration (learned positions, LayerNorm, GELU, pre-norm), a Llama-style one "
        "(RoPE, RMSNorm, SwiGLU, pre-norm) or one of its variants without biases: Qwen3 (qk_norm), Qwen2 "
        "(qkv_bias) or Mistral (sliding_window)"
    )


# ----- the weight map -------------------------------------------------------------------------------

# How one tensor of theirs is made from ours. Each takes our tensors (stacked along dim 0 first, which
# is the output dimension of an nn.Linear weight, so q, k, v stack into one fused projection) and has
# an inverse that `_split_theirs` applies on import.
Transform = Literal["copy", "conv1d", "rope_interleave"]


@dataclass(frozen=True)
class TensorRule:
    """One tensor of the other format: its name, the tinylm parameter(s) it holds, and how it is laid out.

    - ``theirs``: the name in their file ("transformer.h.0.attn.c_attn.weight").
    - ``ours``: the tinylm state-dict names, stacked along dim 0 in this order (one name for most).
    - ``transform``: "copy" (as is), "conv1d" (GPT-2's (in, out) layout: a 2-D matrix is transposed,
      a bias is not), "rope_interleave" (llama.cpp's rotary layout: see `tinylm.export.gguf`).
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
    t = tensors[0] if len(tensors) == 1 else torch.cat(list(tensors), dim=0)
    if rule.transform == "conv1d" and t.dim() == 2:
        t = t.T  # (out, in) -> GPT-2's (in, out)
    elif rule.transform == "rope_interleave":
        t = rope_interleave(t, rule.heads)
    return t.contiguous()


def to_ours(rule: TensorRule, t: Tensor, sizes: Sequence[int]) -> list[Tensor]:
    """Their tensor for ``rule`` -> our tensor(s), split along dim 0 into ``sizes`` rows (the inverse of `to_theirs`)."""
    if rule.transform == "conv1d" and t.dim() == 2:
        t = t.T
    elif rule.transform == "rope_interleave":
        t = rope_deinterleave(t, rule.heads)
    return [part.contiguous() for part in torch.split(t, list(sizes), dim=0)]


def hf_rules(config: GPTConfig, arch: Architecture | None = None) -> list[TensorRule]:
    """The tensors of the `transformers` checkpoint of ``config``, in file order, with where each comes from.

    GPT-2 rules always include the biases (GPT-2 has them everywhere; `export_hf` writes zeros for
    a ``bias = false`` model). The Llama-shaped ones share Llama's names, with biases where our model
    has them (all projections with ``bias``, q, k and v with Qwen2's ``qkv_bias``), plus each layer's
    q_norm and k_norm for Qwen3. An untied output head is one more rule; a tied one is E itself.
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
            # SwiGLU: (SiLU(x W_1) * x W_3) W_2, and Llama's down(silu(gate(x)) * up(x))
            for theirs, ours in (("gate_proj", "W_1"), ("up_proj", "W_3"), ("down_proj", "W_2")):
                rules += [TensorRule(f"{h}mlp.{theirs}.{k}", (f"{b}mlp.{ours}.{k}",)) for k in kinds]
        rules.append(TensorRule("model.norm.weight", ("norm_f.weight",)))
    if not config.tie_embeddings:
        rules.append(TensorRule("lm_head.weight", ("lm_head.weight",)))
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


# ----- export ---------------------------------------------------------------------------------------


def hf_config(config: GPTConfig, tokenizer: Tokenizer | None = None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """config.json for ``config``: the `transformers` GPT2Config, LlamaConfig, Qwen3Config, Qwen2Config or
    MistralConfig fields that say the same."""
    arch = architecture_for(config)
    specials: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if tokenizer is not None:
        specials = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
                    "pad_token_id": tokenizer.pad_id}
    dtype_name = str(dtype).removeprefix("torch.")
    common = {"architectures": [HF_CLASSES[arch]], "model_type": arch, "vocab_size": config.vocab_size,
              "initializer_range": config.init_std, "tie_word_embeddings": config.tie_embeddings,
              "use_cache": True, **specials,
              # `dtype` is what transformers 5 reads, `torch_dtype` what 4.x reads
              "dtype": dtype_name, "torch_dtype": dtype_name}
    if arch == "gpt2":
        return {**common,
                "n_positions": config.block_size,
                "n_ctx": config.block_size,  # the old name of n_positions; llama.cpp's converter reads it
                "n_embd": config.d_model, "n_layer": config.n_layer, "n_head": config.n_head,
                "n_inner": config.hidden_dim,
                "activation_function": "gelu_new",  # GELU's tanh form, which our MLP computes
                "layer_norm_epsilon": config.norm_eps,
                "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False}
    return {**common, **llama_family_fields(config, arch)}


def _tokenizer_files(tokenizer: Tokenizer, block_size: int, model_vocab: int) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json, special_tokens_map.json and generation_config.json for ``tokenizer``, with a model
    of ``model_vocab`` outputs (more than the tokenizer's ids when its output layer is padded)."""
    bos, eos, pad = (tokenizer.roles[role] for role in ("bos", "eos", "pad"))
    reserved = [name for name in tokenizer.special_tokens if name not in (bos, eos, pad)]
    added_words = getattr(tokenizer, "added_words", {})
    added = {
        str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": name in tokenizer.special_tokens}
        for name, i in sorted({**tokenizer.special_tokens, **added_words}.items(), key=lambda kv: kv[1])
    }
    unk = getattr(tokenizer, "unk", None)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # reads tokenizer.json alone; no vocab.json/merges.txt
        "bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk,
        "additional_special_tokens": reserved,
        "added_tokens_decoder": added,
        "model_max_length": block_size,
        # tinylm's own tokenizers add no BOS/EOS while encoding: the caller puts the start token (see
        # run.start_ids); an imported Llama's tokenizer.json puts its "<s>" in front itself
        "add_bos_token": tokenizer.add_bos, "add_eos_token": False,
        # transformers' old default strips spaces before punctuation when decoding: not our text
        "clean_up_tokenization_spaces": False,
    }
    template = getattr(tokenizer, "chat_template", None)
    if template is not None:
        tokenizer_config["chat_template"] = template
    special_tokens_map = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "additional_special_tokens": reserved}
    if unk is not None:
        special_tokens_map["unk_token"] = unk
    # suppress_tokens: transformers' generate then never draws what tinylm's samplers never draw (PAD, BOS, ...)
    # eos_token_id as a list when the tokenizer ends a turn with other tokens too (Llama 3's <|eot_id|>)
    stop = [tokenizer.eos_id, *(i for i in getattr(tokenizer, "stop_ids", ()) if i != tokenizer.eos_id)]
    generation_config = {"bos_token_id": tokenizer.bos_id, "eos_token_id": stop if len(stop) > 1 else stop[0],
                         "pad_token_id": tokenizer.pad_id,
                         "suppress_tokens": generation_excluded(tokenizer) + list(range(tokenizer.vocab_size,
                                                                                         model_vocab))}
    return {TOKENIZER_CONFIG_FILE: tokenizer_config, SPECIAL_TOKENS_FILE: special_tokens_map,
            GENERATION_CONFIG_FILE: generation_config}


def _check_tokenizer(tokenizer: Tokenizer | None, config: GPTConfig, what: str) -> Tokenizer | None:
    if tokenizer is None:
        return None
    if not isinstance(tokenizer, (BPETokenizer, ImportedTokenizer)):
        raise TinyLMError(
            f"a {tokenizer.kind} tokenizer cannot be exported for {what}: tokenizer.json and GGUF hold byte-level "
            "BPE only. Train the model with a BPE tokenizer (--tokenizer-kind bpe), or export the weights alone "
            "(tokenizer=None in Python)"
        )
    if tokenizer.vocab_size > config.vocab_size:
        raise TinyLMError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size} "
                          "rows of embeddings: they are not a pair")
    return tokenizer


def _prepare_out_dir(out_dir: Path, names: Sequence[str], overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise TinyLMError(f"{out_dir} exists and is not a folder; choose another --out")
    present = [name for name in names if (out_dir / name).exists()]
    if present and not overwrite:
        raise TinyLMError(f"{out_dir} already holds {', '.join(present)}; choose another --out or overwrite "
                          "explicitly (--force)")
    out_dir.mkdir(parents=True, exist_ok=True)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def export_hf(model: GPT, tokenizer: Tokenizer | None, out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write ``model`` (and ``tokenizer``) as a `transformers` checkpoint folder; returns the folder.

    The folder loads with ``AutoModelForCausalLM.from_pretrained(out_dir)`` as GPT2LMHeadModel,
    LlamaForCausalLM or Qwen3ForCausalLM (`architecture_for` decides, or refuses) and with
    ``AutoTokenizer`` when a tokenizer is given (it must be byte-level BPE). ``tokenizer=None``
    writes the weights and config.json alone. Existing files are replaced only with ``overwrite``.
    """
    config = model.config
    arch = architecture_for(config)
    tok = _check_tokenizer(tokenizer, config, "transformers")
    out_dir = Path(out_dir)
    _prepare_out_dir(out_dir, EXPORTED_FILES if tok is not None else (CONFIG_FILE, WEIGHTS_FILE), overwrite)

    state = model.state_dict()
    tensors = convert_to_theirs(state, hf_rules(config, arch))
    with atomic_path(out_dir / WEIGHTS_FILE) as tmp:
        # {"format": "pt"} is what transformers' own save_pretrained writes, and what it checks on load
        save_safetensors(tensors, tmp, metadata={"format": "pt"})
    _write_json(out_dir / CONFIG_FILE, hf_config(config, tok, state["E.weight"].dtype))
    if tok is not None:
        export_tokenizer(tok, out_dir / TOKENIZER_FILE, "hf", overwrite=True)
        for name, data in _tokenizer_files(tok, config.block_size, config.vocab_size).items():
            _write_json(out_dir / name, data)
    return out_dir


# ----- import ---------------------------------------------------------------------------------------


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TinyLMError(f"{path} is missing: a Hugging Face checkpoint folder has {what}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TinyLMError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise TinyLMError(f"{path} is not a JSON object")
    return data


def _arch_of(hf: Mapping[str, Any], source: str) -> Architecture:
    model_type = hf.get("model_type")
    classes = hf.get("architectures") or []
    for arch, cls in HF_CLASSES.items():
        if model_type == arch or cls in classes:
            return arch
    *others, last = HF_CLASSES.values()
    raise TinyLMError(
        f"{source} describes a {model_type or '?'} model ({', '.join(classes) or 'no architectures listed'}); "
        f"tinylm imports {', '.join(others)} and {last} checkpoints only"
    )


def config_from_hf(hf: Mapping[str, Any], source: str = CONFIG_FILE) -> tuple[GPTConfig, Architecture]:
    """The `GPTConfig` of a GPT-2, Llama, Qwen3, Qwen2 or Mistral config.json, and which it is; variants
    tinylm does not compute are errors (one line naming the key)."""
    arch = _arch_of(hf, source)
    if arch != "gpt2":
        return llama_family_config(hf, arch, source), arch

    def need(key: str, *alternatives: str) -> Any:
        return required(hf, source, arch, key, *alternatives)

    tie = bool(hf.get("tie_word_embeddings", True))
    act = hf.get("activation_function", "gelu_new")
    if act not in _TANH_GELUS:
        raise refusal(source, arch, f"activation_function is {act!r}, and tinylm's GELU is the tanh form "
                                    f"({', '.join(_TANH_GELUS)})")
    for key, ok in (("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False),
                    ("scale_attn_weights", True)):
        if bool(hf.get(key, ok)) != ok:
            raise refusal(source, arch, f"{key} is {hf.get(key)}")
    d_model = int(need("n_embd", "hidden_size"))
    d_ff = hf.get("n_inner")
    config = GPTConfig(
        vocab_size=int(need("vocab_size")), block_size=int(need("n_positions", "n_ctx")),
        n_layer=int(need("n_layer")), d_model=d_model, n_head=int(need("n_head")), mlp="gelu",
        d_ff=None if d_ff is None else default_rule(int(d_ff), d_model, "gelu"),
        norm="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), positions="learned",
        bias=True, tie_embeddings=tie, dropout=float(hf.get("resid_pdrop", 0.0)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )
    return config, arch


def read_hf_weights(src_dir: str | os.PathLike) -> dict[str, Tensor]:
    """Every tensor of a checkpoint folder: model.safetensors, or the shards its index lists. No pickle files."""
    src_dir = Path(src_dir)
    index = src_dir / WEIGHTS_INDEX_FILE
    if (src_dir / WEIGHTS_FILE).is_file():
        files = [src_dir / WEIGHTS_FILE]
    elif index.is_file():
        weight_map = _read_json(index, "a shard index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise TinyLMError(f"{index} has no weight_map")
        files = [src_dir / name for name in sorted(set(weight_map.values()))]
    else:
        pickles = sorted(p.name for p in src_dir.glob("*.bin")) + sorted(p.name for p in src_dir.glob("*.pt"))
        hint = (f" It has {', '.join(pickles[:3])}: pickle files, which can run code when loaded and which tinylm "
                "does not open; convert them to safetensors first (in transformers: from_pretrained, then "
                "save_pretrained(..., safe_serialization=True))") if pickles else ""
        raise TinyLMError(f"{src_dir} has no {WEIGHTS_FILE} (or {WEIGHTS_INDEX_FILE} with shards).{hint}")
    tensors: dict[str, Tensor] = {}
    for path in files:
        if not path.is_file():
            raise TinyLMError(f"{path} is missing (listed in {WEIGHTS_INDEX_FILE})")
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except Exception as e:  # safetensors has its own error types for a damaged file
            raise TinyLMError(f"{path} is not a readable safetensors file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120]})") from None
    return tensors


def _normalize_names(tensors: dict[str, Tensor], arch: Architecture, config: GPTConfig) -> dict[str, Tensor]:
    """Their names as `hf_rules` spells them: drop non-weight buffers, add GPT-2's optional prefix, drop a tied head."""
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        # GPT-2's causal-mask buffers and Llama's cached RoPE frequencies are not weights
        if name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            continue
        if arch == "gpt2" and not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name  # OpenAI's own upload names the GPT2Model's tensors without it
        out[name] = t
    if config.tie_embeddings:
        out.pop("lm_head.weight", None)  # some files store the tied head anyway; it is E
    return out


def import_hf(src_dir: str | os.PathLike, *,
              roles: dict[str, str] | None = None) -> tuple[GPT, Tokenizer, GPTConfig]:
    """A local `transformers` GPT-2, Llama or Qwen3 checkpoint as a tinylm model (eval mode, float32), tokenizer and config.

    ``src_dir`` holds config.json, model.safetensors (or sharded safetensors with their index) and
    tokenizer.json. Unsupported architectures and variants, missing files, and tokenizers that are
    not in tinylm's id layout are `TinyLMError`s that say which.
    """
    src_dir = Path(src_dir)
    if not src_dir.is_dir():
        raise TinyLMError(f"{src_dir} is not a folder; give the folder that holds config.json and model.safetensors")
    config, arch = config_from_hf(_read_json(src_dir / CONFIG_FILE, "config.json"), str(src_dir / CONFIG_FILE))
    if not (src_dir / TOKENIZER_FILE).is_file() and not (src_dir / "vocab.json").is_file():
        raise TinyLMError(f"{src_dir} has no {TOKENIZER_FILE} (nor vocab.json + merges.txt): tinylm needs the "
                          "tokenizer the model was trained with")
    tensors = _normalize_names(read_hf_weights(src_dir), arch, config)
    try:
        tokenizer = read_hf_tokenizer(src_dir, roles=roles)
    except TinyLMError as e:
        raise TinyLMError(f"the weights are readable, but the tokenizer is not: {e}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise TinyLMError(f"{src_dir}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                          f"{config.vocab_size}; they are not a pair")

    with torch.random.fork_rng(devices=[]):  # the random init is overwritten at once; leave the caller's RNG alone
        model = GPT(config)
    expected = model.state_dict()
    ours = convert_to_ours(tensors, hf_rules(config, arch), expected, str(src_dir))
    if config.tie_embeddings:
        ours["lm_head.weight"] = ours["E.weight"]
    model.load_state_dict(ours, strict=True)
    return model.eval(), tokenizer, config


def import_hf_into_run(src_dir: str | os.PathLike, run_dir: str | os.PathLike, *, force: bool = False,
                       roles: dict[str, str] | None = None) -> Path:
    """Import a `transformers` checkpoint (see `import_hf`) as a tinylm run directory at ``run_dir``.

    The run has config.toml (the imported [model] table and default [train] settings),
    tokenizer.json, run.json (status "imported", where it came from) and one checkpoint at step 0,
    saved as both "latest" and "best", so `load_run`, `tinylm sample`, `serve` and
    ``tinylm train --init-from RUN_DIR`` read it like a trained run. An existing non-empty folder
    is replaced only with ``force``, and only if it is a tinylm run.
    """
    src_dir, run_dir = Path(src_dir), Path(run_dir)
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        if not force:
            raise TinyLMError(f"{run_dir} already exists; choose another --out, or --force to replace it")
        if not run_dir.is_dir() or not ((run_dir / RUN_FILE).exists() or (run_dir / RUN_CONFIG_FILE).exists()):
            raise TinyLMError(f"{run_dir} is not a tinylm run folder; --force replaces only run folders, so choose "
                              "another --out")
    model, tokenizer, model_config = import_hf(src_dir, roles=roles)  # everything is read before anything is deleted
    if run_dir.exists():
        shutil.rmtree(run_dir)
    config = Config(model=model_config)
    run_dir.mkdir(parents=True)
    atomic_write_text(run_dir / RUN_CONFIG_FILE, dump_toml(config.to_dict()))
    tokenizer.save(run_dir / RUN_TOKENIZER_FILE)
    source = {"format": "huggingface", "path": str(src_dir.resolve()),
              "architecture": HF_CLASSES[architecture_for(model_config)]}
    state = {"step": 0, "tokens": 0, "elapsed": 0.0, "best_val_loss": None, "imported_from": source}
    latest = checkpoint_path(run_dir, "latest")
    save_checkpoint(latest, model_state=model.state_dict(), optimizer_state=None, rng_state={}, state=state,
                    config=config, tokenizer=tokenizer)
    copy_checkpoint(latest, checkpoint_path(run_dir, "best"))
    write_run_info(run_dir, {"status": "imported", "step": 0, "imported_from": source})
    return run_dir


__all__ = [
    "Architecture", "TensorRule", "architecture_for", "architecture_problems", "hf_rules", "hf_config",
    "export_hf", "import_hf", "import_hf_into_run", "config_from_hf", "read_hf_weights",
    "rope_interleave", "rope_deinterleave", "to_theirs", "to_ours", "convert_to_theirs", "convert_to_ours",
]
