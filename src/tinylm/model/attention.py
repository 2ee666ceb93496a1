"""Causal self-attention, the one place where positions exchange information, written three ways.

For one head, with the queries, keys and values of all positions stacked as rows (row vectors
times weights on the right, q_t = h_t W^Q):

    att1h(Q, K, V) = softmax_row(Q K^T / sqrt(d_h) + M) V,   M[i, j] = -inf if j > i else 0

`reference_attention` (the definition, T x T scores), `sdpa_attention` (PyTorch's fused kernel,
the default) and `tiled_attention` (an online softmax over key blocks, never forming T x T) take
q (B, nh, T_q, hs) and k, v (B, n_kv, T_k, hs) and compute the same function, grouped-query heads,
cached keys (T_k >= T_q), padding and a sliding window included; the tests pin them equal.
docs/model.md explains the conventions they share.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.config import GPTConfig
from tinylm.model.positions import apply_rope


class KVCacheLayer(Protocol):
    """What `CausalSelfAttention` needs from a KV cache (one per layer; the generation engine owns them).

    ``length`` is the number of positions stored before this step; ``update`` appends the new
    keys and values (B, n_kv, T_new, hs) and returns all of them, old then new.
    """

    @property
    def length(self) -> int: ...

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, n_kv, T, hs) -> (B, n_kv * n_rep, T, hs): each key/value head repeated for its group of query heads."""
    if n_rep == 1:
        return x
    B, n_kv, T, hs = x.shape
    return x[:, :, None].expand(B, n_kv, n_rep, T, hs).reshape(B, n_kv * n_rep, T, hs)


def visible_keys(T_q: int, T_k: int, key_mask: Tensor | None, device: torch.device,
                 window: int | None = None) -> Tensor:
    """Which keys each query may attend to: (1 or B, 1, T_q, T_k) bool, the complement of M's -inf entries."""
    q_pos = torch.arange(T_k - T_q, T_k, device=device)  # absolute positions of the queries
    k_pos = torch.arange(T_k, device=device)
    visible = causal_visible(q_pos, k_pos, window)[None, None]  # (1, 1, T_q, T_k)
    return visible if key_mask is None else visible & query_key_mask(key_mask)  # (1 or B, 1, T_q, T_k)


def query_key_mask(key_mask: Tensor) -> Tensor:
    """A key mask in the (B, 1, T_q or 1, T_k) form that broadcasts against the scores.

    Attention takes one of two key masks beside causality: (B, T_k), False at padding keys (every
    query skips them), or (B, 1, T_q, T_k), False where query i may not see key j although j is in its
    past: the keys of another conversation packed into the same row.
    """
    return key_mask[:, None, None, :] if key_mask.dim() == 2 else key_mask


def causal_visible(q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor:
    """(T_q, T_k) bool: key j is at or before query i, and within its window when there is one."""
    visible = k_pos[None, :] <= q_pos[:, None]  # the lower triangle
    if window is not None:
        visible = visible & (k_pos[None, :] > q_pos[:, None] - window)  # a band of W diagonals
    return visible


def window_keys(k: Tensor, v: Tensor, key_mask: Tensor | None, T_q: int,
                window: int | None) -> tuple[Tensor, Tensor, Tensor | None, int | None]:
    """Drop the keys (and values, and mask columns) that no query's window reaches; the window still to apply.

    The first of the T_q queries, at T_k - T_q, sees back to T_k - T_q - W + 1; everything before
    goes. When every key left is within every query's window, the window changes nothing and
    comes back as None, so the fused kernels' plain causal paths apply.
    """
    if window is None:
        return k, v, key_mask, None
    first = max(0, k.size(2) - T_q - window + 1)
    k, v = k[:, :, first:], v[:, :, first:]  # (B, n_kv, T_k - first, hs)
    if key_mask is not None:
        key_mask = key_mask[..., first:]  # (B, T_k - first) or (B, 1, T_q, T_k - first)
    return k, v, key_mask, (window if k.size(2) > window else None)


def soft_cap(scores: Tensor, cap: float | None) -> Tensor:
    """c tanh(s / c): every score squashed into (-c, c), nearly unchanged where |s| << c (Gemma 2's logit capping)."""
    return scores if cap is None else cap * torch.tanh(scores / cap)


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """softmax_row(Q K^T / sqrt(d_h) + M) V for every head, exactly as defined; optionally with the weights.

    ``scale`` replaces 1 / sqrt(d_h); ``softcap`` c caps each score s at c tanh(s / c) before M is added.
    """
    n_head, T_q, hs = q.size(1), q.size(2), q.size(3)
    T_k = k.size(2)
    k = repeat_kv(k, n_head // k.size(1))  # (B, nh, T_k, hs)
    v = repeat_kv(v, n_head // v.size(1))  # (B, nh, T_k, hs)
    visible = visible_keys(T_q, T_k, key_mask, q.device, window)  # (1 or B, 1, T_q, T_k)
    has_key = visible.any(dim=-1, keepdim=True)  # (1 or B, 1, T_q, 1)
    # M: -inf where a key is in the future or padding. A row with no visible key keeps 0s, so the
    # softmax stays finite there; that row's weights are zeroed right after.
    M = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
    M = M.masked_fill(~visible & has_key, float("-inf"))  # (1 or B, 1, T_q, T_k)
    scale = 1.0 / math.sqrt(hs) if scale is None else scale
    scores = soft_cap(q @ k.transpose(-2, -1) * scale, softcap) + M  # (B, nh, T_q, T_k)
    att = torch.softmax(scores, dim=-1)  # (B, nh, T_q, T_k), each row sums to 1
    att = att.masked_fill(~has_key, 0.0)  # queries with nothing to look at: all-zero weights
    weights = att
    if dropout_p > 0.0:
        att = F.dropout(att, dropout_p)
    y = att @ v  # (B, nh, T_q, hs): row i is sum_j att[i, j] v_j
    return (y, weights) if return_weights else y


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None = None, dropout_p: float = 0.0,
    window: int | None = None, scale: float | None = None,
) -> Tensor:
    """The same function through `torch.nn.functional.scaled_dot_product_attention` (fused kernels).

    (The kernel cannot cap scores: `CausalSelfAttention` sends a capped model to `reference_attention`.)
    """
    n_head, T_q, T_k = q.size(1), q.size(2), k.size(2)
    k = repeat_kv(k, n_head // k.size(1))  # (B, nh, T_k, hs)
    v = repeat_kv(v, n_head // v.size(1))  # (B, nh, T_k, hs)
    # with a window the mask is a band, which the kernel's is_causal cannot say (nor does the
    # written-out backward assume it): the explicit mask below
    if (key_mask is None or key_mask.dim() == 4) and window is None and T_q == T_k and scale is None \
            and _use_written_out_backward(q, k, v, dropout_p):
        # training on a CPU in bfloat16: plain causal, or the triangle cut into blocks for packed
        # conversations (every query seeing itself); one dtype for all three (value embeddings add a
        # float32 term to v under autocast)
        return _CausalAttention.apply(q, k.to(q.dtype), v.to(q.dtype), key_mask)
    if key_mask is None and window is None:
        if T_q == T_k:
            # the common training case: let the kernel build the causal mask itself (fastest)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
        if T_q == 1:
            # one new query at the last position sees every key: no mask at all
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
        # note: is_causal=True would align the triangle to the top-left corner, wrong when T_q < T_k
    visible = visible_keys(T_q, T_k, key_mask, q.device, window)  # (1 or B, 1, T_q, T_k)
    has_key = visible.any(dim=-1, keepdim=True)  # (1 or B, 1, T_q, 1)
    # rows with no visible key: let them see everything (finite softmax), then zero their output
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible | ~has_key, dropout_p=dropout_p, scale=scale)
    return y.masked_fill(~has_key, 0.0)  # (B, nh, T_q, hs)


# Up to this context, causal attention on a CPU in bfloat16 trains faster with the backward pass
# written out below than with the fused kernel's, whose backward costs several times its forward; beyond
# it the B nh T^2 scores the written-out pass recomputes cost more. Where the two cross depends on the
# machine: `python benchmarks/train_step.py --attention` times both at several contexts.
WRITTEN_OUT_BACKWARD_MAX_T = 128


def _use_written_out_backward(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and dropout_p == 0.0
            and q.size(2) <= WRITTEN_OUT_BACKWARD_MAX_T and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad))


class _CausalAttention(torch.autograd.Function):
    """Causal attention: the fused kernel's forward pass, and its gradient written out.

    On a CPU, PyTorch's fused (flash) kernel computes bfloat16 attention's forward pass quickly but
    its backward pass takes about six times as long at T = 128; this one takes less than half of
    that there (`benchmarks/train_step.py`), though more from T = 256 on (`WRITTEN_OUT_BACKWARD_MAX_T`).
    With S = Q K^T / sqrt(d_h) + M, P = softmax_row(S), Y = P V:

        dV = P^T dY,   dP = dY V^T,   dS = P * (dP - D),   dQ = dS K / sqrt(d_h),   dK = dS^T Q / sqrt(d_h)

    where D = rowsum(P * dP) = rowsum(dY * Y) (one number per query; the second form is cheaper).
    P is recomputed from Q and K rather than stored by the forward pass.

    ``key_mask`` (B, 1, T, T), optional: keys hidden from a query on top of the future ones (another
    conversation packed into the row). Every query must still see itself.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None = None) -> Tensor:
        if key_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            key_mask = key_mask & torch.ones(q.size(2), q.size(2), dtype=torch.bool, device=q.device).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        ctx.save_for_backward(q, k, v, y, key_mask)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, y, visible = ctx.saved_tensors
        with torch.autocast(dy.device.type, enabled=False):  # the dtypes below are chosen, not autocast's
            return *_CausalAttention._gradients(q, k, v, y, dy.to(q.dtype), visible), None

    @staticmethod
    def _gradients(q: Tensor, k: Tensor, v: Tensor, y: Tensor, dy: Tensor,
                   visible: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        T, scale = q.size(2), 1.0 / math.sqrt(q.size(-1))
        if visible is None:
            hidden = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)  # M's -inf entries: the future
        else:
            hidden = ~visible  # (B, 1, T, T): the future and the other conversations
        # the scores and the softmax in float32; the products with the gradient in q's dtype, whose
        # matmuls a CPU runs several times faster (their error is that of the fused kernel's backward)
        scores = (q.float() * scale) @ k.float().transpose(-2, -1)  # (B, nh, T, T)
        p = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)
        dv = p.to(q.dtype).transpose(-2, -1) @ dy  # (B, nh, T, hs)
        D = (dy.float() * y.float()).sum(dim=-1, keepdim=True)  # (B, nh, T, 1)
        ds = (dy @ v.transpose(-2, -1)).float().sub_(D).mul_(p).to(q.dtype)  # (B, nh, T, T): (dP - D) * P
        dq = (ds @ k).mul_(scale)
        dk = (ds.transpose(-2, -1) @ q).mul_(scale)
        return dq, dk, dv


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    tile_size: int = 64,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """The same function by an online softmax over blocks of ``tile_size`` keys: never forms the T x T matrix.

    For one query row, softmax(s) v = sum_j exp(s_j - m) v_j / sum_j exp(s_j - m) for *any* constant
    m; using the row maximum keeps every exp() <= 1. Visiting the keys block by block we keep three
    running quantities per query: m (the largest score so far), l (sum of exp(s_j - m)) and acc (sum
    of exp(s_j - m) v_j). When a block raises the maximum from m to m', the old sums are rescaled by
    exp(m - m') and the block's terms are added; at the end y = acc / l. Memory is the (T_q x
    tile_size) block, linear in T.

    This is FlashAttention's forward pass (Dao et al., 2022) written for reading; the real kernel
    also tiles the queries (each row is independent, so that changes nothing here) and keeps the
    tiles in on-chip memory. Autograd still stores every block for the backward pass; FlashAttention
    recomputes them instead, which this version does not do.
    """
    n_head, T_q, hs = q.size(1), q.size(2), q.size(3)
    T_k = k.size(2)
    k = repeat_kv(k, n_head // k.size(1))  # (B, nh, T_k, hs)
    v = repeat_kv(v, n_head // v.size(1))  # (B, nh, T_k, hs)
    scale = 1.0 / math.sqrt(hs) if scale is None else scale
    q_pos = torch.arange(T_k - T_q, T_k, device=q.device)  # absolute positions of the queries
    # the running statistics stay in float32 even when q, k, v are bf16: they accumulate over many blocks
    m = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=torch.float32, device=q.device)  # (B, nh, T_q, 1)
    l = torch.zeros_like(m)  # (B, nh, T_q, 1)
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, nh, T_q, hs)
    for start in range(0, T_k, tile_size):
        end = min(start + tile_size, T_k)
        k_pos = torch.arange(start, end, device=q.device)
        visible = causal_visible(q_pos, k_pos, window)  # (T_q, Tb): the causal (and window) part of M for this block
        if key_mask is not None:
            visible = visible & query_key_mask(key_mask)[..., start:end]  # (B, 1, T_q, Tb)
        s = soft_cap((q @ k[:, :, start:end].transpose(-2, -1)).float() * scale, softcap)  # (B, nh, T_q, Tb)
        s = s.masked_fill(~visible, float("-inf"))
        # The result does not depend on m (it cancels between acc and l), so its gradient is zero:
        # take it from detached scores and spare autograd the bookkeeping.
        m_new = torch.maximum(m, s.detach().amax(dim=-1, keepdim=True))  # (B, nh, T_q, 1)
        # a row that has seen no visible key yet has m_new = -inf; shift by 0 instead (avoids inf - inf)
        m_shift = m_new.masked_fill(m_new == float("-inf"), 0.0)
        p = torch.exp(s - m_shift)  # (B, nh, T_q, Tb); 0 at invisible keys
        alpha = torch.exp(m - m_shift)  # (B, nh, T_q, 1): rescales the sums kept under the old max
        l = alpha * l + p.sum(dim=-1, keepdim=True)
        if dropout_p > 0.0:
            # dropping entries of p before the division by l is dropout on the normalized weights
            p = F.dropout(p, dropout_p)
        v_blk = v[:, :, start:end]  # (B, nh, Tb, hs)
        acc = alpha * acc + (p.to(v_blk.dtype) @ v_blk).float()  # (B, nh, T_q, hs)
        m = m_new
    # l = 0 only for queries with no visible key; acc is 0 there too, so their output is 0
    return (acc / l.masked_fill(l == 0, 1.0)).to(q.dtype)  # (B, nh, T_q, hs)


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention with projections W_q, W_k, W_v and W_o.

    nn.Linear stores its matrix transposed and computes x @ weight.T, so ``W_q.weight.T`` is the
    row-vector convention's W^Q (d x n_h d_h) and ``q = W_q(x)`` is q = h W^Q for every position and head at once.
    """

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads
        self.head_dim = config.head_dim
        d, hs = config.d_model, config.head_dim
        qkv_bias = config.bias or config.qkv_bias  # Qwen2: biases on q, k, v only
        self.W_q = nn.Linear(d, self.n_head * hs, bias=qkv_bias)
        self.W_k = nn.Linear(d, self.n_kv_head * hs, bias=qkv_bias)
        self.W_v = nn.Linear(d, self.n_kv_head * hs, bias=qkv_bias)
        self.W_o = nn.Linear(self.n_head * hs, d, bias=config.bias)
        # QK-norm: each head's q and k normalized (RMSNorm over d_h, one gain per coordinate)
        self.q_norm = nn.RMSNorm(hs, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(hs, eps=config.norm_eps) if config.qk_norm else None
        # value embeddings: how much of the token's value vector this layer adds to v
        self.ve_weight = nn.Parameter(torch.ones(1)) if config.value_embed else None
        self.implementation = config.attention
        self.tile_size = config.tile_size
        self.window = config.layer_window(layer)  # this layer's: Gemma's whole-context layers have none
        # Gemma's query_pre_attn_scalar in place of d_h; None: the kernels' own 1 / sqrt(d_h)
        self.scale = None if config.attn_scale_dim is None else config.attn_scale_dim ** -0.5
        self.softcap = config.attn_softcap
        self.dropout = config.dropout

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None = None,
        key_mask: Tensor | None = None,
        kv_cache: KVCacheLayer | None = None,
        need_weights: bool = False,
        ve: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, T, d) -> (y (B, T, d), attention weights (B, nh, T, T_k) if ``need_weights`` else None).

        ``rope`` is the (cos, sin) pair of `RotaryPositions` for these T positions; ``key_mask``
        covers all T_k keys (cached ones included); ``need_weights`` runs the reference implementation,
        the only one that forms the weights.
        """
        B, T, _ = x.shape
        hs = self.head_dim
        q = self.W_q(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.W_k(x).view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, n_kv, T, hs)
        v = self.W_v(x)  # (B, T, n_kv * hs)
        if self.ve_weight is not None and ve is not None:
            v = v + self.ve_weight * ve  # the token's own value vector, shared by all layers
        v = v.view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, n_kv, T, hs)
        if self.q_norm is not None:
            # each head's vectors to RMS 1, times the gains; the gains in q's dtype, so that under
            # bfloat16 autocast the fused kernel still applies
            q = F.rms_norm(q, (hs,), self.q_norm.weight.to(q.dtype), self.q_norm.eps)
            k = F.rms_norm(k, (hs,), self.k_norm.weight.to(k.dtype), self.k_norm.eps)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # (B, n_kv, T_k, hs), the stored positions then these T
        # a sliding window: only the last keys matter (a decoding step keeps W of them, a full pass all)
        k, v, key_mask, window = window_keys(k, v, key_mask, T, self.window)
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        scale, cap = self.scale, self.softcap
        if need_weights:
            y, weights = reference_attention(q, k, v, key_mask, dropout_p, return_weights=True, window=window,
                                             scale=scale, softcap=cap)
        elif self.implementation == "sdpa" and cap is None:  # the fused kernel has no place for a cap
            y = sdpa_attention(q, k, v, key_mask, dropout_p, window, scale)
        elif self.implementation == "tiled":
            y = tiled_attention(q, k, v, key_mask, dropout_p, self.tile_size, window, scale, cap)
        else:
            y = reference_attention(q, k, v, key_mask, dropout_p, window=window, scale=scale, softcap=cap)
        # concatenate the heads: position t's row is (head_1 output, ..., head_nh output)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * hs)  # (B, T, nh * hs)
        return self.W_o(y), weights  # (B, T, d)
