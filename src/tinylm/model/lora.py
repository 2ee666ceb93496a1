"""LoRA: adapting a trained model by a low-rank correction to some of its matrices, the rest frozen.

Hu et al. (2021): instead of training a d_out x d_in matrix W, train two thin ones, A (r x d_in)
and B (d_out x r) with a rank r much smaller than either side, and compute with

    W' = W + (alpha / r) B A          y = x W'^T = x W^T + (alpha / r) ((x A^T) B^T)

W stays as it was (no gradient, no optimizer state); only A and B learn. B starts at zero, so before
the first step the model is exactly the one it adapts; A starts random (Kaiming-uniform, as PEFT
does), so B's first gradient is not zero. ``alpha / r`` keeps the size of the update about the same
when r changes. For GPT-2's 124M parameters at r = 8 on every projection that is about 1.3M numbers
to train and two AdamW moments for them, instead of 124M and 248M.

Which matrices (``targets``): a comma-separated list of `TARGET_GROUPS` names and tinylm projection names
(``W_q, W_k, W_v, W_o`` in attention, ``W_1, W_2, W_3`` in the MLP):

    attention   W_q, W_k, W_v, W_o
    mlp         W_1, W_2 and, in a gated MLP, W_3
    all         both (what PEFT calls "all-linear": the embeddings and the output head stay as they are)

The adapter is just the A and B of each target, named after the matrix it corrects
(``blocks.0.attn.W_q.lora_A``); `merge_adapter` folds it into a copy of the base's weights, which is how
tinylm samples, evaluates, serves and exports an adapted model (one model, no extra work per token).
`tinylm.export.peft` writes and reads the same adapter in PEFT's layout.

**Training in less memory** (`prepare_training`, which `tinylm.train.start.build_training_model` calls with
`LoraMemory.default`). Freezing drops the gradients and moments of the frozen weights; what a LoRA step still
holds is the frozen weights, the activations (each corrected matrix's input is kept for A's gradient, and every
other input the backward pass needs) and the head's logits. Three changes cut them; the first and the last
change no number the step computes, the second only how the loss's sums round:

- ``frozen_in_compute_dtype``: under bfloat16 autocast the blocks' frozen matrices and biases are kept in bfloat16.
  Autocast would cast them to bfloat16 at every step anyway (and keep each cast for the backward pass), so
  the products are the same bit for bit, and no float32 copy is kept beside them. A forward pass outside
  autocast (evaluation and sampling on a CPU run in float32) reads each float32 matrix back from where it
  was loaded (the base checkpoint, memory-mapped) as it multiplies by it, and computes as before.
- ``head_in_slices``: the head and the loss a slice of positions at a time in float32 too
  (`tinylm.model.head_loss`; bfloat16 autocast on a CPU already does), so no (B, T, |V|) logits are kept.
  Equal to the plain head and loss up to rounding.
- ``recompute_every``: every k-th block keeps only its input and runs its forward pass again in the backward
  pass (`torch.utils.checkpoint`, random state restored: the same dropout draws), instead of keeping its
  activations. It costs a second forward pass through those blocks.

Usage::

    add_lora(model, LoraSettings(rank=8, alpha=16, dropout=0.0, targets="all"))  # freezes the rest
    adapter = adapter_state(model)                        # {name: tensor}, only A and B
    merged = merge_adapter(base_state, adapter, settings.scale)
    prepare_training(model, LoraMemory.default(torch.bfloat16), torch.bfloat16, read_base)  # before training
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from tinylm.config.training import LORA_ATTENTION as ATTENTION
from tinylm.config.training import LORA_MLP as MLP
from tinylm.config.training import LORA_OUTER as OUTER
from tinylm.config.training import LORA_TARGET_GROUPS as TARGET_GROUPS
from tinylm.config.training import lora_target_names as target_names
from tinylm.errors import TinyLMError
from tinylm.model.memory import count_params, lora_params

LORA_A, LORA_B = "lora_A", "lora_B"  # the suffixes of an adapter's tensor names
LORA_ROWS = "lora_rows"  # new tokens' rows: a delta added to the last rows of the embedding and the head
ROWS_INFIX = ".parametrizations.weight.0."  # where torch's parametrization puts the delta in the state dict


@dataclass(frozen=True)
class LoraSettings:
    """What an adapter is: its rank r, alpha (the update is scaled by alpha / r), dropout on its input, targets."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: str = "all"
    new_tokens: int = 0  # the last this many token ids' embedding and head rows train too (`NewRows`)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, train_config) -> LoraSettings | None:
        """The settings a [train] table asks for, or None (``lora_rank = 0``: every weight trains)."""
        if not train_config.lora_rank:
            return None
        alpha = train_config.lora_alpha if train_config.lora_alpha is not None else 2.0 * train_config.lora_rank
        return cls(train_config.lora_rank, float(alpha), train_config.lora_dropout, train_config.lora_targets,
                   train_config.lora_new_tokens)


def target_modules(model: nn.Module, targets: str) -> dict[str, nn.Linear | nn.Embedding]:
    """The model's layers that ``targets`` names, by module name (``blocks.0.attn.W_q``, ``E``, ``lm_head``)."""
    names = target_names(targets)
    found = {name: m for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in names and name.startswith("blocks.")}
    outer = [name for name in OUTER if name in names]
    if outer and getattr(model.config, "tie_embeddings", False):
        raise TinyLMError(f"lora_targets {', '.join(outer)}: this model's head is its embedding (tied), which a "
                          "low-rank correction to one of them would split; leave E and lm_head out of lora_targets")
    found.update({name: getattr(model, name) for name in outer if hasattr(model, name)})
    if not found:
        raise TinyLMError(f"lora_targets {targets!r} names no matrix of this model (a Transformer's blocks hold "
                          f"{', '.join(ATTENTION + MLP)}); an LSTM or RNN is fine-tuned whole (lora_rank = 0)")
    return found


class LoRALinear(nn.Linear):
    """A frozen nn.Linear plus a trained low-rank correction: y = x W^T + b + scale * (dropout(x) A^T) B^T.

    ``weight`` and ``bias`` keep their names, so the base's state-dict names are unchanged and the adapter's are
    the matrix's own with ``.lora_A`` and ``.lora_B`` after them.
    """

    def __init__(self, base: nn.Linear, settings: LoraSettings) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same tensors: nothing is copied
        self.scale = settings.scale
        self.lora_dropout = nn.Dropout(settings.dropout) if settings.dropout else nn.Identity()
        dev, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Parameter(torch.empty(settings.rank, self.in_features, device=dev, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, settings.rank, device=dev, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear's (and PEFT's) default
        # with the frozen matrix kept in the compute dtype (`store_frozen_in`): that dtype, and how to read the
        # full-precision weight and bias back
        self._compute_dtype: torch.dtype | None = None
        self._read_full: Callable[[], tuple[Tensor, Tensor | None]] | None = None

    def store_frozen_in(self, dtype: torch.dtype, read_full: Callable[[], tuple[Tensor, Tensor | None]]) -> None:
        """Keep the frozen weight and bias in ``dtype`` only (autocast's compute dtype: the numbers it multiplies
        anyway); ``read_full()`` gives the full-precision ones back for a forward pass outside autocast."""
        self._full_dtype = self.weight.dtype  # the model's own (a base stored in another dtype was loaded as this)
        for param in (self.weight, self.bias):
            if param is not None:
                param.data = param.data.to(dtype)
        self._compute_dtype, self._read_full = dtype, read_full

    def _frozen(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """The frozen weight and bias to multiply ``x`` by: the stored ones, or, where they are kept in the compute
        dtype and this pass does not compute in it, the full-precision ones, read back for this pass alone (a
        float32 evaluation holds no second copy of the base)."""
        device = x.device.type
        if self._compute_dtype is None or x.dtype == self._compute_dtype or (
                torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == self._compute_dtype):
            return self.weight, self.bias
        weight, bias = (None if t is None else t.to(self.weight.device, self._full_dtype) for t in self._read_full())
        if not torch.equal(weight.to(self._compute_dtype), self.weight):
            raise TinyLMError("the base checkpoint's weights changed while its adapter was training; put the base "
                              "back as it was and resume the run")
        return weight, bias

    def forward(self, x: Tensor) -> Tensor:
        weight, bias = self._frozen(x)
        out = F.linear(x, weight, bias)  # (..., out)
        low = F.linear(self.lora_dropout(x), self.lora_A)  # (..., r)
        # out + scale * low B^T, added in place: no (..., out) temporary beside the output, which on a CPU left the
        # heap holding freed blocks (a higher peak than the arithmetic needs: benchmarks/lora_memory.py)
        flat = out.view(-1, self.out_features)
        flat.addmm_(low.reshape(-1, low.shape[-1]).to(out.dtype), self.lora_B.to(out.dtype).t(), alpha=self.scale)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scale={self.scale:g}"


class LoRAEmbedding(nn.Embedding):
    """A frozen token embedding plus a trained low-rank correction to its table: row x of E + scale * B A, where
    B (|V| x r) starts at zero and A (r x d) random, the same form as `LoRALinear`'s (W is |V| x d here), so that
    `merge_adapter` folds both alike. Looking up B's rows costs r numbers per token, not a |V| x d table."""

    def __init__(self, base: nn.Embedding, settings: LoraSettings) -> None:
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        self.padding_idx, self.max_norm, self.sparse = base.padding_idx, None, False
        self.norm_type, self.scale_grad_by_freq = 2.0, False
        self.weight = base.weight
        self.scale = settings.scale
        dev, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Parameter(torch.empty(settings.rank, self.embedding_dim, device=dev, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.num_embeddings, settings.rank, device=dev, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, idx: Tensor) -> Tensor:
        return F.embedding(idx, self.weight) + self.scale * (F.embedding(idx, self.lora_B) @ self.lora_A)


def head_weight(head: nn.Linear) -> Tensor:
    """The output head's weight as the model computes with it: with a LoRA correction, W + scale * B A (for the
    loss that reads the weight in slices instead of calling the layer)."""
    if isinstance(head, LoRALinear):
        return head.weight + head.scale * (head.lora_B @ head.lora_A)
    return head.weight


@dataclass(frozen=True)
class LoraMemory:
    """How a LoRA run trains in less memory (`prepare_training`; the module docstring says what each does)."""

    frozen_in_compute_dtype: bool = True  # under autocast, the frozen matrices stored in its dtype only
    head_in_slices: bool = True  # the head and loss a slice of positions at a time in float32 too (on a CPU)
    recompute_every: int = 0  # every k-th block's activations recomputed in the backward pass; 0: none

    @classmethod
    def default(cls, compute_dtype: torch.dtype | None) -> LoraMemory:
        """What training does: everything, except recomputing blocks in float32 (``compute_dtype`` None). There a
        block's forward pass costs so much of a LoRA step that recomputing every block made a step about as slow
        as full fine-tuning's, and recomputing fewer barely lowered the run's peak, which the evaluation's whole
        logits then set (`benchmarks/lora_memory.py` measures each choice)."""
        return cls(recompute_every=1 if compute_dtype is not None else 0)


def prepare_training(model: nn.Module, memory: LoraMemory, compute_dtype: torch.dtype | None,
                     read_base: Callable[[str], Tensor]) -> None:
    """Set up a model `add_lora` adapted to train as ``memory`` says, computing in ``compute_dtype`` (autocast's;
    None: float32). ``read_base(name)`` reads the base's tensor of that state-dict name in full precision (for
    the frozen matrices stored in the compute dtype)."""
    if memory.frozen_in_compute_dtype and compute_dtype is not None:
        for name, module in model.named_modules():
            # the blocks' matrices: a corrected head is read as W + scale B A in float32 before autocast (`head_weight`)
            if isinstance(module, LoRALinear) and name.startswith("blocks."):
                module.store_frozen_in(compute_dtype, functools.partial(_read_linear, read_base, name,
                                                                        module.bias is not None))
    if memory.recompute_every:
        recompute_blocks(model, memory.recompute_every)


def _read_linear(read_base: Callable[[str], Tensor], name: str, has_bias: bool) -> tuple[Tensor, Tensor | None]:
    return read_base(f"{name}.weight"), read_base(f"{name}.bias") if has_bias else None


def recompute_blocks(model: nn.Module, every: int) -> None:
    """Activation recomputation for every ``every``-th of ``model.blocks`` while gradients are taken: the block
    keeps its input and runs again in the backward pass, instead of keeping what its backward pass needs."""
    for block in list(model.blocks)[::every]:
        # the instance's own forward: the module, its names and its weights stay as they are
        block.forward = functools.partial(_recomputed, block.forward)


def _recomputed(forward: Callable, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    # non-reentrant: the block's input need not require a gradient (the frozen embedding's output does not);
    # the random state is restored for the second pass, so dropout draws the same masks
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


class NewRows(nn.Module):
    """The rows of token ids a fine-tuning added (the chat markers), trained beside a frozen table: the weight read
    is the table with ``lora_rows`` (new_tokens x d, starting at zero) added to its last rows. Without it those rows
    would stay the mean rows they were grown as, and a frozen head could never make the end-of-turn token likely."""

    def __init__(self, n: int, d: int, device, dtype) -> None:
        super().__init__()
        self.lora_rows = nn.Parameter(torch.zeros(n, d, device=device, dtype=dtype))

    def forward(self, weight: Tensor) -> Tensor:
        n = self.lora_rows.shape[0]
        return torch.cat([weight[:-n], weight[-n:] + self.lora_rows.to(weight.dtype)])


def add_new_rows(model: nn.Module, n: int) -> None:
    """Train the last ``n`` rows of the token embedding and the output head (one delta when they are tied)."""
    from torch.nn.utils import parametrize

    E, head = model.E.weight, model.lm_head.weight
    rows = NewRows(n, E.shape[1], E.device, E.dtype)
    parametrize.register_parametrization(model.E, "weight", rows, unsafe=True)
    tied = head is E
    parametrize.register_parametrization(model.lm_head, "weight", rows if tied else NewRows(n, E.shape[1], E.device,
                                                                                          E.dtype), unsafe=True)


def add_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Freeze every weight of ``model`` and put a `LoRALinear` in place of each target (in place; returns it)."""
    if settings.rank <= 0:
        raise TinyLMError(f"lora_rank must be a positive integer, got {settings.rank}")
    targets = target_modules(model, settings.targets)
    for p in model.parameters():
        p.requires_grad_(False)
    for name, linear in targets.items():
        parent_name, _, child = name.rpartition(".")
        wrapped = LoRAEmbedding(linear, settings) if isinstance(linear, nn.Embedding) else LoRALinear(linear, settings)
        setattr(model.get_submodule(parent_name), child, wrapped)
    if settings.new_tokens:
        add_new_rows(model, settings.new_tokens)
    return model


def is_adapter_name(name: str) -> bool:
    return name.endswith(("." + LORA_A, "." + LORA_B, "." + LORA_ROWS))


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapter's tensors (every ``lora_A`` and ``lora_B``), by name; nothing of the frozen base."""
    return {name: t for name, t in model.state_dict().items() if is_adapter_name(name)}


def load_adapter(model: nn.Module, adapter: Mapping[str, Tensor], source: str) -> None:
    """Copy ``adapter`` into a model `add_lora` prepared; the adapter must be exactly the model's."""
    mine = adapter_state(model)
    missing, extra = sorted(mine.keys() - adapter.keys()), sorted(adapter.keys() - mine.keys())
    if missing or extra:
        what = f"no {missing[0]}" if missing else f"an unexpected {extra[0]}"
        raise TinyLMError(f"the adapter in {source} does not fit this model and its lora settings ({what}); use the "
                          "settings it was trained with")
    for name, t in adapter.items():
        if mine[name].shape != t.shape:
            raise TinyLMError(f"the adapter in {source} does not fit this model ({name} is {tuple(t.shape)}, the "
                              f"settings make it {tuple(mine[name].shape)}); use the settings it was trained with")
    model.load_state_dict(adapter, strict=False)


def adapter_pairs(adapter: Mapping[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """The adapter as (A, B) per corrected matrix, by the matrix's weight name (``blocks.0.attn.W_q.weight``)."""
    modules = {suffix: {n.removesuffix("." + suffix) for n in adapter if n.endswith("." + suffix)}
               for suffix in (LORA_A, LORA_B)}
    odd = sorted(modules[LORA_A] ^ modules[LORA_B])
    if odd:
        have, lack = (LORA_A, LORA_B) if odd[0] in modules[LORA_A] else (LORA_B, LORA_A)
        raise TinyLMError(f"the adapter has {odd[0]}.{have} but no {odd[0]}.{lack}")
    return {f"{m}.weight": (adapter[f"{m}.{LORA_A}"], adapter[f"{m}.{LORA_B}"]) for m in sorted(modules[LORA_A])}


def merge_adapter(base: Mapping[str, Tensor], adapter: Mapping[str, Tensor], scale: float) -> dict[str, Tensor]:
    """The base's weights with each target's correction added: W + scale * B A (new tensors; ``base`` unchanged)."""
    merged = dict(base)
    for name, delta in adapter.items():  # new tokens' rows: ``E.parametrizations.weight.0.lora_rows`` -> E.weight
        if name.endswith(ROWS_INFIX + LORA_ROWS):
            weight = name.removesuffix(ROWS_INFIX + LORA_ROWS) + ".weight"
            w = base[weight].clone()
            w[-delta.shape[0]:] += delta.to(w.dtype)
            merged[weight] = w
    for weight, (a, b) in adapter_pairs(adapter).items():
        if weight not in base:
            raise TinyLMError(f"the adapter corrects {weight}, which the base model does not have: it was trained on "
                              "another model")
        w = base[weight]
        if (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise TinyLMError(f"the adapter's correction to {weight} is {b.shape[0]} x {a.shape[1]} but the base's "
                              f"matrix is {tuple(w.shape)}: it was trained on another model")
        merged[weight] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return merged


def adapter_size(config, settings: LoraSettings) -> tuple[int, int]:
    """(the adapter's numbers, the base model's) for a Transformer of ``config`` (a `GPTConfig`), counted from its
    shapes (`tinylm.model.memory`): r (d_in + d_out) per corrected matrix, and the new tokens' rows."""
    rows = settings.new_tokens * config.d_model * (1 if config.tie_embeddings else 2)
    return lora_params(config, settings.rank, settings.targets) + rows, count_params(config)


def lora_line(config, settings: LoraSettings) -> str:
    """What a LoRA run trains, in one line: rank, alpha, targets, and its share of the model's numbers."""
    adapter, base = adapter_size(config, settings)
    return (f"lora: rank {settings.rank}, alpha {settings.alpha:g} (scale {settings.scale:g}) on "
            f"{', '.join(target_names(settings.targets))}: {adapter:,} numbers trained, {adapter / base:.2%} of the "
            f"model's {base:,}, which stay frozen")


def count_adapter(model: nn.Module) -> tuple[int, int]:
    """(trainable numbers, all numbers) of a model: with an adapter, how small the trained part is."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


__all__ = ["LoraSettings", "LoRALinear", "LoraMemory", "TARGET_GROUPS", "add_lora", "adapter_state", "load_adapter",
           "adapter_pairs", "merge_adapter", "target_names", "target_modules", "count_adapter", "is_adapter_name",
           "adapter_size", "lora_line", "prepare_training", "recompute_blocks"]
