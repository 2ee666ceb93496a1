"""The Llama-shaped `transformers` architectures (Llama, Qwen3, Qwen2, Mistral, Phi-3) and Gemma 2 and 3: which
tinylm settings each one is, and their config.json.

The Llama-shaped ones are one network (RoPE, RMSNorm, SwiGLU, pre-norm, optional grouped-query attention)
with different switches, each one of ours (``bias``, ``qkv_bias``, ``qk_norm``, ``sliding_window``,
``rope_scaling``); a configuration that fits several goes to the first in that order, unless
``export_as`` names one (Phi-3 is Llama's network with fused matrices: only ``export_as`` tells them
apart). Gemma 2 and 3 add ``embed_scale``, "geglu", "sandwich" norms, ``attn_scale_dim``, the soft caps
and per-layer windows (``sliding_window_pattern``); Gemma 3 has QK-norm and ``rope_local_theta``.
`tinylm.export.weights` uses this module for the Llama-shaped half of `architecture_problems`,
`tinylm.export.hf_import` for `config_from_hf` and `tinylm.export.hf` for `hf_config`.
docs/export.md has the table and the `transformers` defaults that matter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from tinylm.config import GPTConfig
from tinylm.errors import TinyLMError

Architecture = Literal["gpt2", "llama", "qwen3", "qwen2", "mistral", "phi3", "gemma2", "gemma3", "mixtral",
                       "qwen2_moe"]
LlamaShaped = Literal["llama", "qwen3", "qwen2", "mistral", "phi3"]
GemmaShaped = Literal["gemma2", "gemma3"]
MoEShaped = Literal["mixtral", "qwen2_moe"]  # Llama-shaped blocks whose MLP is a Mixture of Experts (`tinylm.export.hf_moe`)

# `transformers` class name and model_type of each architecture; a configuration that fits several
# is exported as the first (see `tinylm.export.weights.architecture_for`)
HF_CLASSES: dict[Architecture, str] = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                                       "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                       "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM",
                                       "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                                       "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
# config.json's model_type, where it is not the architecture's key
MODEL_TYPES: dict[Architecture, str] = {"gemma3": "gemma3_text"}
NAMES: dict[Architecture, str] = {"gpt2": "GPT-2", "llama": "Llama", "qwen3": "Qwen3", "qwen2": "Qwen2",
                                  "mistral": "Mistral", "phi3": "Phi-3", "gemma2": "Gemma 2", "gemma3": "Gemma 3",
                                  "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE"}
LLAMA_SHAPED: tuple[LlamaShaped, ...] = ("llama", "qwen3", "qwen2", "mistral", "phi3")
GEMMA_SHAPED: tuple[GemmaShaped, ...] = ("gemma2", "gemma3")
MOE_SHAPED: tuple[MoEShaped, ...] = ("mixtral", "qwen2_moe")

# config.json defaults of `transformers` that change what a missing key means
MISTRAL_DEFAULT_WINDOW = 4096
QWEN2_DEFAULT_WINDOW = 4096
QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28
QWEN3_DEFAULT_HEAD_DIM = 128
GEMMA_DEFAULT_HEAD_DIM = 256
GEMMA_DEFAULT_QUERY_SCALAR = 256
GEMMA_DEFAULT_WINDOW = 4096
GEMMA_DEFAULT_PATTERN: dict[GemmaShaped, int] = {"gemma2": 2, "gemma3": 6}
GEMMA2_DEFAULT_CAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # Gemma 3: none
GEMMA3_DEFAULT_LOCAL_THETA = 10000.0
# activations that are GELU's tanh form, which tinylm's GeGLU gates with (the erf form "gelu" is not)
TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")

# the rope_parameters keys of each scaling we compute, and the GPTConfig field each one sets
ROPE_KEYS: dict[str, dict[str, str]] = {
    "default": {},
    "linear": {"factor": "rope_factor"},
    "llama3": {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_context"},
}


def llama_shaped(config: GPTConfig) -> LlamaShaped | GemmaShaped:
    """The Llama-shaped (or Gemma) architecture the switches of ``config`` point to (the one a refusal weighs)."""
    if config.export_as in LLAMA_SHAPED or config.export_as in GEMMA_SHAPED:
        return config.export_as
    if config.mlp == "geglu" or config.norm_position == "sandwich" or config.embed_scale:
        return "gemma3" if config.qk_norm else "gemma2"
    if config.qk_norm:
        return "qwen3"
    if config.qkv_bias:
        return "qwen2"
    if config.sliding_window is not None:
        return "mistral"
    return "llama"


def llama_family_problems(config: GPTConfig) -> dict[LlamaShaped, list[str]]:
    """For Llama, Qwen3, Qwen2, Mistral and Phi-3, the settings of ``config`` each cannot express (empty: it fits)."""
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
        problems[arch] = issues + gemma_only_problems(config, name)
    return problems


def gemma_only_problems(config: GPTConfig, name: str) -> list[str]:
    """The settings only Gemma has (besides its MLP and norms, which the shape compares), each a problem for ``name``."""
    issues = []
    if config.embed_scale:
        issues.append(f"embed_scale = true ({name} does not scale its embeddings; Gemma does)")
    if config.attn_scale_dim is not None:
        issues.append(f"attn_scale_dim = {config.attn_scale_dim:g} ({name} divides the scores by sqrt(d_h))")
    if config.attn_softcap is not None:
        issues.append(f"attn_softcap = {config.attn_softcap:g} ({name} does not cap its scores; Gemma 2 does)")
    if config.logit_softcap is not None:
        issues.append(f"logit_softcap = {config.logit_softcap:g} ({name} does not cap its logits; Gemma 2 does)")
    if config.sliding_window_pattern is not None:
        issues.append(f"sliding_window_pattern = {config.sliding_window_pattern} ({name} gives every layer the "
                      "same window; Gemma alternates)")
    if config.rope_local_theta is not None:
        issues.append(f"rope_local_theta = {config.rope_local_theta:g} ({name} has one RoPE base; Gemma 3 has two)")
    return issues


GEMMA_SHAPE: Shape = (("norm_position", "sandwich", " normalizes each sublayer's input and output: 'sandwich'"),
                      ("positions", "rope", " rotates q and k: 'rope'"), ("norm", "rmsnorm", " uses 'rmsnorm'"),
                      ("mlp", "geglu", "'s MLP is 'geglu'"), ("embed_scale", True, " scales its embeddings: true"),
                      ("bias", False, " has no biases: false"), ("qkv_bias", False, " has no biases: false"))


def gemma_family_problems(config: GPTConfig) -> dict[GemmaShaped, list[str]]:
    """For Gemma 2 and Gemma 3, the settings of ``config`` each cannot express (empty: it fits)."""
    problems: dict[GemmaShaped, list[str]] = {}
    for arch in GEMMA_SHAPED:
        issues = shape_problems(config, NAMES[arch], GEMMA_SHAPE)
        if arch == "gemma2":
            if config.qk_norm:
                issues.append("qk_norm = true (Gemma 2 does not normalize q and k; Gemma 3 does)")
            if config.rope_local_theta is not None:
                issues.append(f"rope_local_theta = {config.rope_local_theta:g} (Gemma 2 has one RoPE base; "
                              "Gemma 3 has two)")
        elif not config.qk_norm:
            issues.append("qk_norm = false (Gemma 3 normalizes every head's q and k)")
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


def llama_family_config(hf: Mapping[str, Any], arch: LlamaShaped | GemmaShaped, source: str) -> GPTConfig:
    """The `GPTConfig` of a Llama, Qwen3, Qwen2, Mistral, Phi-3 or Gemma config.json; a variant tinylm does not
    compute is an error."""
    if arch in GEMMA_SHAPED:
        return gemma_family_config(hf, arch, source)
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
    elif arch == "phi3":
        window = hf.get("sliding_window")  # PhiConfig's default: none (Phi-3-mini's own files say 2047)
        rope = hf.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise refusal(source, arch, f"partial_rotary_factor is {partial}, and tinylm rotates every coordinate "
                                        "of a head")
    else:
        window = hf.get("sliding_window", MISTRAL_DEFAULT_WINDOW)  # null: no window
    d_model, n_head = int(required(hf, source, arch, "hidden_size")), int(required(hf, source, arch,
                                                                                    "num_attention_heads"))
    head_dim = hf.get("head_dim") or (QWEN3_DEFAULT_HEAD_DIM if arch == "qwen3" else d_model // n_head)
    # a head size of its own (Qwen3's 128, Mistral NeMo's) is d_head; the usual d_model / n_head is left unset
    d_head = None if head_dim * n_head == d_model else int(head_dim)
    n_kv = int(hf.get("num_key_value_heads") or n_head)
    theta, scaling = rope_from_hf(hf, arch, source)
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
            # Llama's network under another name: only this brings the same class back on export
            export_as="phi3" if arch == "phi3" else "auto",
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


def rope_from_hf(hf: Mapping[str, Any], arch: Architecture, source: str,
                  rope: Mapping[str, Any] | None = None, key: str | None = None) -> tuple[float, dict[str, Any]]:
    """RoPE's base and the GPTConfig scaling fields of a config.json (``rope_scaling`` first, as `transformers` reads it),
    or of ``rope``, one layer type's entry of ``key`` (Gemma 3's)."""
    if rope is None:
        key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_KEYS:
        raise refusal(source, arch, f"its RoPE is scaled ({kind!r}); tinylm computes the plain rotation and the "
                                    f"{' and '.join(repr(k) for k in ROPE_KEYS if k != 'default')} scalings "
                                    f"(key {key}.rope_type)")
    fields: dict[str, Any] = {"rope_scaling": "none" if kind == "default" else kind}
    for key, field in ROPE_KEYS[kind].items():
        if rope.get(key) is None:
            raise refusal(source, arch, f"its {kind!r} RoPE scaling has no {key!r}")
        fields[field] = rope[key]
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), fields


def gemma_family_config(hf: Mapping[str, Any], arch: GemmaShaped, source: str) -> GPTConfig:
    """The `GPTConfig` of a Gemma 2 or Gemma 3 (text) config.json; a key tinylm does not compute is an error."""
    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in TANH_GELUS:
        raise refusal(source, arch, f"hidden_activation is {act!r}, and tinylm's GeGLU gates with GELU's tanh form "
                                    f"({', '.join(TANH_GELUS)})")
    for key in ("attention_bias", "use_bidirectional_attention"):
        if hf.get(key):
            raise refusal(source, arch, f"{key} is true")
    d_model, n_head = int(required(hf, source, arch, "hidden_size")), int(required(hf, source, arch,
                                                                                    "num_attention_heads"))
    n_layer = int(required(hf, source, arch, "num_hidden_layers"))
    head_dim = int(hf.get("head_dim") or GEMMA_DEFAULT_HEAD_DIM)
    n_kv = int(hf.get("num_key_value_heads") or n_head)
    scalar = hf.get("query_pre_attn_scalar", GEMMA_DEFAULT_QUERY_SCALAR)
    window, pattern = _gemma_windows(hf, arch, n_layer, source)
    caps = {key: hf.get(key, GEMMA2_DEFAULT_CAPS[key] if arch == "gemma2" else None) for key in GEMMA2_DEFAULT_CAPS}
    theta, scaling, local_theta = _gemma_rope(hf, arch, source)
    try:
        return GPTConfig(
            vocab_size=int(required(hf, source, arch, "vocab_size")),
            block_size=int(required(hf, source, arch, "max_position_embeddings")),
            n_layer=n_layer, d_model=d_model, n_head=n_head, n_kv_head=None if n_kv == n_head else n_kv,
            d_head=None if head_dim * n_head == d_model else head_dim, mlp="geglu",
            d_ff=default_rule(int(required(hf, source, arch, "intermediate_size")), d_model, "geglu"),
            norm="rmsnorm", norm_position="sandwich", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            positions="rope", rope_theta=theta, **scaling, qk_norm=arch == "gemma3", bias=False,
            embed_scale=True, attn_scale_dim=None if int(scalar) == head_dim else int(scalar),
            attn_softcap=None if caps["attn_logit_softcapping"] is None else float(caps["attn_logit_softcapping"]),
            logit_softcap=None if caps["final_logit_softcapping"] is None else float(caps["final_logit_softcapping"]),
            sliding_window=window, sliding_window_pattern=pattern,
            rope_local_theta=local_theta if window is not None else None,
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            dropout=float(hf.get("attention_dropout", 0.0)), init_std=float(hf.get("initializer_range", 0.02)),
        )
    except TinyLMError as e:
        raise TinyLMError(f"{source}: {e}") from None


def _gemma_windows(hf: Mapping[str, Any], arch: GemmaShaped, n_layer: int, source: str) -> tuple[int | None, int | None]:
    """(sliding_window, sliding_window_pattern) from layer_types, or from the pattern older config.json files give."""
    if hf.get("layer_types"):
        kinds, key = list(hf["layer_types"]), "layer_types"
    else:
        every = int(hf.get("sliding_window_pattern") or GEMMA_DEFAULT_PATTERN[arch])
        kinds, key = [_gemma_layer_type(i, every) for i in range(n_layer)], "sliding_window_pattern"
    if len(kinds) != n_layer or not set(kinds) <= {"sliding_attention", "full_attention"}:
        raise refusal(source, arch, f"{key} is not one 'sliding_attention' or 'full_attention' per layer")
    if "sliding_attention" not in kinds:
        return None, None
    window = hf.get("sliding_window", GEMMA_DEFAULT_WINDOW)
    if window is None:
        raise refusal(source, arch, f"{key} has windowed layers, but sliding_window is null")
    if "full_attention" not in kinds:
        return int(window), None
    for every in range(2, n_layer + 1):  # the N with every N-th layer whole-context, if there is one
        if kinds == [_gemma_layer_type(i, every) for i in range(n_layer)]:
            return int(window), every
    raise refusal(source, arch, f"{key} puts its whole-context layers at no regular interval, and tinylm's "
                                "sliding_window_pattern makes every N-th layer one")


def _gemma_layer_type(layer: int, every: int) -> str:
    return "full_attention" if (layer + 1) % every == 0 else "sliding_attention"


def _gemma_rope(hf: Mapping[str, Any], arch: GemmaShaped, source: str) -> tuple[float, dict[str, Any], float | None]:
    """(rope_theta, the scaling fields, rope_local_theta): Gemma 3's windowed layers have a base of their own."""
    params = hf.get("rope_parameters") or {}
    if arch == "gemma2" or not isinstance(params.get("full_attention"), Mapping):
        theta, scaling = rope_from_hf(hf, arch, source)
        if arch == "gemma2":
            return theta, scaling, None
        # an older Gemma 3 file: rope_theta and rope_scaling are the whole-context layers', the windowed ones' plain
        return theta, scaling, float(hf.get("rope_local_base_freq", GEMMA3_DEFAULT_LOCAL_THETA))
    theta, scaling = rope_from_hf(hf, arch, source, params["full_attention"], "rope_parameters.full_attention")
    local = params.get("sliding_attention") or {}
    if dict(local) == dict(params["full_attention"]):
        return theta, scaling, None
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default":
        raise refusal(source, arch, f"rope_parameters.sliding_attention scales RoPE ({kind!r}), and tinylm's windowed "
                                    "layers rotate by a plain rope_local_theta")
    return theta, scaling, float(local.get("rope_theta", GEMMA3_DEFAULT_LOCAL_THETA))


# ----- GPTConfig -> config.json ----------------------------------------------------------------------


def rope_parameters(config: GPTConfig) -> dict[str, Any]:
    """``rope_parameters`` of config.json: the rope type, its base and the scaling's keys."""
    kind = "default" if config.rope_scaling == "none" else config.rope_scaling
    return {"rope_type": kind, "rope_theta": config.rope_theta,
            **{key: getattr(config, field) for key, field in ROPE_KEYS[kind].items()}}


def llama_family_fields(config: GPTConfig, arch: LlamaShaped | GemmaShaped) -> dict[str, Any]:
    """The config.json fields of ``config`` as Llama, Qwen3, Qwen2, Mistral, Phi-3 or Gemma (besides the ones all
    architectures share; a model_type here replaces theirs)."""
    if arch in GEMMA_SHAPED:
        return gemma_family_fields(config, arch)
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
    if arch == "phi3":  # one matrix for q, k and v, one for gate and up: `tinylm.export.weights`
        return {**fields, "sliding_window": window, "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
                "original_max_position_embeddings": config.block_size}
    return {**fields, "sliding_window": window}  # Mistral: null is no window (a missing key would be 4096)


def gemma_family_fields(config: GPTConfig, arch: GemmaShaped) -> dict[str, Any]:
    """The config.json fields of ``config`` as Gemma 2 or Gemma 3 (text), with every default that matters written out."""
    kinds = ["sliding_attention" if config.layer_window(i) is not None else "full_attention"
             for i in range(config.n_layer)]
    rope = rope_parameters(config)
    fields: dict[str, Any] = {
        "hidden_size": config.d_model, "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,  # Gemma's default is 256
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.norm_eps, "attention_bias": False, "attention_dropout": config.dropout,
        "query_pre_attn_scalar": config.attn_scale_dim if config.attn_scale_dim is not None else config.head_dim,
        "attn_logit_softcapping": config.attn_softcap, "final_logit_softcapping": config.logit_softcap,
        # a window as long as the context where no layer has one: the key must hold a number
        "sliding_window": config.sliding_window if config.sliding_window is not None else config.block_size,
        "layer_types": kinds,
    }
    if arch == "gemma2":
        return {**fields, "rope_theta": config.rope_theta, "rope_parameters": rope}
    local = rope if config.rope_local_theta is None else {"rope_type": "default", "rope_theta": config.rope_local_theta}
    return {**fields, "model_type": MODEL_TYPES["gemma3"], "use_bidirectional_attention": False,
            "rope_parameters": {"full_attention": rope, "sliding_attention": local}}


__all__ = [
    "Architecture", "LlamaShaped", "GemmaShaped", "MoEShaped", "HF_CLASSES", "MODEL_TYPES", "NAMES", "LLAMA_SHAPED",
    "GEMMA_SHAPED", "MOE_SHAPED",
    "llama_shaped", "llama_family_problems", "gemma_family_problems", "gemma_only_problems", "gemma_family_config",
    "gemma_family_fields",
    "llama_family_config", "llama_family_fields", "rope_parameters", "rope_from_hf", "refusal", "required",
    "default_rule", "shape_problems", "LLAMA_SHAPE",
]
