"""One writer per cache: an exclusive ``flock`` on the local lock file, plus a renewed lease
object on a remote cache's URL (``precache.storage.lease``) against runs on other machines."""

from __future__ import annotations

import errno
import fcntl
import os
import time

from precache.cache.layout import CacheLayout
from precache.storage.durable import open_own
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

    def _busy(self, fd: int) -> CacheBusyError:
        """The error naming the run that holds the lock open as ``fd``. It writes its pid just
        after taking the lock: wait for it a moment rather than say "unknown"."""
        holder = ""
        for _ in range(50):
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            if holder:
                break
            time.sleep(0.01)
        return CacheBusyError(
            f"cache '{self.layout.location}' is being written by another precache run "
            f"(pid {holder or 'unknown'}); wait for it to finish or choose another --output")

    def check_free(self) -> None:
        """Raise ``CacheBusyError`` naming the holder if another run holds the lock; create
        nothing (a folder that is not a cache gets no ``.lock`` from this). A run that took the
        lock an instant ago may have written nothing else yet, or only a temporary file: the
        lock, not the folder's files, tells that it is a cache being written.

        Raises:
            CacheBusyError: another run holds the lock.
            LinkRefusedError: ``.lock`` is a symbolic link (or not a plain file).
        """
        try:
            fd = open_own(self.layout.lock, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise self._busy(fd) from None
            raise
        finally:
            os.close(fd)  # also lets go of the shared lock at once

    def acquire(self) -> None:
        """Take the lock or raise ``CacheBusyError`` naming the holder. ``.lock`` is opened
        without following a link, and must be a plain file with one name: the pid written
        into it goes nowhere else.

        Raises:
            CacheBusyError: another run holds the lock.
            LinkRefusedError: ``.lock`` is a symbolic link (or not a plain file).
        """
        self.layout.root.mkdir(parents=True, exist_ok=True)
        fd = open_own(self.layout.lock, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                busy = self._busy(fd)
                os.close(fd)
                raise busy from None
            os.close(fd)
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
