"""Mixtral and Qwen2-MoE: which Mixture-of-Experts settings each one computes, their config.json both ways, and the
tensors of theirs that tinylm's `tinylm.model.moe.MoE` has no parameter for.

Both are a Llama-shaped block (RoPE, RMSNorm, pre-norm) whose MLP is E SwiGLU experts behind a softmax
router, each token through the k it scores highest:

- Mixtral (``MixtralForCausalLM``): the k chosen scores renormalised to sum to 1 (``moe_norm_topk``), no
  shared expert, no biases.
- Qwen2-MoE (``Qwen2MoeForCausalLM``): ``norm_topk_prob`` says whether they are renormalised, q, k and v
  may have biases (``qkv_bias``), and a shared expert every token goes through, gated per token by
  sigmoid(x w_g). tinylm's shared expert is ungated; the export writes w_g = 0, a gate of exactly
  sigmoid(0) = 1/2, and the shared expert's W_2 doubled (both exact in floating point), and a model
  without a shared expert as one of width 0. A Qwen2-MoE checkpoint with any other gate is refused.

Neither has DeepSeek-V3's sigmoid router or its selection bias (``moe_balance = "bias"``): refused by
name. Mixtral comes first, so a model both compute is exported as Mixtral. Their per-expert tensors
(``experts.M.w1`` / ``gate_proj`` ...) are the names on the Hub and what `transformers` 5 writes;
its in-memory layout, each layer's experts fused into ``experts.gate_up_proj`` (E, 2 d_e, d) and
``experts.down_proj`` (E, d, d_e), is read on import too (`split_fused_experts`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from tinylm.config import GPTConfig
from tinylm.errors import TinyLMError
from tinylm.export.hf_families import (MOE_SHAPED, NAMES, MoEShaped, default_rule, gemma_only_problems,
                                      llama_family_fields, refusal, required, rope_from_hf, shape_problems)

# config.json defaults of `transformers` that change what a missing key means
MIXTRAL_DEFAULTS = {"num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_experts_per_tok": 2,
                    "sliding_window": None, "router_aux_loss_coef": 0.001}
QWEN2_MOE_DEFAULTS = {"num_key_value_heads": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                      "num_experts_per_tok": 4, "norm_topk_prob": False, "qkv_bias": True, "decoder_sparse_step": 1,
                      "router_aux_loss_coef": 0.001}


def dense_problem(config: GPTConfig, name: str) -> list[str]:
    """The problem a Mixture-of-Experts model is for a dense architecture ``name`` (empty for a dense model)."""
    if not config.moe_experts:
        return []
    return [f"moe_experts = {config.moe_experts} ({name}'s MLP is dense; Mixtral and Qwen2-MoE route among experts)"]


def moe_family_problems(config: GPTConfig) -> dict[MoEShaped, list[str]]:
    """For Mixtral and Qwen2-MoE, the settings of ``config`` each cannot express (empty: it fits exactly)."""
    problems: dict[MoEShaped, list[str]] = {}
    for arch in MOE_SHAPED:
        name = NAMES[arch]
        if not config.moe_experts:
            problems[arch] = [f"moe_experts = 0 ({name}'s MLP is a Mixture of Experts)"]
            continue
        issues = shape_problems(config, name)  # RoPE, RMSNorm, SwiGLU (the experts' kind), pre-norm
        if config.moe_router != "softmax":
            issues.append(f"moe_router = {config.moe_router!r} ({name} scores the experts by a softmax)")
        if config.moe_balance == "bias":
            issues.append(f"moe_balance = 'bias' ({name} has no per-expert bias on the scores that choose the "
                          "experts)")
        if config.bias:
            issues.append(f"bias = true ({name}'s projections have no biases)")
        if config.qk_norm:
            issues.append(f"qk_norm = true ({name} does not normalize q and k)")
        if arch == "mixtral":
            if not config.moe_norm_topk:
                issues.append("moe_norm_topk = false (Mixtral renormalises the chosen experts' scores; Qwen2-MoE "
                              "need not)")
            if config.moe_shared_experts:
                issues.append("moe_shared_experts = 1 (Mixtral has no shared expert; Qwen2-MoE has one)")
            if config.qkv_bias:
                issues.append("qkv_bias = true (Mixtral has no biases on q, k, v; Qwen2-MoE does)")
        elif config.sliding_window is not None:
            issues.append(f"sliding_window = {config.sliding_window} (Qwen2-MoE windows every other layer; Mixtral "
                          "windows all)")
        problems[arch] = issues + gemma_only_problems(config, name)
    return problems


# ----- GPTConfig -> config.json ----------------------------------------------------------------------


def moe_family_fields(config: GPTConfig, arch: MoEShaped) -> dict[str, Any]:
    """The config.json fields of ``config`` as Mixtral or Qwen2-MoE (besides the ones all architectures share)."""
    d_e, k = config.moe_hidden_dim, config.moe_top_k
    # Hugging Face's load-balancing loss is k times ours (`tinylm.model.moe`): the same term, weighted by this
    experts = {"num_experts_per_tok": k, "router_aux_loss_coef": config.moe_aux_weight / k,
               "output_router_logits": False}
    if arch == "mixtral":  # Mistral's fields (sliding_window: null is none), the experts' width as intermediate_size
        return {**llama_family_fields(config, "mistral"), "intermediate_size": d_e, "num_local_experts":
                config.moe_experts, "router_jitter_noise": 0.0, **experts}
    return {**llama_family_fields(config, "qwen2"), "qkv_bias": config.qkv_bias,
            "num_experts": config.moe_experts, "moe_intermediate_size": d_e,
            "shared_expert_intermediate_size": d_e if config.moe_shared_experts else 0,
            "norm_topk_prob": config.moe_norm_topk, "decoder_sparse_step": 1, "mlp_only_layers": [], **experts}


def constant_tensors(config: GPTConfig, arch: MoEShaped) -> dict[str, Tensor]:
    """The tensors of the export that no parameter of ours makes: Qwen2-MoE's zero shared-expert gates (and, for a
    model without a shared expert, a shared expert of width 0)."""
    if arch != "qwen2_moe":
        return {}
    d = config.d_model
    out: dict[str, Tensor] = {}
    for i in range(config.n_layer):
        m = f"model.layers.{i}.mlp."
        out[f"{m}shared_expert_gate.weight"] = torch.zeros(1, d)  # sigmoid(0) = 1/2 for every token
        if not config.moe_shared_experts:
            out |= {f"{m}shared_expert.gate_proj.weight": torch.zeros(0, d),
                    f"{m}shared_expert.up_proj.weight": torch.zeros(0, d),
                    f"{m}shared_expert.down_proj.weight": torch.zeros(d, 0)}
    return out


# ----- config.json -> GPTConfig ----------------------------------------------------------------------


def moe_family_config(hf: Mapping[str, Any], arch: MoEShaped, source: str) -> GPTConfig:
    """The `GPTConfig` of a Mixtral or Qwen2-MoE config.json; a variant tinylm does not compute is an error naming
    the key."""
    defaults = MIXTRAL_DEFAULTS if arch == "mixtral" else QWEN2_MOE_DEFAULTS
    hf = {**defaults, **hf}
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise refusal(source, arch, f"hidden_act is {act!r}, and tinylm's SwiGLU experts gate with SiLU")
    d_model, n_head = int(required(hf, source, arch, "hidden_size")), int(required(hf, source, arch,
                                                                                    "num_attention_heads"))
    n_layer, top_k = int(required(hf, source, arch, "num_hidden_layers")), int(hf["num_experts_per_tok"])
    head_dim = int(hf.get("head_dim") or d_model // n_head)
    n_kv = int(hf["num_key_value_heads"] or n_head)
    theta, scaling = rope_from_hf(hf, arch, source)
    if arch == "mixtral":
        n_experts = int(required(hf, source, arch, "num_local_experts"))
        d_e = int(required(hf, source, arch, "intermediate_size"))
        if top_k == 1:
            raise refusal(source, arch, "num_experts_per_tok is 1, and a renormalised top-1 gate is always 1, which "
                                        "tinylm does not train (its top-1 routing weighs by the expert's score)")
        fields = dict(moe_shared_experts=0, moe_norm_topk=True, qkv_bias=False, d_ff=None,
                      sliding_window=None if hf["sliding_window"] is None else int(hf["sliding_window"]))
    else:
        n_experts = int(required(hf, source, arch, "num_experts"))
        d_e = int(required(hf, source, arch, "moe_intermediate_size"))
        fields = dict(moe_shared_experts=_qwen2_moe_shared(hf, d_e, source), moe_norm_topk=bool(hf["norm_topk_prob"]),
                      qkv_bias=bool(hf["qkv_bias"]), sliding_window=None,
                      d_ff=default_rule(int(hf.get("intermediate_size") or d_e), d_model, "swiglu"))
        _check_qwen2_moe_layers(hf, n_layer, source)
    try:
        return GPTConfig(
            vocab_size=int(required(hf, source, arch, "vocab_size")),
            block_size=int(required(hf, source, arch, "max_position_embeddings")),
            n_layer=n_layer, d_model=d_model, n_head=n_head, n_kv_head=None if n_kv == n_head else n_kv,
            d_head=None if head_dim * n_head == d_model else head_dim, mlp="swiglu", norm="rmsnorm",
            norm_eps=float(hf["rms_norm_eps"]), positions="rope", rope_theta=theta, **scaling, bias=False,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dropout=float(hf.get("attention_dropout", 0.0)), init_std=float(hf.get("initializer_range", 0.02)),
            moe_experts=n_experts, moe_top_k=top_k, moe_d_ff=d_e, moe_router="softmax", moe_balance="aux",
            moe_aux_weight=float(hf["router_aux_loss_coef"]) * top_k, **fields,
        )
    except TinyLMError as e:  # a value out of range: say where it came from
        raise TinyLMError(f"{source}: {e}") from None


def _qwen2_moe_shared(hf: Mapping[str, Any], d_e: int, source: str) -> int:
    """1 when the checkpoint has a shared expert (of the routed experts' width, as tinylm's), 0 when its width is 0."""
    width = int(required(hf, source, "qwen2_moe", "shared_expert_intermediate_size"))
    if width and width != d_e:
        raise refusal(source, "qwen2_moe", f"shared_expert_intermediate_size is {width}, and tinylm's shared expert "
                                           f"is as wide as the routed ones (moe_intermediate_size {d_e})")
    return 1 if width else 0


def _check_qwen2_moe_layers(hf: Mapping[str, Any], n_layer: int, source: str) -> None:
    """Refuse dense layers among the MoE ones, and sliding windows: tinylm's MoE layers are all alike and see the
    whole context."""
    step, dense = int(hf["decoder_sparse_step"]), list(hf.get("mlp_only_layers") or [])
    if step != 1 or dense:
        key = "mlp_only_layers" if dense else "decoder_sparse_step"
        raise refusal(source, "qwen2_moe", f"{key} makes some layers dense, and every layer of a tinylm MoE model "
                                           "routes among experts")
    kinds = list(hf.get("layer_types") or [])
    if hf.get("use_sliding_window", False) and (not kinds or "sliding_attention" in kinds):
        raise refusal(source, "qwen2_moe", "use_sliding_window is true, and tinylm's Qwen2-MoE attends to the whole "
                                           "context")
    if "sliding_attention" in kinds:
        raise refusal(source, "qwen2_moe", "layer_types gives some layers a sliding window, and tinylm's Qwen2-MoE "
                                           "attends to the whole context")


# ----- their tensors -> the names the rules read --------------------------------------------------------

_FUSED = re.compile(r"^(model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")


def split_fused_experts(tensors: dict[str, Tensor], arch: MoEShaped) -> dict[str, Tensor]:
    """``tensors`` with `transformers` 5's fused experts (``experts.gate_up_proj`` (E, 2 d_e, d), ``experts.down_proj``
    (E, d, d_e)) split into the per-expert names of the Hub's files, and Mixtral's router under its Hub name."""
    expert = f"{'block_sparse_moe' if arch == 'mixtral' else 'mlp'}.experts"
    gate, up, down = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        fused = _FUSED.match(name)
        if fused is None:
            if arch == "mixtral" and re.fullmatch(r"model\.layers\.\d+\.mlp\.gate\.weight", name):
                name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            out[name] = t
            continue
        layer, kind = fused.groups()
        for e, matrix in enumerate(t.unbind(0)):
            if kind == "gate_up_proj":  # the gate's rows first, then the up projection's
                first, second = matrix.chunk(2, dim=0)
                out[f"{layer}{expert}.{e}.{gate}.weight"] = first
                out[f"{layer}{expert}.{e}.{up}.weight"] = second
            else:
                out[f"{layer}{expert}.{e}.{down}.weight"] = matrix
    return out


def take_constant_tensors(tensors: dict[str, Tensor], config: GPTConfig, arch: MoEShaped,
                          source: str) -> dict[str, Tensor]:
    """``tensors`` less those `constant_tensors` names, once checked: a Qwen2-MoE shared expert must be gated by zeros
    (tinylm's is ungated, and the gate of w_g = 0 is exactly 1/2), and one of width 0 computes nothing."""
    if arch != "qwen2_moe":
        return tensors
    out = dict(tensors)
    for i in range(config.n_layer):
        m = f"model.layers.{i}.mlp."
        gate = out.pop(f"{m}shared_expert_gate.weight", None)
        if not config.moe_shared_experts:
            for name in ("gate_proj", "up_proj", "down_proj"):
                out.pop(f"{m}shared_expert.{name}.weight", None)
        elif gate is None or bool(gate.any()):
            raise refusal(source, arch, f"{m}shared_expert_gate gates the shared expert by sigmoid(x w) with w not "
                                        "zero, and tinylm's shared expert is ungated")
    return out


__all__ = ["dense_problem", "moe_family_problems", "moe_family_fields", "constant_tensors", "moe_family_config",
           "split_fused_experts", "take_constant_tensors"]
