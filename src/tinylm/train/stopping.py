"""A clean stop: Ctrl-C (SIGINT) or SIGTERM while training finishes the current step, saves, and stops.

A training process that dies at a signal loses every step since its last checkpoint, hundreds of
them with the default intervals. So while the steps run, `StopRequest` catches both signals:
the first is remembered and announced, and the loop, at the end of the step it is in, writes a
checkpoint of that step, sets run.json's status to "stopped" and returns (`tinylm train` then
exits with 128 + the signal's number, as a process killed by it would); ``--resume`` continues
from that step, with the weights an uninterrupted run would have. A second signal stops at once
(`tinylm.errors.Stopped`, a KeyboardInterrupt), keeping the last checkpoint written.

Under torchrun every process must stop after the same step, or the next gradient all-reduce
would wait forever: the processes agree by a sum of their flags after every step.

Handlers can only be set from the main thread: training started from another thread runs
without them (the signals then act as they always do).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

import torch

from tinylm.errors import Stopped

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Catches SIGINT and SIGTERM while in a ``with`` block; `requested` says whether one came."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._before: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._before[signum] = signal.getsignal(signum)
                signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._before.items():
            signal.signal(signum, handler)
        self._before.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise Stopped(signum)
        self.signum = signum
        # os.write, not print: the handler may run in the middle of a print to the same stream
        os.write(2, f"\ntinylm: {signal.Signals(signum).name} received: stopping after this step with a checkpoint "
                    "(send it again to stop at once)\n".encode())

    def requested(self, all_reduce_sum=None) -> bool:
        """Whether a stop was asked for; ``all_reduce_sum``: the processes' sum, so that all of them agree."""
        if all_reduce_sum is None:
            return self.signum is not None
        flag = all_reduce_sum(torch.tensor([0.0 if self.signum is None else float(self.signum)]))
        if self.signum is None and float(flag) > 0:
            self.signum = int(flag) if int(flag) in SIGNALS else signal.SIGTERM
        return float(flag) > 0

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""
