"""The [model] table: `GPTConfig`, the network's shape, for every model family tinylm trains.

One dataclass serves the four families (``family``): the Transformer ("gpt") and
the baselines it is compared with: "lstm" and "rnn" (`tinylm.model.rnn`) and
"ngram" (`tinylm.model.ngram`). Each field's help, beside it, says which family reads it; a family
ignores the fields it has no use for (`TRANSFORMER_ONLY`, `NGRAM_ONLY`). The defaults are GPT-2 small (124M
parameters with vocab 50257), like nanoGPT's:

    GPTConfig(n_layer=4, d_model=192, n_head=6, positions="rope")
    GPTConfig(family="lstm", n_layer=2, d_model=512, bptt=64)

Impossible combinations (a head count that does not divide d_model, ...) are `TinyLMError`s that
say what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tinylm.config.fields import check_fields, setting
from tinylm.errors import TinyLMError

ModelFamily = Literal["gpt", "lstm", "rnn", "ngram"]
# how messages name a family, article included ("an LSTM model", "a Transformer (gpt) model")
FAMILY_NAMES = {"gpt": "a Transformer (gpt)", "lstm": "an LSTM", "rnn": "an RNN", "ngram": "an n-gram"}
MLPKind = Literal["gelu", "swiglu", "relu2", "geglu"]
NormKind = Literal["layernorm", "rmsnorm"]
NormPosition = Literal["pre", "post", "sandwich"]
PositionKind = Literal["learned", "sinusoidal", "rope", "none"]
RopeScalingKind = Literal["none", "linear", "llama3"]
AttentionKind = Literal["sdpa", "reference", "tiled"]
SmoothingKind = Literal["kn", "add-k", "mle", "kn-nltk"]
MoERouter = Literal["softmax", "sigmoid"]
MoEBalance = Literal["aux", "bias", "none"]
MoEDispatch = Literal["fast", "reference"]
# the transformers / llama.cpp architecture an export writes; "auto" is the first that computes the model
ExportArchitecture = Literal["auto", "gpt2", "llama", "qwen3", "qwen2", "mistral", "phi3", "gemma2", "gemma3"]

# SwiGLU's hidden width when not given: 8/3 d (so its three matrices hold as many weights as
# GELU's two at 4 d), rounded up to a multiple of this so the matrices tile well on hardware.
SWIGLU_MULTIPLE = 64
# A Mixture-of-Experts expert's hidden width when not given is d_ff / (top_k + shared experts), rounded to a
# multiple of this (at least one multiple): a token then does the dense MLP's multiply-adds.
MOE_MULTIPLE = 8


@dataclass
class GPTConfig:
    """The [model] table: the shape and the choices of a GPT-style Transformer, or of a baseline.

    The recurrent families (lstm, rnn) are an embedding, ``n_layer`` recurrent layers of width
    ``d_model`` and the output head; ``dropout`` and ``tie_embeddings`` work as for gpt, ``init_std``
    sets an untied head only (the embedding starts larger: `tinylm.model.rnn.EMBEDDING_STD`). The
    n-gram family counts ``order``-grams and smooths them. Attention, heads, norms and positions
    are the Transformer's alone.

    The options from the modern small-model recipes (modded-nanogpt, nanochat: ``mlp = "relu2"``,
    ``qk_norm``, ``zero_init_projections``, ``logit_softcap``, ``value_embed``, ``bigram_hash``,
    ``head_init_std``) are each off by default unless a preset turns them on;
    `benchmarks/recipe.py` measures each one.
    """

    family: ModelFamily = setting(
        "gpt", "which model: the Transformer (gpt), an lstm or rnn, or a counted ngram model (also --model)")
    vocab_size: int = setting(50257, "|V|; training sets it from the tokenizer")
    block_size: int = setting(1024, "context length T: the most tokens the model sees at once (lstm/rnn: the "
                              "training windows; ngram: the longest request tinylm serve takes)")
    n_layer: int = setting(12, "number of Transformer blocks (lstm/rnn: recurrent layers)")
    d_model: int = setting(768, "width d of every position's vector (lstm/rnn: the state's width)")
    # -- attention
    n_head: int = setting(12, "query heads (each of size d_model / n_head)")
    n_kv_head: int | None = setting(
        None, "key/value heads for grouped-query attention (unset: as many as n_head; 1: multi-query)")
    # Qwen3's and Mistral NeMo's 128 with a narrower d_model / n_head: the heads then span
    # n_head d_h dimensions, which W_o maps back to d_model
    d_head: int | None = setting(None, "the size of one attention head (unset: d_model / n_head)")
    # gelu: x W_1, GELU (GPT-2's tanh form), W_2; swiglu: (SiLU(x W_1) * x W_3) W_2; relu2: ReLU(x W_1)^2 W_2;
    # geglu: (GELU(x W_1) * x W_3) W_2, GELU's tanh form as the gate
    mlp: MLPKind = setting("gelu", "the MLP: GELU (GPT-2), SwiGLU (Llama), ReLU^2 or GeGLU (Gemma)")
    d_ff: int | None = setting(None, "the MLP's hidden width (unset: 4 d for gelu and relu2, about 8/3 d for the "
                               "gated swiglu and geglu)")
    # -- Mixture of Experts (`tinylm.model.moe`): every block's MLP becomes moe_experts MLPs of the kind above,
    # each token sent through the moe_top_k its router scores highest, their outputs mixed by the gate weights
    moe_experts: int = setting(0, "experts per MoE layer, each an MLP of the kind --mlp says (0: the dense MLP)")
    moe_top_k: int = setting(2, "with moe_experts: the experts each token goes through")
    moe_shared_experts: int = setting(
        0, "with moe_experts: 1 adds an expert every token goes through, beside the routed ones (0: none)")
    moe_d_ff: int | None = setting(
        None, "with moe_experts: an expert's hidden width (unset: d_ff / (top_k + shared experts), a multiple of "
        "8, so a token does about the dense MLP's FLOPs)")
    # softmax: p = softmax(x W_r), the top k of p, renormalised over them (Mixtral); sigmoid: s = sigmoid(x W_r),
    # the top k of s, normalised over them (DeepSeek-V3)
    moe_router: MoERouter = setting(
        "softmax", "with moe_experts: the router's scores, softmax over the experts (Mixtral) or a sigmoid each "
        "(DeepSeek-V3)")
    moe_norm_topk: bool = setting(
        True, "with moe_experts: divide the chosen experts' scores by their sum (false: the scores themselves are "
        "the gate weights, Qwen2-MoE's norm_topk_prob = false)")
    moe_balance: MoEBalance = setting(
        "aux", "with moe_experts: keep the experts' loads even by a loss (aux: Switch, Mixtral), by a bias on "
        "the scores that choose them (bias: DeepSeek-V3, no loss), or not at all (none)")
    moe_aux_weight: float = setting(
        0.05, "with moe_balance aux: the weight of the load-balancing loss E sum_i f_i P_i (1 when even); 0.01 "
        "left a load CV of 0.6 after the default run, 0.05 under 0.1 (benchmarks/moe_ablation.py)")
    moe_z_weight: float = setting(
        0.001, "with moe_experts: the weight of the router z-loss, the mean of logsumexp(x W_r)^2 (0: none)")
    moe_bias_rate: float = setting(
        0.01, "with moe_balance bias: how far each expert's bias moves after a step, toward even loads; "
        "DeepSeek-V3's 0.001 is for far longer runs: after the default run's 379 steps it left a load CV of 0.5, "
        "0.01 under 0.1 (benchmarks/moe_ablation.py)")
    # both compute the same function; the tests pin them equal
    moe_dispatch: MoEDispatch = setting(
        "fast", "MoE implementation: tokens sorted by expert and multiplied in groups (fast), or a loop over "
        "the experts (reference)")
    norm: NormKind = setting("layernorm", "LayerNorm or RMSNorm")
    # pre: a final norm before the head too, as modern LMs; post: the original Transformer's, no final norm;
    # sandwich: pre, and each sublayer's output normalized again before it is added (four norms a block)
    norm_position: NormPosition = setting(
        "pre", "normalize each sublayer's input (pre), after each residual addition (post), or its input and "
        "its output before the addition (sandwich: Gemma 2 and 3)")
    norm_eps: float = setting(1e-5, "the norms' epsilon")
    # learned: a trained table added to E[x]; sinusoidal: Vaswani et al.'s fixed table, added; rope: q and k
    # rotated by their position; none: attention alone cannot tell order
    positions: PositionKind = setting(
        "learned", "position information: learned, sinusoidal, rotary (rope) or none")
    rope_theta: float = setting(10000.0, "RoPE's base")
    # `tinylm.model.positions`; each of the four settings below is set exactly when its scaling uses it
    rope_scaling: RopeScalingKind = setting(
        "none", "stretch RoPE's frequencies: none, linear (all divided by --rope-factor) or llama3 (Llama 3.1)")
    rope_factor: float | None = setting(
        None, "linear and llama3 scaling: the factor the (low) frequencies are divided by")
    rope_low_freq_factor: float | None = setting(
        None, "llama3 scaling: wavelengths above original context / this are divided by the factor")
    rope_high_freq_factor: float | None = setting(
        None, "llama3 scaling: wavelengths below original context / this are kept")
    rope_original_context: int | None = setting(
        None, "llama3 scaling: the context the model was first trained at")
    sliding_window: int | None = setting(
        None, "each query attends to itself and the W - 1 positions before it (Mistral; unset: all)")
    # Gemma 2 alternates windowed and whole-context layers (2), Gemma 3 has five windowed ones per whole one (6)
    sliding_window_pattern: int | None = setting(
        None, "with sliding_window: every N-th layer (the N-th, 2N-th, ...) attends to the whole context and the "
        "others to the window (Gemma 2: 2, Gemma 3: 6; unset: every layer has the window)")
    rope_local_theta: float | None = setting(
        None, "with sliding_window: RoPE's base on the windowed layers, unscaled (Gemma 3's local base; unset: "
        "rope_theta and rope_scaling there too)")
    bias: bool = setting(True, "biases on linear layers and LayerNorm")
    qkv_bias: bool = setting(False, "biases on the q, k, v projections only, for a --no-bias model (Qwen2)")
    tie_embeddings: bool = setting(True, "share the output head with the token embedding E")
    embed_scale: bool = setting(False, "multiply the token embeddings by sqrt(d_model) on the way in (Gemma); the "
                                "tied head still reads E unscaled")
    # Gemma's query_pre_attn_scalar: its 27B model divides by sqrt(d_model / n_head), not by sqrt(d_h)
    attn_scale_dim: int | None = setting(
        None, "the scores are q.k / sqrt(this) (Gemma's query_pre_attn_scalar; unset: d_h, the head size)")
    attn_softcap: float | None = setting(
        None, "c: every attention score s becomes c tanh(s / c) before the softmax (Gemma 2; unset: no cap)")
    dropout: float = setting(0.0, "dropout probability")
    init_std: float = setting(0.02, "standard deviation of the initial weights")
    # all three compute the same function; the tests pin them equal
    attention: AttentionKind = setting(
        "sdpa", "attention implementation: fused (sdpa), the definition (reference) or tiled online softmax")
    tile_size: int = setting(64, "key block size of tiled attention")
    # -- the modern recipes' options
    qk_norm: bool = setting(False, "RMSNorm with a learned gain on every head's q and k before RoPE (Qwen3, "
                            "OLMo 2): the scores q.k stay bounded whatever the weights grow to")
    zero_init_projections: bool = setting(
        False, "W_o and the MLP's W_2 start at zero, so every block starts as the identity")
    logit_softcap: float | None = setting(
        None, "c: the logits become c tanh(u / c), always inside (-c, c) (Gemma 2; unset: no cap)")
    value_embed: bool = setting(
        False, "a second embedding table E_v whose row for the current token is added to every layer's values "
        "with a learned per-layer weight (modded-nanogpt's value embeddings)")
    # row 1 + (prev * 1000003 + cur) mod (B - 1); row 0 serves a window's first position, which has no
    # previous token; the table starts at zero
    bigram_hash: int = setting(
        0, "B > 0: an embedding of B rows for the hashed pair (previous token, this token), added to E[x]")
    head_init_std: float | None = setting(
        None, "the initial standard deviation of an untied output head (0: zeros; unset: init_std)")
    # Phi-3 is Llama's network with fused matrices: import sets it so that export writes Phi3ForCausalLM again
    export_as: ExportArchitecture = setting(
        "auto", "the transformers / llama.cpp architecture export writes (auto: the first of gpt2, llama, qwen3, "
        "qwen2, mistral, phi3, gemma2, gemma3 that computes the model)")
    # -- the baselines
    bptt: int | None = setting(
        None, "lstm/rnn: backpropagate through at most this many steps (truncated BPTT; unset: the whole window)")
    order: int = setting(5, "ngram: the n of n-gram (the context is n - 1 tokens)")
    smoothing: SmoothingKind = setting(
        "kn", "ngram: Kneser-Ney (kn), add-k, unsmoothed counts (mle), or nltk's KN (kn-nltk)")
    add_k: float = setting(1.0, "ngram: the pseudo-count of --smoothing add-k")

    def __post_init__(self) -> None:
        check_fields(self)
        self._check_combinations()

    @property
    def head_dim(self) -> int:
        """d_h, the size of one head: d_head, or d_model / n_head."""
        return self.d_head if self.d_head is not None else self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """The number of key/value heads (n_kv_head, or n_head when it is None)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def gated(self) -> bool:
        """Whether the MLP is gated (swiglu, geglu): a third matrix W_3 whose product the activation scales."""
        return self.mlp in ("swiglu", "geglu")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of block ``layer`` (0-based), or None where it attends to the whole context."""
        pattern = self.sliding_window_pattern
        if self.sliding_window is None or (pattern is not None and (layer + 1) % pattern == 0):
            return None
        return self.sliding_window

    @property
    def moe_hidden_dim(self) -> int:
        """An expert's hidden width: moe_d_ff, or hidden_dim / (top_k + shared experts) rounded to `MOE_MULTIPLE`."""
        if self.moe_d_ff is not None:
            return self.moe_d_ff
        share = self.hidden_dim / (self.moe_top_k + self.moe_shared_experts)
        return max(MOE_MULTIPLE, MOE_MULTIPLE * round(share / MOE_MULTIPLE))

    @property
    def hidden_dim(self) -> int:
        """The MLP's hidden width: d_ff, or 4 d for gelu and 8/3 d rounded up to a multiple of 64 for the gated ones."""
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp in ("gelu", "relu2"):
            return 4 * self.d_model
        return SWIGLU_MULTIPLE * math.ceil(8 * self.d_model / 3 / SWIGLU_MULTIPLE)

    def _check_combinations(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "d_model", "n_head", "tile_size"):
            if getattr(self, name) <= 0:
                raise TinyLMError(f"{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("n_kv_head", "d_head", "d_ff", "bptt", "sliding_window", "rope_original_context",
                     "sliding_window_pattern"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise TinyLMError(f"{name} must be a positive integer (or left out), got {getattr(self, name)}")
        if not 1 <= self.order <= 10:
            raise TinyLMError(f"order (of an n-gram model) must be between 1 and 10, got {self.order}")
        if not (math.isfinite(self.add_k) and self.add_k > 0):
            raise TinyLMError(f"add_k must be a positive number, got {self.add_k}")
        if self.family == "ngram" and self.smoothing == "kn-nltk" and self.order < 2:
            raise TinyLMError("smoothing kn-nltk needs order 2 or more (nltk's unigram level divides by zero); "
                              "use kn for order 1")
        if not 0.0 <= self.dropout < 1.0:
            raise TinyLMError(f"dropout is a probability in [0, 1), got {self.dropout}")
        for name in ("logit_softcap", "attn_softcap", "attn_scale_dim", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise TinyLMError(f"{name} must be a positive number (or left unset), got {value}")
        if self.bigram_hash < 0 or self.bigram_hash == 1:
            raise TinyLMError(f"bigram_hash is a number of buckets: 0 (off) or 2 or more, got {self.bigram_hash}")
        if self.head_init_std is not None:
            if not (math.isfinite(self.head_init_std) and self.head_init_std >= 0):
                raise TinyLMError(f"head_init_std must be 0 (zeros) or a positive number, got {self.head_init_std}")
            if self.tie_embeddings:
                raise TinyLMError("head_init_std initialises an untied output head; with tie_embeddings the head is "
                                  "the embedding E: add --no-tie-embeddings or leave head_init_std unset")
        for name in ("init_std", "norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise TinyLMError(f"{name} must be positive, got {getattr(self, name)}")
        if self.bptt is not None and self.family not in ("lstm", "rnn"):
            raise TinyLMError(f"bptt (truncated backpropagation through time) applies to the lstm and rnn families; "
                              f"{FAMILY_NAMES[self.family]} model has no recurrence: leave bptt unset")
        if self.family != "gpt":
            return  # heads, positions and norms are the Transformer's: a baseline does not use them
        if self.d_model % self.n_head and self.d_head is None:
            raise TinyLMError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}), since each head gets "
                f"d_model / n_head dimensions; use n_head in {_divisors(self.d_model)} or a d_model that is a "
                f"multiple of {self.n_head} (or set d_head)"
            )
        if self.n_head % self.kv_heads:
            raise TinyLMError(
                f"n_kv_head ({self.kv_heads}) must divide n_head ({self.n_head}), so that every key/value head "
                f"serves the same number of query heads; use n_kv_head in {_divisors(self.n_head)}"
            )
        if self.positions == "rope" and self.head_dim % 2:
            raise TinyLMError(
                "positions = 'rope' rotates pairs of coordinates, so the head size " +
                (f"d_model / n_head must be even; it is {self.d_model} / {self.n_head} = {self.head_dim}: change "
                 "d_model or n_head" if self.d_head is None else f"d_head must be even; it is {self.d_head}")
            )
        if self.qkv_bias and self.bias:
            raise TinyLMError("qkv_bias puts biases on W_q, W_k and W_v of a bias = false model; with bias = true "
                              "every projection has one already: leave qkv_bias unset or add --no-bias")
        self._check_rope_scaling()
        self._check_windows()
        self._check_moe()
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise TinyLMError(
                f"positions = 'sinusoidal' pairs a sine and a cosine per frequency, so d_model must be even; "
                f"got {self.d_model}"
            )

    def _check_windows(self) -> None:
        if self.sliding_window is None:
            for name in ("sliding_window_pattern", "rope_local_theta"):
                if getattr(self, name) is not None:
                    raise TinyLMError(f"{name} = {getattr(self, name)!r} is a setting of the windowed layers, and "
                                      "sliding_window is unset: set sliding_window too, or leave it unset")
        if self.sliding_window_pattern == 1:
            raise TinyLMError("sliding_window_pattern = 1 would give every layer the whole context: leave "
                              "sliding_window unset instead (or use a pattern of 2 or more)")
        if self.rope_local_theta is not None and self.positions != "rope":
            raise TinyLMError(f"rope_local_theta is RoPE's base on the windowed layers, but positions = "
                              f"{self.positions!r}: use positions = 'rope' or leave it unset")

    def _check_moe(self) -> None:
        if self.moe_experts < 0 or self.moe_experts == 1:
            raise TinyLMError(f"moe_experts is 0 (the dense MLP) or 2 or more experts to route among, got "
                              f"{self.moe_experts}")
        if self.moe_shared_experts not in (0, 1):
            raise TinyLMError(f"moe_shared_experts is 0 or 1, got {self.moe_shared_experts}")
        if self.moe_d_ff is not None and self.moe_d_ff <= 0:
            raise TinyLMError(f"moe_d_ff must be a positive integer (or left out), got {self.moe_d_ff}")
        for name in ("moe_aux_weight", "moe_z_weight", "moe_bias_rate"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise TinyLMError(f"{name} must be 0 or a positive number, got {getattr(self, name)}")
        if not self.moe_experts:
            return
        if not 1 <= self.moe_top_k <= self.moe_experts:
            raise TinyLMError(f"moe_top_k ({self.moe_top_k}) must be between 1 and moe_experts "
                              f"({self.moe_experts}): each token goes through top_k of the experts")
        if self.moe_top_k == 1 and self.moe_norm_topk:
            raise TinyLMError("moe_top_k = 1 with the gate weights normalised over the chosen experts makes every "
                              "gate weight 1, so the loss never teaches the router: add --no-moe-norm-topk (Switch: "
                              "the gate is the expert's score) or use moe_top_k 2 or more")

    def _check_rope_scaling(self) -> None:
        used = {"none": (), "linear": ("rope_factor",),
                "llama3": ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context")}
        wanted = used[self.rope_scaling]
        if self.rope_scaling != "none" and self.positions != "rope":
            raise TinyLMError(f"rope_scaling = {self.rope_scaling!r} rescales RoPE's frequencies, but positions = "
                              f"{self.positions!r}: use positions = 'rope' or leave rope_scaling 'none'")
        for name in used["llama3"]:
            value = getattr(self, name)
            if name in wanted and value is None:
                raise TinyLMError(f"rope_scaling = {self.rope_scaling!r} needs {name} (it reads "
                                  f"{', '.join(wanted)})")
            if name not in wanted and value is not None:
                owners = " or ".join(repr(kind) for kind, names in used.items() if name in names)
                raise TinyLMError(f"{name} is a setting of rope_scaling {owners}, and rope_scaling is "
                                  f"{self.rope_scaling!r}: leave {name} unset")
        for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise TinyLMError(f"{name} must be a positive number, got {value}")
        if self.rope_scaling == "llama3" and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise TinyLMError(f"rope_high_freq_factor ({self.rope_high_freq_factor}) must be larger than "
                              f"rope_low_freq_factor ({self.rope_low_freq_factor}): between them the frequencies blend")


# Which [model] fields each family reads beyond the shared ones (family, vocab_size, block_size,
# n_layer, d_model, dropout, init_std, tie_embeddings, ...): a setting given for another family is
# ignored, with a warning from `tinylm train`.
TRANSFORMER_ONLY = frozenset({
    "n_head", "n_kv_head", "d_head", "mlp", "d_ff", "norm", "norm_position", "norm_eps", "positions", "rope_theta",
    "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context",
    "sliding_window", "bias", "qkv_bias", "attention", "tile_size", "sliding_window_pattern", "rope_local_theta",
    "embed_scale", "attn_scale_dim", "attn_softcap", "export_as", "moe_experts", "moe_top_k", "moe_shared_experts",
    "moe_d_ff", "moe_router", "moe_norm_topk", "moe_balance", "moe_aux_weight", "moe_z_weight", "moe_bias_rate",
    "moe_dispatch"})
NGRAM_ONLY = frozenset({"order", "smoothing", "add_k"})


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0][:12]
