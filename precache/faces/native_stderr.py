"""``native_stderr_silenced``: MediaPipe's C++ start-up log kept out of the progress bar, for the
face mesh (``precache.processing.ops.face_mesh``) and BlazeFace (``precache.faces.blazeface``).
Its own module, below both, so that ``precache.faces`` need not import ``precache.processing``."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

__all__ = ["native_stderr_silenced"]


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null: MediaPipe's C++ start-up logs ("Created TensorFlow
    Lite XNNPACK delegate", feedback-tensor and NORM_RECT warnings) ignore every log-level setting
    and would otherwise print once per worker into the progress bar."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
