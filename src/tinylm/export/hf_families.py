"""The Llama-shaped `transformers` architectures (Llama, Qwen3, Qwen2, Mistral): which tinylm settings each one is, and their config.json.

They are one network (RoPE, RMSNorm, SwiGLU, pre-norm, optional grouped-query attention) with
different switches, each one of ours (``bias``, ``qkv_bias``, ``qk_norm``, ``sliding_window``,
``rope_scaling``); a configuration that fits several goes to the first in that order.
`tinylm.export.weights` uses this module for the Llama-shaped half of `architecture_problems`,
`tinylm.export.hf_import` for `config_from_hf` and `tinylm.export.hf` for `hf_config`.
docs/export.md has the table and the `transformers` defaults that matter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from tinylm.config import GPTConfig
from tinylm.errors import TinyLMError

Architecture = Literal["gpt2", "llama", "qwen3", "qwen2", "mistral"]
LlamaShaped = Literal["llama", "qwen3", "qwen2", "mistral"]

# `transformers` class name and model_type of each architecture; a configuration that fits several
# is exported as the first (see `tinylm.export.weights.architecture_for`)
HF_CLASSES: dict[Architecture, str] = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                                       "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                       "mistral": "MistralForCausalLM"}
NAMES: dict[Architecture, str] = {"gpt2": "GPT-2", "llama": "Llama", "qwen3": "Qwen3", "qwen2": "Qwen2",
                                  "mistral": "Mistral"}
LLAMA_SHAPED: tuple[LlamaShaped, ...] = ("llama", "qwen3", "qwen2", "mistral")

# config.json defaults of `transformers` that change what a missing key means
MISTRAL_DEFAULT_WINDOW = 4096
QWEN2_DEFAULT_WINDOW = 4096
QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28
QWEN3_DEFAULT_HEAD_DIM = 128

# the rope_parameters keys of each scaling we compute, and the GPTConfig field each one sets
ROPE_KEYS: dict[str, dict[str, str]] = {
    "default": {},
    "linear": {"factor": "rope_factor"},
    "llama3": {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_context"},
}


def llama_shaped(config: GPTConfig) -> LlamaShaped:
    """The Llama-shaped architecture the switches of ``config`` point to (the one a refusal weighs)."""
    if config.qk_norm:
        return "qwen3"
    if config.qkv_bias:
        return "qwen2"
    if config.sliding_window is not None:
        return "mistral"
    return "llama"


def llama_family_problems(config: GPTConfig) -> dict[LlamaShaped, list[str]]:
    """For Llama, Qwen3, Qwen2 and Mistral, the settings of ``config`` each cannot express (empty: it fits)."""
    problems: dict[LlamaShaped, list[str]] = {}
    for arch in LLAMA_SHAPED:
        name = NAMES[arch]
        issues = shape_problems(config, name)
        if config.qk_norm and arch != "qwen3":
            issues.append(f"qk_norm = true ({name} does not normalize q and k; Qwen3 does)")
        if not config.qk_norm and arch == "qwen3":
            issues.append("qk_norm = false (Qwen3 normalizes every head's q and k)")
        if config.qkv_bias and arch != "qwen2":
            issues.append(f"qkv_bias = true ({name} has no biases on q, k, v alone; Qwen2 does)")
        if not config.qkv_bias and arch == "qwen2":
            issues.append("qkv_bias = false (Qwen2 has biases on q, k and v)")
        if config.bias and arch != "llama":
            issues.append(f"bias = true ({name}'s MLP has no biases)")
        if config.sliding_window is not None and arch in ("llama", "qwen3"):
            issues.append(f"sliding_window = {config.sliding_window} ({name} attends to the whole context; "
                          "Mistral and Qwen2 have a window)")
        problems[arch] = issues
    return problems


# (setting, the value an architecture needs, what the message says after its name)
Shape = tuple[tuple[str, Any, str], ...]
LLAMA_SHAPE: Shape = (("norm_position", "pre", " normalizes each sublayer's input: 'pre'"),
                      ("positions", "rope", " rotates q and k: 'rope'"), ("norm", "rmsnorm", " uses 'rmsnorm'"),
                      ("mlp", "swiglu", "'s MLP is 'swiglu'"))
GPT2_SHAPE: Shape = (("norm_position", "pre", " normalizes each sublayer's input: 'pre'"),
                     ("positions", "learned", " learns a position table: 'learned'"),
                     ("norm", "layernorm", " uses 'layernorm'"), ("mlp", "gelu", "'s MLP is 'gelu'"))


def shape_problems(config: GPTConfig, name: str, shape: Shape = LLAMA_SHAPE) -> list[str]:
    """The settings of ``config`` that differ from an architecture's ``shape`` (Llama's, which all four Llama-shaped
    ones share, or `GPT2_SHAPE`), each as "setting = value (NAME needs ...)"."""
    return [f"{setting} = {getattr(config, setting)!r} ({name}{why})"
            for setting, value, why in shape if getattr(config, setting) != value]


# ----- config.json -> GPTConfig ----------------------------------------------------------------------


def refusal(source: str, arch: Architecture, what: str) -> TinyLMError:
    """The one-line error for a config.json variant tinylm does not compute."""
    return TinyLMError(f"{source}: {what}; tinylm's model cannot compute that variant of {HF_CLASSES[arch]}")


def required(hf: Mapping[str, Any], source: str, arch: Architecture, key: str, *alternatives: str) -> Any:
    """``hf[key]`` (or the first alternative name present), or an error naming the key."""
    for k in (key, *alternatives):
        if hf.get(k) is not None:
            return hf[k]
    raise TinyLMError(f"{source} has no {key!r}, which a {HF_CLASSES[arch]} config needs")


def default_rule(d_ff: int, d_model: int, mlp: str) -> int | None:
    """d_ff, or None when it equals the default rule (so a round trip gives back the same GPTConfig)."""
    default = GPTConfig(vocab_size=1, block_size=1, n_layer=1, d_model=d_model, n_head=1, mlp=mlp).hidden_dim
    return None if d_ff == default else d_ff


def llama_family_config(hf: Mapping[str, Any], arch: LlamaShaped, source: str) -> GPTConfig:
    """The `GPTConfig` of a Llama, Qwen3, Qwen2 or Mistral config.json; a variant tinylm does not compute is an error."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise refusal(source, arch, f"hidden_act is {act!r}, and tinylm's SwiGLU gates with SiLU")
    bias, qkv_bias, window = False, arch == "qwen2", None
    if arch == "llama":
        if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
            raise refusal(source, arch, "attention_bias and mlp_bias differ, and tinylm has one bias switch for all "
                                        "projections")
        bias = bool(hf.get("attention_bias", False))
    elif arch == "qwen3":
        if hf.get("attention_bias", False):
            raise refusal(source, arch, "attention_bias is true, but its MLP has no biases, and tinylm has one bias "
                                        "switch for all projections")
        windowed = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
        if hf.get("use_sliding_window", False) or windowed:
            raise refusal(source, arch, "it turns on a sliding window (use_sliding_window or layer_types), and "
                                        "tinylm's Qwen3 always sees the whole context")
    elif arch == "qwen2":
        window = _qwen2_window(hf, source)
    else:
        window = hf.get("sliding_window", MISTRAL_DEFAULT_WINDOW)  # null: no window
    d_model, n_head = int(required(hf, source, arch, "hidden_size")), int(required(hf, source, arch,
                                                                                    "num_attention_heads"))
    head_dim = hf.get("head_dim") or (QWEN3_DEFAULT_HEAD_DIM if arch == "qwen3" else d_model // n_head)
    # a head size of its own (Qwen3's 128, Mistral NeMo's) is d_head; the usual d_model / n_head is left unset
    d_head = None if head_dim * n_head == d_model else int(head_dim)
    n_kv = int(hf.get("num_key_value_heads") or n_head)
    theta, scaling = _rope_from_hf(hf, arch, source)
    try:
        return GPTConfig(
            vocab_size=int(required(hf, source, arch, "vocab_size")),
            block_size=int(required(hf, source, arch, "max_position_embeddings")),
            n_layer=int(required(hf, source, arch, "num_hidden_layers")), d_model=d_model, n_head=n_head,
            n_kv_head=None if n_kv == n_head else n_kv, d_head=d_head, mlp="swiglu",
            d_ff=default_rule(int(required(hf, source, arch, "intermediate_size")), d_model, "swiglu"),
            norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), positions="rope",
            rope_theta=theta, **scaling, qk_norm=arch == "qwen3", bias=bias, qkv_bias=qkv_bias,
            sliding_window=None if window is None else int(window),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dropout=float(hf.get("attention_dropout", 0.0)), init_std=float(hf.get("initializer_range", 0.02)),
        )
    except TinyLMError as e:  # a value out of range (a window of 0, a factor of -1): say where it came from
        raise TinyLMError(f"{source}: {e}") from None


def _qwen2_window(hf: Mapping[str, Any], source: str) -> int | None:
    """Qwen2's window if every layer has it, None if none does; layers that differ are refused by key."""
    n_layer = int(required(hf, source, "qwen2", "num_hidden_layers"))
    window = hf.get("sliding_window", QWEN2_DEFAULT_WINDOW) if hf.get("use_sliding_window", False) else None
    if hf.get("layer_types"):
        kinds, key = list(hf["layer_types"]), "layer_types"
    else:
        first = hf.get("max_window_layers", QWEN2_DEFAULT_MAX_WINDOW_LAYERS)
        kinds, key = ["sliding_attention" if window is not None and i >= first else "full_attention"
                      for i in range(n_layer)], "max_window_layers"
    if set(kinds) == {"full_attention"}:
        return None
    if set(kinds) != {"sliding_attention"} or window is None:
        raise refusal(source, "qwen2", f"{key} gives a sliding window to some layers only ({kinds.count('sliding_attention')} "
                                       f"of {len(kinds)}), and tinylm's sliding_window is the same on every layer")
    return window


def _rope_from_hf(hf: Mapping[str, Any], arch: Architecture, source: str) -> tuple[float, dict[str, Any]]:
    """RoPE's base and the GPTConfig scaling fields of a config.json (``rope_scaling`` first, as `transformers` reads it)."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_KEYS:
        raise refusal(source, arch, f"its RoPE is scaled ({kind!r}); tinylm computes the plain rotation and the "
                                    f"{' and '.join(repr(k) for k in ROPE_KEYS if k != 'default')} scalings")
    fields: dict[str, Any] = {"rope_scaling": "none" if kind == "default" else kind}
    for key, field in ROPE_KEYS[kind].items():
        if rope.get(key) is None:
            raise refusal(source, arch, f"its {kind!r} RoPE scaling has no {key!r}")
        fields[field] = rope[key]
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), fields


# ----- GPTConfig -> config.json ----------------------------------------------------------------------


def rope_parameters(config: GPTConfig) -> dict[str, Any]:
    """``rope_parameters`` of config.json: the rope type, its base and the scaling's keys."""
    kind = "default" if config.rope_scaling == "none" else config.rope_scaling
    return {"rope_type": kind, "rope_theta": config.rope_theta,
            **{key: getattr(config, field) for key, field in ROPE_KEYS[kind].items()}}


def llama_family_fields(config: GPTConfig, arch: LlamaShaped) -> dict[str, Any]:
    """The config.json fields of ``config`` as Llama, Qwen3, Qwen2 or Mistral (besides the ones all architectures share)."""
    rope = rope_parameters(config)
    fields: dict[str, Any] = {
        "hidden_size": config.d_model, "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
        # Qwen3Config's head_dim defaults to 128, not hidden_size / heads: always written
        "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
        "hidden_act": "silu", "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.norm_eps,  # Qwen3's q_norm and k_norm use it too, as ours use norm_eps
        # transformers 5 reads rope_parameters; 4.x reads rope_theta, and rope_scaling for a scaled RoPE
        "rope_theta": config.rope_theta, "rope_parameters": rope,
        "attention_dropout": config.dropout,
    }
    if config.rope_scaling != "none":
        fields["rope_scaling"] = rope
    window, n_layer = config.sliding_window, config.n_layer
    if arch == "llama":
        return {**fields, "attention_bias": config.bias, "mlp_bias": config.bias, "pretraining_tp": 1}
    if arch == "qwen3":
        # every layer attends to the whole context: no sliding window (max_window_layers, the layers
        # that would use one, is then unused; Qwen's own configs set it to the depth)
        return {**fields, "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": n_layer, "layer_types": ["full_attention"] * n_layer}
    if arch == "qwen2":
        # layer i is windowed when i >= max_window_layers: 0 windows them all, the depth none
        return {**fields, "use_sliding_window": window is not None, "sliding_window": window,
                "max_window_layers": 0 if window is not None else n_layer,
                "layer_types": ["sliding_attention" if window is not None else "full_attention"] * n_layer}
    return {**fields, "sliding_window": window}  # Mistral: null is no window (a missing key would be 4096)


__all__ = [
    "Architecture", "LlamaShaped", "HF_CLASSES", "NAMES", "LLAMA_SHAPED", "llama_shaped", "llama_family_problems",
    "llama_family_config", "llama_family_fields", "rope_parameters", "refusal", "required", "default_rule",
]
