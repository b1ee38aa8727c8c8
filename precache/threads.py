"""One thread per native library in each worker process, for stage-1 workers and stage-2
DataLoader workers alike: parallelism comes from processes, and competing thread pools in every
process made MTCNN 2.4-2.8x slower on 2 cores (DESIGN.md)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

__all__ = ["pin_threads", "threads_pinned", "THREAD_ENV"]

THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def pin_threads() -> None:
    """One thread per library per process: on 2 cores, competing pools made MTCNN 2.4-2.8x slower
    (DESIGN.md). Parallelism comes from worker processes instead."""
    for var in THREAD_ENV:
        os.environ[var] = "1"
    import cv2

    cv2.setNumThreads(1)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


@contextlib.contextmanager
def threads_pinned() -> Iterator[None]:
    """``pin_threads`` for the duration of a block, then restore the caller's settings (a run in
    the caller's process must not leave its torch or OpenCV single-threaded)."""
    import cv2

    env = {var: os.environ.get(var) for var in THREAD_ENV}
    cv2_threads = cv2.getNumThreads()
    torch = sys.modules.get("torch")
    torch_threads = torch.get_num_threads() if torch is not None else None
    pin_threads()
    try:
        yield
    finally:
        for var, value in env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        cv2.setNumThreads(cv2_threads)
        if torch is not None and torch_threads is not None:
            torch.set_num_threads(torch_threads)
