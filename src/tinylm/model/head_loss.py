"""The output head and the next-token loss in one pass, a slice of positions at a time.

Training needs only the loss, sum over positions of -log softmax(u_t)[x_t] with u_t = h_t W_head^T,
and its gradient. Written plainly (``lm_head`` then ``F.cross_entropy``), the whole (N, |V|) matrix
of logits exists several times over: in the matmul's dtype, in float32, as log-probabilities and
as their gradient. With |V| = 8192 and N = 4096 positions a step that is 134 MB a copy; on a CPU
the sliced form also makes a bfloat16 step faster (`benchmarks/train_step.py` measures it). `head_loss` takes
the rows a slice at a time (``chunk``
positions), and for each slice computes the logits, the loss and, at once, the gradient of the
loss with respect to the logits:

    d loss / d u_t = softmax(u_t) - onehot(x_t)

from which the gradients of h (g W) and of W_head (g^T h) follow by two matmuls. Nothing of size
(N, |V|) is kept; the backward pass only scales the two stored gradients by the incoming one.

With a logit soft-cap c, the scored logits are c tanh(u / c), and the chain rule adds a factor
1 - tanh(u / c)^2. Matmuls run in ``compute_dtype`` (bfloat16 under autocast, as ``lm_head`` would),
the softmax and the sums in float32. A target equal to `IGNORE_INDEX` contributes nothing. The
weight's gradient is taken from the weight as it is during the forward pass (as it is in training,
where the optimizer steps after the backward pass).

`next_token_loss` is the plain form, from logits every model family already has: the one loss
that training, evaluation and each family's forward compute.

Usage::

    loss_sum = head_loss(h.flatten(0, 1), model.lm_head.weight, targets.flatten(), torch.bfloat16)
    loss_sum.backward()
    loss = next_token_loss(logits, targets)       # logits (B, T, |V|), targets (B, T): the mean
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100  # a target with this id contributes nothing to the loss (PyTorch's convention)


# "none" computes the loss this many logits at a time (whole positions): the log-probabilities, as large as the
# logits, then exist a slice at a time (evaluation's peak), and each position's loss is the same number
SLICE_ELEMENTS = 1 << 23


def next_token_loss(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
    """-log softmax(u_t)[x_t] for logits u (B, T, |V|) and targets x (B, T), a target of `IGNORE_INDEX` left out:
    the mean over the targets that count ("mean"), their "sum", or "none": one per position (B*T,), 0 where
    left out."""
    logits, targets = logits.flatten(0, 1), targets.flatten()  # (N, |V|), (N,)
    if reduction != "none":
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction=reduction)
    rows = max(1, SLICE_ELEMENTS // max(1, logits.size(-1)))
    return torch.cat([F.cross_entropy(logits[start:start + rows], targets[start:start + rows],
                                      ignore_index=IGNORE_INDEX, reduction="none")
                      for start in range(0, max(logits.size(0), 1), rows)])  # no positions: one empty slice


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, softcap: float | None, compute_dtype: torch.dtype,
                chunk: int) -> Tensor:
        want_h, want_w = ctx.needs_input_grad[:2]  # both False under no_grad: the loss alone
        with torch.autocast(h.device.type, enabled=False):
            hc, wc = h.to(compute_dtype), weight.to(compute_dtype)  # (N, d), (|V|, d)
            acc = torch.promote_types(compute_dtype, torch.float32)  # softmax and sums: float32 at least
            grad_h = torch.empty(h.shape, dtype=compute_dtype, device=h.device) if want_h else None
            grad_w = torch.zeros(weight.shape, dtype=acc, device=h.device) if want_w else None
            total = torch.zeros((), dtype=acc, device=h.device)
            for start in range(0, h.size(0), chunk):
                rows = slice(start, start + chunk)
                u = (hc[rows] @ wc.T).to(acc)  # (n, |V|) logits of this slice
                if softcap is not None:
                    t = torch.tanh(u / softcap)
                    u = softcap * t
                y = targets[rows]
                keep = y != IGNORE_INDEX  # (n,)
                y_safe = torch.where(keep, y, torch.zeros_like(y))
                picked = u.gather(1, y_safe[:, None]).squeeze(1)  # (n,) the targets' logits
                # softmax in place of the logits: e = exp(u - max), p = e / sum(e); lse = log(sum) + max
                top = u.amax(dim=-1, keepdim=True)  # (n, 1)
                g = u.sub_(top).exp_()
                total_exp = g.sum(dim=-1, keepdim=True)  # (n, 1)
                lse = (total_exp.log() + top).squeeze(1)  # (n,)
                total += torch.where(keep, lse - picked, torch.zeros_like(lse)).sum()
                if not (want_h or want_w):
                    continue
                g.div_(total_exp)  # softmax(u)
                g[torch.arange(g.size(0), device=g.device), y_safe] -= 1.0
                g.mul_(keep[:, None])
                if softcap is not None:
                    g.mul_(1.0 - t * t)
                g = g.to(compute_dtype)
                if want_h:
                    grad_h[rows] = g @ wc
                if want_w:
                    grad_w += g.T @ hc[rows]
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        grad_h, grad_w = ctx.saved_tensors  # None where forward had no gradient to take
        h_dtype, w_dtype = ctx.dtypes
        dh = (grad_h.to(h_dtype) * grad_out).to(h_dtype) if grad_h is not None else None
        dw = (grad_w * grad_out).to(w_dtype) if grad_w is not None else None
        return dh, dw, None, None, None, None


def head_loss(h: Tensor, weight: Tensor, targets: Tensor, compute_dtype: torch.dtype = torch.float32,
              softcap: float | None = None, chunk: int = 256) -> Tensor:
    """The summed next-token loss of hidden states ``h`` (N, d) under head ``weight`` (|V|, d).

    Equal to ``F.cross_entropy(softcap(h @ weight.T), targets, ignore_index=-100, reduction="sum")``
    up to rounding, with the same gradients, without storing the (N, |V|) logits.
    """
    if h.dim() != 2 or targets.shape != h.shape[:1]:
        raise ValueError(f"head_loss takes h (N, d) and targets (N,), got {tuple(h.shape)} and {tuple(targets.shape)}")
    return _HeadLoss.apply(h, weight, targets, softcap, compute_dtype, chunk)
