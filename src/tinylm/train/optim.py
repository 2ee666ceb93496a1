"""The optimizer: AdamW (or SGD with momentum) with two parameter groups, decayed and not.

Weight decay pulls every weight toward zero a little at each step (AdamW: w <- w - lr * wd * w,
"decoupled" from the gradient; SGD: an L2 penalty added to the gradient). It is meant for the
matrices that *mix* coordinates: the rule here, as in nanoGPT, is

    decay      every parameter with 2 or more dimensions: the linear layers' weight matrices
               (W_q, W_k, W_v, W_o, the MLP's W_1, W_2, W_3, an untied head) and the embedding
               tables (E, learned positions)
    no decay   every 1-dimensional parameter: norm gains (LayerNorm/RMSNorm weight), LayerNorm
               and linear biases

Why not the vectors: a norm's gain sets the scale of a whole coordinate and a bias an offset;
shrinking them toward 0 does not make the function simpler, it only fights the normalization.
A tied output head is the embedding E itself, listed (and decayed) once.

`parameter_groups` returns the names too, so the choice can be printed and tested.
"""

from __future__ import annotations

import torch
from torch import nn

from tinylm.config import TrainConfig
from tinylm.errors import TinyLMError


def parameter_groups(model: nn.Module) -> tuple[list[str], list[str]]:
    """The names of the trainable parameters that get weight decay, and of those that don't."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # named_parameters lists a shared (tied) tensor once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(name)
    return decay, no_decay


def make_optimizer(model: nn.Module, config: TrainConfig, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW or SGD over ``model``'s parameters in two groups (see the module docstring).

    The learning rate is set by the training loop before every step (`lr_at`), so the value
    given here is only the starting one. ``fused`` picks PyTorch's fused CUDA kernel for AdamW.
    """
    params = dict(model.named_parameters())
    decay, no_decay = parameter_groups(model)
    groups = [
        {"params": [params[n] for n in decay], "weight_decay": config.weight_decay},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
    ]
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=1e-8,
                                 fused=fused or None)
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)
    raise TinyLMError(f"unknown optimizer {config.optimizer!r}; expected adamw or sgd")


def _parameter_order(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of the parameter behind each index of ``optimizer.state_dict()`` (group by group)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` keyed by parameter name instead of position.

    This is the form FSDP's state-dict helpers use too, so a checkpoint's optimizer state reads
    the same whether it was written by one process, DDP or FSDP, and can be resumed by any.
    """
    sd = optimizer.state_dict()
    order = _parameter_order(model, optimizer)
    return {
        "state": {order[i]: entry for i, entry in sd["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]],
    }


def load_named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """The inverse of `named_optimizer_state`: load name-keyed state into ``optimizer``."""
    index = {name: i for i, name in enumerate(_parameter_order(model, optimizer))}
    try:
        optimizer.load_state_dict({
            "state": {index[name]: entry for name, entry in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
        })
    except (KeyError, ValueError) as e:
        raise TinyLMError(f"the saved optimizer state does not fit this model and optimizer ({e}); "
                          "resume with the run's own settings") from None
