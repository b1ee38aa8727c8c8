"""One writer per cache: an exclusive ``flock`` on the local lock file, plus a renewed lease
object on a remote cache's URL (``precache.storage.lease``) against runs on other machines."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time

from precache.cache.layout import CacheLayout
from precache.storage.durable import open_own
from precache.storage.lease import LEASE_FILE, LeaseLost, WriterLease

__all__ = ["CacheLock", "CacheBusyError", "DEFAULT_WAIT_S"]

DEFAULT_WAIT_S = 2 * 3600.0
"""How long ``precache.run(..., wait=True)`` waits for another run to finish: long enough for
most stage-1 runs, short enough that a hung writer does not hold every rank of a job forever."""
LOCAL_POLL_S = (0.05, 1.0)
"""A waiter tries the local lock every this many seconds (from the first, doubling to the
second): a ``flock`` try costs one system call."""
REMOTE_POLL_S = 5.0
"""A waiter on a remote cache tries the lease this often: each try reads an object."""


class CacheBusyError(RuntimeError):
    """Another process holds the cache's write lock. ``holder`` names it (``pid 123``, or the
    remote lease's words), or is empty where it is not known."""

    def __init__(self, message: str, holder: str = "") -> None:
        super().__init__(message)
        self.holder = holder


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
        holder = f"pid {holder or 'unknown'}"
        return CacheBusyError(
            f"cache '{self.layout.location}' is being written by another precache run "
            f"({holder}); wait for it to finish (precache run --wait) or choose another "
            "--output", holder=holder)

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
                raise CacheBusyError(str(e), holder=self._lease_holder()) from None
            self._lease = lease

    def _lease_holder(self) -> str:
        """The run holding the remote cache's writer lease, as ``host H, pid P``."""
        try:
            held = json.loads(self.layout.store.read_bytes(LEASE_FILE))
            return f"host {held.get('host', '?')}, pid {held.get('pid', '?')}"
        except (OSError, ValueError, AttributeError):  # gone meanwhile, or not precache's
            return ""

    def wait_free(self, deadline: float) -> bool:
        """Sleep until no other run holds the local lock, or until ``deadline``
        (``time.monotonic``); return whether it looked free. Polls (one ``flock`` try each,
        backing off to a second) rather than blocking, so that it can stop at the deadline.
        A remote cache's lease is another machine's: after the local lock is free this sleeps
        ``REMOTE_POLL_S`` and the caller tries the lease again. The lock may be taken again
        by the time the caller tries it: the caller loops."""
        pause = LOCAL_POLL_S[0]
        while True:
            try:
                self.check_free()
                break
            except CacheBusyError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, LOCAL_POLL_S[1])
        if self.layout.url is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(REMOTE_POLL_S, left))
        return True

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
