"""The one way the benchmarks time things: medians of repeated runs, contenders taking turns.

This machine is shared and noisy, so a figure is a median, and a comparison runs its contenders in
alternation (a, b, a, b, ...) rather than back to back, so that a change of load in the middle hits
both sides alike. The benchmark scripts import it as ``from timing import ...`` (they run as
``python benchmarks/NAME.py``, which puts this folder on the path).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def alternating(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, tuple[float, Any]]:
    """name -> (median wall time of ``repeats`` calls, the last result), the functions taking turns each round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    results: dict[str, Any] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(times[name]), results[name]) for name in fns}


def median_seconds(fn: Callable[[], Any], repeats: int = 1) -> tuple[float, Any]:
    """(median wall time of ``repeats`` calls of ``fn``, the last result)."""
    return alternating({"fn": fn}, repeats)["fn"]
