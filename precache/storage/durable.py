"""Writes that survive crashes and power cuts: a finished file is fsynced, renamed into place,
and its folder fsynced, so a name never points at bytes that were lost."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["atomic_write_bytes", "fsync_file", "fsync_dir"]


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a finished file's data to disk, so that a power cut cannot leave a published name
    pointing at missing bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a folder's entries (a rename into it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    ``fsync`` also makes it survive a power cut, not only a crash of the process."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: leave no half-written temporary file behind
        tmp.unlink(missing_ok=True)
        raise
