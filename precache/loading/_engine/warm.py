"""``ShardWarmer``: reads whole shard files into the page cache in a background thread.

A cache that fits in memory is read fastest in large sequential reads, but a shuffled epoch
touches its shards one random row at a time. The kernel's own read-ahead does not help here:
read-ahead is off for the mapped shards (``MADV_RANDOM``: past RAM it would read megabytes per
row), and ``madvise(MADV_WILLNEED)`` over a whole file is capped at the read-ahead window and
dropped when the disk queue is busy. So a thread reads each shard a batch has touched, once:
``sendfile`` to ``/dev/null`` makes the kernel read the file into the page cache without
copying it into this process (no buffer, no private memory; the GIL is released while it
waits on the disk). After the first batches, every row is served from memory.

Several threads read at once: one file at a time leaves the disk one request deep, and small
shards are read no faster than they are requested (782 files of 290 KB: 0.32-0.35 s with one
thread, 0.22-0.23 s with four, where one 210 MB file took 0.10-0.16 s).
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

__all__ = ["ShardWarmer"]

_CHUNK = 4 << 20
"""Bytes per ``sendfile`` call."""

THREADS = 4
"""Files read at once (each thread waits on the disk with the GIL released)."""


class ShardWarmer:
    """Reads the files it is given, each once, about in the order given, in ``threads``
    daemon threads.

    Create it in the process that reads (a thread does not survive a fork).
    """

    def __init__(self, threads: int = THREADS) -> None:
        self._queue: queue.SimpleQueue[Path | None] = queue.SimpleQueue()
        self._seen: set[Path] = set()
        self._pid, self._closed = os.getpid(), False
        self._threads = [threading.Thread(target=self._run, name="precache-warm", daemon=True)
                         for _ in range(threads)]
        for thread in self._threads:
            thread.start()

    def warm(self, path: Path) -> None:
        """Queue ``path`` to be read, unless it was queued before."""
        if path not in self._seen and not self._closed:
            self._seen.add(path)
            self._queue.put(path)

    def close(self) -> None:
        """Stop (what is queued is dropped; a file being read stops at its next chunk) and
        wait for the threads to end, in the process that made them (a forked copy has none to
        stop). A second call does nothing."""
        if self._pid != os.getpid() or self._closed:
            return
        self._closed = True
        try:  # what is still queued is not read
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        for _ in self._threads:
            self._queue.put(None)
        self._seen.clear()
        for thread in self._threads:
            if thread is not threading.current_thread():  # (a finalizer may run in one)
                thread.join()

    def _run(self) -> None:
        sink = os.open(os.devnull, os.O_WRONLY)
        try:
            while (path := self._queue.get()) is not None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue  # gone (evicted from a disk cache): the reader reports it if needed
                try:
                    offset = 0
                    while not self._closed and (sent := os.sendfile(sink, fd, offset, _CHUNK)):
                        offset += sent
                except OSError:
                    pass  # only a hint: the reads that matter happen in the gather
                finally:
                    os.close(fd)
        finally:
            os.close(sink)
