"""The compiled one-token decoding step as an ahead-of-time package: C++ from the new token to its logits.

`torch.compile` turns the step into one fused C++ kernel, but each call still goes through Python:
dynamo's frame hook, the wrapper that checks sizes and allocates every intermediate buffer, the
runtime wrapper. On the default run that was 0.33 ms of a 0.92 ms token (one thread, cProfile of
`Engine.generate`), more than a third of the time. AOTInductor compiles the same graph
(`DecodeWeights.step` with the written-out products) into a shared library whose runner is C++ too,
so a call costs the kernel and little else.

The key mask's width is the one size left free when the graph is exported: a step reads as many
cache slots as have been written (any number from 2 to one less than the cache's), so one package serves
every length, and attention costs what the sequence's length asks, not the whole context's.

Exporting and compiling take 15 to 90 seconds, so the package is kept on disk, in the cache folder
(``$TINYLM_CACHE/decode``, else ``~/.cache/tinylm/decode``), named by a digest of everything it depends
on: the weights, the model's settings, the input shapes, the thread count it was compiled for, the
torch version and the CPU's vector instructions. The folder keeps the most recently used packages up to
512 MB (`prune`; a package is 2 to 6 MB). The next `tinylm sample --compile` of the same model
loads it in well under a second. The package holds the code, not the weights: loading it hands it the
decoding layout's own tensors (`DecodeWeights` registers each under a name of its own), so the weights
are in memory once (a package with its own copy doubled GPT-2's memory). The digest still covers the
weights, since the compiler may fold what it computes from them into the code.

Where AOTInductor cannot build the package (no C++ compiler, an operator it does not cover), the
decoder falls back to `torch.compile`'s step, with one warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import tempfile
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

AOT_FORMAT = 4  # raised when the graph changes, so packages written by older code are not loaded (options are keyed)
FOLDER = "decode"
KEEP_BYTES = 512 * 2**20  # the packages kept in the folder: the least recently used go past this (`prune`)
MASK = 3  # the inputs' place of the key mask (B, L), whose width L, the slots attention reads, varies from call to call


class _OneToken(nn.Module):
    """What the package computes: `DecodeWeights.step` for one token per row, written out for the compiler."""

    def __init__(self, weights: nn.Module) -> None:
        super().__init__()
        self.weights = weights

    def forward(self, tokens: Tensor, slots: Tensor, positions: Tensor, key_mask: Tensor, k: Tensor,
                v: Tensor) -> Tensor:
        return self.weights.step(tokens, slots, positions, key_mask, k, v, written_out=True)


class _GreedyRun(nn.Module):
    """``n`` greedy tokens in one call: the last token is written to the cache, the next is the argmax of its
    logits (ids in ``excluded`` never chosen), and so on; the tokens (B, n) and their log-probabilities (B, n)."""

    def __init__(self, weights: nn.Module, n: int) -> None:
        super().__init__()
        self.weights = weights
        self.n = n

    def forward(self, token: Tensor, slot: Tensor, position: Tensor, key_mask: Tensor, k: Tensor, v: Tensor,
                excluded: Tensor) -> tuple[Tensor, Tensor]:
        tokens, logprobs = [], []
        for i in range(self.n):
            slots = slot + i  # (1,)
            key_mask.index_fill_(1, slots, True)
            logits = self.weights.step(token, slots, position + i, key_mask, k, v, written_out=True)[:, -1]  # (B, V)
            logits = logits.masked_fill(excluded, float("-inf"))
            token = logits.argmax(-1, keepdim=True)  # (B, 1): the first index wins a tie, as in `sample`
            tokens.append(token)
            logprobs.append(torch.log_softmax(logits.float(), dim=-1).gather(-1, token))
        return torch.cat(tokens, dim=1), torch.cat(logprobs, dim=1)


def _tensors(weights: nn.Module) -> list[tuple[str, Tensor]]:
    """Every tensor the step reads besides its inputs, by its name in the layout (the names the package asks for,
    less the ``weights.`` prefix)."""
    return sorted(itertools.chain(weights.named_parameters(), weights.named_buffers()), key=lambda item: item[0])


def package_key(weights: nn.Module, args: tuple[Tensor, ...], graph: str = "one token",
                options: dict | None = None) -> str:
    """The digest that names a package: the graph, weights, settings, shapes and dtypes (not the mask's width: any
    width is one package), the compiler's options, threads, torch and the CPU."""
    shapes = [(tuple(a.shape) if i != MASK else (a.size(0), "live"), str(a.dtype)) for i, a in enumerate(args)]
    facts = (AOT_FORMAT, graph, sorted((options or {}).items()), torch.__version__,
             torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), repr(weights.config), shapes,
             weights_digest(weights))
    return hashlib.sha256(repr(facts).encode()).hexdigest()[:32]


# a layout's weights never change (`tinylm.generate.fast.decode_weights` makes a new one when the model's do)
_WEIGHT_DIGESTS: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def weights_digest(weights: nn.Module) -> str:
    """SHA-256 of every tensor the layout holds, with its name, shape and dtype: read once per layout."""
    if weights not in _WEIGHT_DIGESTS:
        digest = hashlib.sha256()
        for name, tensor in _tensors(weights):
            digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            digest.update(tensor.detach().contiguous().view(torch.uint8).reshape(-1).numpy())  # (no bytes copy)
        _WEIGHT_DIGESTS[weights] = digest.hexdigest()
    return _WEIGHT_DIGESTS[weights]


def package_folder() -> Path:
    from tinylm.data.corpora import cache_dir

    return cache_dir() / FOLDER


class AOTStep:
    """A loaded package: called with the step's inputs, returns the logits (B, 1, V), the caches written in place."""

    def __init__(self, runner, path: Path, outputs: int = 1) -> None:
        self.runner = runner
        self.run = runner.loader.boxed_run  # the C++ call itself: the runner's __call__ parses its input spec each time
        self.path = path
        self.outputs = outputs

    def __call__(self, *args: Tensor) -> Tensor | list[Tensor]:
        out = self.run(list(args))
        return out[0] if self.outputs == 1 else out


def one_token_step(weights: nn.Module, args: tuple[Tensor, ...], options: dict) -> AOTStep | None:
    """The package for ``weights``' one-token step on inputs shaped like ``args``, loaded from disk or built
    (and kept); None, with a warning, where it cannot be built."""
    return _package(_OneToken(weights), weights, args, options, "one token", 1)


def greedy_run(weights: nn.Module, args: tuple[Tensor, ...], n: int, options: dict) -> AOTStep | None:
    """The package that makes ``n`` greedy tokens a call (`_GreedyRun`), as `one_token_step` makes its own."""
    return _package(_GreedyRun(weights, n), weights, args, options, f"greedy {n}", 2)


def _package(module: nn.Module, weights: nn.Module, args: tuple[Tensor, ...], options: dict, graph: str,
             outputs: int) -> AOTStep | None:
    path = package_folder() / f"{package_key(weights, args, graph, options)}.pt2"
    try:
        if path.exists():
            with contextlib.suppress(OSError):  # used now: `prune` removes the least recently used first
                os.utime(path)  # (a folder this user may not write to, or the package pruned meanwhile)
        else:
            _build(module, args, options, path)
            prune(path.parent, keep=path)
        runner = torch._inductor.aoti_load_package(str(path))
        _give_weights(runner, weights)
        return AOTStep(runner, path, outputs)
    except Exception as error:  # noqa: BLE001 (any failure of export or the C++ build means: use torch.compile)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        warnings.warn(f"the ahead-of-time decoding step could not be built ({first[:200]}); "
                      "using torch.compile's step instead", stacklevel=2)
        return None


def prune(folder: Path, keep: Path, budget: int = KEEP_BYTES) -> list[Path]:
    """Remove the least recently used packages in ``folder`` until the rest fit in ``budget`` bytes (one per model,
    shape, graph and thread count, and an older tinylm's never used again: they would pile up); never ``keep``, the
    one just made. The paths removed."""
    packages = []
    for path in folder.glob("*.pt2"):
        if path.name.startswith("."):  # another process's package being built
            continue
        with contextlib.suppress(OSError):  # (another process may be pruning too)
            packages.append((path.stat().st_mtime, path.stat().st_size, path))
    total = sum(size for _, size, _ in packages)
    removed = []
    for _, size, path in sorted(packages):
        if total <= budget:
            break
        if path == keep:
            continue
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
        total -= size
    return removed


@contextlib.contextmanager
def _without_packed_int8(module: nn.Module) -> Iterator[None]:
    """Int8 matrices with fbgemm's packed copy (an eager kernel's, a TorchScript object export cannot trace)
    set it aside while exporting; the written-out product never reads it."""
    from tinylm.model.quant import Int8Matrix

    kept = [(m, m._packed) for m in module.modules() if isinstance(m, Int8Matrix)]
    for m, _ in kept:
        m._packed = None
    try:
        yield
    finally:
        for m, packed in kept:
            m._packed = packed


def _give_weights(runner, weights: nn.Module) -> None:
    """Point the package at the layout's own tensors (it was built without copies of them): one copy in memory."""
    ours = {f"weights.{name}": tensor for name, tensor in _tensors(weights)}
    wanted = runner.get_constant_fqns()
    missing = [name for name in wanted if name not in ours]
    if missing:
        raise RuntimeError(f"the package reads tensors the decoding layout does not have: {', '.join(missing[:5])}")
    runner.load_constants({name: ours[name] for name in wanted}, check_full_update=True, user_managed=True)


def _build(module: nn.Module, args: tuple[Tensor, ...], options: dict, path: Path) -> None:
    """Export ``module`` on ``args`` and compile it into a package at ``path`` (written whole, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode(False), torch.no_grad(), _without_packed_int8(module), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (torch's own: a deprecated pytree check inside export)
        # export traces on copies of the inputs (ordinary tensors, not inference ones): the caches stay as they are
        example = tuple(torch.empty_like(a).copy_(a) for a in args)
        # the slots read: any width from 2 (a width of 1 would be taken for a constant) to one less than the cache's
        # (the whole cache is a case of its own to the exporter; a compiled decoder has slots past its window)
        live = torch.export.Dim("live", min=2, max=args[4].size(3) - 1)
        dynamic = tuple({1: live} if i == MASK else None for i in range(len(args)))
        program = torch.export.export(module, example, dynamic_shapes=dynamic, strict=False)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".building-", suffix=".pt2")
    os.close(fd)
    try:
        # the weights stay out of the package: `_give_weights` hands it the layout's tensors when it is loaded
        configs = {**options, "aot_inductor.package_constants_in_so": False}
        torch._inductor.aoti_compile_and_package(program, package_path=temporary, inductor_configs=configs)
        os.chmod(temporary, 0o644)  # (mkstemp made it private; the cache folder's other files are not)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
