"""Where the arithmetic runs: the default thread count reads the cores that are busy now."""

from __future__ import annotations

import pytest

import tinylm.device as device


def test_default_threads_count_the_cores_busy_now_not_the_load_average(tmp_path, monkeypatch):
    """The kernel's cpuN lines are read twice: a core that was 75% busy in between counts 0.75. The 1-minute load
    average is not used where /proc/stat is: it still counts a run that has just finished (this process's own)."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  9 9 9 9 9 9 9 9 0 0\n"
                    "cpu0 100 0 50 800 50 0 0 0 0 0\n"
                    "cpu1 10 0 10 70 10 0 0 0 0 0\n"
                    "cpu7 1 1 1 1 1 1 1 1 0 0\n"
                    "intr 12345\n", encoding="ascii")
    assert device.cpu_times({0, 1}, str(stat)) == {0: (1000, 850), 1: (100, 80)}  # idle = idle + iowait

    snapshots = iter([{0: (1000, 850), 1: (100, 80)}, {0: (1400, 950), 1: (300, 280)}])
    monkeypatch.setattr(device, "cpu_times", lambda cores: next(snapshots))
    monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # (Linux only)
    monkeypatch.setattr(device.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(device.os, "getloadavg", lambda: (2.0, 2.0, 2.0))  # as after a run on both cores
    assert device.busy_cores(window=0) == pytest.approx(0.75 + 0.0)  # cpu0: 300 of 400 ticks busy; cpu1: idle
    snapshots = iter([{0: (0, 0), 1: (0, 0)}, {0: (100, 100), 1: (100, 90)}] * 2)
    monkeypatch.setattr(device, "available_cpus", lambda: 2)
    assert device.default_cpu_threads(1) == 2  # the load average (2.0) would have said: no core free
    monkeypatch.setattr(device, "cpu_times", lambda cores: {})  # no /proc/stat lines: the load average
    assert device.busy_cores(window=0) == 2.0 and device.default_cpu_threads(1) == 1
    monkeypatch.setattr(device.os, "getloadavg", lambda: (1.6, 1.0, 1.0))  # whole cores, as before: one is free
    assert device.default_cpu_threads(1) == 1 and device.busy_cores(window=0) == 1.0
