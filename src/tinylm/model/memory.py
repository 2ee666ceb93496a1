"""What a model's shape costs in parameters and bytes, and the check that it fits before anything is allocated.

The counts are formulas over a `GPTConfig` (`tinylm.explain.accounting` explains them and builds
FLOPs and activations on them); they live here, with the models, because every network checks
with them that it fits this machine before it allocates a single weight (`check_fits`, called by
`GPT` and `RecurrentLM` themselves, so every way to a model goes through it: `build_model`, a
checkpoint, an imported Hugging Face folder, training, a Python caller).

What the check counts, in float32 (what tinylm keeps weights in):

- the weights: `count_params` x 4 bytes;
- what a Transformer allocates from ``block_size`` to be used: the cos and sin tables RoPE's
  decoder computes for every position, and a KV cache of one sequence of the full context;
- training: the gradients and the optimizer's state (`training_memory`), and the token ids of
  one optimizer step, all ``batch_size x grad_accum`` rows, which are drawn at once
  (`tinylm.train.batches`). A LoRA run (``lora_rank``) has gradients and optimizer state for its
  adapter alone (`lora_params`); the frozen weights have neither.

Activations are left out: they depend on the batch, and running out of them is caught as it
happens with advice on what to lower. So a refusal here means the model cannot possibly run,
never that it might be tight.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import torch

from tinylm.config import GPTConfig, TrainConfig
from tinylm.config.training import lora_target_names
from tinylm.errors import TinyLMError

BYTES_PER_VALUE = 4  # float32 weights, gradients, optimizer state, caches
# a training step's token ids are int64, and numpy holds about three copies of them while cutting the
# windows: the index array, the gathered tokens widened to int64, and x and y (views or copies)
STEP_BATCH_BYTES_PER_TOKEN = 3 * 8


# optimizer -> tensors of state it keeps per parameter (AdamW: first and second moments). Muon keeps
# one (its momentum) for the blocks' matrices and AdamW's two for the rest (`training_memory`).
OPTIMIZER_STATES = {"adamw": 2, "sgd": 0, "muon": 1}


def attention_layer_weights(config: GPTConfig) -> int:
    """The matrices of one attention layer alone: W_q d (n_h d_h), W_k and W_v d (n_kv d_h) each, W_o (n_h d_h) d."""
    d, hs, nh, nkv = config.d_model, config.head_dim, config.n_head, config.kv_heads
    return d * nh * hs + 2 * d * nkv * hs + nh * hs * d


def attention_layer_params(config: GPTConfig) -> int:
    """Parameters of one attention layer: W_q, W_k, W_v (grouped-query sizes) and W_o, with biases if any."""
    d, hs, nh, nkv = config.d_model, config.head_dim, config.n_head, config.kv_heads
    weights = attention_layer_weights(config)
    biases = nh * hs + 2 * nkv * hs + d if config.bias else 0
    qk_norm = 2 * hs if config.qk_norm else 0  # the q and k gains, shared by the heads
    value_weight = 1 if config.value_embed else 0  # how much of the value embedding this layer adds
    return weights + biases + qk_norm + value_weight


def expert_params(config: GPTConfig, d_ff: int) -> int:
    """Parameters of one MLP of hidden width ``d_ff``: two matrices for gelu, three for the gated swiglu and geglu,
    with biases if any."""
    d = config.d_model
    n_in = 2 if config.gated else 1  # W_1 (and W_3) map d -> d_ff; gelu and relu2 have no gate
    weights = (n_in + 1) * d * d_ff
    biases = n_in * d_ff + d if config.bias else 0
    return weights + biases


def mlp_layer_params(config: GPTConfig) -> int:
    """Parameters of one block's MLP: the dense MLP, or a Mixture of Experts' E experts (and the shared one) of
    width moe_d_ff with its router W_r (d x E)."""
    if not config.moe_experts:
        return expert_params(config, config.hidden_dim)
    experts = config.moe_experts + config.moe_shared_experts
    return experts * expert_params(config, config.moe_hidden_dim) + config.d_model * config.moe_experts


def active_mlp_layer_params(config: GPTConfig) -> int:
    """The parameters of one block's MLP that a token goes through: all of a dense MLP; of a Mixture of Experts,
    its top_k experts, the shared one and the router."""
    if not config.moe_experts:
        return mlp_layer_params(config)
    experts = config.moe_top_k + config.moe_shared_experts
    return experts * expert_params(config, config.moe_hidden_dim) + config.d_model * config.moe_experts


def mlp_matmul_weights(config: GPTConfig) -> int:
    """The weights a token multiplies by in one block's MLP (no biases): (2 or 3) d d_ff dense; with experts,
    (2 or 3) d d_e for each of the top_k (and the shared one) and d E for the router."""
    per_matrix = 3 if config.gated else 2
    if not config.moe_experts:
        return per_matrix * config.d_model * config.hidden_dim
    experts = config.moe_top_k + config.moe_shared_experts
    return experts * per_matrix * config.d_model * config.moe_hidden_dim + config.d_model * config.moe_experts


def norm_params(config: GPTConfig) -> int:
    """Parameters of one norm: a gain per coordinate, and a bias for LayerNorm with ``bias``."""
    return config.d_model * (2 if config.norm == "layernorm" and config.bias else 1)


def param_breakdown(config: GPTConfig) -> dict[str, int]:
    """Parameters by part of the model; the values sum to `count_params`."""
    d, V, L = config.d_model, config.vocab_size, config.n_layer
    final_norms = 0 if config.norm_position == "post" else 1
    block_norms = 4 if config.norm_position == "sandwich" else 2  # sandwich: each sublayer's output too
    return {
        "token_embedding": V * d,
        "position_embedding": config.block_size * d if config.positions == "learned" else 0,
        "attention": L * attention_layer_params(config),
        "mlp": L * mlp_layer_params(config),
        "norms": (block_norms * L + final_norms) * norm_params(config),
        "lm_head": 0 if config.tie_embeddings else V * d,
        "value_embedding": V * config.kv_heads * config.head_dim if config.value_embed else 0,
        "bigram_embedding": config.bigram_hash * d,
    }


def count_params(config: GPTConfig) -> int:
    """The number of parameters of ``GPT(config)`` (or of the recurrent model a lstm/rnn config describes),
    a tied head counted once."""
    if config.family in ("rnn", "lstm"):
        return count_recurrent_params(config)
    return sum(param_breakdown(config).values())


def count_active_params(config: GPTConfig) -> int:
    """The parameters one token goes through: `count_params`, less the experts a Mixture of Experts did not pick."""
    if config.family != "gpt" or not config.moe_experts:
        return count_params(config)
    return count_params(config) - config.n_layer * (mlp_layer_params(config) - active_mlp_layer_params(config))


def count_recurrent_params(config: GPTConfig) -> int:
    """The number of parameters of ``RecurrentLM(config)``, a tied head counted once.

    Per layer: W_ih and W_hh (d x gd each, g = 4 gates for an LSTM, 1 for an RNN) and two biases
    of gd; plus the embedding |V| d and, untied, the head d |V|.
    """
    d, V = config.d_model, config.vocab_size
    g = 4 if config.family == "lstm" else 1
    per_layer = 2 * d * g * d + 2 * g * d
    return V * d * (1 if config.tie_embeddings else 2) + config.n_layer * per_layer


def lora_matrix_shapes(config: GPTConfig) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each matrix of a block that LoRA may correct, by its name (W_3 only in a gated MLP)."""
    d, hs, nh, nkv, d_ff = config.d_model, config.head_dim, config.n_head, config.kv_heads, config.hidden_dim
    shapes = {"W_q": (d, nh * hs), "W_k": (d, nkv * hs), "W_v": (d, nkv * hs), "W_o": (nh * hs, d),
              "W_1": (d, d_ff), "W_2": (d_ff, d)}
    if config.gated:
        shapes["W_3"] = (d, d_ff)
    return shapes


def lora_params(config: GPTConfig, rank: int, targets: str = "all") -> int:
    """The numbers a LoRA adapter of rank r on ``targets`` trains: r (d_in + d_out) for each matrix it corrects
    (A is r x d_in, B is d_out x r), in every layer. A target the model does not have (W_3 of a GELU MLP) adds none; the embedding E and the head
    (|V| x d each) add r (|V| + d) once."""
    shapes = lora_matrix_shapes(config)
    names = lora_target_names(targets)
    per_layer = sum(rank * sum(shapes[name]) for name in names if name in shapes)
    outer = sum(rank * (config.vocab_size + config.d_model) for name in ("E", "lm_head") if name in names)
    return config.n_layer * per_layer + outer


def training_memory(config: GPTConfig, bytes_per_value: int = 4, optimizer: str = "adamw",
                    lora_rank: int = 0, lora_targets: str = "all") -> dict[str, int]:
    """Bytes for weights, gradients and optimizer state (activations excluded), and their total.

    With ``lora_rank`` the weights are the frozen model's and the adapter's, and only the adapter has gradients
    and optimizer state; an optimizer keeps AdamW's two moments for it even under Muon (`tinylm.train.optim`).
    """
    if optimizer not in OPTIMIZER_STATES:
        raise TinyLMError(f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZER_STATES)}")
    n = count_params(config) * bytes_per_value
    if lora_rank:
        adapter = lora_params(config, lora_rank, lora_targets) * bytes_per_value
        states = (2 if optimizer == "muon" else OPTIMIZER_STATES[optimizer]) * adapter
        memory = {"weights": n + adapter, "gradients": adapter, "optimizer": states}
        memory["total"] = sum(memory.values())
        return memory
    states = OPTIMIZER_STATES[optimizer] * n
    if optimizer == "muon":  # one tensor for the blocks' matrices, AdamW's two for everything else
        routers = config.d_model * config.moe_experts  # a Mixture of Experts' router is AdamW's
        matrices = (config.n_layer * (attention_layer_params(config) + mlp_layer_params(config) - routers)
                    * bytes_per_value)
        states = matrices + 2 * (n - matrices)
    memory = {"weights": n, "gradients": n, "optimizer": states}
    memory["total"] = sum(memory.values())
    return memory


def kv_cache_bytes_per_token(config: GPTConfig, bytes_per_value: int = 4) -> int:
    """Bytes a KV cache holds per token of context: a key and a value of n_kv d_h numbers in every layer
    (grouped-query attention shares them between n_h / n_kv query heads, which is what it saves)."""
    return 2 * config.n_layer * config.kv_heads * config.head_dim * bytes_per_value


# ----- does it fit ----------------------------------------------------------------------------------

# GPT-2 small's sizes (GPTConfig's defaults), and a usual batch: a refusal names the field that is the
# furthest above its usual size among those that make the largest part, since that is the one to lower
USUAL_SIZES = {"n_layer": 12, "d_model": 768, "n_head": 12, "n_kv_head": 12, "d_head": 64, "d_ff": 3072,
               "vocab_size": 50257, "bigram_hash": 50257, "moe_experts": 8, "block_size": 1024, "batch_size": 64, "grad_accum": 8}
# which fields make each part (of the weights, or of the memory beside them)
PART_FIELDS = {
    "token_embedding": ("vocab_size", "d_model"), "lm_head": ("vocab_size", "d_model"),
    "position_embedding": ("block_size", "d_model"),
    "attention": ("n_layer", "d_model", "d_head", "n_head", "n_kv_head"),
    "mlp": ("n_layer", "d_ff", "d_model", "moe_experts"), "norms": ("n_layer", "d_model"),
    "value_embedding": ("vocab_size", "d_head", "n_kv_head", "d_model"),
    "bigram_embedding": ("bigram_hash", "d_model"), "recurrent_layers": ("n_layer", "d_model"),
    "position tables": ("block_size", "d_head", "d_model"),
    "KV cache": ("block_size", "n_layer", "n_kv_head", "d_head", "d_model"),
    "a step's token ids": ("grad_accum", "batch_size", "block_size"),
}
# Each block is a dozen PyTorch modules, about 1 ms and 50 kB to build beside its weights: far past the
# deepest networks ever trained (about a thousand layers), a narrow model that fits in memory would
# still take minutes just to construct
MAX_LAYERS = 10_000
# fields whose every value passes validation, so the largest that fits can be searched for (d_model and
# the head sizes must divide one another)
SEARCHABLE = ("n_layer", "block_size", "vocab_size", "bigram_hash", "batch_size", "grad_accum")


def machine_memory() -> int | None:
    """This machine's total RAM in bytes (None where the system does not say)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return total if total > 0 else None


def gpu_memory(device: torch.device) -> int:
    """The total memory of the CUDA GPU ``device``."""
    return torch.cuda.get_device_properties(device).total_memory


def format_bytes(n: int) -> str:
    """A byte count for a message: "11.5 GB" (powers of 1000, as disks and RAM sizes are sold)."""
    for unit, size in (("PB", 10**15), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            value = n / size
            return f"{value:,.0f} {unit}" if value >= 100 else f"{value:.1f} {unit}"
    return f"{n} bytes"


def weight_parts(config: GPTConfig) -> dict[str, int]:
    """Parameters by part: `param_breakdown` for a Transformer, embeddings and layers for lstm/rnn."""
    if config.family in ("rnn", "lstm"):
        embedding = config.vocab_size * config.d_model
        return {"token_embedding": embedding, "lm_head": 0 if config.tie_embeddings else embedding,
                "recurrent_layers": count_recurrent_params(config) - embedding * (1 if config.tie_embeddings else 2)}
    return param_breakdown(config)


def memory_parts(config: GPTConfig, train: TrainConfig | None = None) -> dict[str, int]:
    """Bytes the model needs before any activation (see the module docstring): the weights, what a Transformer
    sizes by ``block_size``, and when ``train`` is given the gradients, the optimizer state and a step's token ids."""
    n = count_params(config) * BYTES_PER_VALUE
    parts = {"weights": n}
    if train is not None:
        if config.family == "gpt":  # a LoRA run: the adapter's weights, gradients and state beside the frozen model
            memory = training_memory(config, BYTES_PER_VALUE, train.optimizer, train.lora_rank, train.lora_targets)
            parts["weights"] = memory["weights"]
            parts["gradients"], parts["optimizer state"] = memory["gradients"], memory["optimizer"]
        else:  # Muon's momentum is one tensor where AdamW keeps two: AdamW's count bounds both
            parts["gradients"], parts["optimizer state"] = n, n * max(OPTIMIZER_STATES.values())
    if config.family == "gpt":
        # the decoder's cos and sin tables, (block_size, d_h) float32 each, and the int64 positions they come from
        rope = config.block_size * (2 * config.head_dim * BYTES_PER_VALUE + 8) if config.positions == "rope" else 0
        parts["position tables"] = rope
        parts["KV cache"] = kv_cache_bytes_per_token(config, BYTES_PER_VALUE) * config.block_size
    if train is not None:
        tokens = train.batch_size * train.grad_accum * config.block_size
        parts["a step's token ids"] = tokens * STEP_BATCH_BYTES_PER_TOKEN
    return parts


def check_fits(config: GPTConfig, train: TrainConfig | None = None, device: torch.device | str | None = None,
               source: str | None = None, shards: int = 1) -> None:
    """Refuse, in one `TinyLMError` line with the numbers, a model (to train, with ``train``) that cannot fit.

    The weights are built in RAM first, so they must fit there; the rest is compared with the memory of
    ``device``: a CUDA GPU's own, else this machine's RAM. A step's token ids are always in RAM.
    ``shards``: the processes that split the weights, gradients and optimizer state on their GPUs (FSDP).
    ``source`` (a file) starts the message, for a configuration that was read from one.
    """
    if config.family == "ngram":
        return  # counted from data: no weights to allocate
    parts = memory_parts(config, train)
    host = machine_memory()
    if device is not None and torch.device(device).type == "cuda":
        gpu = torch.device(device)
        split = ("weights", "gradients", "optimizer state")
        on_gpu = {name: -(-size // shards) if name in split else size
                  for name, size in parts.items() if name != "a step's token ids"}
        _refuse_over(on_gpu, gpu_memory(gpu), f"the GPU's {{}} ({gpu})", config, train, source)
        on_host = {name: size for name, size in parts.items() if name in ("weights", "a step's token ids")}
        _refuse_over(on_host, host, "this machine's {} of memory", config, train, source)
    else:
        _refuse_over(parts, host, "this machine's {} of memory", config, train, source)
    # a narrow model of absurdly many layers fits in memory; it is refused for the time it takes to build
    if config.n_layer > MAX_LAYERS:
        raise TinyLMError(f"{source + ': ' if source else ''}n_layer {config.n_layer} is more layers than any "
                          f"language model has (the deepest have about a thousand), and building their modules alone "
                          f"would take minutes; use at most {MAX_LAYERS:,}")


def _refuse_over(parts: Mapping[str, int], limit: int | None, where: str, config: GPTConfig,
                 train: TrainConfig | None, source: str | None) -> None:
    if limit is None or sum(parts.values()) <= limit:
        return
    where = where.format(format_bytes(limit))
    start = f"{source}: " if source else ""
    if parts["weights"] > limit:
        weights = weight_parts(config)
        field = _field_to_lower(max(weights, key=weights.get), config, train)
        raise TinyLMError(f"{start}the model would need {format_bytes(parts['weights'])} for its weights alone "
                          f"({count_params(config):,} parameters of {BYTES_PER_VALUE} bytes), more than {where}; "
                          f"{_lower(field, config, train, limit, set(parts))}")
    biggest = max(parts, key=parts.get)
    if biggest in ("weights", "gradients", "optimizer state"):
        weights = weight_parts(config)
        biggest = max(weights, key=weights.get)
    field = _field_to_lower(biggest, config, train)
    what = f"training the model with {train.optimizer}" if train is not None else "the model"
    listing = ", ".join(f"{name} {format_bytes(size)}" for name, size in parts.items() if size)
    drawn = (" (a step draws all its batch_size x grad_accum rows of block_size tokens at once)"
             if field in ("grad_accum", "batch_size") else "")
    raise TinyLMError(f"{start}{what} would need {format_bytes(sum(parts.values()))} before any activation "
                      f"({listing}), more than {where}{drawn}; {_lower(field, config, train, limit, set(parts))}")


def _value(field: str, config: GPTConfig, train: TrainConfig | None) -> int | None:
    return getattr(train, field) if field in ("batch_size", "grad_accum") else getattr(config, field)


def _field_to_lower(part: str, config: GPTConfig, train: TrainConfig | None) -> str:
    """The field furthest above its usual size among those that make ``part``."""
    candidates = [field for field in PART_FIELDS[part] if _value(field, config, train) is not None]
    if config.d_head is None and "n_head" in candidates:
        candidates.remove("n_head")  # without d_head the heads split d_model: their number costs nothing
    return max(candidates, key=lambda field: _value(field, config, train) / USUAL_SIZES[field])


def _lower(field: str, config: GPTConfig, train: TrainConfig | None, limit: int, names: set[str]) -> str:
    """"lower FIELD (now V; N at most fits)" for the field ``field``."""
    value = _value(field, config, train)
    most = _largest_that_fits(field, config, train, limit, names) if field in SEARCHABLE else None
    fits = f"; at most {most:,} could fit" if most else ""
    return f"lower {field} (now {value}{fits})" + ("" if field in ("batch_size", "grad_accum") else
                                                   ", or use a smaller model")


def _largest_that_fits(field: str, config: GPTConfig, train: TrainConfig | None, limit: int,
                       names: set[str]) -> int | None:
    """The largest value of ``field`` below its value now with which the parts ``names`` fit ``limit`` (None: none)."""
    def fits(value: int) -> bool:
        try:
            if field in ("batch_size", "grad_accum"):
                parts = memory_parts(config, dataclasses.replace(train, **{field: value}))
            else:
                parts = memory_parts(dataclasses.replace(config, **{field: value}), train)
        except TinyLMError:
            return False
        return sum(size for name, size in parts.items() if name in names) <= limit

    low, high = 0, _value(field, config, train)  # fits(low) is taken as true, fits(high) is false
    if field == "n_layer":
        high = min(high, MAX_LAYERS + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low if low >= 1 and fits(low) else None
