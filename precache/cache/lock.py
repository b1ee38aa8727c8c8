"""One writer per cache: an exclusive ``flock`` on the local lock file, plus a renewed lease
object on a remote cache's URL (``precache.storage.lease``) against runs on other machines."""

from __future__ import annotations

import errno
import fcntl
import os

from precache.cache.layout import CacheLayout
from precache.storage.lease import LeaseLost, WriterLease

__all__ = ["CacheLock", "CacheBusyError"]


class CacheBusyError(RuntimeError):
    """Another process holds the cache's write lock."""


class CacheLock:
    """Exclusive, non-blocking ``flock`` on ``CACHE/.lock``; released by the kernel if the
    holder dies (kill -9), so a crashed run never blocks the next one. For a remote cache the
    flock is in the local working directory, and a ``WriterLease`` on the URL keeps out runs on
    other machines."""

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self._fd: int | None = None
        self._lease: WriterLease | None = None

    def acquire(self) -> None:
        """Take the lock or raise ``CacheBusyError`` naming the holder."""
        self.layout.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.layout.lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise CacheBusyError(
                    f"cache '{self.layout.location}' is being written by another precache run "
                    f"(pid {holder}); wait for it to finish or choose another --output"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        if self.layout.url is not None:
            lease = WriterLease(self.layout.store)
            try:
                lease.acquire()
            except LeaseLost as e:
                self.release()
                raise CacheBusyError(str(e)) from None
            self._lease = lease

    def check(self) -> None:
        """Before publishing: raise ``CacheBusyError`` if another run took the remote lease."""
        if self._lease is not None:
            try:
                self._lease.check()
            except LeaseLost as e:
                raise CacheBusyError(f"{e}; this run did not publish its manifest") from None

    def release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> CacheLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
