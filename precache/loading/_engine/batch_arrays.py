"""The arrays a batch is gathered into, and where they start.

NumPy puts a large new array 16 bytes past a 64-byte boundary (glibc's chunk header: past a
page when glibc maps the array), and copying 49,152-byte rows into it took 1,080 us a batch of
256 where the same copy into an array starting on a 32- or 64-byte boundary took 870 (one
process, same rows). ``aligned_empty``'s arrays start on 64 bytes.

Reusing the memory of batches the consumer has dropped (kept here, handed out again once
nothing referred to it) was tried and measured worse: 0.42-0.46 of the limit where glibc's
arrays read at 0.89-0.96 in the main thread, 0.59 against 0.70 in 2 thread workers
(``bench_gather.py``'s settings, a new dataset each, alternating in one process, five rounds).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["aligned_empty"]

_LINE = 64
"""The boundary ``aligned_empty``'s arrays start on (a cache line, and AVX-512's width)."""


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary (see the
    module docstring), part of a NumPy array 64 bytes larger that it keeps alive (a dtype that
    holds Python objects, a subarray or no bytes, or a negative size: ``np.empty``'s)."""
    dtype = np.dtype(dtype)
    if (dtype.hasobject or dtype.subdtype is not None or dtype.itemsize == 0
            or min(shape, default=0) < 0):  # (np.empty's own handling, or its error)
        return np.empty(shape, dtype)
    nbytes = dtype.itemsize * math.prod(shape)
    raw = np.empty(nbytes + _LINE, np.uint8)
    start = -raw.ctypes.data % _LINE
    return raw[start:start + nbytes].view(dtype).reshape(shape)
