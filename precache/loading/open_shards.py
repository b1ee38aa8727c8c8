"""The shard readers one process keeps open, and the memory they may keep.

A reader holds a file descriptor and a memory map (bounded by ``max_open``), and the decoded
data of columns that cannot be mapped (strings of older caches, compressed or multi-page
columns; bounded by ``max_decoded_bytes``). Past either bound the least recently used reader is
closed; it is opened (and decoded) again when next needed. Open files and maps belong to the
process that opened them: a forked DataLoader worker starts with none of its parent's, and a
pickled copy carries none. The ``RowTable``s of this process hold an entry per open reader and
lose it when the reader is closed."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from precache.cache.formats.base import ShardReader
from precache.loading.row_table import RowTable

__all__ = ["OpenShards"]


class OpenShards:
    """Shard number -> its open reader, least recently used first (see the module docstring).

    Args:
        open_reader: opens shard ``i``'s reader.
        max_open: readers kept open at once.
        max_decoded_bytes: decoded bytes the open readers may keep together.
    """

    def __init__(self, open_reader: Callable[[int], ShardReader], max_open: int,
                 max_decoded_bytes: int) -> None:
        self.open_reader, self.max_open = open_reader, max(1, int(max_open))
        self.max_decoded_bytes = max_decoded_bytes
        self._forget()

    def _forget(self) -> None:
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._decoded: dict[int, int] = {}  # shard -> bytes its reader keeps
        self._decoded_total = 0
        self._memos: dict[int, dict[Any, Any]] = {}  # shard -> what callers derived from it
        self._tables: dict[Any, RowTable] = {}
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

    def row_table(self, key: Any, make: Callable[[], RowTable]) -> RowTable:
        """This process's row table under ``key`` (made by ``make`` the first time): its entries
        are emptied as readers close."""
        if self._pid != os.getpid():
            self._forget()
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = make()
        return table

    def keep(self, shards: Iterable[int]) -> None:
        """Mark these open shards as just used, so that opening others closes them last (reads
        through a ``RowTable`` do not pass through ``get``)."""
        for shard in shards:
            if shard in self._readers:
                self._readers.move_to_end(shard)

    def opened(self, shard: int) -> bool:
        """Whether shard ``shard`` is open in this process."""
        return self._pid == os.getpid() and shard in self._readers

    def _get(self, shard: int) -> ShardReader:
        reader = self._readers.get(shard)
        if reader is None:
            if len(self._readers) >= self.max_open:
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
        self._forget()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_readers=OrderedDict(), _decoded={}, _decoded_total=0, _memos={},
                     _tables={})
        return state
