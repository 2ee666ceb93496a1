"""Int8 weights for decoding: every matrix of a GPT's blocks and its output head stored as int8, one scale per row.

Decoding one token reads every weight once, so on a CPU its time is mostly the time to stream the weights
from memory; int8 weights are a quarter of float32's bytes. Each matrix W (out x in, nn.Linear's layout) is
stored as

    W[o, :] ~= s[o] * q[o, :],   s[o] = max_i |W[o, i]| / 127,   q[o, i] = round(W[o, i] / s[o]) in [-127, 127]

symmetric (no zero point: q = 0 is exactly 0), round-to-nearest, one scale per output channel (row), so a
row with small weights keeps its precision beside a row with large ones. The biases, the norms, the
embeddings (a lookup reads one row per token) and everything else stay float32. A tied head gets its own
int8 copy of the embedding; the embedding stays float for the lookup.

How the product x W^T is computed is measured, not assumed (`Int8Matrix.kernel`): per matrix shape, per
thread count, for one row (a decoding step at batch 1) and for several (a prefill, a batch), the fastest of

- ``"int8 activations"``: `torch.ops.quantized.linear_dynamic` (what `torch.ao`'s dynamic quantization
  calls; fbgemm's int8 x int8 product). The activations are quantized too, per call: one scale and zero
  point for the whole input, 8 bits (7 on a CPU without a VNNI dot product, where fbgemm's 16-bit sums could
  saturate). It changes the numbers most (about 1% relative error per product where weight-only is 0.8%,
  on GPT-2 124M's shapes), and was the fastest everywhere but the tiny matrices when this was written;
- ``"weight-only, bf16"``: `torch.ops.aten._weight_int8pack_mm` on bfloat16 activations (the input and the
  output rounded to bfloat16, the weights int8 with their scales; no activation quantization). Only for
  rows of a multiple of 32 values: in PyTorch 2.13 its vectorized loop has no tail (24 values crashed the
  process, 33 gave NaN);
- ``"weight-only"``: the same kernel on float32 activations (exact weight-only numerics; on the AVX-512
  CPU here it had no vectorized path and took about 10 times float32's time, so it only wins where the
  others lose more; it is measured for one row only, it took over a second for 8 rows of a 50k head).

The third candidate named for this, a compiled dequantize-and-multiply, is the compiled decoding step's
own product (`tinylm.generate.fast` with ``compile``): `Int8Matrix.written_out` sums q * x in float32 and
scales once per row, which inductor turns into one loop over the int8 rows fused with what surrounds it;
the decoder times that compiled step against the eager one (with the kernels above) and keeps the faster.

Usage::

    quantize_int8(model)                  # in place: the float matrices are freed
    copy = quantized_copy(model)          # a decoding-only copy sharing the float embeddings and norms
    logits, _ = copy(idx)

An int8 model decodes and evaluates; it does not train (its forward refuses training mode).
"""

from __future__ import annotations

import copy as copying
import functools
import itertools
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.errors import TinyLMError

QUANT_KINDS = ("int8",)
QMAX = 127  # symmetric: -127..127 (-128 is never used, so negating a row never overflows)
QUANTIZED = ("W_q", "W_k", "W_v", "W_o", "W_1", "W_2", "W_3")  # a block's matrices (an MoE router stays float)

DYNAMIC, BF16, WEIGHT_ONLY = "int8 activations", "weight-only, bf16", "weight-only"
ONE_ROW_KERNELS = (DYNAMIC, BF16, WEIGHT_ONLY)
MANY_ROW_KERNELS = (DYNAMIC, BF16)
MEASURE_ROUNDS = 5  # timed calls per candidate (taking turns); the median decides
MANY_ROWS = 8  # the row count several-row products are timed at


# ----- quantizing one matrix ------------------------------------------------------------------------------


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """W (out, in) -> (q int8 (out, in), s float32 (out,)) with W[o] ~= s[o] q[o]: symmetric, per row, round to nearest.

    An all-zero row gets the scale 1 (its q is 0 either way), so dequantizing never divides by zero.
    Ties round to the even integer (`torch.round`).
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / QMAX  # (out,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


@functools.cache
def _exact_int8_dot() -> bool:
    """Whether the CPU has a VNNI int8 dot product, with which fbgemm sums u8 x s8 pairs without saturating.

    Without it fbgemm adds pairs of u8 x s8 products in 16 bits, which can overflow for 8-bit activations:
    then they are quantized to 7 bits (``reduce_range``) instead.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


class Int8Matrix(nn.Module):
    """A matrix W (out, in) as int8 rows ``q`` and their float32 ``scale``; `matmul` is x W^T (+ b) in float32."""

    def __init__(self, q: Tensor, scale: Tensor, kernel: str | None = None) -> None:
        super().__init__()
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.size(0),):
            raise TinyLMError(f"an int8 matrix is int8 rows (out, in) and one scale per row, got {q.dtype} "
                              f"{tuple(q.shape)} and scales {tuple(scale.shape)}")
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.fixed_kernel = kernel  # None: measured per row count (`kernel`)
        self._packed = None  # fbgemm's packed weight, made on first use of the int8-activations kernel
        self._scale_bf16: Tensor | None = None

    @classmethod
    def of(cls, weight: Tensor, kernel: str | None = None) -> Int8Matrix:
        """``weight`` (out, in) quantized by `quantize_rows`."""
        return cls(*quantize_rows(weight), kernel=kernel)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype products are computed and returned in (float32), as a float matrix's dtype says."""
        return self.scale.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantized(self) -> Tensor:
        """The float32 matrix (out, in) the int8 rows stand for: s[o] * q[o, i]."""
        return self.q.float() * self.scale[:, None]

    # -- the products ----------------------------------------------------------------------------------

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x (..., in) W^T (+ bias): (..., out) in float32, by the kernel measured fastest for this many rows."""
        rows = x.reshape(-1, x.size(-1))  # (M, in)
        if torch.compiler.is_compiling():  # inside a compiled step of several tokens: a plain dequantized product
            y = F.linear(rows.float(), self.q.float()) * self.scale
        else:
            y = KERNELS[self.kernel(rows.size(0))](self, rows.float().contiguous())
        y = y.reshape(*x.shape[:-1], self.q.size(0))
        return y + bias if bias is not None else y

    def written_out(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """The same product as a sum for the compiler: y[m, o] = s[o] sum_i q[o, i] x[m, i] (one row at a time)."""
        rows = x.reshape(-1, x.size(-1))  # (M, in)
        y = (self.q[:, None, :].to(rows.dtype) * rows[None, :, :]).sum(-1).T * self.scale  # (M, out)
        y = y.reshape(*x.shape[:-1], self.q.size(0))
        return y + bias if bias is not None else y

    def kernel(self, rows: int) -> str:
        """The kernel for a product of ``rows`` rows: the fixed one (weight-only where it `can_run` not), else the
        fastest measured for this shape."""
        if self.fixed_kernel is not None:
            return self.fixed_kernel if can_run(self.fixed_kernel, self) else WEIGHT_ONLY
        key = (tuple(self.q.shape), rows == 1, torch.get_num_threads(), self.q.device.type)
        if key not in _CHOSEN:
            _CHOSEN[key] = fastest_kernel(self, rows == 1)
        return _CHOSEN[key]

    def packed(self):
        """fbgemm's packed copy of the int8 rows and scales (for `torch.ops.quantized.linear_dynamic`)."""
        if self._packed is None:
            zero = torch.zeros(self.q.size(0), dtype=torch.long)
            with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm's packing still takes one
                warnings.simplefilter("ignore", UserWarning)
                qweight = torch._make_per_channel_quantized_tensor(self.q, self.scale.double(), zero, 0)
                self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        return self._packed

    def scale_bf16(self) -> Tensor:
        if self._scale_bf16 is None:
            self._scale_bf16 = self.scale.bfloat16()
        return self._scale_bf16


def _int8_activations(m: Int8Matrix, rows: Tensor) -> Tensor:
    return torch.ops.quantized.linear_dynamic(rows, m.packed(), not _exact_int8_dot())


def _weight_only_bf16(m: Int8Matrix, rows: Tensor) -> Tensor:
    return torch.ops.aten._weight_int8pack_mm(rows.bfloat16(), m.q, m.scale_bf16()).float()


def _weight_only(m: Int8Matrix, rows: Tensor) -> Tensor:
    return torch.ops.aten._weight_int8pack_mm(rows, m.q, m.scale)


KERNELS: dict[str, Callable[[Int8Matrix, Tensor], Tensor]] = {
    DYNAMIC: _int8_activations, BF16: _weight_only_bf16, WEIGHT_ONLY: _weight_only,
}

# (shape, one row, threads, device type) -> the kernel measured fastest
_CHOSEN: dict[tuple, str] = {}


def can_run(kernel: str, matrix: Int8Matrix) -> bool:
    """Whether ``kernel`` computes this matrix's product correctly (the bf16 kernel: rows of a multiple of 32)."""
    return kernel != BF16 or matrix.q.size(1) % 32 == 0


def fastest_kernel(matrix: Int8Matrix, one_row: bool) -> str:
    """The candidate kernel with the lowest median time on this matrix, for one row or `MANY_ROWS` rows.

    Each candidate runs once to warm up, then `MEASURE_ROUNDS` times, the candidates taking turns so that a
    change of load on a shared machine hits them alike.
    """
    candidates = [k for k in (ONE_ROW_KERNELS if one_row else MANY_ROW_KERNELS) if can_run(k, matrix)]
    x = torch.randn(1 if one_row else MANY_ROWS, matrix.q.size(1), device=matrix.device)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    with torch.inference_mode():
        for name in candidates:
            KERNELS[name](matrix, x)
        for _ in range(MEASURE_ROUNDS):
            for name in candidates:
                started = time.perf_counter()
                KERNELS[name](matrix, x)
                times[name].append(time.perf_counter() - started)
    return min(candidates, key=lambda name: statistics.median(times[name]))


def chosen_kernels() -> dict[tuple, str]:
    """What `Int8Matrix.kernel` has measured so far: (shape, one row, threads, device type) -> kernel."""
    return dict(_CHOSEN)


def stack_rows(matrices: Sequence[Int8Matrix]) -> Int8Matrix:
    """Several matrices with the same input as one, their rows stacked (per-row scales stack with them)."""
    if len(matrices) == 1:
        return matrices[0]
    return Int8Matrix(torch.cat([m.q for m in matrices]), torch.cat([m.scale for m in matrices]),
                      kernel=matrices[0].fixed_kernel)


# ----- a GPT with int8 matrices ------------------------------------------------------------------------------


class Int8Linear(nn.Module):
    """nn.Linear with its weight as an `Int8Matrix`: y = x W^T + b, for decoding and evaluation only."""

    def __init__(self, linear: nn.Linear, kernel: str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.matrix = Int8Matrix.of(linear.weight, kernel)
        bias = linear.bias
        self.register_buffer("bias", bias.detach().float().clone() if bias is not None else None)

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            raise TinyLMError("an int8 model decodes and evaluates only; train the float model (without --quant)")
        return self.matrix.matmul(x, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row scales"


def check_quantizable(model: nn.Module, kind: str = "int8") -> None:
    """Refuse, in one line, what int8 decoding does not cover: another kind, another family, a live adapter, a GPU."""
    from tinylm.model.gpt import GPT
    from tinylm.model.lora import LoRALinear

    if kind not in QUANT_KINDS:
        raise TinyLMError(f"--quant takes {', '.join(QUANT_KINDS)}, got {kind!r}")
    if not isinstance(model, GPT):
        family = getattr(getattr(model, "config", None), "family", type(model).__name__)
        raise TinyLMError(f"--quant int8 quantizes a GPT's matrices; this run's model is {family!r}: "
                          "drop --quant to decode it in float32")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise TinyLMError("the model carries a live LoRA adapter: merge it first (a loaded LoRA run comes merged), "
                          "then quantize")
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise TinyLMError(f"--quant int8 runs CPU kernels; the model is on {device}: use --device cpu or drop --quant")


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` computes with int8 matrices (`quantize_int8`)."""
    return any(isinstance(m, Int8Linear) for m in model.modules())


def _targets(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every matrix to quantize: the blocks' `QUANTIZED` linears, then the head."""
    found = []
    for block in model.blocks:
        for parent in block.modules():
            for name, child in parent.named_children():
                if name in QUANTIZED and type(child) is nn.Linear:
                    found.append((parent, name))
    return found + ([(model, "lm_head")] if type(model.lm_head) is nn.Linear else [])  # (once quantized: none)


def quantize_int8(model: nn.Module, kernel: str | None = None) -> nn.Module:
    """Replace a GPT's block matrices and head by `Int8Linear` in place (the float matrices are freed); the model.

    The model is put in eval mode and its remaining parameters frozen: it decodes and evaluates, and refuses
    to train. ``kernel`` fixes the product's kernel (one of `KERNELS`); None measures the fastest per shape.
    """
    check_quantizable(model)
    _replace_linears(model, kernel)
    model.requires_grad_(False)
    return model


def _replace_linears(model: nn.Module, kernel: str | None) -> None:
    """Every `_targets` linear of ``model`` replaced by its `Int8Linear`; ``model`` put in eval mode."""
    if kernel is not None and kernel not in KERNELS:
        raise TinyLMError(f"unknown int8 kernel {kernel!r}; one of {', '.join(KERNELS)}")
    with torch.no_grad():
        for parent, name in _targets(model):
            setattr(parent, name, Int8Linear(getattr(parent, name), kernel))
    model.eval()


def quantized_copy(model: nn.Module, kernel: str | None = None) -> nn.Module:
    """An int8 copy of a GPT for decoding (`quantize_int8`), sharing its float embeddings and norms; ``model`` is untouched."""
    check_quantizable(model)
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    duplicate = copying.deepcopy(model, shared)  # new modules around the same tensors
    _replace_linears(duplicate, kernel)  # (the shared parameters keep their requires_grad: they are model's too)
    return duplicate


def int8_bytes(model: nn.Module) -> int:
    """Bytes the int8 matrices and their scales take."""
    return sum(m.q.numel() + 4 * m.scale.numel() for m in model.modules() if isinstance(m, Int8Matrix))
