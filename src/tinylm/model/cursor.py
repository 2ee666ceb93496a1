"""What every generation cache counts, whatever it stores: how many positions it has read, of how many.

The engine (`tinylm.generate.engine`) asks a cache for ``length`` (positions read so far) and
``max_len`` (the window it may fill before the engine starts a new one). A Transformer's
cache layers (`tinylm.generate.cache.StaticKVCacheLayer`) store keys and values for each
position; the other families store a fixed-size summary of the past instead (an RNN's state, an
n-gram's last tokens). All of them subclass `CacheCursor` for the counting.
"""

from __future__ import annotations


class CacheCursor:
    """``length`` positions read, out of a window of ``max_len``."""

    def __init__(self, max_len: int) -> None:
        self._max_len = max_len
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def max_len(self) -> int:
        return self._max_len

    def _advance(self, steps: int) -> None:
        self._length += steps

    def _rewind(self) -> None:
        self._length = 0
