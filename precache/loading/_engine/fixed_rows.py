"""Fixed-shape columns of every open shard by dataset index: a batch is one gather a column,
whatever shards it touches (wide rows, where that is safe, into arrays that start on a cache
line).

A shuffled batch of 256-row shards touches a shard every few rows, and anything done once a
shard (a lookup, a ``np.take`` call) cost more than the rows of a small column (``label`` read
at 0.04 of a memmap's gather, 128 px crops at 0.65). A row's bytes are at its shard's view
address plus ``row * row_bytes``, so ``FixedRows`` keeps, per column, where each open shard's
rows start, and reads a batch as one gather from a ``_Span``: an array of row-wide items one
``step`` apart spanning every open shard's view. The offsets of a batch's rows in every column
take a few vector operations, and the copy runs without the GIL (thread workers gather in
parallel).

Where the rows land matters as much as where they come from (``batch_arrays``: wide rows
copied into arrays that start on 64 bytes took 870 us a batch where NumPy's own arrays took
1,080). NumPy has no gather into a given array from a source that is not contiguous, so wide
rows (``WIDE_ROW_BYTES`` or more) are copied into ``aligned_empty``'s arrays one of two ways:

- **As pages**, where every row is a whole number of 4 KB pages and starts on one (stage 1
  starts such columns on a page of the file, ``PAGE_ALIGNMENT``, and a mapped file's bytes lie
  as they do on its pages): the span read as an array of pages *is* contiguous, so one
  ``np.take(out=)`` of the batch's pages fills the array. It runs on the calling thread alone,
  whatever torch's thread count, and is fork-safe. NumPy checks that ``out`` does not overlap
  the source by address range alone, and gathers into a temporary first (a second copy) where it
  might, so the page copy is used only into arrays outside the pages' range: on a process's main
  thread (a loader without workers, a DataLoader worker process, a rank), whose arrays come from
  glibc's heap below the maps, and into a caller's arrays where they lie outside. A thread
  worker's arrays come from its thread's glibc arena, which lies among the shards' maps (184 of
  186 batches inside the range; 2 thread workers read 0.31-0.38 of the limit as pages, 0.79-0.81
  as before), so thread workers copy as before, without making an array first.
- **By ``torch.index_select(out=)``**, only while torch runs one intra-op thread
  (``torch.get_num_threads() == 1``: torchrun's ranks, DataLoader worker processes). With more,
  it splits the copy among OpenMP threads, and GNU OpenMP is not fork-safe: a process forked
  after that hangs in its next parallel region (the ranks of ``bench_gather.py --ranks 2``,
  forked after the parent had read a batch, hung in their first read). So with more threads
  NumPy's own gather copies such rows, into its own arrays. A caller's ``empty`` (a thread
  loader's pinned memory, so a CUDA process) is filled by ``index_select`` where the rows are
  not pages or it lies inside their range: gathering and then copying read at half the rate.

Narrower rows are copied by NumPy's own gather (about 5 us a column less for 8-byte rows).
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from precache.loading._engine.batch_arrays import aligned_empty
from precache.loading._engine.row_table import ShardsReady

__all__ = ["FixedRows", "WIDE_ROW_BYTES"]

WIDE_ROW_BYTES = 16 << 10
"""Rows at least this wide are copied into ``aligned_empty``'s arrays (see the module)."""

PAGE = 4096
"""Rows a whole number of these wide, each starting on one, are copied as pages (the module)."""


Plan = tuple[list["_Span"], np.ndarray]
"""Each column's span, and the batch's rows' offsets in them (one row of offsets a column)."""


class FixedRows(ShardsReady):
    """Fixed-shape columns ``names`` of a dataset by dataset index (see the module docstring).

    Only the views of shards open in this process are held (``drop`` as ``OpenShards`` closes
    a reader), so the table keeps no more files mapped than the open-file budget allows; a
    batch whose shards cannot all be open at once is read the per-shard way.

    Args:
        names: the columns, in the order ``read`` returns them.
        specs: each column's ``(dtype, shape)``.
        first: the dataset index of each shard's first row, and the dataset's length last.
        shard_of, rows: the shard and the row in its shard of every dataset index.

    Attributes:
        ready, complete, usable: as ``RowTable``'s.
    """

    def __init__(self, names: Sequence[str], specs: Sequence[tuple[np.dtype, tuple[int, ...]]],
                 first: np.ndarray, shard_of: np.ndarray, rows: np.ndarray) -> None:
        self.names, self._specs = list(names), list(specs)
        self._first, self._shard_of, self._rows = first, shard_of, rows
        shards = len(first) - 1
        super().__init__(shards)
        self.usable = True
        self._row_bytes = [int(np.dtype(dtype).itemsize * math.prod(shape))
                           for dtype, shape in self._specs]
        self._address = np.zeros((len(self.names), shards), dtype=np.int64)
        self._views: list[list[np.ndarray | None]] = [[None] * shards for _ in self.names]
        # rebuilt after a shard is added or dropped: the spans, where each shard's rows start
        # in them and how far apart a shard's rows are (both in steps, one row a column)
        self._spans: list[_Span] | None = None
        self._starts = np.zeros((len(self.names), shards), dtype=np.int64)
        self._row_steps = np.zeros((len(self.names), 1), dtype=np.int64)

    def add(self, shard: int, views: dict[str, np.ndarray]) -> bool:
        """Make shard ``shard`` ready from its mapped views. False, leaving the table unusable,
        if a column is not mapped, its rows are not contiguous, or a row is past its end."""
        lo, hi = int(self._first[shard]), int(self._first[shard + 1])
        found = [views.get(name) for name in self.names]
        for view, (dtype, shape) in zip(found, self._specs):
            if (view is None or view.dtype != dtype or view.shape[1:] != tuple(shape)
                    or not view.flags.c_contiguous or view.dtype.hasobject
                    or (hi > lo and int(self._rows[lo:hi].max()) >= len(view))):
                self.usable = False
                return False
        for k, view in enumerate(found):
            assert view is not None
            self._views[k][shard] = view
            self._address[k, shard] = view.ctypes.data
        self._mark_ready(shard)
        self._spans = None
        return True

    def drop(self, shard: int) -> None:
        """Shard ``shard`` is being closed: let go of its views (its file is unmapped once no
        batch in flight holds them)."""
        if self._mark_closed(shard):
            for views in self._views:
                views[shard] = None
            self._spans = None

    def plan(self, indices: np.ndarray) -> Plan | None:
        """Each column's span and the batch's offsets in it; ``None`` unless every shard of
        ``indices`` is ready. Call under the dataset's lock; ``gather`` may run outside it (the
        spans hold the views of the shards they cover, so their files stay mapped).

        Raises:
            IndexError: an index is out of range."""
        shards = self._shard_of[indices]
        if not self.complete and not self.ready[shards].all():
            return None
        if self._spans is None:
            self._build_spans()
        assert self._spans is not None
        return self._spans, self._starts[:, shards] + self._rows[indices] * self._row_steps

    def _build_spans(self) -> None:
        """The spans of the ready shards' views, and where each shard's rows start in them."""
        spans = [_Span([v for v in views if v is not None], width)
                 for views, width in zip(self._views, self._row_bytes)]
        lows = np.array([span.low for span in spans], dtype=np.int64)[:, None]
        steps = np.array([span.step for span in spans], dtype=np.int64)[:, None]
        self._starts = (self._address - lows) // steps  # (shards not ready: never read)
        self._row_steps = np.array(self._row_bytes, dtype=np.int64)[:, None] // steps
        self._spans = spans

    def gather(self, plan: Plan, empty: Callable[..., np.ndarray] | None = None,
               ) -> dict[str, np.ndarray]:
        """The columns' rows of a ``plan``, one array each, without the GIL: rows narrower than
        ``WIDE_ROW_BYTES`` by NumPy's gather, wider ones into ``aligned_empty``'s arrays (or
        given ``empty(shape, dtype)``'s: pinned memory) as whole pages where they lie on pages
        (on the main thread, or into given arrays, and outside the pages' address range), else
        by ``index_select`` while torch runs one thread (see the module)."""
        spans, offsets = plan
        count = offsets.shape[1]
        serial = torch.get_num_threads() == 1  # (no OpenMP region opened: forks stay safe)
        main = threading.current_thread() is threading.main_thread()
        out = {}
        for k, (name, (dtype, shape), span) in enumerate(zip(self.names, self._specs, spans)):
            pages = span.pages is not None and (main or empty is not None)
            if empty is None and (span.width < WIDE_ROW_BYTES or not (serial or pages)):
                out[name] = span.take(offsets[k], dtype, shape)
                continue
            array = out[name] = (empty or aligned_empty)((count, *shape), dtype)
            if not array.flags.c_contiguous:  # (reshape would copy: write through indexing)
                array[...] = span.take(offsets[k], dtype, shape)
            elif not (count and span.width):
                continue
            elif pages and not np.may_share_memory(array, span.pages):  # (see copy_pages)
                span.copy_pages(offsets[k], array)
            elif serial or empty is not None:
                span.copy_rows(offsets[k], array)
            else:  # (inside the pages' address range, and no fork-safe copy into it)
                out[name] = span.take(offsets[k], dtype, shape)
        return out


class _Span:
    """The address range from the lowest to the highest byte of some views, as an array of
    ``width``-byte rows one ``step`` apart (only the rows at the views' rows are ever read),
    and the views, which it holds so that their files stay mapped while it is used.

    ``step`` is the largest of 8, 4, 2 and 1 bytes that divides ``width`` and every view's
    address: a row is ``width // step`` integers of ``step`` bytes, so NumPy copies a batch
    without the GIL (as ``np.take`` does; as one ``width``-byte ``void`` item a row it held the
    GIL), and torch, whose strides count elements, can read the same rows as a tensor."""

    def __init__(self, views: list[np.ndarray], width: int) -> None:
        self.views, self.width = views, width
        self._raw: Any = None
        self._tensor: torch.Tensor | None = None
        self.pages: np.ndarray | None = None  # (rows of whole pages, each starting on one)
        starts = [view.ctypes.data for view in views if view.size]
        ends = [view.ctypes.data + view.nbytes for view in views if view.size]
        self.low = min(starts, default=0)
        size = max(ends, default=0) - self.low
        self.step = next(s for s in (8, 4, 2, 1)
                         if width % s == 0 and all(a % s == 0 for a in starts)) if width else 1
        dtype = np.dtype(f"i{self.step}" if self.step > 1 else "u1")
        if size < width or width == 0:
            self.items = np.empty((0, width // self.step), dtype=dtype)
            return
        raw = self._raw = (ctypes.c_char * size).from_address(self.low)
        # (numpy's stubs omit ctypes arrays from what ``buffer`` takes; they are buffers)
        self.items = np.ndarray(shape=((size - width) // self.step + 1, width // self.step),
                                dtype=dtype, buffer=raw,  # type: ignore[arg-type]
                                strides=(self.step, self.step))
        self.items.flags.writeable = False
        if width % PAGE == 0 and self.step == 8 and all((a - self.low) % PAGE == 0
                                                         for a in starts):
            self.pages = np.ndarray(shape=(size // PAGE, PAGE // 8), dtype=np.int64,
                                    buffer=raw)  # type: ignore[arg-type]
            self.pages.flags.writeable = False

    def take(self, offsets: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The rows at ``offsets`` (in steps) as a new ``(len(offsets), *shape)`` array of
        ``dtype``, by NumPy's gather."""
        return self.items[offsets].view(dtype).reshape(len(offsets), *shape)

    def copy_pages(self, offsets: np.ndarray, array: np.ndarray) -> None:
        """Copy the rows at ``offsets`` (in steps) into ``array`` (C-contiguous, one row of
        ``width`` bytes each) page by page, by one ``np.take`` from ``pages``."""
        assert self.pages is not None
        first = offsets * self.step // PAGE
        pages = (first[:, None] + np.arange(self.width // PAGE)).ravel()
        target = array.reshape(len(offsets), -1).view(np.uint8).view(np.int64)
        # (mode="clip": the offsets are in range by construction, and "raise" would gather
        # into a temporary copy of ``array`` first)
        np.take(self.pages, pages, axis=0, out=target.reshape(len(pages), -1), mode="clip")

    def copy_rows(self, offsets: np.ndarray, array: np.ndarray) -> None:
        """Copy the rows at ``offsets`` (in steps) into ``array`` (C-contiguous, one row of
        ``width`` bytes each), by ``torch.index_select(out=)``."""
        target = torch.from_numpy(array.reshape(len(offsets), -1).view(np.uint8)
                                  .view(self.items.dtype))  # (bytes first: any dtype's rows)
        torch.index_select(self.tensor(), 0, torch.from_numpy(offsets), out=target)

    def tensor(self) -> torch.Tensor:
        """``items`` as a tensor, made when first asked for (from a writable array over the same
        bytes: torch warns on read-only ones; it is never written through)."""
        if self._tensor is None:
            rows = self.items if self._raw is None else np.ndarray(
                shape=self.items.shape, dtype=self.items.dtype, buffer=self._raw,
                strides=self.items.strides)
            self._tensor = torch.from_numpy(rows)
        return self._tensor
