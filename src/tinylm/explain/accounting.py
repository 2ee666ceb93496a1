"""Parameter, FLOP and memory accounting for any `GPTConfig`, by formula, without building the model.

Parameters, layer by layer (d = d_model, d_h = d / n_head, n_kv key/value heads, d_ff the MLP width):

- token embedding E: |V| d; learned positions P: block_size d (sinusoidal, RoPE and none have none)
- attention: W_q d (n_h d_h) + W_k, W_v d (n_kv d_h) each + W_o (n_h d_h) d, plus a bias per output
  if ``bias``. One multi-head layer with d = 512, n_h = 8, d_h = 64: 3 * 8 * 512 * 64 + 512 * 512 =
  1,048,576 weights, a count worth checking by hand once.
- MLP: 2 d d_ff (gelu: W_1, W_2) or 3 d d_ff (swiglu: W_1, W_3, W_2), plus biases
- norms: d per RMSNorm, 2 d per LayerNorm with bias; two per block, one final (pre-norm only)
- output head: |V| d, or nothing when tied to E
The tests check this count against ``sum(p.numel() for p in GPT(config).parameters())``.

Training FLOPs per token, the PaLM convention (Chowdhery et al., 2022, appendix B), which nanoGPT
and most MFU figures use:

    6 N + 12 n_layer n_h d_h T

N counts the weights of the matrix multiplications a token goes through: attention projections,
MLP, and the output head (|V| d, tied or not; an embedding *lookup* does no arithmetic). Each
weight costs one multiply-add, 2 FLOPs, in the forward pass and twice that in the backward pass
(gradients for the input and for the weight): 6 per weight. Attention adds, per layer and head, a
query's T inner products q k_j^T and the weighted sum of T values, 2 d_h T FLOPs each forward, so
12 n_layer n_h d_h T with the backward pass. T is the full context (block_size unless given);
like PaLM we count the masked half of the causal score matrix, which a fused kernel may skip. Norms,
softmax, biases and the residual additions cost a few FLOPs per *activation*, not per weight, and are
left out (Hoffmann et al., 2022, appendix F, counts them and gets within a few percent).

Inner products: a head computes T^2 of them per sequence (T queries times T keys), so doubling
the context quadruples them, while the parameters do not change at all.

Memory for training with AdamW in float32: the weights, their gradients, and two moment estimates
per weight: 16 bytes per parameter, before activations (which depend on batch and context).
"""

from __future__ import annotations

from tinylm.config import GPTConfig
from tinylm.errors import TinyLMError

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


def mlp_layer_params(config: GPTConfig) -> int:
    """Parameters of one MLP: two matrices for gelu, three for swiglu, with biases if any."""
    d, d_ff = config.d_model, config.hidden_dim
    n_in = 2 if config.mlp == "swiglu" else 1  # W_1 (and W_3) map d -> d_ff; gelu and relu2 have no gate
    weights = (n_in + 1) * d * d_ff
    biases = n_in * d_ff + d if config.bias else 0
    return weights + biases


def norm_params(config: GPTConfig) -> int:
    """Parameters of one norm: a gain per coordinate, and a bias for LayerNorm with ``bias``."""
    return config.d_model * (2 if config.norm == "layernorm" and config.bias else 1)


def param_breakdown(config: GPTConfig) -> dict[str, int]:
    """Parameters by part of the model; the values sum to `count_params`."""
    d, V, L = config.d_model, config.vocab_size, config.n_layer
    final_norms = 1 if config.norm_position == "pre" else 0
    return {
        "token_embedding": V * d,
        "position_embedding": config.block_size * d if config.positions == "learned" else 0,
        "attention": L * attention_layer_params(config),
        "mlp": L * mlp_layer_params(config),
        "norms": (2 * L + final_norms) * norm_params(config),
        "lm_head": 0 if config.tie_embeddings else V * d,
        "value_embedding": V * config.kv_heads * config.head_dim if config.value_embed else 0,
        "bigram_embedding": config.bigram_hash * d,
    }


def count_params(config: GPTConfig) -> int:
    """The number of parameters of ``GPT(config)`` (or of the recurrent model a lstm/rnn config describes),
    a tied head counted once."""
    if config.family in ("rnn", "lstm"):
        from tinylm.model.rnn import count_recurrent_params

        return count_recurrent_params(config)
    return sum(param_breakdown(config).values())


def matmul_params(config: GPTConfig) -> int:
    """N of the FLOP formula: weights used in matrix multiplications per token (no biases, norms or lookups)."""
    d, hs, nh, nkv, d_ff = config.d_model, config.head_dim, config.n_head, config.kv_heads, config.hidden_dim
    attention = d * nh * hs + 2 * d * nkv * hs + nh * hs * d
    mlp = (3 if config.mlp == "swiglu" else 2) * d * d_ff
    return config.n_layer * (attention + mlp) + d * config.vocab_size


def forward_flops_breakdown(config: GPTConfig, seq_len: int | None = None) -> dict[str, int]:
    """Forward-pass FLOPs per token by part (a multiply-add counts 2), with a context of ``seq_len`` tokens."""
    T = _context(config, seq_len)
    d, hs, nh, nkv, d_ff, L = (config.d_model, config.head_dim, config.n_head, config.kv_heads,
                               config.hidden_dim, config.n_layer)
    return {
        "attention_projections": L * 2 * (d * nh * hs + 2 * d * nkv * hs + nh * hs * d),
        "attention_scores": L * 2 * nh * hs * T,  # q k_j^T for T keys, every head
        "attention_weighted_sum": L * 2 * nh * hs * T,  # sum_j a_j v_j over T values, every head
        "mlp": L * 2 * (3 if config.mlp == "swiglu" else 2) * d * d_ff,
        "lm_head": 2 * d * config.vocab_size,
    }


def flops_per_token(config: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token (forward + backward = 3 x forward): 6 N + 12 n_layer n_h d_h T."""
    return 3 * sum(forward_flops_breakdown(config, seq_len).values())


def attention_inner_products(config: GPTConfig, seq_len: int | None = None) -> int:
    """Inner products q_i k_j^T in one forward pass over one sequence: n_layer n_h T^2."""
    T = _context(config, seq_len)
    return config.n_layer * config.n_head * T * T


def training_memory(config: GPTConfig, bytes_per_value: int = 4, optimizer: str = "adamw") -> dict[str, int]:
    """Bytes for weights, gradients and optimizer state (activations excluded), and their total."""
    if optimizer not in OPTIMIZER_STATES:
        raise TinyLMError(f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZER_STATES)}")
    n = count_params(config) * bytes_per_value
    states = OPTIMIZER_STATES[optimizer] * n
    if optimizer == "muon":  # one tensor for the blocks' matrices, AdamW's two for everything else
        matrices = config.n_layer * (attention_layer_params(config) + mlp_layer_params(config)) * bytes_per_value
        states = matrices + 2 * (n - matrices)
    memory = {"weights": n, "gradients": n, "optimizer": states}
    memory["total"] = sum(memory.values())
    return memory


def kv_cache_bytes_per_token(config: GPTConfig, bytes_per_value: int = 4) -> int:
    """Bytes a KV cache holds per token of context: a key and a value of n_kv d_h numbers in every layer
    (grouped-query attention shares them between n_h / n_kv query heads, which is what it saves)."""
    return 2 * config.n_layer * config.kv_heads * config.head_dim * bytes_per_value


def kv_cache_bytes(config: GPTConfig, seq_len: int | None = None, bytes_per_value: int = 4) -> dict[str, int]:
    """Bytes of the KV cache per token (`kv_cache_bytes_per_token`) and for a whole context of ``seq_len`` tokens
    (block_size unless given) of one sequence."""
    per_token = kv_cache_bytes_per_token(config, bytes_per_value)
    return {"per_token": per_token, "full_context": per_token * _context(config, seq_len)}


def activation_bytes(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                     bytes_per_value: int = 4) -> dict[str, int]:
    """An estimate of the activations a training step keeps for the backward pass, for a batch of B sequences of T.

    Per layer, counted tensor by tensor as the reference path stores them (B T values each): the two norms'
    inputs and outputs (4 d), q, k, v and the attention output (2 d + 2 n_kv d_h), the attention
    weights before and after softmax (2 n_h T per token: the T^2 term, which a fused kernel does not
    store), W_o's output (d), and the MLP's inputs and hidden activations (d + 3 d_ff, 4 d_ff for swiglu).
    Then the final logits, V per token. A rough count (dropout masks and kernel workspaces left out),
    meant to show which term grows with what; the tests hold it within 25% of what autograd saves.
    """
    T = _context(config, seq_len)
    d, hs, nh, nkv, d_ff = config.d_model, config.head_dim, config.n_head, config.kv_heads, config.hidden_dim
    mlp = d + (4 if config.mlp == "swiglu" else 3) * d_ff
    per_token_layer = 4 * d + 2 * nh * hs + 2 * nkv * hs + d + mlp
    tokens = batch_size * T
    parts = {
        "layers": config.n_layer * tokens * per_token_layer * bytes_per_value,
        "attention_scores": config.n_layer * batch_size * 2 * nh * T * T * bytes_per_value,
        "logits": tokens * config.vocab_size * bytes_per_value,
    }
    parts["total"] = sum(parts.values())
    return parts


def exact_flops_per_token(config: GPTConfig, seq_len: int | None = None) -> dict[str, int]:
    """FLOPs per token counted matrix multiplication by matrix multiplication (forward, and training at 3x), next
    to the rule of thumb 6 N + 12 n_layer n_h d_h T with N all the parameters (embeddings too, as most
    back-of-the-envelope estimates take it). The exact count is what `torch.utils.flop_counter` counts for
    a forward pass through the reference attention path."""
    forward = sum(forward_flops_breakdown(config, seq_len).values())
    T = _context(config, seq_len)
    rule = 6 * count_params(config) + 12 * config.n_layer * config.n_head * config.head_dim * T
    return {"forward": forward, "training": 3 * forward, "rule_6n": rule}


def cost_vs_context(config: GPTConfig, contexts: list[int]) -> list[dict[str, int]]:
    """For each context length T: parameters, training FLOPs per token, inner products per sequence, KV bytes."""
    return [{"T": T, "params": count_params(config), "flops_per_token": flops_per_token(config, T),
             "inner_products": attention_inner_products(config, T),
             "kv_cache_bytes": kv_cache_bytes(config, T)["full_context"]} for T in contexts]


def summary(config: GPTConfig, seq_len: int | None = None) -> str:
    """One line for the start of a run: shape, parameters and training FLOPs per token."""
    if config.family in ("rnn", "lstm"):
        from tinylm.model.rnn import describe

        return describe(config)
    heads = f"{config.n_head} heads" + (f" ({config.kv_heads} kv)" if config.kv_heads != config.n_head else "")
    return (f"{config.n_layer} layers, d_model {config.d_model}, {heads}, context {_context(config, seq_len)}: "
            f"{count_params(config):,} parameters, {flops_per_token(config, seq_len) / 1e6:,.1f} MFLOPs per token "
            f"(training)")


def _context(config: GPTConfig, seq_len: int | None) -> int:
    T = config.block_size if seq_len is None else seq_len
    if T <= 0:
        raise TinyLMError(f"seq_len must be a positive number of tokens, got {T}")
    return T
