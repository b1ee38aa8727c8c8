"""The shard readers one process keeps open, and the memory they may keep.

A reader holds a file descriptor and a memory map (bounded by ``max_open``), and the decoded
data of columns that cannot be mapped (strings of older caches, compressed or multi-page
columns; bounded by ``max_decoded_bytes``). Past either bound the least recently used reader is
closed; it is opened (and decoded) again when next needed. Open files and maps belong to the
process that opened them: a forked DataLoader worker starts with none of its parent's, and a
pickled copy carries none. The ``RowTable``s of this process hold an entry per open reader and
lose it when the reader is closed.

**File descriptors.** Each open reader holds descriptors (``fds_per_reader``: one for a Parquet
shard's map, one for an HDF5 file and one for each dataset of it NumPy maps), and a process may
have only ``RLIMIT_NOFILE`` (``ulimit -n``, often 1024) open at once: a cache has thousands of
shards. So the readers of every ``OpenShards`` of a process together keep at most half of the
soft limit, less the descriptors that were open already and are not theirs (the other half is
left to the user's own files, sockets and DataLoader pipes), shared equally among those with a
reader open (``_ProcessFiles``). Each process counts its own: a forked worker has its own table
of descriptors (and its parent's, inherited, count as already open)."""

from __future__ import annotations

import functools
import os
import resource
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar, cast

from precache.cache import Cache
from precache.cache.formats import get_format
from precache.cache.formats.base import ShardReader
from precache.cache.schema import ColumnSpec

__all__ = ["OpenShards", "fds_per_reader", "open_files", "open_readers", "shard_budget",
           "soft_fd_limit"]


class _Table(Protocol):
    """A per-process row table (``RowTable``, ``FixedRows``): it forgets a shard closed."""

    def drop(self, shard: int) -> None: ...


TableT = TypeVar("TableT", bound=_Table)

_NO_LIMIT = 1 << 20
"""The soft limit taken when ``RLIMIT_NOFILE`` is unlimited."""


def soft_fd_limit() -> int:
    """This process's soft ``RLIMIT_NOFILE``: the descriptors it may have open at once."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return _NO_LIMIT if soft == resource.RLIM_INFINITY else int(soft)


def open_files() -> int:
    """Descriptors this process has open now (0 where ``/proc/self/fd`` cannot be listed)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listing it
    except OSError:
        return 0


def fds_per_reader(format_name: str, schema: dict[str, ColumnSpec]) -> int:
    """Descriptors an open reader of ``schema``'s columns holds (the format's ``descriptors``:
    a Parquet shard one, an HDF5 shard one for the file and one for each dataset NumPy maps).
    Measured in tests/precache/loading/test_open_files.py."""
    return get_format(format_name).descriptors(schema)


class _ProcessFiles:
    """The descriptors the ``OpenShards`` of this process may hold together (see the module
    docstring). ``OpenShards`` with a reader open in this process are ``active``; each may keep
    an equal share.

    The lock is re-entrant and the active ones are read from a snapshot: a dataset's finalizer
    (its readers leave) may run in a garbage collection started inside ``_count``."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._pid = -1

    def _here(self) -> None:
        if self._pid != os.getpid():  # (a forked child: its parent's readers are not its own)
            self._pid, self._soft, self._allowed = os.getpid(), -1, 0
            self._active: dict[int, weakref.ref[OpenShards]] = {}

    def _add(self, shards: OpenShards) -> None:
        key = id(shards)  # dropped without close(): it leaves when collected
        self._active[key] = weakref.ref(shards, lambda _: self._active.pop(key, None))

    def _count(self) -> None:
        """How many descriptors the active readers may hold: half the soft limit, less those
        open now that are not theirs."""
        self._soft = soft_fd_limit()
        active = [ref() for ref in list(self._active.values())]
        ours = sum(len(shards) * shards.fds_per_reader for shards in active if shards is not None)
        self._allowed = max(0, self._soft // 2 - (open_files() - ours))

    def allowed(self) -> int:
        """Descriptors all readers of this process may hold (counted now)."""
        with self._lock:
            self._here()
            self._count()
            return self._allowed

    def share(self, shards: OpenShards) -> int:
        """Readers ``shards`` may keep open (at least one), counting it active."""
        with self._lock:
            self._here()
            if id(shards) not in self._active:
                self._add(shards)
                self._count()
            elif self._soft != soft_fd_limit():  # the limit was changed (setrlimit)
                self._count()
            return max(1, self._allowed // max(1, len(self._active)) // shards.fds_per_reader)

    def leave(self, shards: OpenShards) -> None:
        """``shards`` closed its readers: the others may keep more."""
        with self._lock:
            self._here()
            if self._active.pop(id(shards), None) is not None:
                self._count()


_FILES = _ProcessFiles()


def shard_budget(fds: int) -> int:
    """Readers of ``fds`` descriptors each this process may keep open now, if they were all
    (at least one)."""
    return max(1, _FILES.allowed() // max(1, fds))


class OpenShards:
    """Shard number -> its open reader, least recently used first (see the module docstring).

    Args:
        open_reader: opens shard ``i``'s reader.
        max_open: readers kept open at once (``None``: as many as this process's share of
            descriptors allows, see the module docstring; never more than that).
        max_decoded_bytes: decoded bytes the open readers may keep together.
        fds_per_reader: descriptors a reader holds (``fds_per_reader()``).
    """

    def __init__(self, open_reader: Callable[[int], ShardReader], max_open: int | None,
                 max_decoded_bytes: int, fds_per_reader: int = 1) -> None:
        self.open_reader = open_reader
        self.max_open = None if max_open is None else max(1, int(max_open))
        self.max_decoded_bytes = max_decoded_bytes
        self.fds_per_reader = max(1, int(fds_per_reader))
        self._forget()

    def _forget(self) -> None:
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._decoded: dict[int, int] = {}  # shard -> bytes its reader keeps
        self._decoded_total = 0
        self._memos: dict[int, dict[Any, Any]] = {}  # shard -> what callers derived from it
        self._tables: dict[Any, _Table] = {}
        self._pid = os.getpid()

    def get(self, shard: int) -> ShardReader:
        """Shard ``shard``'s reader, opened if it is not (closing the oldest past ``max_open``)."""
        if self._pid != os.getpid():  # a forked worker: the parent's handles are not ours
            self._forget()
        return self._get(shard)

    def get_many(self, shards: Iterable[int]) -> list[tuple[ShardReader, dict[Any, Any]]]:
        """``(reader, memo)`` of each shard, as ``get`` (one process check for all): ``memo`` is a
        dict for what a caller derives from the reader (e.g. row readers), dropped with it."""
        if self._pid != os.getpid():
            self._forget()
        memos = self._memos
        found = []
        for shard in shards:
            reader = self._get(shard)
            memo = memos.get(shard)
            if memo is None:
                memo = memos[shard] = {}
            found.append((reader, memo))
        return found

    def row_table(self, key: Any, make: Callable[[], TableT]) -> TableT:
        """This process's row table under ``key`` (made by ``make`` the first time): its entries
        are emptied as readers close. A key names one kind of table: the one ``make`` makes."""
        if self._pid != os.getpid():
            self._forget()
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = make()
        return cast(TableT, table)

    def keep(self, shards: Iterable[int]) -> None:
        """Mark these open shards as just used, so that opening others closes them last (reads
        through a ``RowTable`` do not pass through ``get``)."""
        for shard in shards:
            if shard in self._readers:
                self._readers.move_to_end(shard)

    def opened(self, shard: int) -> bool:
        """Whether shard ``shard`` is open in this process."""
        return self._pid == os.getpid() and shard in self._readers

    def limit(self) -> int:
        """Readers this process may keep open now: ``max_open``, within its share of
        descriptors (see the module docstring)."""
        share = _FILES.share(self)
        return share if self.max_open is None else min(self.max_open, share)

    def room(self) -> int:
        """Shards that can be opened now without closing one."""
        return max(0, self.limit() - len(self))

    def _get(self, shard: int) -> ShardReader:
        reader = self._readers.get(shard)
        if reader is None:
            limit = self.limit()
            while self._readers and len(self._readers) >= limit:
                self._close_oldest()
            reader = self._readers[shard] = self.open_reader(shard)
        self._readers.move_to_end(shard)
        return reader

    def account(self, shard: int) -> None:
        """Record what shard ``shard``'s reader decoded and keeps; close the least recently used
        others while the total is over ``max_decoded_bytes``."""
        kept = self._readers[shard].nbytes
        self._decoded_total += kept - self._decoded.get(shard, 0)
        self._decoded[shard] = kept
        while self._decoded_total > self.max_decoded_bytes and len(self._readers) > 1:
            if next(iter(self._readers)) == shard:
                break
            self._close_oldest()

    def _close_oldest(self) -> None:
        oldest, reader = self._readers.popitem(last=False)
        reader.close()
        self._memos.pop(oldest, None)
        for table in self._tables.values():
            table.drop(oldest)
        self._decoded_total -= self._decoded.pop(oldest, 0)

    def __len__(self) -> int:
        return len(self._readers) if self._pid == os.getpid() else 0

    def values(self) -> Iterable[ShardReader]:
        """This process's open readers."""
        return list(self._readers.values()) if self._pid == os.getpid() else []

    def close(self) -> None:
        """Close every reader this process opened."""
        for reader in self.values():
            reader.close()
        if self._pid == os.getpid():
            _FILES.leave(self)
        self._forget()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_readers=OrderedDict(), _decoded={}, _decoded_total=0, _memos={},
                     _tables={})
        return state


def open_readers(pinned: Cache, path: str, names: list[str], max_open_shards: int | None,
                 max_decoded_bytes: int) -> OpenShards:
    """A ``CachedDataset``'s shard readers, of the requested columns ``names`` only (a shard then
    opens with fewer page headers to read); an explicit ``max_open_shards`` past this process's
    budget is capped, with a warning (raised at the dataset's caller)."""
    schema = pinned.manifest.schema
    fds = fds_per_reader(pinned.manifest.format, {n: schema[n] for n in names})
    if max_open_shards is not None and max_open_shards > (budget := shard_budget(fds)):
        warnings.warn(
            f"{path}: max_open_shards={max_open_shards} would hold up to "
            f"{max_open_shards * fds} file descriptors ({fds} a shard), past half of this "
            f"process's open-file limit ({soft_fd_limit()}, `ulimit -n`) less those open; "
            f"keeping at most {budget} shards open at once (raise `ulimit -n` to keep more)",
            stacklevel=4)  # (open_readers < CachedDataset._open < __init__ < the caller)
    return OpenShards(functools.partial(pinned.reader, columns=names),
                      max_open_shards, max_decoded_bytes, fds)
