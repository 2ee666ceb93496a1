"""How many CPU threads decode a token, and on which cores: chosen by timing the step, not assumed.

A command's thread count (`tinylm.device.use_threads`) is one per core not busy now. That is right for
training and for reading a prompt, where each product is large enough to split. Decoding one token is a
string of small products, and whether a second thread helps depends on the model and the machine: on the
default run here, one thread made the eager step faster than two (1.84 against 1.93 ms a token), while
the compiled step was faster on two (0.42 against 0.58). llama.cpp keeps two counts for this reason (its
``-t`` and ``-tb``).

So the decoder times its own one-token step (`tinylm.generate.fast.StaticDecoder`) before it decodes:

- the counts from the command's count halving down to one (8, 4, 2, 1), the next smaller tried only while
  the last one won: each count runs the step that count is fastest with (a compiled step is built for one
  thread count);
- then, at the winning count when it leaves cores idle, pinned to the cores that were least busy
  (`tinylm.device.pin_threads`) against left where the kernel puts them.

Each comparison runs the candidates in turns (a change of load on a shared machine hits them alike), and
the lower median wins. The choice is said in one line and kept for the model, for one row and for
batches, and the kind of step (compiled or not). The prompt is still read with the command's count,
unpinned, and the engine goes back to it when it is done (`DecodeThreads.apply` switches between them).
With a compiled step each count timed builds its own package the first time (15 to 90 s each).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tinylm import device as devices

ROUNDS = 5  # timed turns per candidate; the median decides
SAMPLE_SECONDS = 0.004  # one timed turn repeats the step until about this long (a small model's step is 0.3 ms)


@dataclass(frozen=True)
class DecodeThreads:
    """A thread count and, optionally, the cores the process is held to while it decodes (None: not held)."""

    threads: int
    cores: tuple[int, ...] | None = None

    def apply(self) -> None:
        """Make this the setting now (a no-op where it already is)."""
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        wanted = set(self.cores) if self.cores is not None else None
        if devices.pinned_cores() != wanted:
            devices.pin_threads(wanted)

    def describe(self) -> str:
        text = f"{self.threads} thread{'s' if self.threads > 1 else ''}"
        if self.cores is not None:
            text += f" pinned to core{'s' if len(self.cores) > 1 else ''} {', '.join(map(str, self.cores))}"
        return text


def median_times(candidates: list[DecodeThreads], call: Callable[[], object], rounds: int = ROUNDS) -> list[float]:
    """The median seconds of one ``call`` under each candidate setting, taken in turns after one warm call each
    (which builds what a count needs). A turn repeats the call until about `SAMPLE_SECONDS` have passed."""
    repeats = []
    for candidate in candidates:
        candidate.apply()
        call()  # warm: a compiled step for this count is built (or loaded) here
        started = time.perf_counter()
        call()
        repeats.append(max(1, round(SAMPLE_SECONDS / max(time.perf_counter() - started, 1e-6))))
    times: list[list[float]] = [[] for _ in candidates]
    for _ in range(rounds):
        for i, candidate in enumerate(candidates):
            candidate.apply()
            started = time.perf_counter()
            for _ in range(repeats[i]):
                call()
            times[i].append((time.perf_counter() - started) / repeats[i])
    return [statistics.median(t) for t in times]


def halvings(n: int) -> list[int]:
    """n, n // 2, n // 4, ..., 1 (each once)."""
    counts = [n]
    while counts[-1] > 1:
        counts.append(counts[-1] // 2)
    return counts


Comparison = tuple[DecodeThreads, float, DecodeThreads, float]  # (the setting before, its time, the one tried, its)


def fastest(call: Callable[[], object], threads: int, free_cores: list[int] | None,
            rounds: int = ROUNDS) -> tuple[DecodeThreads, list[Comparison]]:
    """The setting ``call`` runs fastest under, and the comparisons that chose it, in order (median seconds a call).

    ``threads``: the most threads to try (the command's count); ``free_cores``: the process's cores, least busy
    first (None: pinning is not tried). Counts halve while the smaller one wins; then pinning to the winning
    count's least busy cores is timed against not pinning, where that leaves a core out.
    """
    measured: list[Comparison] = []

    def beats(tried: DecodeThreads, setting: DecodeThreads) -> bool:
        times = median_times([setting, tried], call, rounds)
        measured.append((setting, times[0], tried, times[1]))
        return times[1] < times[0]

    best = DecodeThreads(threads)
    for count in halvings(threads)[1:]:
        if not beats(DecodeThreads(count), best):
            break
        best = DecodeThreads(count)
    if free_cores is not None and best.threads < len(free_cores):
        pinned = DecodeThreads(best.threads, tuple(sorted(free_cores[:best.threads])))
        if beats(pinned, best):
            best = pinned
    return best, measured


def report(best: DecodeThreads, measured: list[Comparison]) -> str:
    """One line: what was chosen, and the comparisons it was chosen by (ms a step, each pair timed together)."""
    pairs = "; ".join(f"{a.describe()} {ta * 1e3:.3g} against {b.describe()} {tb * 1e3:.3g}"
                      for a, ta, b, tb in measured)
    return f"decoding with {best.describe()}, measured fastest (ms a step: {pairs})"


def free_cores_now(choice: devices.ThreadChoice) -> list[int] | None:
    """The process's cores with the ones the thread policy counted busy last (None where it could not tell which)."""
    try:
        cores = sorted(devices.process_cores())  # (not the cores of a pin in force now)
    except AttributeError:
        return None
    if choice.busy and not choice.left_out:
        return None
    return [c for c in cores if c not in choice.left_out] + list(choice.left_out)


def command_setting() -> DecodeThreads | None:
    """The command's own thread count, where decoding may choose another: inside a `use_threads` block that chose
    its count itself (no ``--threads``) on a CPU; else None (a count the user set is kept as it is)."""
    choice = devices.active_choice()
    if choice is None or choice.setting is not None or choice.threads is None:
        return None
    return DecodeThreads(choice.threads)


def decode_settings(call: Callable[[], object]) -> tuple[DecodeThreads, DecodeThreads] | None:
    """(the prompt's setting, the decoding step's) where `command_setting` allows a choice, the latter measured with
    ``call`` (one decoding step) and said in one line; None elsewhere."""
    choice = devices.active_choice()
    prompt = command_setting()
    if choice is None or prompt is None:
        return None
    free = free_cores_now(choice)
    if choice.threads == 1 and (free is None or len(free) == 1):
        return None
    try:
        best, measured = fastest(call, choice.threads, free)
    finally:
        prompt.apply()
    devices.say(report(best, measured))
    return prompt, best
