"""Checkpoints that a preemption cannot corrupt and that cannot run code when loaded.

``save_checkpoint`` writes to a temporary file beside the target, then renames it over it, so
``last.pt`` is always the previous complete checkpoint or the new one. ``load_checkpoint`` reads
only tensors and plain data (``torch.load(weights_only=True)``): a checkpoint on a shared file
system is written by whoever can write there, and a full unpickle would run any code it names."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

__all__ = ["CheckpointRefused", "load_checkpoint", "save_checkpoint"]

# Globals beyond torch's weights-only defaults that precache's own states need. None today: model,
# optimizer, GradScaler, sampler, loader and schedule states are tensors, numbers, strings, None,
# and lists, tuples and dicts of them. A state that adds a type must add it here, reviewed.
SAFE_GLOBALS: list[Any] = []


class CheckpointRefused(pickle.UnpicklingError):
    """A checkpoint holds something other than tensors and plain data: it is not loaded."""


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


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = None) -> Any:
    """``torch.load(path, weights_only=True)``, allowing ``SAFE_GLOBALS`` too.

    Raises:
        CheckpointRefused: the file names a function or class outside that list (e.g. one whose
            unpickling would run code); the message is one line naming the file and the global.
    """
    import torch

    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = found[1] if found else "an object that is not a tensor or plain data"
        raise CheckpointRefused(
            f"refusing to load checkpoint {os.fspath(path)}: it holds {what}, and loading it could "
            "run code (only tensors and plain data are loaded: torch.load weights_only=True)"
        ) from None
