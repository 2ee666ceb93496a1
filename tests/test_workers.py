"""The worker pool behind tokenizer training and `prepare`: fresh processes, results in order, a dead worker is one line.

Forked workers once hung the README tour for ten minutes: a fork copies every lock that another
thread of the parent holds at that instant, and tinylm's SIGTERM handler, which a stuck child
never runs, so ending the pool waited for ever. These tests hold a lock in another thread and
install a handler, and check that the workers see neither.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tinylm.errors import TinyLMError
from tinylm.workers import alive, in_order, running

HELD = threading.Lock()


def _take_the_lock(item: int) -> int:
    with HELD:  # a forked worker would find this lock taken for ever
        return item * item


def _sigterm_handler_is_default(item: int) -> bool:
    return signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _handler(signum, frame):
    pass


def _exit_on(item: int) -> int:
    if item == 3:
        os._exit(7)  # killed outright, as the out-of-memory killer would
    return item


def test_a_lock_held_by_another_thread_does_not_reach_the_workers():
    taken, release = threading.Event(), threading.Event()

    def hold():
        with HELD:
            taken.set()
            release.wait()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    taken.wait()
    got: list = []
    # in a thread of its own, so that a hung pool fails this test instead of holding the suite
    work = threading.Thread(target=lambda: got.extend(in_order(_take_the_lock, range(9), workers=2, died="x")),
                            daemon=True)
    work.start()
    work.join(timeout=90)
    release.set()
    assert not work.is_alive(), "the workers hung on a lock that another thread of the parent held"
    assert got == [(i, i * i) for i in range(9)]  # every result, in the items' order


def test_the_workers_do_not_inherit_a_sigterm_handler():
    before = signal.signal(signal.SIGTERM, _handler)
    try:
        got = [answer for _, answer in in_order(_sigterm_handler_is_default, range(2), workers=2, died="x")]
    finally:
        signal.signal(signal.SIGTERM, before)
    assert got == [True, True]


def test_a_worker_that_dies_is_one_line_that_says_what_to_do():
    with pytest.raises(TinyLMError, match=r"^a counting worker died \(out of memory, or killed\); "
                                          r"run again with --workers 1"):
        list(in_order(_exit_on, range(8), workers=2, died="a counting worker died"))


def test_a_process_that_ended_is_neither_alive_nor_running():
    assert alive(os.getpid()) and running(os.getpid())
    child = subprocess.Popen(["true"])
    for _ in range(200):  # until it has ended; unreaped, it is a zombie: it exists but no longer runs
        if not running(child.pid):
            break
        time.sleep(0.05)
    assert alive(child.pid) and not running(child.pid)
    child.wait()
    assert not alive(child.pid) and not running(child.pid)


def test_a_script_without_a_main_guard_runs_once(tmp_path):
    # spawn's default would run this script again in each worker, which would start pools of its own
    script = tmp_path / "script.py"
    script.write_text("from tinylm.workers import in_order\n"
                      "print('start')\n"
                      "print(sum(r for _, r in in_order(abs, [-1, -2, -3, -4], workers=2, died='x')))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "start\n10\n"), done.stderr
