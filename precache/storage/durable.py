"""Writes that survive crashes and power cuts: a finished file is fsynced, renamed into place,
and its folder fsynced, so a name never points at bytes that were lost.

**Never through a link.** The files precache writes in a cache (its lock, temporary names under
``.staging/``, the temporary name of every atomic write: journal entries, manifests, the marker)
are opened with ``O_NOFOLLOW`` and, where they are new, created with ``O_EXCL``: a symbolic link
planted at such a name (by another user of a shared folder, or a mistaken ``ln -s``) is refused
in one line (``LinkRefusedError``) and nothing is written where it points. A rename into place
replaces a link at the final name itself, never its target."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from precache.errors import RunError

__all__ = ["atomic_write_bytes", "fsync_file", "fsync_dir", "LinkRefusedError", "create_new",
           "open_own", "same_file"]

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class LinkRefusedError(RunError):
    """A file precache writes in a cache is a symbolic link (or not a plain file): it is not
    written through. The message names the file and the fix."""


def refused(path: str | os.PathLike[str], what: str) -> LinkRefusedError:
    """The one-line error for the name ``path`` that is ``what`` (a symbolic link, ...)."""
    return LinkRefusedError(
        f"'{path}' is {what}; precache writes this file of the cache itself and never writes "
        f"through a link or into another file: remove '{path}' (rm) and re-run")


def _what(path: str | os.PathLike[str]) -> str | None:
    """What is at ``path`` if it is not a plain file with one name (``lstat``: a link is not
    followed); ``None`` for a plain file, or nothing there."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(found.st_mode):
        return "a symbolic link"
    if not stat.S_ISREG(found.st_mode):
        return "not a plain file"
    return "a file with other hard links" if found.st_nlink > 1 else None


def create_new(path: str | os.PathLike[str]) -> int:
    """Create ``path`` as a new, empty file for writing and return its descriptor, never
    following a link (``O_EXCL | O_NOFOLLOW``). A plain file already there is a temporary one
    that a crashed process of the same pid left: it is replaced.

    Raises:
        LinkRefusedError: a link, or anything but a plain file, is at ``path`` (left alone).
    """
    try:
        return os.open(path, _NEW, 0o666)
    except FileExistsError:
        what = _what(path)
        if what is not None:
            raise refused(path, what) from None
        os.unlink(path)
        try:
            return os.open(path, _NEW, 0o666)
        except FileExistsError:  # planted meanwhile
            raise refused(path, _what(path) or "a file created meanwhile") from None


def open_own(path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags | O_NOFOLLOW)`` of a file precache owns and keeps (the lock),
    checked to be a plain file with one name.

    Raises:
        LinkRefusedError: ``path`` is a link, not a plain file, or has other hard links.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise refused(path, _what(path) or "not a plain file") from None
        raise
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode) or found.st_nlink > 1:
        os.close(fd)
        raise refused(path, "not a plain file" if not stat.S_ISREG(found.st_mode)
                      else "a file with other hard links")
    return fd


def same_file(fd: int, path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` (not followed) is still the file open as ``fd``: a file written by
    name after ``create_new`` made it was not swapped for a link meanwhile."""
    try:
        named, opened = os.lstat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


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

    ``fsync`` also makes it survive a power cut, not only a crash of the process.

    Raises:
        LinkRefusedError: a link is planted at the temporary name (``.NAME.tmp-PID``).
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    # (a link planted at the temporary name is refused and left alone: not in the try below)
    out = open(tmp, "wb", opener=lambda name, flags: create_new(name))
    try:
        with out as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: leave no half-written temporary file behind
        tmp.unlink(missing_ok=True)
        raise
