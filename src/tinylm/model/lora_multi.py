"""Several LoRA adapters on one base model at once, each row of a batch corrected by its own.

`tinylm.model.lora.merge_adapter` folds one adapter into a copy of the base's weights: a whole model per
adapter, and rows for two adapters can never share a decoding step. Here the base's weights stay as they
are, shared, and each matrix the adapters correct carries every adapter's correction side by side:

    down (d_in, n r)    the adapters' A^T: adapter k (1..n) in columns (k - 1) r .. k r
    up   (n r, d_out)   their scale * B^T, adapter k in rows (k - 1) r .. k r

where r is the largest rank among them (a smaller rank is padded with zeros, and an adapter that does not
correct this matrix is zeros throughout). A row that reads adapter k computes

    y = x W^T + bias + (x down_k) up_k  =  x W^T + bias + scale_k (x A_k^T) B_k^T

which is the adapted model's product (W + scale_k B_k A_k) without ever forming its matrix; adapter 0 is the
base itself, with nothing added.

**Which adapter each row reads** is chosen before the forward passes (`MultiLoRA.choose`, or
`MultiLoRA.chosen` for a block of code), and the choice belongs to the thread that made it: the server's
scheduler chooses for its batch while another thread runs the same model for the base. What was chosen
decides how the rows are computed:

- every row the base (``None``): the plain product, nothing added, nothing read;
- every row one adapter k (an int): ``(x down_k) up_k``, two thin products;
- rows of several adapters (a 0/1 mask (B, 1, n, 1)): ``x down`` is every adapter's projection of every
  row (B, T, n r); the mask keeps each row's own block (a base row keeps none) and one product by ``up``
  adds it. A mixed batch costs the same three small operations per matrix whatever the mix, and reads
  each adapter's numbers once.

Usage::

    stack = MultiLoRA(model, [Adapter("poems", adapter_state, 2.0), Adapter("code", other, 2.0)])
    stack.choose([0, 1, 2, 1])      # rows 0..3 of the next forward passes: the base, poems, code, poems
    logits, _ = model(idx)          # idx (4, T)
    with stack.chosen(2):           # every row reads "code", in this thread, inside the block
        logits, _ = model(one_row)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.errors import TinyLMError
from tinylm.model.lora import adapter_pairs

# what the rows read: None (all the base), an adapter for every row, or a mask (B, 1, n, 1) of each row's adapter
Rows = Union[None, int, Tensor]


@dataclass(frozen=True)
class Adapter:
    """One adapter to stack: its name, its tensors (``blocks.0.attn.W_q.lora_A`` and ``.lora_B``, as
    `tinylm.model.lora.adapter_state` names them) and its scale, alpha / r."""

    name: str
    tensors: Mapping[str, Tensor]
    scale: float


class _Chosen(threading.local):
    """The rows' adapters, one choice per thread (a thread that chose nothing reads the base)."""

    rows: Rows = None


def add_low_rank(y: Tensor, x: Tensor, down: Tensor, up: Tensor, rows: Rows, n: int) -> Tensor:
    """``y`` (B, T, d_out) plus the correction that the rows of x (B, T, d_in) get from ``down`` (d_in, n r) and
    ``up`` (n r, d_out): adapter ``rows`` for every row (an int, 1..n), or each row its own (a mask (B, 1, n, 1)).
    The sum is the last product's own (``addmm``), which saves a pass over ``y`` (and a kernel on a GPU)."""
    if isinstance(rows, int):
        width = down.size(1) // n
        start = (rows - 1) * width
        low, up = x @ down[:, start:start + width], up[start:start + width]  # (B, T, r)
    else:
        low = ((x @ down).unflatten(-1, (n, -1)) * rows).flatten(-2)  # (B, T, n r): each row's own block kept
    return torch.addmm(y.reshape(-1, y.size(-1)), low.reshape(-1, low.size(-1)), up).view(y.shape)


class MultiLoRALinear(nn.Linear):
    """A base nn.Linear (its own ``weight`` and ``bias``, not copies) plus every adapter's correction, each
    row of the input corrected by the adapter chosen for it (module docstring)."""

    def __init__(self, base: nn.Linear, down: Tensor, up: Tensor, n: int, chosen: _Chosen) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        # not in the state dict: the model's own weights stay what its checkpoint holds
        self.register_buffer("lora_down", down, persistent=False)  # (d_in, n r)
        self.register_buffer("lora_up", up, persistent=False)  # (n r, d_out)
        self.n = n
        self.chosen = chosen

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        rows = self.chosen.rows
        return y if rows is None else add_low_rank(y, x, self.lora_down, self.lora_up, rows, self.n)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, adapters={self.n}, rank={self.lora_down.size(1) // self.n}"


class MultiLoRA:
    """``adapters`` stacked on ``model`` (in place: each matrix they correct becomes a `MultiLoRALinear`);
    adapter k of the list is index k + 1, 0 is the base. See the module docstring."""

    def __init__(self, model: nn.Module, adapters: Sequence[Adapter]) -> None:
        if not adapters:
            raise TinyLMError("MultiLoRA needs at least one adapter")
        if any(isinstance(m, MultiLoRALinear) for m in model.modules()):
            raise TinyLMError("this model carries stacked adapters already: stack them all at once")
        self.model = model
        self.names = [a.name for a in adapters]
        self.n = len(adapters)
        self._chosen = _Chosen()
        self._last: tuple[tuple[int, ...], Rows] = ((), None)  # the last choice: a batch makes it step after step
        pairs = [adapter_pairs(a.tensors) for a in adapters]  # per adapter: matrix name -> (A, B)
        modules = dict(model.named_modules())
        wanted = set().union(*pairs)
        for name, linear in modules.items():
            if f"{name}.weight" not in wanted or not (isinstance(linear, nn.Linear) and name.startswith("blocks.")):
                continue
            wanted.discard(f"{name}.weight")
            down, up = _stacked(linear, name, [(a, p.get(f"{name}.weight")) for a, p in zip(adapters, pairs)])
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, MultiLoRALinear(linear, down, up, self.n, self._chosen))
        if wanted:
            weight = sorted(wanted)[0]
            owner = next(a.name for a, p in zip(adapters, pairs) if weight in p)
            raise TinyLMError(f"the adapter '{owner}' corrects {weight}, which the base model does not have: it was "
                              "trained on another model")

    @property
    def rows(self) -> Rows:
        """What this thread chose for the rows (module docstring)."""
        return self._chosen.rows

    def choose(self, adapters: Sequence[int]) -> None:
        """Row b of the forward passes this thread runs next reads adapter ``adapters[b]`` (0: the base)."""
        key = tuple(adapters)
        last = self._last
        if last[0] != key:
            last = (key, self._rows_for(key))
            self._last = last
        self._chosen.rows = last[1]

    @contextmanager
    def chosen(self, adapter: int) -> Iterator[None]:
        """Every row of the forward passes this thread runs inside the block reads ``adapter`` (0: the base)."""
        before = self._chosen.rows
        self._chosen.rows = self._rows_for((adapter,))
        try:
            yield
        finally:
            self._chosen.rows = before

    def _rows_for(self, key: tuple[int, ...]) -> Rows:
        if any(not 0 <= k <= self.n for k in key):
            raise TinyLMError(f"adapter index out of range: {self.n} adapters are stacked (1..{self.n}; 0 is the base)")
        if not any(key):
            return None
        if all(k == key[0] for k in key):
            return key[0]
        weight = next(self.model.parameters())
        mask = F.one_hot(torch.tensor(key, device=weight.device), self.n + 1)[:, 1:]  # (B, n): the base has none
        return mask.to(weight.dtype)[:, None, :, None]  # (B, 1, n, 1)

    def joined(self, linears: Sequence[nn.Module]) -> tuple[Tensor, Tensor] | None:
        """The corrections of matrices used side by side as one (their outputs concatenated, as a fused q, k, v
        product): down (d_in, n R) and up (n R, sum of d_out), with R the sum of their ranks and each adapter's
        block of ``up`` block-diagonal; None where none of them is corrected."""
        parts = [(m.lora_down, m.lora_up) if isinstance(m, MultiLoRALinear) else None for m in linears]
        found = [p for p in parts if p is not None]
        if not found:
            return None
        n = self.n
        ranks = [p[0].size(1) // n if p is not None else 0 for p in parts]
        outs = [m.out_features for m in linears]
        R = sum(ranks)
        down = found[0][0].new_zeros(found[0][0].size(0), n * R)
        up = found[0][1].new_zeros(n * R, sum(outs))
        for k in range(n):
            column, out = k * R, 0
            for part, r, d in zip(parts, ranks, outs):
                if part is not None:
                    down[:, column:column + r] = part[0][:, k * r:(k + 1) * r]
                    up[column:column + r, out:out + d] = part[1][k * r:(k + 1) * r]
                column, out = column + r, out + d
        return down, up


def _stacked(linear: nn.Linear, name: str,
             entries: Sequence[tuple[Adapter, tuple[Tensor, Tensor] | None]]) -> tuple[Tensor, Tensor]:
    """down (d_in, n r) and up (n r, d_out) for the matrix ``name``: adapter k's A^T and scale * B^T in its
    block, zeros where it has no correction of this matrix or a smaller rank (module docstring)."""
    d_in, d_out = linear.in_features, linear.out_features
    rank = max(pair[0].size(0) for _, pair in entries if pair is not None)
    down = torch.zeros(d_in, len(entries) * rank)
    up = torch.zeros(len(entries) * rank, d_out)
    for k, (adapter, pair) in enumerate(entries):
        if pair is None:
            continue
        a, b = pair
        r = a.size(0)
        if a.shape != (r, d_in) or b.shape != (d_out, r):
            raise TinyLMError(f"the adapter '{adapter.name}' corrects {name}.weight as {b.size(0)} x {a.size(1)} but "
                              f"the base's matrix is {d_out} x {d_in}: it was trained on another model")
        down[:, k * rank:k * rank + r] = a.float().T
        up[k * rank:k * rank + r] = adapter.scale * b.float().T
    weight = linear.weight
    return down.to(weight.device, weight.dtype), up.to(weight.device, weight.dtype)


__all__ = ["Adapter", "MultiLoRA", "MultiLoRALinear", "Rows", "add_low_rank"]
