"""``ShardWarmer``: reads whole shard files into the page cache in a background thread.

A cache that fits in memory is read fastest in large sequential reads, but a shuffled epoch
touches its shards one random row at a time. The kernel's own read-ahead does not help here:
read-ahead is off for the mapped shards (``MADV_RANDOM``: past RAM it would read megabytes per
row), and ``madvise(MADV_WILLNEED)`` over a whole file is capped at the read-ahead window and
dropped when the disk queue is busy. So a thread reads each shard a batch has touched, once:
``sendfile`` to ``/dev/null`` makes the kernel read the file into the page cache without
copying it into this process (no buffer, no private memory; the GIL is released while it
waits on the disk). After the first batches, every row is served from memory.
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

__all__ = ["ShardWarmer"]

_CHUNK = 4 << 20
"""Bytes per ``sendfile`` call."""


class ShardWarmer:
    """Reads the files it is given, each once, in the order given, in a daemon thread.

    Create it in the process that reads (a thread does not survive a fork).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Path | None] = queue.SimpleQueue()
        self._seen: set[Path] = set()
        self._thread = threading.Thread(target=self._run, name="precache-warm", daemon=True)
        self._thread.start()

    def warm(self, path: Path) -> None:
        """Queue ``path`` to be read, unless it was queued before."""
        if path not in self._seen:
            self._seen.add(path)
            self._queue.put(path)

    def close(self) -> None:
        """Stop after the file being read."""
        self._queue.put(None)

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
                    while sent := os.sendfile(sink, fd, offset, _CHUNK):
                        offset += sent
                except OSError:
                    pass  # only a hint: the reads that matter happen in the gather
                finally:
                    os.close(fd)
        finally:
            os.close(sink)
