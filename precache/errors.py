"""Errors that more than one layer raises, and how a message quotes a value it cannot trust.

``RunError`` lives here, not in ``precache.processing``, so that the executors and the cache's write
transaction can raise it without importing the runner that calls them."""

from __future__ import annotations

import errno

__all__ = ["DISK_FULL", "RunError", "UsageError", "disk_full", "short_repr"]

DISK_FULL = {errno.ENOSPC: "no space left on device", errno.EROFS: "read-only file system"}
"""errno -> words for the writes that fail for want of space (or of a writable file system)."""
if hasattr(errno, "EDQUOT"):
    DISK_FULL[errno.EDQUOT] = "disk quota exceeded"


class RunError(RuntimeError):
    """The run cannot continue; the message says what happened, where, and what to do."""


class UsageError(ValueError):
    """A value the user gave (a ``--set`` parameter, an argument) is wrong; the message names it
    and the fix. The ``precache`` command prints it as one line and exits 2."""


def short_repr(value: object) -> str:
    """``repr`` of a value read from a manifest, cut short, for a one-line message."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def disk_full(error: BaseException | None) -> OSError | None:
    """``error`` if it is an ``OSError`` for a full disk, an exhausted quota or a read-only file
    system (``DISK_FULL``), else None. pyarrow's write errors are such ``OSError``s too."""
    if isinstance(error, OSError) and error.errno in DISK_FULL:
        return error
    return None
