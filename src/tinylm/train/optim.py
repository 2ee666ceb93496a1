"""The optimizer: AdamW, SGD with momentum, or Muon for the hidden matrices beside AdamW for the rest.

Every trainable parameter falls in one of four roles (`parameter_roles`):

    embedding  the tables of `nn.Embedding` modules: the token embedding E (and so a tied head),
               learned positions, value and bigram embeddings
    head       an untied output head, ``lm_head.weight``
    matrix     every other parameter with 2 or more dimensions: the blocks' W_q, W_k, W_v, W_o,
               the MLP's W_1, W_2, W_3 (an RNN's or LSTM's weight matrices)
    vector     every 1-dimensional parameter: norm gains, biases, the per-layer scalars
    router     a Mixture of Experts' router matrices W_r (E x d): AdamW at ``lr`` even under Muon
               (`tinylm.model.moe`; the experts' W_1, W_2, W_3 are matrices like the dense MLP's)
    adapter    a LoRA run's A matrices and new-token rows (everything else is frozen there:
               `tinylm.model.lora`), and its B matrices (``adapter_B``), at ``lora_b_lr_ratio`` times
               the rate (LoRA+)

**Weight decay** pulls every weight toward zero a little at each step (AdamW: w <- w - lr * wd * w,
"decoupled" from the gradient; SGD: an L2 penalty added to the gradient). It is meant for the
parameters that *mix* coordinates (embeddings, head, matrices) and never for the vectors: a norm's
gain sets the scale of a whole coordinate and a bias an offset; shrinking them toward 0 does not
make the function simpler, it only fights the normalization.

**Learning rates per role.** ``lr`` is the peak rate of the matrices and vectors (AdamW, SGD), of
the embeddings unless ``embed_lr`` is set, and of an untied head unless ``head_lr`` is set.

**Muon** (``optimizer = "muon"``; Jordan et al., 2024) trains the matrices with PyTorch's own
`torch.optim.Muon`: the momentum of the gradient is orthogonalized by a few Newton-Schulz
iterations (every singular value pushed to about 1) before the step, so a matrix moves by the same
amount in every direction its gradient points in, instead of mostly along the few directions
that dominate it. It is meant for hidden weight matrices only; the embeddings (a lookup, not a
linear map on a dense input), the head and the vectors stay with AdamW, each group at its own rate
(``muon_lr`` for the matrices). The two optimizers step together as one `OptimizerChain`.

Every group records its peak rate as ``peak_lr``; the training loop sets each group's ``lr`` to
the schedule's value for that peak before every step (`set_schedule`), so warmup and decay apply
to all groups alike, each floor at the same fraction of its own peak.

Usage::

    optimizer = make_optimizer(model, config.train)
    set_schedule(optimizer, lambda peak: peak / 2)        # every group at half its peak rate
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tinylm.config import TrainConfig
from tinylm.errors import TinyLMError

ROLES = ("embedding", "head", "matrix", "vector", "adapter", "adapter_B", "router")


def parameter_roles(model: nn.Module) -> dict[str, str]:
    """Each trainable parameter's name -> its role: embedding, head, matrix or vector (module docstring)."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(model, "lm_head", None)
    head_id = id(head.weight) if isinstance(head, nn.Linear) else None
    roles = {}
    for name, p in model.named_parameters():  # named_parameters lists a shared (tied) tensor once
        if not p.requires_grad:
            continue
        if name.endswith(".lora_B"):
            roles[name] = "adapter_B"
        elif name.endswith((".lora_A", ".lora_rows")):
            roles[name] = "adapter"
        elif id(p) in embedding_ids:
            roles[name] = "embedding"
        elif id(p) == head_id:
            roles[name] = "head"
        elif name.endswith(".router.weight"):
            roles[name] = "router"
        else:
            roles[name] = "matrix" if p.dim() >= 2 else "vector"
    return roles


def parameter_groups(model: nn.Module) -> tuple[list[str], list[str]]:
    """The names of the trainable parameters that get weight decay, and of those that don't."""
    roles = parameter_roles(model)
    return [n for n, r in roles.items() if r != "vector"], [n for n, r in roles.items() if r == "vector"]


class OptimizerChain:
    """Several optimizers stepped as one: ``param_groups`` lists all their groups, in order.

    What the training loop uses of an optimizer (``step``, ``zero_grad``, ``param_groups``); the
    checkpoints go through `optimizers_of`, each optimizer keeping its own state for its own parameters.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def optimizers_of(optimizer: torch.optim.Optimizer | OptimizerChain) -> list[torch.optim.Optimizer]:
    """The plain optimizers behind ``optimizer`` (itself, or a chain's members)."""
    return list(optimizer.optimizers) if isinstance(optimizer, OptimizerChain) else [optimizer]


def _groups(model: nn.Module, config: TrainConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    """(optimizer kind, param group) pairs; parameters of equal settings share one group, in model order."""
    roles = parameter_roles(model)
    params = dict(model.named_parameters())
    muon = config.optimizer == "muon"
    fallback = "adamw" if muon else config.optimizer
    settings = {
        "embedding": (fallback, config.embed_lr or config.lr, config.weight_decay),
        "head": (fallback, config.head_lr or config.lr, config.weight_decay),
        "matrix": ("muon", config.muon_lr,
                   config.weight_decay if config.muon_weight_decay is None else config.muon_weight_decay)
        if muon else (fallback, config.lr, config.weight_decay),
        "vector": (fallback, config.lr, 0.0),
        # a few logits a token, whose every direction Muon would move as far as the largest: AdamW at lr
        "router": (fallback, config.lr, config.weight_decay),
        # thin low-rank factors, not hidden matrices for Muon to orthogonalize: AdamW (or SGD) at lr
        "adapter": (fallback, config.lr, config.weight_decay),
        "adapter_B": (fallback, config.lr * config.lora_b_lr_ratio, config.weight_decay),  # LoRA+ when the ratio > 1
    }
    groups: dict[tuple[str, float, float], dict[str, Any]] = {}
    for name, role in roles.items():
        kind, lr, wd = settings[role]
        group = groups.setdefault((kind, lr, wd), {"params": [], "lr": lr, "peak_lr": lr, "weight_decay": wd,
                                                   "roles": []})
        group["params"].append(params[name])
        if role not in group["roles"]:
            group["roles"].append(role)
    for (kind, _, _), group in groups.items():
        group["roles"] = ",".join(group["roles"])
        yield kind, group


def make_optimizer(model: nn.Module, config: TrainConfig, fused: bool = False) -> torch.optim.Optimizer | OptimizerChain:
    """AdamW, SGD, or Muon with AdamW, over ``model``'s parameters in groups by role (module docstring).

    The learning rate is set by the training loop before every step (`set_schedule`), so the
    value given here is only the starting one. ``fused`` picks PyTorch's fused AdamW kernel.
    """
    if config.optimizer not in ("adamw", "sgd", "muon"):
        raise TinyLMError(f"unknown optimizer {config.optimizer!r}; expected adamw, sgd or muon")
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for kind, group in _groups(model, config):
        by_kind.setdefault(kind, []).append(group)
    optimizers = []
    if "muon" in by_kind:
        optimizers.append(torch.optim.Muon(by_kind["muon"], lr=config.muon_lr, momentum=config.muon_momentum,
                                           nesterov=True, adjust_lr_fn=config.muon_adjust_lr))
    if "adamw" in by_kind:
        optimizers.append(torch.optim.AdamW(by_kind["adamw"], lr=config.lr, betas=(config.beta1, config.beta2),
                                            eps=1e-8, fused=fused or None))
    if "sgd" in by_kind:
        optimizers.append(torch.optim.SGD(by_kind["sgd"], lr=config.lr, momentum=config.momentum))
    return optimizers[0] if len(optimizers) == 1 else OptimizerChain(optimizers)


def set_schedule(optimizer: torch.optim.Optimizer | OptimizerChain, rate: Callable[[float], float],
                 muon_momentum: float | None = None) -> None:
    """Every group's ``lr`` to ``rate(peak_lr)``; Muon's groups' momentum to ``muon_momentum`` if given."""
    for opt in optimizers_of(optimizer):
        for group in opt.param_groups:
            group["lr"] = rate(group["peak_lr"])
            if muon_momentum is not None and isinstance(opt, torch.optim.Muon):
                group["momentum"] = muon_momentum


def _parameter_order(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of the parameter behind each index of ``optimizer.state_dict()`` (group by group)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerChain) -> dict:
    """``optimizer.state_dict()`` keyed by parameter name instead of position.

    This is the form FSDP's state-dict helpers use too, so a checkpoint's optimizer state reads
    the same whether it was written by one process, DDP or FSDP, and can be resumed by any. A
    chain's optimizers write their groups one after another, each group naming its parameters.
    """
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for opt in optimizers_of(optimizer):
        sd = opt.state_dict()
        order = _parameter_order(model, opt)
        state.update({order[i]: entry for i, entry in sd["state"].items()})
        groups += [{**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerChain,
                               state: dict) -> None:
    """The inverse of `named_optimizer_state`: load name-keyed state into ``optimizer``."""
    saved_groups = list(state["param_groups"])
    try:
        for opt in optimizers_of(optimizer):
            mine, saved_groups = saved_groups[:len(opt.param_groups)], saved_groups[len(opt.param_groups):]
            index = {name: i for i, name in enumerate(_parameter_order(model, opt))}
            names = [n for g in mine for n in g["params"]]
            peaks = [g["peak_lr"] for g in opt.param_groups]  # the configuration's rates, not the saved ones
            opt.load_state_dict({
                "state": {index[n]: state["state"][n] for n in names if n in state["state"]},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in mine],
            })
            for group, peak in zip(opt.param_groups, peaks):
                group["peak_lr"] = peak
        if saved_groups:
            raise ValueError(f"{len(saved_groups)} parameter groups more than this optimizer has")
    except (KeyError, ValueError) as e:
        raise TinyLMError(f"the saved optimizer state does not fit this model and optimizer ({e}); "
                          "resume with the run's own settings") from None
