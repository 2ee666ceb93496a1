"""One forward pass of a Transformer, step by step, in row-vector notation (vectors on the left: q = h W^Q).

    from tinylm.explain.forward import trace_forward, format_trace, two_token_loss
    trace = trace_forward(run.model, ids, position=3)
    print(format_trace(trace))       # x, h = E[x], then per layer q, k, v, scores, M, softmax, output, ...

The numbers are read off the real model while it runs: forward hooks on its modules (E, the
norms, W^Q, W^K, W^V, the attention and MLP sublayers, the head) record what each one computed
during one ``model(ids)`` call, so the logits printed are the model's own. Only the inside of one
head's attention, which the fused kernels never form, is recomputed from the recorded q and k:
scores q_t k_j^T / sqrt(d_h) (after QK-norm and RoPE where the model has them), the mask row M[t]
and the softmax. The loss at the end is the mean next-token cross-entropy over the text, as
``model(ids[:-1], targets=ids[1:])`` computes it.

`two_token_loss` is the smallest worked loss: |V| = 3, data (x_1, x_2) = (token 1, token 2),
logits u_1 = (2, 1, -1) and u_2 = (0, 1, 1): -log 0.705 + -log 0.422 = 0.349 + 0.862 = 1.211 nats,
0.606 per token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.config import FAMILY_NAMES
from tinylm.errors import TinyLMError
from tinylm.model.gpt import GPT
from tinylm.model.positions import apply_rope

SHOWN = 4  # how many numbers of a vector to print


@dataclass
class Step:
    """One line of the trace: a name, the formula, the tensor's shape, and its values at the position shown."""

    name: str
    formula: str
    shape: tuple[int, ...]
    values: list[float]  # the row at position t (its first few numbers, or the whole row 0..t of scores)

    def report(self) -> dict:
        return {"name": self.name, "formula": self.formula, "shape": list(self.shape),
                "values": [x if math.isfinite(x) else ("-inf" if x < 0 else "inf") for x in self.values]}


@dataclass
class ForwardTrace:
    """A traced forward pass: the steps in order, the full logits (T, |V|) and the loss."""

    ids: list[int]
    position: int
    head: int
    steps: list[Step] = field(default_factory=list)
    logits: Tensor | None = None  # (T, |V|), exactly model(ids)'s
    loss: float = float("nan")  # mean cross-entropy of logits[t] against ids[t + 1]
    top_ids: list[int] = field(default_factory=list)  # the ids of the largest logits at t, the "logits u" values

    def report(self) -> dict:
        return {"ids": self.ids, "position": self.position, "head": self.head, "loss": self.loss,
                "top_ids": self.top_ids, "steps": [s.report() for s in self.steps]}


def _row(t: Tensor, n: int = SHOWN) -> list[float]:
    return [float(x) for x in t.flatten()[:n]]


@torch.no_grad()
def trace_forward(model: nn.Module, ids: Sequence[int], position: int | None = None, head: int = 0) -> ForwardTrace:
    """Run ``model`` once on ``ids`` and record every step, showing position ``position`` (default: the last)."""
    if not isinstance(model, GPT):
        family = getattr(getattr(model, "config", None), "family", None)
        what = f"{FAMILY_NAMES[family]} model" if family in FAMILY_NAMES else type(model).__name__
        raise TinyLMError(f"{what} has no Transformer forward pass to trace; `explain forward` is for Transformers")
    T, cfg = len(ids), model.config
    if not 1 <= T <= cfg.block_size:
        raise TinyLMError(f"the text is {T} tokens but the model's context is {cfg.block_size}; give a shorter text")
    t = T - 1 if position is None else position
    if not 0 <= t < T:
        raise TinyLMError(f"--position {position} is out of range: the text has positions 0..{T - 1}")
    if not 0 <= head < cfg.n_head:
        raise TinyLMError(f"--head {head} is out of range: the model has heads 0..{cfg.n_head - 1}")
    seen: dict[nn.Module, Tensor] = {}  # module -> its output (attention: the first of its pair)
    inputs: dict[nn.Module, Tensor] = {}  # block -> the residual stream entering it
    watched = [model.E, model.norm_f, model.lm_head] + ([model.pos_emb] if model.pos_emb is not None else [])
    for block in model.blocks:
        watched += [block.norm_1, block.norm_2, block.attn, block.attn.W_q, block.attn.W_k, block.attn.W_v, block.mlp]
    hooks = [m.register_forward_hook(lambda m, args, out: seen.__setitem__(m, out[0] if isinstance(out, tuple) else out))
             for m in watched]
    hooks += [b.register_forward_pre_hook(lambda m, args: inputs.__setitem__(m, args[0])) for b in model.blocks]
    was_training = model.training
    model.eval()
    try:
        idx = torch.tensor([list(ids)], dtype=torch.long, device=next(model.parameters()).device)  # (1, T)
        logits, _ = model(idx)  # (1, T, |V|)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    trace = ForwardTrace(list(ids), t, head)
    add = lambda name, formula, x: trace.steps.append(Step(name, formula, tuple(x.shape[1:]), _row(x[0, t])))  # noqa: E731
    trace.steps.append(Step("x", "the token ids x_0..x_{T-1}", (T,), [float(i) for i in ids]))
    add("E[x]", f"h = E[x_t]: row x_t of E ({cfg.vocab_size} x {cfg.d_model}), x_t = {ids[t]}", seen[model.E])
    if model.pos_emb is not None:
        add("P[t]", f"{cfg.positions} position vector, added: h = E[x_t] + P[t]", seen[model.pos_emb])
    for i, block in enumerate(model.blocks):
        _trace_block(trace, add, model, block, i, seen, inputs[block], T, t, head)
    if cfg.norm_position == "pre":
        add("norm_f(h)", f"the final {cfg.norm}", seen[model.norm_f])
    trace.logits = logits[0].float()  # (T, |V|)
    # the most likely ids, not the first ones: ids 0..3 are special or rare tokens whose logits say little
    top = torch.topk(trace.logits[t], min(SHOWN, cfg.vocab_size))
    trace.top_ids = [int(i) for i in top.indices]
    trace.steps.append(Step("logits u", f"u = h W_head ({cfg.d_model} x {cfg.vocab_size})"
                            + (f", then softcap {cfg.logit_softcap} tanh(u / cap)" if cfg.logit_softcap else "")
                            + f"; the {len(trace.top_ids)} largest, of ids {', '.join(map(str, trace.top_ids))}",
                            tuple(logits.shape[1:]), [float(v) for v in top.values]))
    p = torch.softmax(trace.logits[t], dim=-1)
    if t + 1 < T:
        nxt = ids[t + 1]
        trace.steps.append(Step("p(next)", f"softmax(u_t)[x_{t + 1}]: the probability of the next token {nxt}", (),
                                [float(p[nxt])]))
    if T > 1:
        target = torch.tensor(ids[1:], device=trace.logits.device)
        trace.loss = float(F.cross_entropy(trace.logits[:-1], target))
        trace.steps.append(Step("loss", f"mean over t < {T - 1} of -log softmax(u_t)[x_(t+1)]", (), [trace.loss]))
    return trace


def _trace_block(trace: ForwardTrace, add, model: GPT, block: nn.Module, i: int, seen: dict, h_in: Tensor,
                 T: int, t: int, head: int) -> None:
    """The steps of block ``i``: its norms, q, k, v, one head's scores, mask and softmax, and the residual adds."""
    attn, hs = block.attn, block.attn.head_dim
    L = f"[{i}]"
    add(f"h{L}", f"the residual stream entering layer {i}", h_in)
    x = seen[block.norm_1] if block.pre_norm else h_in  # what attention reads
    if block.pre_norm:
        add(f"norm_1{L}", "norm_1(h)", x)
    q = seen[attn.W_q].view(1, T, attn.n_head, hs).transpose(1, 2)  # (1, nh, T, hs)
    k = seen[attn.W_k].view(1, T, attn.n_kv_head, hs).transpose(1, 2)  # (1, n_kv, T, hs)
    add(f"q{L}", f"q = h W^Q, all heads ({attn.n_head} x {hs})", seen[attn.W_q])
    add(f"k{L}", "k = h W^K", seen[attn.W_k])
    add(f"v{L}", "v = h W^V", seen[attn.W_v])
    if attn.q_norm is not None:
        q = F.rms_norm(q, (hs,), attn.q_norm.weight, attn.q_norm.eps)
        k = F.rms_norm(k, (hs,), attn.k_norm.weight, attn.k_norm.eps)
    if model.rope is not None:
        cos, sin = model.rope(torch.arange(T, device=q.device)[None])
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kh = k[0, head // (attn.n_head // attn.n_kv_head)]  # (T, hs): this head's keys (shared in a group)
    scores = q[0, head] @ kh.T / math.sqrt(hs)  # (T, T)
    M = torch.zeros(T, T, device=q.device).masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1),
                                                       float("-inf"))  # (T, T)
    if attn.window is not None:
        M = M.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-attn.window), float("-inf"))
    rotated = " (after QK-norm)" if attn.q_norm is not None else ""
    rotated += " (q, k rotated by RoPE)" if model.rope is not None else ""
    trace.steps.append(Step(f"scores{L}", f"head {head}: q_t k_j^T / sqrt({hs}), j = 0..{T - 1}{rotated}",
                            (T, T), [float(s) for s in scores[t]]))
    trace.steps.append(Step(f"M{L}", "the mask row: 0 for j <= t, -inf for the future", (T, T),
                            [float(m) for m in M[t]]))
    weights = torch.softmax(scores + M, dim=-1)  # (T, T)
    trace.steps.append(Step(f"softmax{L}", f"head {head}: p_tj = softmax_j(scores + M), sums to 1", (T, T),
                            [float(w) for w in weights[t]]))
    a = seen[attn]  # (1, T, d)
    add(f"attn{L}", "attention output: (p V) of every head, concatenated, times W^O", a)
    if block.pre_norm:
        h_mid = h_in + a  # (1, T, d)
        add(f"h + attn{L}", "residual: h = h + attn(norm_1(h))", h_mid)
        add(f"norm_2{L}", "norm_2(h)", seen[block.norm_2])
        add(f"mlp{L}", f"MLP ({model.config.mlp})", seen[block.mlp])
        add(f"h + mlp{L}", "residual: h = h + mlp(norm_2(h))", h_mid + seen[block.mlp])
    else:
        add(f"norm_1{L}", "post-norm residual: h = norm_1(h + attn(h))", seen[block.norm_1])
        add(f"mlp{L}", f"MLP ({model.config.mlp})", seen[block.mlp])
        add(f"norm_2{L}", "post-norm residual: h = norm_2(h + mlp(h))", seen[block.norm_2])


def format_trace(trace: ForwardTrace) -> str:
    """The trace as aligned lines: name, shape, the values at position t, and the formula."""
    lines = [f"forward pass over {len(trace.ids)} tokens; the values are row t = {trace.position} "
             f"(first {SHOWN} numbers; scores, M and softmax: the whole row, head {trace.head})"]
    for s in trace.steps:
        values = s.values if s.name == "x" or s.name.startswith(("scores", "M[", "softmax")) else s.values[:SHOWN]
        text = ", ".join("-inf" if v == float("-inf") else f"{v:.4g}" if s.name != "x" else str(int(v)) for v in values)
        shape = "(" + ", ".join(map(str, s.shape)) + ("," if len(s.shape) == 1 else "") + ")"
        lines.append(f"{s.name:<14} {shape:<14} [{text}]  {s.formula}")
    return "\n".join(lines)


@dataclass
class TwoTokenLoss:
    """A worked loss: per-position probabilities of the right token, losses, their sum and mean."""

    logits: Tensor  # (2, 3)
    targets: Tensor  # (2,)
    probabilities: Tensor  # (2, 3): softmax of each row
    losses: Tensor  # (2,): -log softmax(u_t)[x_t]
    total: float
    mean: float

    def report(self) -> dict:
        return {"logits": self.logits.tolist(), "targets": self.targets.tolist(),
                "probabilities": self.probabilities.tolist(), "losses": self.losses.tolist(),
                "total": self.total, "mean": self.mean}


def two_token_loss(logits: Sequence[Sequence[float]] = ((2.0, 1.0, -1.0), (0.0, 1.0, 1.0)),
                   targets: Sequence[int] = (0, 1)) -> TwoTokenLoss:
    """The loss of two positions by `F.cross_entropy`, as `GPT.forward` computes it: 0.349 + 0.862 = 1.211."""
    u = torch.tensor(logits, dtype=torch.float64)  # (2, |V|)
    y = torch.tensor(targets)  # (2,)
    losses = F.cross_entropy(u, y, reduction="none")  # (2,)
    return TwoTokenLoss(u, y, torch.softmax(u, dim=-1), losses, float(losses.sum()), float(losses.mean()))


def format_two_token_loss(example: TwoTokenLoss) -> str:
    """The worked loss as text, to 3 decimals (tokens numbered from 1, as the data (x_1, x_2) is)."""
    lines = [f"|V| = {example.logits.size(1)}, data (x_1, x_2) = "
             f"({', '.join(str(int(y) + 1) for y in example.targets)}) (token numbers from 1)"]
    for t, (u, p, y, loss) in enumerate(zip(example.logits, example.probabilities, example.targets, example.losses), 1):
        lines.append(f"position {t}: u_{t} = ({', '.join(f'{x:g}' for x in u.tolist())}), softmax(u_{t}) = "
                     f"({', '.join(f'{x:.3f}' for x in p.tolist())}), loss -log {float(p[y]):.3f} = {float(loss):.3f}")
    lines.append(f"total {example.total:.3f} nats, mean {example.mean:.3f} per token "
                 f"(a uniform guess: log {example.logits.size(1)} = {math.log(example.logits.size(1)):.3f} per token)")
    return "\n".join(lines)
