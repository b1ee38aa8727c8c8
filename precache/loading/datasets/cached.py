"""``CachedDataset``: a map-style PyTorch dataset over a finished cache.

A batch of indices is one read per shard (``__getitems__``), not one per sample. Shard files are
opened lazily, in the process that reads them, so DataLoader workers never inherit open handles
(safe under fork and spawn). The index -> (shard, row) map lives in two NumPy arrays, so forked
workers share it instead of copying Python objects page by page.

**Mapped columns.** Fixed-shape and scalar columns of Parquet shards written by precache (and
of HDF5 shards) are read from the memory-mapped shard file: a batch is a gather from the page
cache, which holds each page once for every worker and rank on the node. Nothing is decoded and
no process keeps a private copy, so the speed does not depend on how the cache compares with
this process's memory, and the first batch needs no decoding pass. With a read-ahead hint (the
``ahead`` indices ``make_loader`` attaches to each batch) the worker asks the kernel to start
reading the rows of its next batch (``madvise(MADV_WILLNEED)``) before gathering this one, so
a cold or larger-than-RAM cache reads with many disk requests in flight instead of one page
fault at a time. Warm, a batch of only fixed-shape columns is one gather a column through this
process's ``FixedRows`` (each open shard's view address; nothing done a shard), however many
shards it touches: with 256-row shards a shuffled batch touches one every few rows.

**Variable-length columns** (ragged token ids, JPEG/WebP bytes, strings) that stage 1 wrote in
place (``precache.cache.formats.variable``) are read the same way: each row is a slice of the
mapped file (its shard's offsets checked against their checksum when the shard is opened). A
batch that takes many rows of a shard reads them with a few NumPy calls a shard; one that
takes a few rows of each of many shards, through this process's ``RowTable`` (one gather and
one slice a row, nothing a shard). Ragged rows leave a worker as one array and its row ends
(``RaggedRows``); encoded images are decoded straight into one batch array.

**Decoded columns.** The variable-length and array columns of older caches (list columns,
compressed, or written in several pages) must be decoded a whole shard at a time. Each shard's
reader keeps what it decoded, and the least recently used are dropped past
``max_decoded_bytes`` (``open_shards.OpenShards``). When such columns of the whole cache fit
that budget, a Parquet cache is decoded once per process into one array per column
(``resident``).

A remote cache (``s3://...``) is read through a local ``DiskCache``: each process downloads a
shard the first time it needs it (once per machine: processes share the folder), checks it
against the manifest's checksum, and reads (maps) it from local disk from then on, so epoch 2
makes no remote reads while the folder holds the cache.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from precache.cache import Cache
from precache.cache.formats.base import ShardReader
from precache.cache.formats.variable import FEW_ROWS
from precache.cache.image_codec import encoded_columns
from precache.loading.datasets.batches import CachedBatch, RaggedRows
from precache.loading.loaders.image_decode import decode_into_batch
from precache.loading._engine.open_shards import (OpenShards, fds_per_reader, shard_budget,
                                                   soft_fd_limit)
from precache.loading._engine.generation_pin import open_pinned
from precache.loading._engine.row_table import FixedRows, RowTable
from precache.loading._engine.page_policy import PagePolicy
from precache.loading._engine.warm import ShardWarmer
from precache.storage.disk_cache import DiskCache

__all__ = ["CachedDataset"]

Sample = dict[str, Any]

def _available_memory() -> int:
    """Bytes the kernel says are available for new data (``MemAvailable``; 0 if unknown)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _index_array(indices: Sequence[int]) -> np.ndarray:
    """``indices`` as int64, taken from the array a ``make_loader`` ``IndexBatch`` carries
    (``array``) when it has one."""
    given = getattr(indices, "array", None)
    return np.asarray(indices if given is None or len(given) != len(indices) else given,
                      dtype=np.int64)


class CachedDataset:
    """Rows of a cache as samples: dicts of column name -> NumPy value (``key`` is a ``str``).

    Args:
        cache: the cache directory, or the URL of a remote cache (``s3://bucket/cache``).
        columns: columns to read (default: all). Reading fewer columns reads fewer bytes.
        transform: applied to each sample dict after reading (e.g. ``FaceAugment``).
        max_decoded_bytes: per process, the decoded data of columns that cannot be mapped
            (older caches' variable-length and array columns) kept for later batches (default
            1 GiB); past it the least recently used shards are dropped and decoded again when
            next needed. Mapped and in-place columns take none of it.
        resident: hold the requested columns whole in this process's memory, so a batch is one
            gather. Default (None): only for Parquet caches with requested array columns that
            cannot be mapped (older caches) and that fit ``max_decoded_bytes``. ``True`` makes
            every process hold its own copy instead of sharing the page cache; ``False`` never.
        max_open_shards: shard files this process keeps open (mapped) at once; the least
            recently used are closed. Each holds file descriptors (a Parquet shard one, an HDF5
            shard one a mapped column and one more), and a process may open only ``ulimit -n``:
            default (None) and at most, as many as half the soft ``RLIMIT_NOFILE`` allows, less
            the descriptors already open (``open_shards``); a larger number is capped, with a
            warning.
        release_mapped_bytes: after gathering this many bytes from mapped columns, this
            process unmaps the pages it touched (``madvise(MADV_DONTNEED)``; the page cache
            keeps them). Default ``None``: never. A page mapped by one process only counts in
            its private memory (USS, ``Private_Clean``) though the page cache holds it once for
            all, so a worker's USS shows the part of the cache it alone has read; a bound here
            keeps that under the bound, at a price: warm batches map their pages again (on 2
            cores, 64 MiB made warm epochs about 3x slower).
        disk_cache_dir: with a remote cache, the local folder its shards are downloaded to
            (default ``precache_home()/shards``, ``$PRECACHE_HOME`` moves it).
        disk_cache_bytes: with a remote cache, the most bytes that folder keeps (default 50 GiB;
            least recently used shards are deleted past it). Give it the whole cache for epoch 2
            to read only from local disk.

        decode_images: decode JPEG/WebP columns (stage 1's ``image_codec``) into one uint8
            batch array (default). ``False``: hand out each row's encoded bytes (a uint8 array
            viewing the shard) for ``precache.loading.decode_images(rows, "cuda")`` to decode
            on the GPU: a batch then travels at the size of its JPEG bytes.
        generation: the generation of the cache to read (default: the current one; under
            ``torch.distributed``, the one rank 0 finds current, so all ranks read the same).
            The dataset holds it (a reader lease): a re-run of stage 1 publishes a new one
            without removing this one's files while the dataset is open. ``close()``, or
            dropping the last reference to the dataset, lets go of it (and stops the dataset's
            threads).

    Raises:
        ManifestError: ``cache`` holds no finished cache.
        GenerationError: ``generation`` is not kept any more.
        KeyError: a requested column is not in the cache.
    """

    def __init__(self, cache: str | os.PathLike[str], columns: Sequence[str] | None = None,
                 transform: Callable[[Sample], Sample] | None = None,
                 max_decoded_bytes: int = 1 << 30, resident: bool | None = None,
                 max_open_shards: int | None = None, release_mapped_bytes: int | None = None,
                 disk_cache_dir: str | os.PathLike[str] | None = None,
                 disk_cache_bytes: int | None = None, generation: int | None = None,
                 decode_images: bool = True) -> None:
        self.path = os.fspath(cache)
        self._owner_pid = os.getpid()
        self._cache = open_pinned(self.path, DiskCache(disk_cache_dir, disk_cache_bytes),
                                  generation)
        schema = self._cache.manifest.schema
        missing = [c for c in columns or () if c not in schema]
        if missing:
            raise KeyError(f"{self.path}: no column {missing} in this cache; it has {sorted(schema)}")
        self.columns = list(columns) if columns else list(schema)
        self.transform = transform
        self.decode_images = decode_images
        # JPEG/WebP columns (stage 1's image_codec): decoded here, one row at a time
        self._encoded = {name: codec for name, codec in
                         encoded_columns(self._cache.manifest.ops).items() if name in self.columns}
        shard_of, row_of = [], []
        for shard, info in enumerate(self._cache.manifest.shards):
            rows = info.live_indices()
            shard_of.append(np.full(len(rows), shard, dtype=np.int32))
            row_of.append(np.asarray(rows, dtype=np.int64))
        self._shard = np.concatenate(shard_of) if shard_of else np.empty(0, np.int32)
        self._row = np.concatenate(row_of) if row_of else np.empty(0, np.int64)
        # the index of each shard's first row (a shard's rows are consecutive indices), and len
        self._first = np.cumsum([0, *map(len, row_of)], dtype=np.int64)
        # (pid, table) once a row table serves every requested column of every shard: warm
        # batches then go straight to it (_read_complete)
        self._complete: tuple[int, RowTable] | None = None
        # faults, read-ahead, warming (a cache that fits in memory), release of mapped pages
        self._policy = PagePolicy(
            sum(s.bytes for s in self._cache.manifest.shards) <= _available_memory() // 2,
            release_mapped_bytes, local=self._cache.disk_cache is None)
        # readers of the requested columns only: a shard opens with fewer page headers to read
        fds = fds_per_reader(self._cache.manifest.format, {n: schema[n] for n in self.columns})
        if max_open_shards is not None and max_open_shards > (budget := shard_budget(fds)):
            warnings.warn(
                f"{self.path}: max_open_shards={max_open_shards} would hold up to "
                f"{max_open_shards * fds} file descriptors ({fds} a shard), past half of this "
                f"process's open-file limit ({soft_fd_limit()}, `ulimit -n`) less those open; "
                f"keeping at most {budget} shards open at once (raise `ulimit -n` to keep more)",
                stacklevel=2)
        self._readers = OpenShards(functools.partial(self._cache.reader, columns=self.columns),
                                   max_open_shards, max_decoded_bytes, fds)
        # dropped without close(): let go of the lease and stop the threads all the same (the
        # finalizer holds what it releases, not the dataset)
        self._finalizer = weakref.finalize(self, _let_go, self._cache, self._owner_pid,
                                           self._readers, self._policy.warmers)
        # read_batch may run in several threads (make_loader's thread workers): what it opens
        # and the tables it fills are guarded; decoding images runs outside the lock
        self._lock, self._lock_pid = threading.RLock(), os.getpid()
        self._resident: dict[str, np.ndarray] | None = None
        # every requested column fixed-shape (and mapped, as _read_fixed finds): read by FixedRows
        self._fixed_only = all(schema[n].kind in ("ndarray", "scalar") for n in self.columns)
        self.resident = self._fits_in_memory() if resident is None else bool(resident)
        if self.resident and any(schema[c].kind in ("bytes", "ragged") for c in self.columns):
            raise ValueError(f"{self.path}: bytes and ragged columns cannot be held resident; "
                             "leave them out of columns or pass resident=False")

    def _fits_in_memory(self) -> bool:
        """Whether this is a Parquet cache whose requested array columns cannot be mapped (an
        older cache) and fit the budget as whole columns."""
        manifest = self._cache.manifest
        if manifest.format != "parquet" or not len(self):
            return False
        fixed = [n for n in self.columns if manifest.schema[n].kind in ("ndarray", "scalar")]
        if all(n in self._reader(int(self._shard[0])).mapped() for n in fixed):
            return False  # mapped: a gather from the shared page cache, no private copy
        total = 0
        for name in self.columns:
            spec = manifest.schema[name]
            if spec.kind in ("bytes", "ragged"):  # ragged: read per shard for now
                return False
            row = 64 if spec.kind == "str" else int(np.prod(spec.shape)) * np.dtype(spec.dtype).itemsize
            total += row * len(self._shard)
        return total <= self.max_decoded_bytes

    def _resident_columns(self) -> dict[str, np.ndarray]:
        """Every row of the requested columns, one array per column (strings as a NumPy string
        array, not Python objects), decoded shard by shard the first time it is needed."""
        if self._resident is None:
            schema = self._cache.manifest.schema
            arrays = {n: np.empty((len(self), *schema[n].shape), dtype=schema[n].dtype)
                      for n in self.columns if schema[n].kind in ("ndarray", "scalar")}
            strings: dict[str, list[str]] = {n: [] for n in self.columns if n not in arrays}
            start = 0
            for shard, info in enumerate(self._cache.manifest.shards):
                rows = info.live_indices()
                reader = self._cache.reader(shard)
                try:
                    part = reader.read(rows, self.columns)
                finally:
                    reader.close()
                for name, values in part.items():
                    if name in arrays:
                        arrays[name][start:start + len(rows)] = values
                    else:
                        strings[name].extend(values)
                start += len(rows)
            arrays.update({n: np.array(v, dtype=str) for n, v in strings.items()})
            self._resident = arrays
        return self._resident

    def __len__(self) -> int:
        return len(self._shard)

    @property
    def generation(self) -> int:
        """The generation of the cache this dataset reads (pinned when it was opened)."""
        return self._cache.generation

    def kept_generations(self) -> list[int]:
        """The generations of the cache whose files are kept now (the current one included)."""
        return self._cache.kept_generations()

    @property
    def encoded_columns(self) -> list[str]:
        """The requested columns stored as JPEG/WebP (decoded here unless ``decode_images``
        is False)."""
        return list(self._encoded)

    @property
    def shard_ids(self) -> np.ndarray:
        """The shard (in manifest order) of every index, for samplers that keep reads local."""
        return self._shard

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_resident"] = None  # rebuilt by the process that reads, never pickled
        state["_policy"] = self._policy.for_copy()  # (threads stay in their process)
        state["_finalizer"] = None  # (a copy makes its own: __setstate__)
        state["_complete"] = None  # this process's
        state["_lock"], state["_lock_pid"] = None, 0  # a lock does not travel; made on use
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # a copy (a worker's, or copy.copy's: it may share the readers and the lease with the
        # original, whose own finalizer lets go of them) stops only the threads it starts
        self._finalizer = weakref.finalize(self, _let_go, None, -1, None, self._policy.warmers)

    def _guard(self) -> threading.RLock:
        """This process's lock over the readers and row tables (a forked or unpickled copy
        makes its own: a lock copied while another thread held it would never open)."""
        if self._lock_pid != os.getpid():
            self._lock, self._lock_pid = threading.RLock(), os.getpid()
        return self._lock

    @property
    def release_mapped_bytes(self) -> int | None:
        """See the class docstring."""
        return self._policy.release_mapped_bytes

    @release_mapped_bytes.setter
    def release_mapped_bytes(self, value: int | None) -> None:
        self._policy.release_mapped_bytes = value

    @property
    def max_decoded_bytes(self) -> int:
        """See the class docstring."""
        return self._readers.max_decoded_bytes

    @property
    def max_open_shards(self) -> int:
        """Shard files this process may keep open now (see the class docstring)."""
        return self._readers.limit()

    def _reader(self, shard: int) -> ShardReader:
        """Shard ``shard``'s open reader."""
        return self._readers.get(shard)

    def _groups(self, indices: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``(shard, positions in indices, rows in the shard)`` for each shard the indices
        touch, rows ascending within a shard (reads move forward through each file)."""
        if not indices.size:
            return []
        shards, rows = self._shard[indices], self._row[indices]
        grouped = np.lexsort((rows, shards))
        ordered_shards, ordered_rows = shards[grouped], rows[grouped]
        bounds = [0, *(np.flatnonzero(np.diff(ordered_shards)) + 1).tolist(), len(grouped)]
        firsts = ordered_shards[bounds[:-1]].tolist()
        return [(shard, grouped[a:b], ordered_rows[a:b])  # slices: views, no copies
                for shard, a, b in zip(firsts, bounds, bounds[1:])]

    def read_ahead(self, indices: Sequence[int]) -> None:
        """Ask the kernel to start reading the mapped columns of these rows (see the module
        docstring); returns at once. Indices out of range are ignored.

        Skipped while reads come from memory: when the last batch this process gathered caused
        no page read from disk (``ru_majflt`` did not grow), the pages are in the page cache and
        a hint per row would only cost system calls."""
        if not self._policy.faulting:
            return
        indices = np.asarray(indices, dtype=np.int64)
        with self._guard():
            groups = self._groups(indices[(indices >= 0) & (indices < len(self))])
            self._open_many([shard for shard, _, _ in groups])
            self._will_need(groups)

    def _will_need(self, groups: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        """Hint the mapped columns of these ``_groups`` (one call per shard)."""
        for shard, _, rows in groups:
            self._reader(shard).will_need(rows, self.columns)

    def _lists_row_by_row(self, indices: np.ndarray, names: list[str]) -> dict[str, list] | None:
        """The variable-length columns ``names`` of rows ``indices``, in that order, read one
        row at a time: through this process's ``RowTable`` (one slice a row, nothing a shard)
        where their offsets were verified when opened, else ``_lists_by_row_reader``. ``None``
        if a shard holds one of them otherwise (an older cache): then they are read by shard."""
        table = self._readers.row_table(("rows", *names), lambda: RowTable(
            names, [name in self._encoded for name in names], self._first, self._row))
        ready = table.complete
        if table.usable and not ready:
            shard_ids = self._shard[indices]  # (not needed once every shard is ready)
            ready = bool(table.ready[shard_ids].all()) or self._fill(table, shard_ids)
        if table.usable and ready:
            self._policy.mapped_read += int(table.row_bytes * len(indices))  # about
            if table.complete and names == self.columns:
                self._complete = (os.getpid(), table)
            return table.read(indices)
        return self._lists_by_row_reader(indices, names)

    def _fill(self, table: RowTable, shard_ids: np.ndarray) -> bool:
        """Open the shards of ``shard_ids`` that ``table`` lacks and add them; whether every one
        of them is then ready (not if one cannot be added, or the batch touches more shards
        than may be open at once)."""
        wanted = np.unique(shard_ids)
        ready = table.ready[wanted]
        self._readers.keep(wanted[ready].tolist())  # not closed to open the others
        for shard in wanted[~ready].tolist():
            variable = self._readers.get(shard).variable()
            if not table.add(shard, [variable.get(name) for name in table.names]):
                return False
        return bool(table.ready[wanted].all())

    def _open_many(self, shards: list[int]) -> None:
        """Open those of these shards that are not open, in stages that each ask the disk for
        all of them at once: their files' ends (footers, offsets; ``_advise_tails``), then,
        once the footers are parsed, the page headers mapping checks (``will_open``), then map
        them. One shard after another, a cold disk was waited on once a shard (159 of the 212
        shards of a first batch past RAM). Not while the warming thread reads every shard
        whole: the disk is busy with it, and opening shard by shard read cold 8,192-row shards
        at 1.10 of the limit, in stages at 1.01-1.05."""
        closed = [shard for shard in shards if not self._readers.opened(shard)]
        if len(closed) < 2:
            return  # nothing to overlap
        self._advise_tails(closed)
        if len(closed) > self._readers.room() or self._policy.warming_every_shard():
            return  # opening them would close some of them again; or see above
        readers = [self._readers.get(shard) for shard in closed]  # parses each footer
        for reader in readers:
            reader.will_open()
        for reader in readers:
            reader.mapped()

    def _advise_tails(self, shards: list[int]) -> None:
        """Ask the kernel for the end of each of these shard files that is not open, all at
        once (``POSIX_FADV_WILLNEED``, which returns at once): stage 1 writes a Parquet shard's
        offsets columns last, before the footer, so opening the shards one by one then finds
        what it reads in memory instead of waiting on the disk for each in turn (a shuffled
        batch of a cold cache opens hundreds). Local caches of a format that names such bytes
        (``ShardFormat.tail_bytes``: Parquet's) only; a hint, nothing more."""
        if len(shards) < 2 or self._cache.disk_cache is not None:
            return
        schema, form = self._cache.manifest.schema, self._cache.format
        for shard in shards:
            if self._readers.opened(shard):
                continue
            tail = form.tail_bytes(schema, self.columns, self._cache.manifest.shards[shard].rows)
            if not tail:
                return  # (the format has nothing worth asking for)
            try:
                fd = os.open(self._cache.shard_path(shard, look=False), os.O_RDONLY)
            except OSError:
                continue  # opening it says what is wrong
            try:
                size = os.fstat(fd).st_size
                os.posix_fadvise(fd, max(0, size - tail), tail, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def _lists_by_row_reader(self, indices: np.ndarray, names: list[str]) -> dict[str, list] | None:
        """``_lists_row_by_row`` through each shard's ``VariableColumn.row_reader`` (which checks
        every row against its written length where the offsets carry no checksum): a shard
        costs one lookup, a row a few Python operations."""
        shards, rows = self._shard[indices].tolist(), self._row[indices].tolist()
        distinct = list(dict.fromkeys(shards))  # each shard once
        names_key = tuple(names)
        readers: dict[int, list[Any]] = {}
        row_bytes = 0.0
        for shard, (reader, memo) in zip(distinct, self._readers.get_many(distinct)):
            made = memo.get(names_key)
            if made is None:
                variable = reader.variable()
                columns = [variable.get(name) for name in names]
                if None in columns:
                    return None
                made = memo[names_key] = (
                    [c.row_reader(buffers=n in self._encoded) for c, n in zip(columns, names)],
                    sum(c.row_bytes for c in columns))
            readers[shard] = made[0]
            row_bytes += made[1]
        self._policy.mapped_read += int(row_bytes / max(1, len(readers)) * len(rows))  # about
        if len(names) == 1:
            one = {shard: made[0] for shard, made in readers.items()}
            return {names[0]: [one[s](r) for s, r in zip(shards, rows)]}
        return {name: [readers[s][k](r) for s, r in zip(shards, rows)]
                for k, name in enumerate(names)}

    def read_batch(self, indices: Sequence[int], ahead: Sequence[int] | None = None,
                   storage_order: bool = False,
                   empty: Callable[..., np.ndarray] = np.empty) -> dict[str, Any]:
        """Columns of the given rows: arrays of shape (len(indices), ...), in the given order.

        Args:
            indices: the rows.
            ahead: rows a later batch will read, to start reading now (``read_ahead``), after
                this batch's own rows were asked for.
            storage_order: return the same rows in the order they are stored (by shard, then
                row) instead: each mapped column is then copied once, straight into the batch,
                not gathered and then put in order (a shuffled batch is as random either way).
                ``make_loader``'s batches ask for it.
            empty: ``empty(shape, dtype)`` makes each fixed-shape column's array and the
                decoded images' array (``ThreadedBatches`` passes ``pinned_empty`` when it pins:
                the batch is gathered and decoded straight into page-locked memory).

        Safe to call from several threads at once: which shards to open, and the row tables,
        are handled under this dataset's lock; the copies of mapped rows into the batch and the
        decoding of encoded images run outside it, in parallel (the views keep their files
        mapped even if another thread closes a reader meanwhile).
        """
        fast = self._read_complete(indices, empty)
        if fast is None:
            fast = self._read_fixed(indices, empty)
        if fast is not None:
            return fast
        copies: list[tuple[np.ndarray, np.ndarray, np.ndarray, Any, bool]] = []
        with self._guard():
            faults = self._policy.begin()
            out, order, groups = self._gather(indices, ahead, storage_order, copies, empty)
        for view, rows, batch, positions, take in copies:  # without the GIL: in parallel
            if take:  # rows are in range (checked): "clip" only spares take a copy
                np.take(view, rows, axis=0, out=batch[positions], mode="clip")
            else:  # (take is slow on unaligned data; a slice takes a plain copy)
                batch[positions] = view[rows]
        if not self.resident:
            with self._guard():
                self._policy.after_gather(
                    faults, lambda: [self._reader(shard).path for shard, _, _ in groups],
                    self._readers.values())
        for name in self._encoded:
            if name in out and order is not None:
                out[name] = self._images(name, out[name], order, empty)
        return out

    def _read_complete(self, indices: Sequence[int],
                       empty: Callable[..., np.ndarray]) -> dict[str, Any] | None:
        """A batch of a warm cache whose requested columns are all variable-length and served
        by a complete ``RowTable``: one table read, none of ``_gather``'s groups and checks
        (they cost a fifth of the rows' own time on a 256-row batch). ``None`` otherwise."""
        complete = self._complete
        if complete is None or self._policy.faulting or self.release_mapped_bytes is not None:
            return None
        index = _index_array(indices)
        with self._guard():
            pid, table = complete
            if pid != os.getpid() or not table.complete:  # a fork's copy, or a shard closed
                return None
            faults = self._policy.begin()
            if self._policy.faulting:  # the general path reads ahead again
                return None
            try:
                lists = table.read(index)  # negative indices count from the end, as in _gather
            except IndexError:
                raise IndexError(f"index out of range for a cache of {len(self)} rows") from None
            self._policy.faults_at_return = faults  # (reading the table touches no row)
        schema = self._cache.manifest.schema
        out = {name: RaggedRows(values) if schema[name].kind == "ragged" else values
               for name, values in lists.items()}
        for name in self._encoded:
            out[name] = self._images(name, out[name], index, empty)
        return out

    def _read_fixed(self, indices: Sequence[int],
                    empty: Callable[..., np.ndarray]) -> dict[str, Any] | None:
        """A warm batch whose requested columns are all fixed-shape and mapped: one gather a
        column through this process's ``FixedRows``, whatever shards it touches, instead of
        ``_gather``'s one copy a shard (into ``empty``'s arrays where the caller gives one:
        pinned memory). ``None`` otherwise: then ``_gather`` reads it (and opens its shards,
        which the next batch adds to the table)."""
        if (self._policy.faulting or self.resident or self.release_mapped_bytes is not None
                or not self._fixed_only):
            return None
        index = _index_array(indices)
        with self._guard():
            faults = self._policy.begin()
            if self._policy.faulting:
                return None
            schema = self._cache.manifest.schema
            table = self._readers.row_table(("fixed", *self.columns), lambda: FixedRows(
                self.columns, [(np.dtype(schema[n].dtype), schema[n].shape) for n in self.columns],
                self._first, self._shard, self._row))
            if not table.usable:
                self._fixed_only = False  # (a shard's column is not mapped: an older cache)
                return None
            try:
                plan = table.plan(index)
                if plan is None and self._fill_fixed(table, self._shard[index]):
                    plan = table.plan(index)
            except IndexError:
                raise IndexError(f"index out of range for a cache of {len(self)} rows") from None
            if plan is None:
                return None
            self._policy.faults_at_return = faults
        # outside the lock: in parallel in thread workers
        return table.gather(plan, None if empty is np.empty else empty)

    def _fill_fixed(self, table: FixedRows, shard_ids: np.ndarray) -> bool:
        """``_fill`` for a ``FixedRows``: open the shards of ``shard_ids`` it lacks and add them;
        whether all of them are then ready (not past the open-file budget: then the per-shard
        path reads the batch)."""
        wanted = np.unique(shard_ids)
        ready = table.ready[wanted]
        if len(wanted) > self._readers.limit():
            return False
        self._readers.keep(wanted[ready].tolist())
        for shard in wanted[~ready].tolist():
            if not table.add(shard, self._readers.get(shard).mapped()):
                return False
        return bool(table.ready[wanted].all())

    def _gather(self, indices: Sequence[int], ahead: Sequence[int] | None, storage_order: bool,
                copies: list[tuple[np.ndarray, np.ndarray, np.ndarray, Any, bool]],
                empty: Callable[..., np.ndarray],
                ) -> tuple[dict[str, Any], np.ndarray | None,
                           list[tuple[int, np.ndarray, np.ndarray]]]:
        """``read_batch`` but for the copies of mapped rows, which it appends to ``copies`` as
        ``(view, rows, batch array, positions, take)``, and decoding: the columns (encoded ones as the file's
        bytes), the rows in the order they come back (``None`` where nothing is left to
        decode), and the shards read (``_groups``)."""
        indices = _index_array(indices)
        low = int(indices.min()) if indices.size else 0
        if indices.size and (low < -len(self) or indices.max() >= len(self)):
            raise IndexError(f"index out of range for a cache of {len(self)} rows")
        if self.resident:
            return {name: (np.take(values, indices, axis=0, mode="wrap",  # (checked above)
                                   out=empty((len(indices), *values.shape[1:]), values.dtype))
                           if values.dtype.kind != "U" else values[indices].tolist())
                    for name, values in self._resident_columns().items()}, None, []
        if low < 0:
            indices = np.where(indices < 0, indices + len(self), indices)
        schema = self._cache.manifest.schema
        out: dict[str, Any] = {}
        for name in self.columns:  # fixed-shape columns: filled in place
            spec = schema[name]
            if spec.kind in ("ndarray", "scalar"):
                out[name] = empty((len(indices), *spec.shape), np.dtype(spec.dtype))
        listed = [name for name in self.columns if name not in out]
        # a few rows of each of many shards: list columns row by row, in the order asked for
        row_by_row = bool(listed) and (not out or not storage_order) and (
            len(indices) < FEW_ROWS * len(self._cache.manifest.shards))
        self._policy.before_gather(lambda: (self._cache.shard_path(shard, look=False)
                                            for shard in range(len(self._cache.manifest.shards))))
        faulting = self._policy.faulting
        groups = self._groups(indices) if out or faulting or not row_by_row else None
        if faulting and groups:  # ask for every row at once: the disk serves them in parallel
            self._open_many([shard for shard, _, _ in groups])
            self._will_need(groups)
        if ahead is not None:
            self.read_ahead(ahead)
        in_order = self._lists_row_by_row(indices, listed) if row_by_row else None
        if groups is None:  # unless some shard decodes them (then they are read by shard)
            groups = [] if in_order is not None else self._groups(indices)
        lists = {} if in_order is not None else {name: [] for name in listed}  # storage order
        start = 0
        for shard, positions, rows in groups:
            if storage_order:  # this group's slots: the next len(rows) of the batch
                positions = slice(start, start + len(rows))
                start += len(rows)
            reader = self._readers.get(shard)
            views = reader.mapped()
            if views and rows[-1] >= len(next(iter(views.values()))):  # rows ascend: O(1)
                raise IndexError(f"{self.path}: row {int(rows[-1])} of shard {shard} is past the "
                                 "end of its file; run `precache verify` on the cache")
            variable = reader.variable()
            rest = []
            for name, values in lists.items():  # in place: views of the mapped file
                column = variable.get(name)
                if column is None:
                    rest.append(name)
                    continue
                values.extend(column.buffers(rows) if name in self._encoded
                              else column.rows(rows))
                self._policy.mapped_read += int(column.row_bytes * len(rows))  # about
            for name, view in views.items():
                if name in out:  # copied into the batch by read_batch, outside the lock
                    copies.append((view, rows, out[name], positions,
                                   bool(storage_order and view.flags.aligned)))
                    self._policy.mapped_read += view.itemsize * view[0].size * len(rows)
            rest += [name for name in out if name not in views]  # older shards' arrays
            if rest:
                for name, values in reader.read(rows, rest).items():  # decoded (older shards)
                    if name in lists:
                        lists[name].extend(values)
                    else:
                        out[name][positions] = values
                self._readers.account(shard)
        # where each row read in storage order goes in the batch (needed only to reorder lists,
        # or to name rows of an encoded column in storage order)
        reorder = lists and not storage_order or self._encoded and storage_order and not in_order
        stored = (np.concatenate([positions for _, positions, _ in groups])
                  if groups and reorder else None)
        if lists and not storage_order and stored is not None:  # back to the order asked for
            back = np.argsort(stored)
            lists = {name: [values[i] for i in back.tolist()] for name, values in lists.items()}
        lists.update(in_order or {})
        out.update({name: RaggedRows(values) if schema[name].kind == "ragged" else values
                    for name, values in lists.items()})
        order = indices[stored] if storage_order and stored is not None and not in_order else indices
        return out, order, groups or []

    def _images(self, name: str, values: list[Any], indices: np.ndarray,
                empty: Callable[..., np.ndarray]) -> Any:
        """An encoded column's rows as the batch gets them: decoded into one array, or (with
        ``decode_images=False``) each row's bytes as a uint8 array viewing the shard."""
        if self.decode_images:
            return self._decode(name, values, indices, empty)
        return [np.frombuffer(value, np.uint8) for value in values]

    def _decode(self, name: str, values: list[Any], indices: np.ndarray,
                empty: Callable[..., np.ndarray]) -> np.ndarray:
        """The decoded images of an encoded column, each decoded straight into its slot of one
        ``(n, h, w, 3)`` uint8 array (crops of one cache share a size). ``indices``: the rows,
        for messages."""
        def where(i: int) -> str:
            index = int(indices[i])
            return f"{self.path}: row {index} (shard {int(self._shard[index])}), column {name!r}"

        try:
            return decode_into_batch(values, where, empty)
        except ValueError as error:
            raise ValueError(f"{error}; run `precache verify {self.path}`") from None

    def __getitems__(self, indices: Sequence[int]) -> list[Sample]:
        # make_loader's IndexBatch: a later batch of this worker, and any order will do; and
        # ThreadedBatches' pinned allocation (not for a transform: its samples are re-stacked)
        empty = getattr(indices, "empty", None) if self.transform is None else None
        batch = self.read_batch(indices, ahead=getattr(indices, "ahead", None),
                                storage_order=getattr(indices, "storage_order", False),
                                empty=empty or np.empty)
        if self.transform is None:
            return CachedBatch(batch, len(indices))
        samples = [{name: values[i] for name, values in batch.items()} for i in range(len(indices))]
        return [self.transform(s) for s in samples]

    def __getitem__(self, index: int) -> Sample:
        return self.__getitems__([index])[0]

    def read_column(self, name: str) -> Any:
        """Every row of column ``name`` (one of ``columns``), in index order: an array for a
        fixed-shape column, else a list. Read a few shards at a time: a read holds the files of
        every shard it touches until it returns (its rows are views of them), so one read of
        the whole cache would hold all of them (``max_open_shards``)."""
        step = max(1, self.max_open_shards // 2)
        shards = len(self._first) - 1
        parts = [self.read_batch(np.arange(self._first[s],
                                           self._first[min(s + step, shards)]))[name]
                 for s in range(0, shards, step)]
        if self._cache.manifest.schema[name].kind in ("ndarray", "scalar"):
            spec = self._cache.manifest.schema[name]
            return (np.concatenate(parts) if parts
                    else np.empty((0, *spec.shape), np.dtype(spec.dtype)))
        return [value for part in parts for value in part]

    def close_files(self) -> None:
        """Close the shard files this process has open (they open again when next read); the
        generation stays held."""
        with self._guard():
            self._readers.close()
            self._complete = None

    def close(self) -> None:
        """Close the shard files and let go of the generation (its lease); dropping the last
        reference to the dataset does the same."""
        _let_go(self._cache, self._owner_pid, self._readers, self._policy.warmers)
        self._policy.warmer = None
        self._resident = None


def _let_go(cache: Cache | None, owner_pid: int, readers: OpenShards | None,
            warmers: list[ShardWarmer]) -> None:
    """Release what a dataset holds in this process: its lease (only in the process that took
    it, ``owner_pid``; not a forked worker's copy), its warming threads, its open shards. For
    ``close()`` and the finalizer that runs when the dataset is dropped; a second call does
    nothing more."""
    if cache is not None and owner_pid == os.getpid():
        cache.close()
    for warmer in warmers:
        warmer.close()  # (a forked worker's copy of its parent's does nothing)
    warmers.clear()
    if readers is not None:
        readers.close()
