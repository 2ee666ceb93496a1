"""Configuration as data: the model's settings, named presets, TOML files and `--key value` overrides.

A run's configuration is a small TOML document with one table per part of the pipeline:
``[model]`` (the fields of `GPTConfig`: the network's shape) and ``[train]`` (the fields of
`TrainConfig`: data, optimizer, schedule, budget, evaluation, device). Every helper here works
table by table, so adding a table is a new entry in `SECTIONS`.

    [model]
    n_layer = 4
    d_model = 192
    positions = "rope"

    [train]
    batch_size = 32
    lr = 2e-3
    max_tokens = 20_000_000

Where settings come from, later ones winning:

1. the dataclass defaults (`GPTConfig()` is GPT-2 small, like nanoGPT's),
2. a named preset (``src/tinylm/presets/<name>.toml``, see `list_presets`),
3. a TOML file of the user's; a top-level ``preset = "tiny"`` line in it starts from that preset,
4. command-line style overrides, ``["--n-layer", "6", "--positions=rope", "--no-bias"]`` or a
   dict ``{"n_layer": 6}``; a key may be qualified by its table (``--model.n-layer``) and must be
   when two tables share a name.

Unknown keys and values of the wrong type are `TinyLMError`s that name the valid keys or the
expected type; impossible combinations (a head count that does not divide d_model, ...) are
rejected by `GPTConfig` itself, with a message that says what to change.

Usage::

    cfg = resolve_config(preset="tiny", overrides=["--n-layer", "6", "--lr", "1e-3"])
    model = GPT(cfg.model)
    text = dump_toml(cfg.to_dict())        # the resolved configuration, saved with the run

This module imports nothing heavier than the standard library: it sits at the bottom of the
package, below the model, so anything may read a configuration without importing torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from tinylm.errors import TinyLMError

MLPKind = Literal["gelu", "swiglu", "relu2"]
NormKind = Literal["layernorm", "rmsnorm"]
NormPosition = Literal["pre", "post"]
PositionKind = Literal["learned", "sinusoidal", "rope", "none"]
RopeScalingKind = Literal["none", "linear", "llama3"]
AttentionKind = Literal["sdpa", "reference", "tiled"]
TokenizerKind = Literal["bpe", "char", "word"]
DecodeErrors = Literal["strict", "replace", "ignore"]
BatchMode = Literal["packed", "documents"]
OptimizerKind = Literal["adamw", "sgd", "muon"]
DecayKind = Literal["cosine", "linear", "constant", "wsd"]
DecayShape = Literal["linear", "1-sqrt"]
MuonAdjustLR = Literal["original", "match_rms_adamw"]
DtypeKind = Literal["auto", "float32", "bfloat16"]
ParallelKind = Literal["ddp", "fsdp"]
WandbMode = Literal["offline", "online"]
# where [train] log_to may send the metrics rows; metrics.jsonl ("jsonl") is always written
LOG_BACKENDS = ("jsonl", "tensorboard", "wandb")
ModelFamily = Literal["gpt", "lstm", "rnn", "ngram"]
# how messages name a family, article included ("an LSTM model", "a Transformer (gpt) model")
FAMILY_NAMES = {"gpt": "a Transformer (gpt)", "lstm": "an LSTM", "rnn": "an RNN", "ngram": "an n-gram"}
SmoothingKind = Literal["kn", "add-k", "mle", "kn-nltk"]

# SwiGLU's hidden width when not given: 8/3 d (so its three matrices hold as many weights as
# GELU's two at 4 d), rounded up to a multiple of this so the matrices tile well on hardware.
SWIGLU_MULTIPLE = 64


@dataclass
class GPTConfig:
    """The [model] table: the shape and the choices of a GPT-style Transformer (SPEC section 3),
    or of one of the baselines it is compared with (SPEC section 6).

    The defaults are GPT-2 small (124M parameters with vocab 50257). Fields:

    - ``family`` which kind of language model: "gpt" (the Transformer, everything below), "lstm"
      or "rnn" (`tinylm.model.rnn`: an embedding, ``n_layer`` recurrent layers of width
      ``d_model``, the output head; ``dropout`` and ``tie_embeddings`` as for gpt, ``init_std`` for
      an untied head only (the embedding starts larger: `tinylm.model.rnn.EMBEDDING_STD`),
      and ``bptt``: backpropagate through at most that many steps of a window, truncated
      backpropagation through time, None for the whole window), or "ngram"
      (`tinylm.model.ngram`: counts of ``order``-grams with ``smoothing``, ``add_k`` the pseudo-count
      of add-k). A family ignores the fields it has no use for; attention, heads, norms and
      positions are the Transformer's alone.

    - ``vocab_size`` |V|, ``block_size`` the context length T (the most tokens the model sees).
    - ``n_layer`` blocks, each attention then MLP; ``d_model`` the width d of every position's vector.
    - ``n_head`` query heads n_h, each of size d_h = d_model / n_head; ``n_kv_head`` key/value heads
      (grouped-query attention): None or equal to n_head is multi-head attention, 1 is multi-query.
      ``d_head`` sets d_h itself (unset: d_model / n_head): the heads then span n_head d_h dimensions,
      which W_o maps back to d_model (Qwen3's and Mistral NeMo's 128 with a narrower d_model / n_head).
    - ``mlp`` "gelu" (GPT-2: x W_1, GELU, W_2; GELU in GPT-2's tanh form) or "swiglu"
      (Llama: (SiLU(x W_1) * x W_3) W_2); ``d_ff`` the hidden width, None for the usual rule
      (4 d for gelu, 8/3 d rounded up to a multiple of 64 for swiglu; see `hidden_dim`).
    - ``norm`` "layernorm" or "rmsnorm", ``norm_position`` "pre" (normalize the input of each
      sublayer, as modern LMs do; a final norm before the head) or "post" (normalize after each
      residual addition, as the original Transformer; no final norm), ``norm_eps``.
    - ``positions`` "learned" (a trained table added to the token embeddings), "sinusoidal" (the
      fixed sin/cos table of Vaswani et al., added), "rope" (rotary: q and k rotated by their
      position, ``rope_theta`` the base), or "none" (attention alone cannot tell order).
    - ``rope_scaling`` stretches RoPE's frequencies for a longer context (`tinylm.model.positions`):
      "none"; "linear" divides every frequency by ``rope_factor``; "llama3" (Llama 3.1) divides the
      low frequencies by ``rope_factor``, keeps the high ones and blends between, with the bounds set
      by ``rope_low_freq_factor``, ``rope_high_freq_factor`` and ``rope_original_context`` (the
      context the model was first trained at). Each of the four is set exactly when its scaling uses it.
    - ``sliding_window`` W: each query attends to itself and the W - 1 positions before it, as
      Mistral does (unset: the whole causal context).
    - ``bias`` on every linear layer and LayerNorm; ``qkv_bias`` on W_q, W_k and W_v only, for a
      ``bias = false`` model (Qwen2's layout); ``tie_embeddings`` shares the output head with the token
      embedding E; ``dropout``; ``init_std`` the standard deviation of the initial weights.
    - ``attention`` "sdpa" (PyTorch's fused kernel), "reference" (the definition written out) or
      "tiled" (online softmax over key blocks of ``tile_size``, the FlashAttention idea). All three
      compute the same function; the tests pin them equal.

    Options from the modern small-model recipes (modded-nanogpt, nanochat), each off by default
    unless a preset turns it on (`benchmarks/recipe.py` measures each one):

    - ``mlp = "relu2"``: y = ReLU(x W_1)^2 W_2, no gate, hidden width 4 d.
    - ``qk_norm``: RMSNorm (with a learned gain per head coordinate) on every head's q and k before
      RoPE, as in Qwen3 and OLMo 2: the scores q.k stay bounded whatever the weights grow to.
    - ``zero_init_projections``: W_o and the MLP's W_2 start at zero, so every block starts as the
      identity and the residual stream is the embedding alone at step 0.
    - ``logit_softcap`` c: the logits become c tanh(u / c), always inside (-c, c) (Gemma 2).
    - ``value_embed``: a second embedding table E_v, (|V|, n_kv_head d_h), whose row for the current
      token is added to every layer's values with a learned per-layer weight (modded-nanogpt's
      value embeddings, shared by all layers).
    - ``bigram_hash`` B > 0: an embedding of B rows for the pair (previous token, this token),
      hashed to row 1 + (prev * 1000003 + cur) mod (B - 1), added to E[x]; row 0 serves the first
      position of a window, which has no previous token. It starts at zero.
    - ``head_init_std``: the initial standard deviation of an untied head (0: zeros); unset:
      ``init_std``.
    """

    family: ModelFamily = "gpt"
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    d_model: int = 768
    n_head: int = 12
    n_kv_head: int | None = None
    d_head: int | None = None
    mlp: MLPKind = "gelu"
    d_ff: int | None = None
    norm: NormKind = "layernorm"
    norm_position: NormPosition = "pre"
    norm_eps: float = 1e-5
    positions: PositionKind = "learned"
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingKind = "none"
    rope_factor: float | None = None
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_original_context: int | None = None
    sliding_window: int | None = None
    bias: bool = True
    qkv_bias: bool = False
    tie_embeddings: bool = True
    dropout: float = 0.0
    init_std: float = 0.02
    attention: AttentionKind = "sdpa"
    tile_size: int = 64
    qk_norm: bool = False
    zero_init_projections: bool = False
    logit_softcap: float | None = None
    value_embed: bool = False
    bigram_hash: int = 0
    head_init_std: float | None = None
    bptt: int | None = None
    order: int = 5
    smoothing: SmoothingKind = "kn"
    add_k: float = 1.0

    def __post_init__(self) -> None:
        hints = _type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, check_type(f.name, getattr(self, f.name), hints[f.name]))
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
    def hidden_dim(self) -> int:
        """The MLP's hidden width: d_ff, or 4 d for gelu and 8/3 d rounded up to a multiple of 64 for swiglu."""
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp in ("gelu", "relu2"):
            return 4 * self.d_model
        return SWIGLU_MULTIPLE * math.ceil(8 * self.d_model / 3 / SWIGLU_MULTIPLE)

    def _check_combinations(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "d_model", "n_head", "tile_size"):
            if getattr(self, name) <= 0:
                raise TinyLMError(f"{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("n_kv_head", "d_head", "d_ff", "bptt", "sliding_window", "rope_original_context"):
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
        if self.logit_softcap is not None and not (math.isfinite(self.logit_softcap) and self.logit_softcap > 0):
            raise TinyLMError(f"logit_softcap must be a positive number (or left unset for no cap), got {self.logit_softcap}")
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
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise TinyLMError(
                f"positions = 'sinusoidal' pairs a sine and a cosine per frequency, so d_model must be even; "
                f"got {self.d_model}"
            )

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


def _help(text: str) -> Any:
    return {"help": text}


@dataclass
class TrainConfig:
    """How a model is trained (SPEC section 4): data, optimizer, schedule, budget, evaluation, device.

    Each field's ``metadata["help"]`` says what it means (it is also what `tinylm train --help`
    prints). A field that may be unset (``X | None``) defaults to None, because TOML has no null:
    the saved configuration leaves such a field out, and reading it back must give None again.

    The batch is counted in sequences of ``model.block_size`` tokens: one optimizer step sees
    ``batch_size * grad_accum`` sequences, whatever the number of processes (with ``torchrun``,
    each of W processes takes ``batch_size / W`` rows of every micro-batch).
    """

    # -- data
    corpus: str = field(default="shakespeare", metadata=_help(
        "a built-in corpus (shakespeare, stdlib) or a path to a text file, a folder or a .jsonl file"))
    glob: str | None = field(default=None, metadata=_help(
        "for a folder corpus: which files to read (default **/*.txt)"))
    text_field: str = field(default="text", metadata=_help("for a JSONL corpus: the field that holds the text"))
    encoding: str = field(default="utf-8", metadata=_help(
        "the text encoding of a local corpus's files, any Python codec name (latin-1, cp1252, utf-16, ...); "
        "the built-in corpora are UTF-8"))
    errors: DecodeErrors = field(default="strict", metadata=_help(
        "corpus bytes that are not valid in the encoding: stop naming the file and offset (strict), replace "
        "them with U+FFFD, or drop them (ignore)"))
    tokenizer: str | None = field(default=None, metadata=_help(
        "a tinylm tokenizer JSON file to use; unset: train one on the corpus (see tokenizer_kind)"))
    tokenizer_kind: TokenizerKind = field(default="bpe", metadata=_help("the tokenizer to train when none is given"))
    tokenizer_vocab_size: int = field(default=2048, metadata=_help(
        "|V| of the tokenizer to train (bpe, word; a char tokenizer takes every character it sees)"))
    tokenizer_pattern: str = field(default="gpt4", metadata=_help("bpe split pattern: gpt2, gpt4 or a regex"))
    data_dir: str | None = field(default=None, metadata=_help(
        "where the token shards go; unset: data/<corpus>-<tokenizer> (reused on the next run)"))
    val_fraction: float = field(default=0.1, metadata=_help("share of the corpus's documents held out for validation"))
    batch_mode: BatchMode = field(default="packed", metadata=_help(
        "packed: random windows of the token stream; documents: one document per row, truncated or padded"))
    # -- batch and budget
    batch_size: int = field(default=32, metadata=_help("sequences per micro-batch, summed over all processes"))
    grad_accum: int = field(default=1, metadata=_help("micro-batches per optimizer step (gradient accumulation)"))
    max_steps: int | None = field(default=None, metadata=_help(
        "optimizer steps to train; with max_tokens too, whichever budget is smaller wins"))
    max_tokens: int | None = field(default=None, metadata=_help(
        "training tokens to see, rounded up to whole steps of batch_size * grad_accum * block_size"))
    # -- optimizer and schedule
    optimizer: OptimizerKind = field(default="adamw", metadata=_help(
        "adamw, sgd (with momentum), or muon (torch.optim.Muon for the blocks' weight matrices, AdamW for the "
        "rest: embeddings, head, norms)"))
    lr: float = field(default=1e-3, metadata=_help(
        "the peak learning rate, reached at the end of warmup (with muon: of the AdamW groups)"))
    muon_lr: float = field(default=0.02, metadata=_help(
        "with muon: the peak learning rate of the blocks' weight matrices"))
    muon_momentum: float = field(default=0.95, metadata=_help("with muon: Muon's (Nesterov) momentum"))
    muon_momentum_warmup: int = field(default=0, metadata=_help(
        "with muon: steps over which Muon's momentum rises linearly from 0.85 to muon_momentum (0: none)"))
    muon_adjust_lr: MuonAdjustLR = field(default="original", metadata=_help(
        "with muon: how the update is scaled for a matrix's shape: original (sqrt(max(1, rows/cols)), Keller "
        "Jordan's) or match_rms_adamw (0.2 sqrt(max(rows, cols)), Moonshot's)"))
    muon_weight_decay: float | None = field(default=None, metadata=_help(
        "with muon: the Muon matrices' decoupled weight decay; unset: weight_decay"))
    embed_lr: float | None = field(default=None, metadata=_help(
        "the peak learning rate of the embedding tables (token, position, value and bigram embeddings); "
        "unset: lr"))
    head_lr: float | None = field(default=None, metadata=_help(
        "the peak learning rate of an untied output head; unset: lr"))
    min_lr: float | None = field(default=None, metadata=_help("the learning rate at the last step; unset: lr / 10"))
    warmup_steps: int = field(default=100, metadata=_help("steps of linear warmup from lr / warmup_steps to lr"))
    decay: DecayKind = field(default="cosine", metadata=_help(
        "after warmup, from lr down to min_lr at the last step: cosine, linear, constant, or wsd (warmup-stable-"
        "decay: lr held, then decay_shape down to min_lr over the last decay_fraction of the steps)"))
    decay_fraction: float = field(default=0.2, metadata=_help(
        "with wsd: the share of all steps, at the end, over which the rate decays"))
    decay_shape: DecayShape = field(default="linear", metadata=_help(
        "with wsd: the decay's shape, linear or 1-sqrt (lr * (1 - sqrt(p)), which drops fastest at first)"))
    weight_decay: float = field(default=0.1, metadata=_help(
        "decoupled weight decay (AdamW) or L2 (SGD), on matrices and embeddings only, never on norms and biases"))
    beta1: float = field(default=0.9, metadata=_help("AdamW's first-moment decay"))
    beta2: float = field(default=0.95, metadata=_help("AdamW's second-moment decay"))
    momentum: float = field(default=0.9, metadata=_help("SGD's momentum"))
    grad_clip: float = field(default=1.0, metadata=_help(
        "clip the gradient's global norm to this; 0 turns clipping off"))
    seed: int = field(default=1337, metadata=_help("seeds the initial weights, the batches and dropout"))
    # -- evaluation, checkpoints, logging
    eval_interval: int = field(default=250, metadata=_help("evaluate on the validation split every this many steps"))
    eval_tokens: int = field(default=65536, metadata=_help(
        "tokens per periodic evaluation (evenly spaced windows of the split); 0: the whole split"))
    final_eval_tokens: int = field(default=0, metadata=_help(
        "tokens for the evaluation at the end; 0: the whole validation split"))
    eval_batch_size: int | None = field(default=None, metadata=_help(
        "sequences per evaluation batch; unset: batch_size"))
    checkpoint_interval: int | None = field(default=None, metadata=_help(
        "save checkpoints/latest every this many steps; unset: at every evaluation (and always at the end)"))
    log_interval: int = field(default=10, metadata=_help(
        "steps between metrics.jsonl lines (and progress lines when the output is not a terminal)"))
    # log_to, not log: torchrun reads a prefix of its own --log-dir in `--log`, so `torchrun ... -m tinylm train
    # --log X` would stop at torchrun's "ambiguous option" before tinylm saw it
    log_to: str = field(default="jsonl", metadata=_help(
        "where the metrics go besides metrics.jsonl (always written): jsonl (nowhere else), tensorboard (event files "
        "in the run's tensorboard/), wandb (a Weights & Biases run), or several comma-separated, e.g. "
        "tensorboard,wandb; each needs its extra: pip install -e '.[tensorboard]' or '.[wandb]'"))
    wandb_project: str = field(default="tinylm", metadata=_help("with --log-to wandb: the W&B project"))
    wandb_mode: WandbMode = field(default="offline", metadata=_help(
        "with --log-to wandb: offline (written under the run's wandb/, no account or network; `wandb sync` uploads it "
        "later) or online"))
    # -- hardware
    device: str = field(default="auto", metadata=_help(
        "auto (cuda when there is a GPU, else cpu), cpu, cuda, cuda:N or mps"))
    dtype: DtypeKind = field(default="auto", metadata=_help(
        "auto: bfloat16 autocast where the hardware multiplies bfloat16 natively (a GPU that has it, a CPU with "
        "AVX512-BF16 or AMX), float32 elsewhere; or float32, bfloat16"))
    compile: bool = field(default=False, metadata=_help("torch.compile the model (worth it on a GPU)"))
    threads: int | None = field(default=None, metadata=_help(
        "CPU threads per process; unset: the cores free now (busy ones left out), divided among the processes "
        "of this machine"))
    parallel: ParallelKind = field(default="ddp", metadata=_help(
        "under torchrun: ddp (replicate the model) or fsdp (shard weights, gradients and optimizer state)"))
    # -- the sample printed at the end
    sample_tokens: int = field(default=200, metadata=_help("tokens of text to generate at the end (0: none)"))
    sample_temperature: float = field(default=0.8, metadata=_help("temperature of that sample (0: greedy)"))
    sample_top_k: int = field(default=40, metadata=_help("sample from the k most likely tokens only; 0: from all"))

    def __post_init__(self) -> None:
        hints = _type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, check_type(f.name, getattr(self, f.name), hints[f.name]))
        for name in ("tokenizer_vocab_size", "batch_size", "grad_accum", "eval_interval", "log_interval"):
            if getattr(self, name) <= 0:
                raise TinyLMError(f"{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("max_steps", "max_tokens", "eval_batch_size", "checkpoint_interval", "threads"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise TinyLMError(f"{name} must be a positive integer (or left unset), got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_tokens", "final_eval_tokens", "sample_tokens", "sample_top_k"):
            if getattr(self, name) < 0:
                raise TinyLMError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**63:  # numpy's and torch's generators take no negative seeds
            raise TinyLMError(f"seed must be an integer from 0 to 2**63 - 1, got {self.seed}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise TinyLMError(f"lr must be a positive number, got {self.lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise TinyLMError(f"min_lr must be between 0 and lr ({self.lr}), got {self.min_lr}")
        for name in ("muon_lr", "embed_lr", "head_lr"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise TinyLMError(f"{name} must be a positive number, got {value}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise TinyLMError(f"decay_fraction is a share of the steps in (0, 1], got {self.decay_fraction}")
        if self.muon_momentum_warmup < 0:
            raise TinyLMError(f"muon_momentum_warmup must be 0 or more, got {self.muon_momentum_warmup}")
        for name in ("beta1", "beta2", "momentum", "muon_momentum"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise TinyLMError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.muon_weight_decay is not None and not (math.isfinite(self.muon_weight_decay)
                                                       and self.muon_weight_decay >= 0):
            raise TinyLMError(f"muon_weight_decay must be 0 or a positive number, got {self.muon_weight_decay}")
        for name in ("weight_decay", "grad_clip", "sample_temperature"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise TinyLMError(f"{name} must be 0 or a positive number, got {getattr(self, name)}")
        if not 0.0 < self.val_fraction < 1.0:
            raise TinyLMError(f"val_fraction must be strictly between 0 and 1 (training needs a validation split), "
                              f"got {self.val_fraction}")
        self.log_backends  # an unknown name is an error now, not when the run starts

    @property
    def final_lr(self) -> float:
        """min_lr, or lr / 10 when it is unset."""
        return self.lr / 10 if self.min_lr is None else self.min_lr

    @property
    def log_backends(self) -> tuple[str, ...]:
        """The backends ``log_to`` names, each once, "jsonl" first: ``"wandb, tensorboard"`` gives
        ``("jsonl", "wandb", "tensorboard")``, and ``""`` just ``("jsonl",)``."""
        names = [name.strip() for name in self.log_to.split(",") if name.strip()]
        for name in names:
            if name not in LOG_BACKENDS:
                raise TinyLMError(f"log_to: unknown backend {name!r}{_did_you_mean(name, LOG_BACKENDS)}; choose from "
                                  f"{', '.join(LOG_BACKENDS)}, several comma-separated (e.g. tensorboard,wandb)")
        return tuple(dict.fromkeys(["jsonl", *names]))


@dataclass
class Config:
    """A whole run's configuration: one dataclass per TOML table."""

    model: GPTConfig = field(default_factory=GPTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The nested dict `dump_toml` writes; fields left as None (meaning "the default rule") are omitted."""
        return {
            f.name: {k: v for k, v in dataclasses.asdict(getattr(self, f.name)).items() if v is not None}
            for f in dataclasses.fields(self)
        }


# table name -> the dataclass its keys are the fields of
SECTIONS: dict[str, type] = {"model": GPTConfig, "train": TrainConfig}


# -- presets and files ---------------------------------------------------------------------------


def list_presets() -> list[str]:
    """The names of the presets shipped in ``tinylm/presets``."""
    folder = resources.files("tinylm") / "presets"
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def load_preset(name: str) -> dict[str, dict[str, Any]]:
    """A named preset as a nested dict ``{"model": {...}}``, checked like any configuration file."""
    return _load_preset(name, seen=())


def load_config_file(path: str | Path, default_preset: str | None = None,
                     own_only: bool = False) -> dict[str, dict[str, Any]]:
    """A TOML configuration file as a nested dict, merged over its ``preset = "..."`` if it names one,
    else over ``default_preset`` (`tinylm train --config` gives "tiny", where the command starts).
    ``own_only``: the file's own tables alone, over no preset."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TinyLMError(f"configuration file not found: {path}") from None
    except OSError as e:
        raise TinyLMError(f"cannot read configuration file {path}: {e.strerror}") from None
    return _parse_toml(text, source=str(path), seen=(), default_preset=default_preset, own_only=own_only)


def _load_preset(name: str, seen: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    if name in seen:
        raise TinyLMError(f"preset {name!r} includes itself through {' -> '.join(seen + (name,))}")
    resource = resources.files("tinylm") / "presets" / f"{name}.toml"
    if not resource.is_file():
        raise TinyLMError(f"unknown preset {name!r}{_did_you_mean(name, list_presets())}; "
                          f"the presets are: {', '.join(list_presets())}")
    return _parse_toml(resource.read_text(encoding="utf-8"), source=f"preset {name!r}", seen=seen + (name,))


def _parse_toml(text: str, source: str, seen: tuple[str, ...],
                default_preset: str | None = None, own_only: bool = False) -> dict[str, dict[str, Any]]:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TinyLMError(f"{source} is not valid TOML: {e}") from None
    base: dict[str, dict[str, Any]] = _load_preset(default_preset, seen) if default_preset else {}
    if "preset" in raw:
        preset = raw.pop("preset")
        if not isinstance(preset, str):
            raise TinyLMError(f"{source}: 'preset' must be a preset name in quotes, got {preset!r}")
        base = _load_preset(preset, seen)
    if own_only:
        base = {}
    for key, table in raw.items():
        if key not in SECTIONS or not isinstance(table, dict):
            raise TinyLMError(
                f"{source}: unexpected {'table [' + key + ']' if isinstance(table, dict) else 'key ' + repr(key)}; "
                f"a configuration has the tables {', '.join('[' + s + ']' for s in SECTIONS)} "
                f"and an optional top-level preset = \"name\""
            )
        cls = SECTIONS[key]
        hints = _type_hints(cls)
        for name, value in table.items():
            if name not in hints:
                raise TinyLMError(f"{source}: unknown key {name!r} in [{key}]{_did_you_mean(name, list(hints))}; "
                                  f"the valid keys are: {', '.join(hints)}")
            check_type(f"{key}.{name}", value, hints[name])
    return _merge(base, raw)


def _merge(base: Mapping[str, Mapping[str, Any]], top: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    merged = {section: dict(table) for section, table in base.items()}
    for section, table in top.items():
        merged.setdefault(section, {}).update(table)
    return merged


# -- overrides -----------------------------------------------------------------------------------


def apply_overrides(
    cfg: Mapping[str, Mapping[str, Any]], overrides: Sequence[str] | Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """A copy of ``cfg`` with the overrides applied.

    ``overrides`` is either command-line style, ``["--n-layer", "6", "--positions=rope"]`` (a bool
    key alone means true, ``--no-<key>`` means false), or a dict ``{"n_layer": 6, "model.bias":
    False}``; dict values that are strings are parsed like command-line text. Keys use dashes or
    underscores alike.
    """
    out = _merge(cfg, {})
    pairs = _override_pairs(overrides)
    for flag, value in pairs:
        section, name = _resolve_key(flag)
        tp = _type_hints(SECTIONS[section])[name]
        label = f"--{name.replace('_', '-')}"
        if isinstance(value, str) and tp is not str and typing.get_origin(tp) is not Literal:
            value = parse_value(label, value, tp)
        out.setdefault(section, {})[name] = check_type(label, value, tp)
        if value is None:
            del out[section][name]  # None means "use the default rule": the same as leaving the key out
    return out


def _override_pairs(overrides: Sequence[str] | Mapping[str, Any]) -> list[tuple[str, Any]]:
    if isinstance(overrides, Mapping):
        return list(overrides.items())
    if isinstance(overrides, str):
        raise TinyLMError("overrides must be a list of arguments such as ['--n-layer', '4'], not one string")
    pairs: list[tuple[str, Any]] = []
    args = list(overrides)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise TinyLMError(f"expected a setting such as --n-layer, got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        if eq:
            pairs.append((key, value))
            i += 1
            continue
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs.append((key, args[i + 1]))
            i += 2
            continue
        # a bare flag: `--bias` is true and `--no-bias` false; anything else needs a value
        negated = key.startswith(("no-", "no_")) and _is_bool_key(key[3:])
        section, name = _resolve_key(key[3:] if negated else key)
        if not _is_bool_key(f"{section}.{name}"):
            raise TinyLMError(f"--{key} needs a value, e.g. --{key} VALUE or --{key}=VALUE")
        pairs.append((f"{section}.{name}", not negated))
        i += 1
    return pairs


def _is_bool_key(key: str) -> bool:
    try:
        section, name = _resolve_key(key)
    except TinyLMError:
        return False
    return _type_hints(SECTIONS[section])[name] is bool


def _resolve_key(key: str) -> tuple[str, str]:
    """``"n-layer"`` or ``"model.n_layer"`` -> ``("model", "n_layer")``, or an error naming the valid keys."""
    key = key.removeprefix("--").replace("-", "_")
    section, dot, name = key.rpartition(".")
    if dot:
        if section not in SECTIONS:
            raise TinyLMError(f"unknown table {section!r} in --{key}; the tables are: {', '.join(SECTIONS)}")
        candidates = [section] if name in _type_hints(SECTIONS[section]) else []
    else:
        candidates = [s for s, cls in SECTIONS.items() if name in _type_hints(cls)]
    if len(candidates) == 1:
        return candidates[0], name
    if len(candidates) > 1:
        raise TinyLMError(f"--{name} is ambiguous; say which table: " + ", ".join(f"--{s}.{name}" for s in candidates))
    valid = [f"--{n.replace('_', '-')}" for s, cls in SECTIONS.items() if not dot or s == section
             for n in _type_hints(cls)]
    flag = "--" + name.replace("_", "-")
    raise TinyLMError(f"unknown setting {flag}{_did_you_mean(flag, valid)}; the valid settings are: {', '.join(valid)}")


# -- building and writing ------------------------------------------------------------------------


def build_config(cfg: Mapping[str, Mapping[str, Any]]) -> Config:
    """The dataclasses for a nested dict; unknown tables and keys are errors, then each dataclass validates itself."""
    kwargs = {}
    for section, table in cfg.items():
        if section not in SECTIONS:
            raise TinyLMError(f"unknown table [{section}]; the tables are: {', '.join(SECTIONS)}")
        hints = _type_hints(SECTIONS[section])
        unknown = [k for k in table if k not in hints]
        if unknown:
            raise TinyLMError(f"unknown key {unknown[0]!r} in [{section}]{_did_you_mean(unknown[0], list(hints))}; "
                              f"the valid keys are: {', '.join(hints)}")
        kwargs[section] = SECTIONS[section](**table)
    return Config(**kwargs)


def resolve_config(
    preset: str | None = None,
    path: str | Path | None = None,
    overrides: Sequence[str] | Mapping[str, Any] = (),
) -> Config:
    """Defaults, then ``preset``, then the file at ``path``, then ``overrides``: the checked `Config`."""
    cfg: dict[str, dict[str, Any]] = load_preset(preset) if preset is not None else {}
    if path is not None:
        cfg = _merge(cfg, load_config_file(path))
    mine = load_config_file(path, own_only=True) if path is not None else {}
    return build_config(tie_without_head_settings(apply_overrides(cfg, overrides), apply_overrides(mine, overrides)))


def tie_without_head_settings(cfg: dict[str, dict[str, Any]], mine: Mapping[str, Mapping[str, Any]]) -> dict:
    """``cfg`` without an untied head's ``head_init_std`` when it ties the head and the caller (``mine``:
    their file's own tables and their flags) did not set ``head_init_std`` themselves: a preset's setting for its untied
    head (tiny's zero head) means nothing once the caller asks for ``tie_embeddings``. Set both, and
    `GPTConfig` says they contradict each other."""
    model = cfg.get("model", {})
    if model.get("tie_embeddings") and "head_init_std" in model and "head_init_std" not in mine.get("model", {}):
        cfg = _merge(cfg, {})
        del cfg["model"]["head_init_std"]
    return cfg


def dump_toml(cfg: Mapping[str, Mapping[str, Any]]) -> str:
    """A nested dict of scalars as TOML text that `load_config_file` reads back to the same dict."""
    lines: list[str] = []
    for section, table in cfg.items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # repr is the shortest text that reads back to the same float
    if isinstance(value, str):
        return json.dumps(value)  # TOML basic strings escape like JSON strings
    raise TinyLMError(f"cannot write {value!r} ({type(value).__name__}) as a TOML value")


# -- types ---------------------------------------------------------------------------------------


def check_type(name: str, value: Any, tp: Any) -> Any:
    """``value`` if it fits the annotation ``tp`` (ints are accepted as floats), else a `TinyLMError`.

    Handles the annotations configuration fields use: int, float, bool, str, Literal[...] and
    ``X | None``.
    """
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or not isinstance(value, str):
            raise TinyLMError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        (inner,) = args
        return check_type(name, value, inner)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"configuration fields cannot have the annotation {tp!r}")
    raise TinyLMError(f"{name} expects {_describe(tp)}, got {value!r} ({type(value).__name__})")


def parse_value(name: str, text: str, tp: Any) -> Any:
    """Command-line text to a value of type ``tp``: "4" -> 4, "true" -> True, "none" -> None (for ``X | None``)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if text.strip().lower() in ("none", "null", "auto", "default"):
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return parse_value(name, text, inner)
    s = text.strip()
    try:
        if tp is bool:
            if s.lower() in ("true", "yes", "on", "1"):
                return True
            if s.lower() in ("false", "no", "off", "0"):
                return False
            raise ValueError
        if tp is int:
            return int(s)
        if tp is float:
            return float(s)
    except ValueError:
        raise TinyLMError(f"{name} expects {_describe(tp)}, got {text!r}") from None
    return text


def _describe(tp: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, repr(tp))


def _type_hints(cls: type) -> dict[str, Any]:
    # Field annotations are strings under `from __future__ import annotations`; resolve them once.
    hints = _HINTS.get(cls)
    if hints is None:
        resolved = typing.get_type_hints(cls)
        hints = _HINTS[cls] = {f.name: resolved[f.name] for f in dataclasses.fields(cls)}
    return hints


_HINTS: dict[type, dict[str, Any]] = {}


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0][:12]


def _did_you_mean(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
