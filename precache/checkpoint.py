"""Checkpoints that a preemption cannot corrupt: written to a temporary file beside the target,
then renamed over it, so ``last.pt`` is always the previous complete checkpoint or the new one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["save_checkpoint"]


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """``torch.save(state)`` to ``path`` atomically (same-directory temp file, fsync, rename)."""
    import torch

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
