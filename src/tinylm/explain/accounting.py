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

# The parameter and memory counts live with the models (`tinylm.model.memory`), because building a model
# checks with them that it fits before allocating anything; they are this module's names too.
from tinylm.model.memory import (  # noqa: F401
    OPTIMIZER_STATES,
    attention_layer_params,
    attention_layer_weights,
    count_params,
    kv_cache_bytes_per_token,
    mlp_layer_params,
    mlp_matmul_weights,
    norm_params,
    param_breakdown,
    training_memory,
)

def matmul_params(config: GPTConfig) -> int:
    """N of the FLOP formula: weights used in matrix multiplications per token (no biases, norms or lookups)."""
    d, hs, nh, nkv = config.d_model, config.head_dim, config.n_head, config.kv_heads
    attention = d * nh * hs + 2 * d * nkv * hs + nh * hs * d
    return config.n_layer * (attention + mlp_matmul_weights(config)) + d * config.vocab_size


def forward_flops_breakdown(config: GPTConfig, seq_len: int | None = None) -> dict[str, int]:
    """Forward-pass FLOPs per token by part (a multiply-add counts 2), with a context of ``seq_len`` tokens."""
    T = _context(config, seq_len)
    d, hs, nh, nkv, L = config.d_model, config.head_dim, config.n_head, config.kv_heads, config.n_layer
    return {
        "attention_projections": L * 2 * (d * nh * hs + 2 * d * nkv * hs + nh * hs * d),
        "attention_scores": L * 2 * nh * hs * T,  # q k_j^T for T keys, every head
        "attention_weighted_sum": L * 2 * nh * hs * T,  # sum_j a_j v_j over T values, every head
        "mlp": L * 2 * mlp_matmul_weights(config),  # a Mixture of Experts: the experts a token goes through
        "lm_head": 2 * d * config.vocab_size,
    }


def flops_per_token(config: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token (forward + backward = 3 x forward): 6 N + 12 n_layer n_h d_h T."""
    return 3 * sum(forward_flops_breakdown(config, seq_len).values())


def attention_inner_products(config: GPTConfig, seq_len: int | None = None) -> int:
    """Inner products q_i k_j^T in one forward pass over one sequence: n_layer n_h T^2."""
    T = _context(config, seq_len)
    return config.n_layer * config.n_head * T * T


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
    mlp = d + (4 if config.gated else 3) * d_ff
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
