"""A Mixture-of-Experts MLP: E expert MLPs behind a router, each token sent through the k it scores highest.

For one position's vector x (a row, d numbers), with E experts MLP_1..MLP_E (each an `MLP` of the
block's kind, of hidden width d_e = ``moe_d_ff``) and the router matrix W_r (d x E):

    z = x W_r                                   router logits, one per expert
    softmax router:  p = softmax(z)             Mixtral, Qwen2-MoE, OLMoE
    sigmoid router:  p = sigmoid(z)             each score on its own (DeepSeek-V3)
    S = the k experts with the largest p_i + b_i  (b: the balancing bias, zero unless moe_balance = "bias")
    g_i = p_i / sum_{j in S} p_j  for i in S    the gate weights (norm_topk; else g_i = p_i)
    y = sum_{i in S} g_i MLP_i(x)  (+ MLP_shared(x), the shared expert every token goes through)

So a token does k experts' work (and the shared one's) out of E: the parameters grow E times, the
FLOPs per token do not. ``moe_d_ff`` defaults to d_ff / (k + shared), so that a token does the
dense MLP's multiply-adds (`tinylm.config.GPTConfig.moe_hidden_dim`).

**Keeping the load even.** Left alone a router tends to collapse onto a few experts (they get
better because they get the tokens, and get the tokens because they are better). Two remedies:

- ``moe_balance = "aux"`` (Switch Transformer, Mixtral, OLMoE): the loss gets
  ``moe_aux_weight * E sum_i f_i P_i``, f_i the fraction of the step's token-slots (N k of them)
  routed to expert i and P_i the mean router probability of expert i (the sigmoid router's
  scores normalised to sum to 1 first). f is counted, so the gradient flows through P; the term
  is 1 when both are even (1/E each) and up to E when one expert takes everything. (Hugging
  Face's `load_balancing_loss_func` counts f per slot of the top k, so its value is k times this.)
- ``moe_balance = "bias"`` (DeepSeek-V3's auxiliary-loss-free balancing): a per-expert bias b is
  added to the scores *for choosing* the experts only, never to the gate weights; after each
  optimizer step b_i <- b_i + rate * sign(mean_j c_j - c_i), c_i the token-slots expert i got in
  the step (over every process). The bias is a buffer: saved in checkpoints, outside autograd.

Either way the router z-loss ``moe_z_weight * mean_tokens (logsumexp z)^2`` (ST-MoE) keeps the
logits small. Both losses are those of the last training forward pass (`MoE.aux_loss`,
`MoE.z_loss`); the training loop adds them to the loss (`tinylm.train.moe`).

**Two implementations, one function** (``moe_dispatch``, pinned equal by the tests):

- reference: a loop over the experts, each taking the tokens routed to it;
- fast: the N k (token, expert) pairs sorted by expert, their rows gathered once, each matrix
  applied to its expert's run of rows (`grouped_linear`: a product per expert's run, or PyTorch's
  ``F.grouped_mm`` in one call, which measured slower in a whole step), the results scattered back.

Usage::

    moe = MoE(GPTConfig(d_model=64, n_head=4, moe_experts=8, moe_top_k=2))
    y = moe(x)                                     # x, y: (B, T, d)
    moe.aux_loss, moe.z_loss, moe.step_counts      # after a training forward pass
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.config import GPTConfig
from tinylm.model.mlp import MLP, mlp_activation


class Routing(NamedTuple):
    """Where each of N tokens goes: its k experts (N, k), their gate weights (N, k) and every expert's score (N, E)."""

    experts: Tensor
    gates: Tensor
    scores: Tensor


def route(logits: Tensor, top_k: int, router: str = "softmax", bias: Tensor | None = None,
          normalize: bool = True) -> Routing:
    """The k experts of each row of router ``logits`` (N, E) and their gate weights (module docstring).

    Scores p = softmax(z) or sigmoid(z) (float32); the experts chosen are the k largest p + ``bias``;
    the gate weights are their p, divided by the sum over the k when ``normalize``.
    """
    z = logits.float()
    scores = torch.softmax(z, dim=-1) if router == "softmax" else torch.sigmoid(z)  # (N, E)
    choose_by = scores if bias is None else scores + bias  # the bias picks, it never weighs
    experts = choose_by.topk(top_k, dim=-1).indices  # (N, k)
    gates = scores.gather(-1, experts)  # (N, k)
    if normalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return Routing(experts, gates, scores)


def expert_counts(experts: Tensor, n_experts: int) -> Tensor:
    """How many token-slots each expert got: (E,) counts of the ids in ``experts`` (N, k)."""
    return torch.bincount(experts.flatten(), minlength=n_experts)


def load_balance_loss(routing: Routing, n_experts: int, router: str = "softmax") -> Tensor:
    """E sum_i f_i P_i: f_i the fraction of token-slots routed to expert i, P_i its mean router probability.

    1 when the loads and the probabilities are even; the sigmoid router's scores are normalised to
    sum to 1 per token before P is taken. Only P carries a gradient.
    """
    f = expert_counts(routing.experts, n_experts).float() / routing.experts.numel()  # (E,), sums to 1
    probs = routing.scores if router == "softmax" else routing.scores / routing.scores.sum(-1, keepdim=True)
    P = probs.mean(dim=0)  # (E,)
    return n_experts * (f * P).sum()


def router_z_loss(logits: Tensor) -> Tensor:
    """The mean over tokens of logsumexp(z)^2 (ST-MoE's z-loss): small router logits."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def bias_update(bias: Tensor, counts: Tensor, rate: float) -> None:
    """b_i <- b_i + rate * sign(mean_j c_j - c_i), in place: an under-loaded expert is chosen more next step."""
    counts = counts.to(bias.device, torch.float32)
    bias.add_(rate * torch.sign(counts.mean() - counts))


def load_cv(counts: Tensor) -> float:
    """The coefficient of variation of the experts' loads, std / mean (0: even; sqrt(E - 1): one expert takes all)."""
    loads = counts.double()
    mean = loads.mean()
    return float(loads.std(unbiased=False) / mean) if mean > 0 else 0.0


def grouped_linear(x: Tensor, weight: Tensor, bias: Tensor | None, counts: Tensor, rows_expert: Tensor,
                   method: str = "auto") -> Tensor:
    """Rows sorted by expert times their expert's matrix: x (M, in), weight (E, out, in), counts (E,) -> (M, out).

    Rows counts[0] first belong to expert 0, the next counts[1] to expert 1, ...; ``rows_expert``
    (M,) names each row's expert (for the biases). ``method``: "split" (a product per expert),
    "grouped_mm" (one call of ``F.grouped_mm``, on a CPU where its kernel takes the shapes: rows a
    multiple of 16 bytes; split elsewhere) or "auto", which is split: a whole training step of the
    default model with 8 experts, top 2, on two cores took 1.46x the dense step's time with split
    and 1.68x with grouped_mm (`benchmarks/moe_step.py`, medians of 9), though grouped_mm alone
    multiplies faster.
    """
    if method == "auto" or (method == "grouped_mm" and not _grouped_mm_takes(x, weight)):
        method = "split"
    if method == "grouped_mm":
        offsets = counts.cumsum(0).to(torch.int32)  # where each expert's rows end
        y = F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)  # (M, out)
    else:
        parts = x.split(counts.tolist())
        y = torch.cat([F.linear(part, w) for part, w in zip(parts, weight)])  # (M, out)
    return y if bias is None else y + bias[rows_expert]


def _grouped_mm_takes(x: Tensor, weight: Tensor) -> bool:
    # The CPU kernel wants every row of x, W and the gradients to start on a 16-byte boundary.
    step = 16 // x.element_size()
    return (hasattr(F, "grouped_mm") and x.device.type == "cpu" and x.dtype == weight.dtype
            and x.size(-1) % step == 0 and weight.size(1) % step == 0)


class MoE(nn.Module):
    """The Mixture-of-Experts MLP of a block (module docstring): ``router``, ``experts``, optionally ``shared``.

    Parameter names follow the dense MLP, so an expert maps one to one onto Mixtral's and
    Qwen2-MoE's: ``router.weight`` (E, d) is W_r^T (their ``gate``), ``experts.{i}.W_1`` / ``W_3`` /
    ``W_2`` (gate_proj / up_proj / down_proj, Mixtral's w1 / w3 / w2), ``shared.W_*`` the shared
    expert. ``bias`` (E,) is DeepSeek-V3's selection bias, zero and unused unless moe_balance is "bias".
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d_e = config.moe_hidden_dim
        self.n_experts, self.top_k = config.moe_experts, config.moe_top_k
        self.router_kind, self.normalize = config.moe_router, config.moe_norm_topk
        self.balance, self.dispatch = config.moe_balance, config.moe_dispatch
        self.kind, self.gated = config.mlp, config.gated
        self.router = nn.Linear(config.d_model, config.moe_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config, d_e) for _ in range(config.moe_experts))
        self.shared = MLP(config, d_e) if config.moe_shared_experts else None
        self.register_buffer("bias", torch.zeros(config.moe_experts))
        self.grouped = "auto"  # how the fast dispatch multiplies (`grouped_linear`); the benchmark sets it
        # what the training forward passes leave for the loop (`tinylm.train.moe`): the last pass's losses, and
        # the token-slots each expert got since the loop last took them. A plain attribute, not a buffer:
        # DDP would broadcast a buffer from process 0 at every forward pass.
        self.aux_loss: Tensor | None = None
        self.z_loss: Tensor | None = None
        self.step_counts: Tensor | None = None

    def all_experts(self) -> list[MLP]:
        """The routed experts, then the shared one if there is one."""
        return [*self.experts, *([self.shared] if self.shared is not None else [])]

    def route(self, x: Tensor) -> tuple[Tensor, Routing]:
        """The router logits (N, E) of rows ``x`` (N, d) and where they send each row."""
        logits = self.router(x)  # (N, E)
        bias = self.bias if self.balance == "bias" else None
        return logits, route(logits, self.top_k, self.router_kind, bias, self.normalize)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, d): every position on its own
        logits, routing = self.route(x)
        if self.training and torch.is_grad_enabled():
            self._record(logits, routing)
        if self.dispatch == "reference":
            y = self.reference_dispatch(x, routing)
        else:
            y = self.fast_dispatch(x, routing)
        if self.shared is not None:
            y = y + self.shared(x)
        return y.reshape(shape)  # (B, T, d)

    def _record(self, logits: Tensor, routing: Routing) -> None:
        """Keep this training pass's balancing losses and add its counts to ``step_counts``."""
        counts = expert_counts(routing.experts.detach(), self.n_experts)
        self.step_counts = counts if self.step_counts is None else self.step_counts + counts
        self.aux_loss = load_balance_loss(routing, self.n_experts, self.router_kind) if self.balance == "aux" else None
        self.z_loss = router_z_loss(logits)

    def reference_dispatch(self, x: Tensor, routing: Routing) -> Tensor:
        """y = sum over the chosen experts of g_i MLP_i(x), one expert at a time over the tokens it was given."""
        y = None
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(routing.experts == e)  # the tokens that chose e, and in which of their k slots
            # an expert no token chose still runs (on no rows): its weights get a zero gradient, as DDP expects
            out = expert(x[token]) * routing.gates[token, slot, None]  # (n_e, d)
            y = torch.zeros_like(x, dtype=out.dtype) if y is None else y
            y.index_add_(0, token, out)
        return y  # (N, d)

    def fast_dispatch(self, x: Tensor, routing: Routing) -> Tensor:
        """The same sum with the (token, expert) pairs sorted by expert and each matrix applied once per group."""
        N, k = routing.experts.shape
        chosen = routing.experts.flatten()  # (N k): pair j is token j // k going to expert chosen[j]
        order = chosen.argsort(stable=True)  # the pairs grouped by expert
        token, rows_expert = order // k, chosen[order]  # (N k) each, in sorted order
        counts = expert_counts(chosen, self.n_experts)  # (E,)
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        rows = x[token].to(dtype)  # (N k, d)
        # W_1 and W_3 of an expert stacked as one (2 d_e, d) matrix: one grouped product makes both
        W_up = torch.stack([torch.cat([e.W_1.weight, e.W_3.weight]) if self.gated else e.W_1.weight
                            for e in self.experts]).to(dtype)  # (E, d_e or 2 d_e, d)
        b_up = None
        if self.experts[0].W_1.bias is not None:
            b_up = torch.stack([torch.cat([e.W_1.bias, e.W_3.bias]) if self.gated else e.W_1.bias
                                for e in self.experts]).to(dtype)
        a = grouped_linear(rows, W_up, b_up, counts, rows_expert, self.grouped)  # (N k, d_e or 2 d_e)
        hidden = mlp_activation(self.kind, *(a.chunk(2, dim=-1) if self.gated else (a,)))  # (N k, d_e)
        W_down = torch.stack([e.W_2.weight for e in self.experts]).to(dtype)  # (E, d, d_e)
        b_down = (torch.stack([e.W_2.bias for e in self.experts]).to(dtype)
                  if self.experts[0].W_2.bias is not None else None)
        out = grouped_linear(hidden, W_down, b_down, counts, rows_expert, self.grouped)  # (N k, d)
        out = out * routing.gates.flatten()[order, None]  # each pair weighted by its gate
        return torch.zeros(N, x.size(-1), dtype=out.dtype, device=x.device).index_add_(0, token, out)  # (N, d)
