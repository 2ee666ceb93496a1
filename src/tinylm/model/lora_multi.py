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
base itself, with nothing added. The output head (lora_targets ``lm_head``) is such a matrix too.

The token embedding (lora_targets ``E``) is looked up, not multiplied: row x of adapter k's table is
W[x] + scale_k B_k[x] A_k. Its corrections are stacked the same way with the roles turned round:

    rows (|V|, n r)     the adapters' scale * B: adapter k in columns (k - 1) r .. k r, looked up by token
    up   (n r, d)       their A, adapter k in rows (k - 1) r .. k r

so a token's correction is its row of ``rows`` (r numbers per adapter) times ``up``, chosen per row of the
batch exactly as a product's ``x down`` is.

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
from collections.abc import Callable, Iterator, Mapping, Sequence
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
    ``up`` (n r, d_out): adapter ``rows`` for every row (an int, 1..n), or each row its own (a mask (B, 1, n, 1))."""
    if isinstance(rows, int):
        block = _block(rows, down.size(1) // n)
        return _add_product(y, x @ down[:, block], up[block])  # (B, T, r) by (r, d_out)
    return _add_product(y, _own_blocks(x @ down, rows, n), up)


def add_looked_up(y: Tensor, idx: Tensor, table: Tensor, up: Tensor, rows: Rows, n: int) -> Tensor:
    """``y`` (B, T, d), the embedding of tokens ``idx`` (B, T), plus each row's correction from ``table``
    (|V|, n r), looked up by token, and ``up`` (n r, d) (module docstring); ``rows`` as for `add_low_rank`."""
    low = F.embedding(idx, table)  # (B, T, n r): every adapter's r numbers per token, a small gather
    if isinstance(rows, int):
        block = _block(rows, table.size(1) // n)
        return _add_product(y, low[..., block], up[block])
    return _add_product(y, _own_blocks(low, rows, n), up)


def _block(adapter: int, width: int) -> slice:
    """Adapter ``adapter``'s (1..n) columns of a stacked down, or rows of a stacked up."""
    return slice((adapter - 1) * width, adapter * width)


def _own_blocks(low: Tensor, mask: Tensor, n: int) -> Tensor:
    """``low`` (B, T, n r) with every block but each row's own adapter's zeroed by ``mask`` (B, 1, n, 1)."""
    return (low.unflatten(-1, (n, -1)) * mask).flatten(-2)


def _add_product(y: Tensor, low: Tensor, up: Tensor) -> Tensor:
    """``y`` + ``low`` @ ``up``, the sum being the product's own (``addmm``), which saves a pass over ``y`` (and a
    kernel on a GPU)."""
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


class MultiLoRAEmbedding(nn.Embedding):
    """A base token embedding (its own ``weight``) plus every adapter's correction of its rows, each row of the
    batch corrected by the adapter chosen for it (module docstring)."""

    def __init__(self, base: nn.Embedding, table: Tensor, up: Tensor, n: int, chosen: _Chosen) -> None:
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = base.padding_idx, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.weight = base.weight
        self.register_buffer("lora_table", table, persistent=False)  # (|V|, n r)
        self.register_buffer("lora_up", up, persistent=False)  # (n r, d)
        self.n = n
        self.chosen = chosen

    def forward(self, idx: Tensor) -> Tensor:
        y = F.embedding(idx, self.weight)
        rows = self.chosen.rows
        return y if rows is None else add_looked_up(y, idx, self.lora_table, self.lora_up, rows, self.n)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, adapters={self.n}, rank={self.lora_table.size(1) // self.n}"


class MultiLoRA:
    """``adapters`` stacked on ``model`` (in place: each matrix they correct becomes a `MultiLoRALinear`);
    adapter k of the list is index k + 1, 0 is the base. See the module docstring."""

    def __init__(self, model: nn.Module, adapters: Sequence[Adapter]) -> None:
        if not adapters:
            raise TinyLMError("MultiLoRA needs at least one adapter")
        if any(isinstance(m, (MultiLoRALinear, MultiLoRAEmbedding)) for m in model.modules()):
            raise TinyLMError("this model carries stacked adapters already: stack them all at once")
        self.model = model
        self.names = [a.name for a in adapters]
        self.n = len(adapters)
        self._chosen = _Chosen()
        self._last: tuple[tuple[int, ...], Rows] = ((), None)  # the last choice: a batch makes it step after step
        pairs = [adapter_pairs(a.tensors) for a in adapters]  # per adapter: matrix name -> (A, B)
        modules = dict(model.named_modules())
        wanted = set().union(*pairs)
        for name, layer in modules.items():
            if f"{name}.weight" not in wanted or not _correctable(name, layer):
                continue
            wanted.discard(f"{name}.weight")
            entries = [(a, p.get(f"{name}.weight")) for a, p in zip(adapters, pairs)]
            if isinstance(layer, nn.Embedding):
                table, up = _stacked_table(layer, name, entries)
                stacked: nn.Module = MultiLoRAEmbedding(layer, table, up, self.n, self._chosen)
            else:
                down, up = _stacked(layer, name, entries)
                stacked = MultiLoRALinear(layer, down, up, self.n, self._chosen)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, stacked)
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


def _correctable(name: str, layer: nn.Module) -> bool:
    """Whether the module ``name`` is one an adapter may correct: a block's projection, the output head, the token
    embedding (`tinylm.model.lora.target_modules`)."""
    if isinstance(layer, nn.Embedding):
        return name == "E"
    return isinstance(layer, nn.Linear) and (name.startswith("blocks.") or name == "lm_head")


def _stacked(linear: nn.Linear, name: str,
             entries: Sequence[tuple[Adapter, tuple[Tensor, Tensor] | None]]) -> tuple[Tensor, Tensor]:
    """down (d_in, n r) and up (n r, d_out) for the matrix ``name``: adapter k's A^T and scale * B^T in its
    block, zeros where it has no correction of this matrix or a smaller rank (module docstring)."""
    return _blocks(linear.weight, "matrix", name, entries, lambda a, b, scale: (a.T, scale * b.T))


def _stacked_table(embedding: nn.Embedding, name: str,
                   entries: Sequence[tuple[Adapter, tuple[Tensor, Tensor] | None]]) -> tuple[Tensor, Tensor]:
    """rows (|V|, n r) and up (n r, d) for the embedding ``name``: adapter k's scale * B and A in its block, zeros
    where it leaves the embedding as it is or has a smaller rank (module docstring)."""
    return _blocks(embedding.weight, "table", name, entries, lambda a, b, scale: (scale * b, a))


def _blocks(weight: Tensor, what: str, name: str, entries: Sequence[tuple[Adapter, tuple[Tensor, Tensor] | None]],
            factors: Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """The two stacked factors, left (., n r) and right (n r, .): adapter k's ``factors(A, B, scale)`` in its
    block of columns and of rows, zeros where it has no correction of ``weight`` or a smaller rank. Each
    adapter's B A must have the base's shape (a matrix's or a table's, W = B A either way)."""
    rank = max(pair[0].size(0) for _, pair in entries if pair is not None)
    blocks = []
    for adapter, pair in entries:
        if pair is None:
            blocks.append(None)
            continue
        a, b = pair
        if (b.size(0), a.size(1)) != tuple(weight.shape) or a.size(0) != b.size(1):
            raise TinyLMError(f"the adapter '{adapter.name}' corrects {name}.weight as {b.size(0)} x {a.size(1)} but "
                              f"the base's {what} is {' x '.join(map(str, weight.shape))}: it was trained on another "
                              "model")
        blocks.append(factors(a.float(), b.float(), adapter.scale))
    size_left, size_right = next(block for block in blocks if block is not None)
    left = torch.zeros(size_left.size(0), len(entries) * rank)
    right = torch.zeros(len(entries) * rank, size_right.size(1))
    for k, block in enumerate(blocks):
        if block is not None:
            r = block[0].size(1)
            left[:, k * rank:k * rank + r], right[k * rank:k * rank + r] = block
    return left.to(weight.device, weight.dtype), right.to(weight.device, weight.dtype)


__all__ = ["Adapter", "MultiLoRA", "MultiLoRAEmbedding", "MultiLoRALinear", "Rows", "add_looked_up", "add_low_rank"]
