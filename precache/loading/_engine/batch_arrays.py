"""The arrays a batch is gathered into: where they start, and whose memory they reuse.

**Where a batch lands.** NumPy puts a large new array 16 bytes past a 64-byte boundary (glibc's
chunk header: past a page when glibc maps the array), and copying 49,152-byte rows into it took
1,080 us a batch of 256 where the same copy into an array starting on a 32- or 64-byte boundary
took 870 (one process, same rows). ``aligned_empty``'s arrays start on 64 bytes.

**Whose memory.** A large array freed by another thread than the one that made it goes back to
that thread's glibc arena, which hands free pages back to the kernel; a thread worker's next
batch then faults its array in afresh, the kernel zeroing each page first (with 2 thread
workers, 13% of the process's time in ``clear_page_erms``). Off the main thread,
``batch_empty`` therefore reuses the memory of a large batch array once nothing refers to it
any more (the consumer dropped the batch: no array, tensor or view of it is left, so its memory
is this module's alone), and makes a new one otherwise. In the main thread glibc hands a freed
large array back already faulted, and reusing memory here measured no better and at times
worse (12,000 128 px crops, ``read_batch`` in one process alternating both ways: 122,000-200,000
rows/s glibc's way, 127,000-234,000 and twice bimodal this way; 2 thread workers 33,000-194,000
glibc's way, 198,000-252,000 this way), so there ``aligned_empty`` makes every array.
"""

from __future__ import annotations

import math
import sys
import threading
from collections import deque
from typing import Any

import numpy as np

__all__ = ["aligned_empty", "batch_empty", "REUSED_BYTES"]

_LINE = 64
"""The boundary ``aligned_empty``'s arrays start on (a cache line, and AVX-512's width)."""

REUSED_BYTES = 1 << 20
"""Arrays at least this large are made from reused memory where they can be (the module)."""

_KEPT_BYTES = 256 << 20
"""At most this much memory is kept for reuse (the most recent arrays' first)."""


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary (see the
    module docstring), part of a NumPy array 64 bytes larger that it keeps alive (a dtype that
    holds Python objects, a subarray or no bytes, or a negative size: ``np.empty``'s)."""
    dtype = np.dtype(dtype)
    if _not_plain(shape, dtype):
        return np.empty(shape, dtype)
    nbytes = dtype.itemsize * math.prod(shape)
    return _aligned_view(np.empty(nbytes + _LINE, np.uint8), nbytes, shape, dtype)


def batch_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """``aligned_empty``'s array; off the main thread, and at least ``REUSED_BYTES``, made from
    the memory of an earlier one of the same size that nothing refers to any more where there
    is one (see the module)."""
    dtype = np.dtype(dtype)
    if (_not_plain(shape, dtype) or dtype.itemsize * math.prod(shape) < REUSED_BYTES
            or threading.current_thread() is threading.main_thread()):
        return aligned_empty(shape, dtype)
    nbytes = dtype.itemsize * math.prod(shape)
    return _aligned_view(_REUSED.memory(nbytes + _LINE), nbytes, shape, dtype)


class _Reused:
    """The memory of recent large batch arrays (see the module docstring), for reuse once
    nothing else refers to it. Thread workers share it (a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: deque[np.ndarray] = deque()

    def memory(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of ``uint8``: kept memory nothing else refers to, or new (then kept)."""
        with self._lock:
            for position in range(len(self._kept) - 1, -1, -1):  # (the latest first: cached)
                raw = self._kept[position]
                # referred to by the deque, ``raw`` and getrefcount's argument alone: every
                # array, tensor or view made from it is gone
                if len(raw) == nbytes and sys.getrefcount(raw) == 3:
                    del self._kept[position]  # (by position: ``remove`` compares arrays)
                    self._kept.append(raw)
                    return raw
            raw = np.empty(nbytes, np.uint8)
            self._kept.append(raw)
            while sum(len(kept) for kept in self._kept) > _KEPT_BYTES and len(self._kept) > 1:
                self._kept.popleft()
            return raw


_REUSED = _Reused()

def _not_plain(shape: tuple[int, ...], dtype: np.dtype) -> bool:
    """Whether ``np.empty`` must make the array (objects, a subarray, no bytes, a negative
    size: its own handling, or its error)."""
    return (dtype.hasobject or dtype.subdtype is not None or dtype.itemsize == 0
            or min(shape, default=0) < 0)


def _aligned_view(raw: np.ndarray, nbytes: int, shape: tuple[int, ...],
                  dtype: np.dtype) -> np.ndarray:
    """The ``nbytes`` of ``raw`` from its first 64-byte boundary on, as ``shape`` of ``dtype``."""
    start = -raw.ctypes.data % _LINE
    return raw[start:start + nbytes].view(dtype).reshape(shape)
