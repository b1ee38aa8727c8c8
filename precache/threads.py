"""One thread per native library in each worker process, for stage-1 workers and stage-2
DataLoader workers alike: parallelism comes from processes, and competing thread pools in every
process made MTCNN 2.4-2.8x slower on 2 cores (DESIGN.md)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

__all__ = ["pin_threads", "threads_pinned", "THREAD_ENV", "guard_opencv_forks"]

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


_OPENCV_FORK_GUARD = [False]


def guard_opencv_forks() -> None:
    """Make ``os.fork`` safe for OpenCV in this process (once): before each fork, OpenCV's
    thread pool is stopped (one thread), and restarted in the parent afterwards.

    OpenCV's pool, once a parallel OpenCV call has run in any thread other than the main one (a
    loader thread decoding or augmenting), is copied half-alive into a forked child, whose first
    ``cv2.setNumThreads`` then waits forever: every DataLoader worker process that
    ``make_loader`` forks calls it (``pin_threads``). Measured: the child hung without this guard
    and started at once with it. Forks are rare (worker start-up), so stopping the pool costs
    nothing that matters."""
    if _OPENCV_FORK_GUARD[0]:
        return
    _OPENCV_FORK_GUARD[0] = True
    saved: list[int] = []

    def before() -> None:
        cv2 = sys.modules.get("cv2")
        if cv2 is not None:
            saved.append(cv2.getNumThreads())
            cv2.setNumThreads(1)

    def after_in_parent() -> None:
        cv2 = sys.modules.get("cv2")
        if cv2 is not None and saved:
            cv2.setNumThreads(saved.pop())

    os.register_at_fork(before=before, after_in_parent=after_in_parent)
