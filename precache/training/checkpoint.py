"""Checkpoints that a preemption cannot corrupt and that cannot run code when loaded.

``save_checkpoint`` writes to a temporary file beside the target, then renames it over it, so
``last.pt`` is always the previous complete checkpoint or the new one. ``load_checkpoint`` reads
only tensors and plain data (``torch.load(weights_only=True)``): a checkpoint on a shared file
system is written by whoever can write there, and a full unpickle would run any code it names.

A path that is no loadable checkpoint is ``CheckpointUnreadable`` (a ``CheckpointRefused``, which
the trainers print as one line): missing, a directory (say which file to pass instead: ``last.pt``
inside it, or for an fsdp shard folder the ``last.pt`` beside it that names it), empty, truncated
(with its size), or not a PyTorch checkpoint at all (e.g. a text file)."""

from __future__ import annotations

import codecs
import os
import pickle
import re
import struct
import zipfile
from pathlib import Path
from typing import Any

__all__ = ["CheckpointRefused", "CheckpointUnreadable", "load_checkpoint",
           "save_checkpoint"]

# Globals beyond torch's weights-only defaults that precache's own states need. None today: model,
# optimizer, GradScaler, sampler, loader and schedule states are tensors, numbers, strings, None,
# and lists, tuples and dicts of them. A state that adds a type must add it here, reviewed.
SAFE_GLOBALS: list[Any] = []


class CheckpointRefused(pickle.UnpicklingError):
    """A checkpoint is not loaded: it holds something other than tensors and plain data, or
    (``CheckpointUnreadable``) it is no whole PyTorch checkpoint. The message is one line naming
    the file."""


class CheckpointUnreadable(CheckpointRefused):
    """The path is missing, a directory, empty, truncated, or not a PyTorch checkpoint."""


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
        CheckpointUnreadable: ``path`` does not exist, is a directory (an fsdp checkpoint is the
            file ``last.pt``, which names its shard folder), is empty, is truncated, or is not a
            PyTorch checkpoint; one line saying which.
        CheckpointRefused: the file names a function or class outside that list (e.g. one whose
            unpickling would run code); the message is one line naming the file and the global.
    """
    import torch

    named = isinstance(path, (str, os.PathLike))  # not a file object
    if named and os.path.isdir(path):
        raise CheckpointUnreadable(_directory_message(Path(path)))
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        wrong = _what_is_wrong(Path(path), e) if named else None
        if wrong is not None:
            raise CheckpointUnreadable(f"cannot load checkpoint {os.fspath(path)}: "
                                       f"{wrong}") from None
        if not isinstance(e, pickle.UnpicklingError):
            raise
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = found[1] if found else "an object that is not a tensor or plain data"
        raise CheckpointRefused(
            f"refusing to load checkpoint {os.fspath(path)}: it holds {what}, and loading it could "
            "run code (only tensors and plain data are loaded: torch.load weights_only=True)"
        ) from None


_ZIP = b"PK\x03\x04"
# torch.save's legacy (non-zip) format starts with a pickled magic number (protocol 2, LONG1).
_LEGACY = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_EARLIER = "resume from an earlier checkpoint (or copy this one again), or start without it"


def _what_is_wrong(path: Path, error: BaseException) -> str | None:
    """Why ``path`` is no loadable checkpoint, or None when the file looks whole (the error is
    about its contents)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(64)
    except FileNotFoundError:
        return "no such file; give the checkpoint file a trainer wrote (e.g. OUT/last.pt)"
    except OSError:
        return None  # unreadable for another reason (permissions...): torch's error says it
    if size == 0:
        return f"it is empty (0 bytes), not a checkpoint; {_EARLIER}"
    if head.startswith(_ZIP):
        if not zipfile.is_zipfile(path):  # the zip's directory, at its end, is missing
            return (f"it is truncated ({size} bytes): a PyTorch checkpoint is a zip archive and "
                    f"this one has no end (a partial copy, or a write cut short); {_EARLIER}")
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
                if not any(n.endswith("data.pkl") for n in names):
                    return ("it is a zip archive but not a PyTorch checkpoint (no data.pkl "
                            "inside); give a file torch.save wrote (e.g. OUT/last.pt)")
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            return f"it is damaged ({size} bytes; {e}); {_EARLIER}"
        if bad is not None:
            return f"it is damaged ({size} bytes; {bad} fails its CRC check); {_EARLIER}"
        return None
    if head.startswith(_LEGACY):
        # what reading past the end raises in torch's unpicklers and storage reader
        if (isinstance(error, (EOFError, struct.error, IndexError))
                or re.search(r"truncated|\bEOF\b|end of file", str(error), re.IGNORECASE)):
            return f"it is truncated ({size} bytes); {_EARLIER}"
        return None
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(head)
    if "\ufffd" not in text and all(c.isprintable() or c.isspace() for c in text):
        first = text.strip().splitlines()[0][:24] if text.strip() else text
        what = f"it is text (it begins {first!r})"
    else:
        what = f"it begins with the bytes {head[:8]!r}"
    return (f"it is not a PyTorch checkpoint: {what}, where torch.save writes a zip archive; "
            "give the checkpoint file a trainer wrote (e.g. OUT/last.pt)")


def _directory_message(path: Path) -> str:
    """What to pass instead of the directory ``path``."""
    start = f"cannot load checkpoint {path}: it is a directory"
    if (path / ".metadata").is_file():  # an fsdp shard folder (torch.distributed.checkpoint)
        stem = path.name.split(".shards-")[0]
        named_by = path.with_name(f"{stem}.pt")
        return (f"{start} of fsdp shards (torch.distributed.checkpoint); pass the checkpoint "
                f"file that names it, {named_by}, which loads them")
    inside = sorted(p.name for p in path.glob("*.pt") if p.is_file())
    if "last.pt" in inside:
        return f"{start}; pass the checkpoint file inside it: {path / 'last.pt'}"
    if inside:
        shown = ", ".join(str(path / name) for name in inside[:3])
        more = f" (and {len(inside) - 3} more)" if len(inside) > 3 else ""
        return f"{start}; pass one of the checkpoint files inside it: {shown}{more}"
    return (f"{start} holding no .pt file; pass a checkpoint file (a trainer writes "
            "OUT/last.pt)")
