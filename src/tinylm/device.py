"""Where the arithmetic runs: the device, its precision, and how many CPU threads to use.

Everything that runs a model (training, evaluation, sampling, serving) asks this module, so
loading a run never leans on the training wing::

    device = resolve_device("auto")                    # the GPU when CUDA is there, else the CPU
    autocast = autocast_for(device, "auto")            # bfloat16 where the hardware has it
    with use_threads(device, setting=None, log=print):  # the cores that are free now, said in one line
        with autocast():
            ...

The thread count matters on a shared CPU: small models on a few cores are hurt badly by
oversubscription, so the default counts only the cores that are idle now (`busy_cores`).
`use_threads` is the one policy every command follows (train, eval, compare, sample, next-token,
explain, serve): on a CPU, one thread per core that is not busy now, busy cores left out and named
in one line (`ThreadChoice.line`); ``setting`` (``--threads N``) overrides it. Inside an outer
`use_threads` block an inner one without a setting keeps the outer choice, so a command that calls
another (compare evaluates each run) measures and says it once.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tinylm.errors import TinyLMError


def resolve_device(setting: str, local_rank: int = 0) -> torch.device:
    """"auto" -> the process's GPU when CUDA is there, else the CPU; other settings are checked."""
    if setting == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(setting)
    except RuntimeError:
        raise TinyLMError(f"unknown device {setting!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TinyLMError(f"device {setting!r} asked for, but PyTorch sees no CUDA GPU here; use --device cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise TinyLMError("device 'mps' asked for, but this PyTorch has no Metal support here; use --device cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise TinyLMError(f"unsupported device {setting!r}; use auto, cpu, cuda, cuda:N or mps")
    return device


# ----- precision ----------------------------------------------------------------------------------


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices in hardware: a GPU that has it, or a CPU with
    AVX512-BF16 or AMX. Elsewhere PyTorch emulates bfloat16 on the CPU, slower than float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


def autocast_for(device: torch.device, dtype: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the mixed-precision context for ``dtype`` ("float32", "bfloat16" or "auto"):
    bfloat16 autocast, or `contextlib.nullcontext` (float32)."""
    use_bf16 = dtype == "bfloat16" or (dtype == "auto" and native_bf16(device))
    if not use_bf16:
        return contextlib.nullcontext
    # Matmuls run in bfloat16, reductions (softmax, norms, the loss) stay in float32: autocast's
    # per-operation policy. bfloat16 has float32's range, so no loss scaling is needed.
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def precision_name(device: torch.device, dtype: str) -> str:
    return "bfloat16 autocast" if autocast_for(device, dtype) is not contextlib.nullcontext else "float32"


# ----- CPU threads --------------------------------------------------------------------------------


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """PyTorch's intra-op thread count set to ``n`` (None: left as it is) inside the block, restored after."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cpu_threads(setting: int | None, device: torch.device, processes: int) -> int | None:
    """The thread count to run with: ``setting`` if given, else on a CPU the free cores shared among
    ``processes`` (`default_cpu_threads`), else None (PyTorch's own count)."""
    return choose_threads(setting, device, processes).threads


def default_cpu_threads(processes: int) -> int:
    """Threads per process: the cores this machine has free, shared among its processes.

    Small models on a few cores are hurt badly by oversubscription: on a 2-core machine with
    another busy process, the tiny preset ran several times slower with 2 threads than with 1
    (benchmarks/threads.py). So cores that are busy now (`busy_cores`) are left out.
    """
    cores = available_cpus()
    busy = round(busy_cores())
    return max(1, min(cores, cores - busy) // processes)


@dataclass(frozen=True)
class ThreadChoice:
    """The CPU threads a command runs with, and why: what `ThreadChoice.line` says in one line.

    ``threads`` None leaves PyTorch's own count (the model runs on a GPU); ``left_out`` names the
    cores counted busy (empty when none are, or when only the load average could say how many:
    ``busy`` is the count either way); ``setting`` is the count asked for (``--threads``), if any.
    """

    threads: int | None
    cores: int
    busy: int = 0
    left_out: tuple[int, ...] = ()
    setting: int | None = None
    processes: int = 1
    device: str = "cpu"

    def line(self) -> str:
        if self.setting is not None:
            return f"threads: {_threads(self.setting)}{self._each()}, as --threads set"
        if self.threads is None:
            return f"threads: PyTorch's own CPU thread count (the model runs on {self.device}; --threads N sets it)"
        if not self.busy:
            return (f"threads: {_threads(self.threads)}{self._each()}, one a core: none of the {self.cores} cores "
                    "is busy now (--threads N sets the count)")
        which = (f"core{'s' if len(self.left_out) > 1 else ''} {', '.join(map(str, self.left_out))}" if self.left_out
                 else f"{self.busy} core{'s' if self.busy > 1 else ''}")
        return (f"threads: {_threads(self.threads)}{self._each()}: {which} of {self.cores} left out, busy with other "
                "work now (--threads N sets the count)")

    def _each(self) -> str:
        return f" in each of {self.processes} processes" if self.processes > 1 else ""


def _threads(n: int) -> str:
    return f"{n} CPU thread{'s' if n > 1 else ''}"


def choose_threads(setting: int | None, device: torch.device | str = "cpu", processes: int = 1) -> ThreadChoice:
    """The thread policy: ``setting`` when given; else on a CPU one thread per core not busy now, shared among
    ``processes`` (at least one each); else (a GPU) PyTorch's own count."""
    device = torch.device(device)
    cores = available_cpus()
    if setting is not None:
        if setting < 1:
            raise TinyLMError(f"threads must be 1 or more, got {setting}")
        return ThreadChoice(setting, cores, setting=setting, processes=processes, device=str(device))
    if device.type != "cpu":
        return ThreadChoice(None, cores, processes=processes, device=str(device))
    loads = core_loads()
    busy = round(sum(loads.values())) if loads is not None else round(busy_cores())
    busy = min(busy, cores)
    left_out = tuple(sorted(sorted(loads, key=lambda n: -loads[n])[:busy])) if loads is not None else ()
    return ThreadChoice(max(1, (cores - busy) // processes), cores, busy, left_out, processes=processes,
                        device=str(device))


# the `use_threads` blocks this process is inside, innermost last, with the function each says its lines to
_active: list[tuple[ThreadChoice, Callable[[str], None] | None]] = []


@contextlib.contextmanager
def use_threads(device: torch.device | str = "cpu", setting: int | None = None, processes: int = 1,
                log: Callable[[str], None] | None = None) -> Iterator[ThreadChoice]:
    """Run the block with the thread policy's count (`choose_threads`), said in one line to ``log`` (a count the
    caller set is not repeated back); PyTorch's count before is restored after, and the cores the process may
    run on, if something inside pinned it (`pin_threads`). Inside another `use_threads` block, one without a
    ``setting`` keeps the outer choice (nothing measured, nothing said again)."""
    if setting is None and _active:
        yield _active[-1][0]
        return
    choice = choose_threads(setting, device, processes)
    if log is not None and setting is None:
        log(choice.line())
    pinned = pinned_cores()
    with threads(choice.threads):
        _active.append((choice, log))
        try:
            yield choice
        finally:
            _active.pop()
            if pinned_cores() != pinned:
                pin_threads(pinned)


def active_choice() -> ThreadChoice | None:
    """The thread choice of the innermost `use_threads` block this process is inside, if any."""
    return _active[-1][0] if _active else None


def say(line: str) -> None:
    """Say ``line`` where the innermost `use_threads` block says its choice (nothing outside such a block)."""
    if _active and _active[-1][1] is not None:
        _active[-1][1](line)


# while pinned: [the process's cores before `pin_threads` narrowed them, the cores it is held to now]
_pinned: list[set[int]] = []


def pin_threads(cores: set[int] | None) -> bool:
    """Every thread of this process (PyTorch's pool, the server's, this one) allowed on ``cores`` only; None: back
    to the cores it had before the first pin. Whether it took effect (Linux only; elsewhere nothing changes).

    Threads started later inherit the calling thread's set. A thread that ends while it is being set is skipped.
    """
    if cores is None and not _pinned:
        return True
    try:
        start = process_cores()
        target = set(cores) if cores is not None else start
        _set_affinity(target)
    except (AttributeError, OSError, ValueError):
        with contextlib.suppress(AttributeError, OSError, ValueError):  # undo a pin that reached some threads only
            _set_affinity(_pinned[1] if _pinned else start)
        return False
    _pinned[:] = [start, target] if cores is not None else []
    return True


def _set_affinity(cores: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # (a thread that ended meanwhile)
            os.sched_setaffinity(int(tid), cores)


def process_cores() -> set[int]:
    """The cores this process may run on when it is not pinned (`pin_threads`): its affinity set before the pin."""
    return set(_pinned[0]) if _pinned else set(os.sched_getaffinity(0))


def pinned_cores() -> set[int] | None:
    """The cores `pin_threads` holds the process to now; None when it is not pinned."""
    return _pinned[1] if _pinned else None


def busy_cores(window: float = 0.25) -> float:
    """How many of this process's cores are busy now: each one's non-idle share over ``window`` seconds, summed.

    Read from /proc/stat (Linux) for the cores in this process's affinity set (`core_loads`). Elsewhere,
    the 1-minute load average; but that counts recent work too, this process's own included, so a
    second run straight after a first (or the next model of a benchmark) would see the cores it
    just used as taken. The price of a short sample: a neighbour that is bursty and happens to be
    idle in the window is not counted (``--threads`` sets the count outright).
    """
    loads = core_loads(window)
    if loads is not None:
        return sum(loads.values())
    try:
        return float(int(os.getloadavg()[0]))  # whole cores: a load of 1.6 leaves the second core free
    except (AttributeError, OSError):  # no load average on this platform
        return 0.0


def core_loads(window: float = 0.25) -> dict[int, float] | None:
    """Each of this process's cores' non-idle share over ``window`` seconds (0 to 1), from /proc/stat;
    None where the kernel does not list them (not Linux)."""
    try:
        cores = os.sched_getaffinity(0)
        before = cpu_times(cores)
        time.sleep(window)
        after = cpu_times(cores)
        if before.keys() != cores or after.keys() != cores:
            raise OSError("/proc/stat does not list this process's cores")
    except (AttributeError, OSError, ValueError, IndexError):
        return None
    loads = {}
    for n in sorted(cores):
        total = after[n][0] - before[n][0]
        loads[n] = 1 - (after[n][1] - before[n][1]) / total if total > 0 else 0.0
    return loads


def cpu_times(cores: set[int], stat: str = "/proc/stat") -> dict[int, tuple[int, int]]:
    """(all time, idle time) in clock ticks of each of ``cores`` since boot, from the kernel's "cpuN" lines."""
    times = {}
    with open(stat, encoding="ascii") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores and len(fields) >= 5:
                ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                times[int(name[3:])] = (sum(ticks), ticks[3] + ticks[4])  # waiting for I/O is idle too
    return times


def available_cpus() -> int:
    """The cores this process may run on (its affinity set: container and taskset limits count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ----- memory -------------------------------------------------------------------------------------


@contextlib.contextmanager
def out_of_memory_explained(advice: str) -> Iterator[None]:
    """An out-of-memory error inside the block, from PyTorch or the allocator, as one `TinyLMError` line: ``advice``."""
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError):
        raise TinyLMError(advice) from None
    except RuntimeError as e:
        text = str(e)
        if "out of memory" in text or "can't allocate memory" in text:
            raise TinyLMError(advice) from None
        raise
