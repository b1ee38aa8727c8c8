"""``CachedDataset``: a map-style PyTorch dataset over a finished cache, a façade over the
private engine (``precache.loading._engine``): ``read_state`` (what every read path shares),
the gathers (``gather_fixed``: fixed-shape columns, one gather a column; ``gather_rows``:
variable-length rows through a row table; ``gather_shards``: the general path, shard by shard,
and read-ahead; ``resident``: columns held whole), ``encoded_images`` (JPEG/WebP decoding) and
``page_policy`` (faults, warming, release of mapped pages). Their docstrings say why each
works as it does."""

from __future__ import annotations

import functools
import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from precache.cache import Cache
from precache.loading.datasets.batches import CachedBatch
from precache.loading._engine import gather_shards
from precache.loading._engine.encoded_images import batch_images
from precache.loading._engine.gather_fixed import read_tables
from precache.loading._engine.gather_rows import read_complete
from precache.loading._engine.generation_pin import open_pinned
from precache.loading._engine.open_shards import (OpenShards, fds_per_reader, shard_budget,
                                                   soft_fd_limit)
from precache.loading._engine.page_policy import PagePolicy, available_memory
from precache.loading._engine.read_state import ReadState
from precache.loading._engine.resident import fits_in_memory
from precache.loading._engine.warm import ShardWarmer
from precache.storage.disk_cache import DiskCache

__all__ = ["CachedDataset"]

Sample = dict[str, Any]


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
        path = os.fspath(cache)
        self._owner_pid = os.getpid()
        pinned = open_pinned(path, DiskCache(disk_cache_dir, disk_cache_bytes), generation)
        schema = pinned.manifest.schema
        missing = [c for c in columns or () if c not in schema]
        if missing:
            raise KeyError(f"{path}: no column {missing} in this cache; it has {sorted(schema)}")
        names = list(columns) if columns else list(schema)
        self.transform = transform
        policy = PagePolicy(  # warm whole shards when the cache fits in memory
            sum(s.bytes for s in pinned.manifest.shards) <= available_memory() // 2,
            release_mapped_bytes, local=pinned.disk_cache is None)
        # readers of the requested columns only: a shard opens with fewer page headers to read
        fds = fds_per_reader(pinned.manifest.format, {n: schema[n] for n in names})
        if max_open_shards is not None and max_open_shards > (budget := shard_budget(fds)):
            warnings.warn(
                f"{path}: max_open_shards={max_open_shards} would hold up to "
                f"{max_open_shards * fds} file descriptors ({fds} a shard), past half of this "
                f"process's open-file limit ({soft_fd_limit()}, `ulimit -n`) less those open; "
                f"keeping at most {budget} shards open at once (raise `ulimit -n` to keep more)",
                stacklevel=2)
        readers = OpenShards(functools.partial(pinned.reader, columns=names),
                             max_open_shards, max_decoded_bytes, fds)
        self._state = state = ReadState(pinned, path, names, readers, policy, decode_images)
        # dropped without close(): let go of the lease and stop the threads all the same (the
        # finalizer holds what it releases, not the dataset)
        self._finalizer = weakref.finalize(self, _let_go, pinned, self._owner_pid, readers,
                                           policy.warmers)
        state.resident = fits_in_memory(state) if resident is None else bool(resident)
        if state.resident and any(schema[c].kind in ("bytes", "ragged") for c in names):
            raise ValueError(f"{path}: bytes and ragged columns cannot be held resident; "
                             "leave them out of columns or pass resident=False")

    def __len__(self) -> int:
        return len(self._state.shard)

    @property
    def path(self) -> str:
        """The cache directory or URL, as given."""
        return self._state.path

    @property
    def columns(self) -> list[str]:
        """The requested columns."""
        return self._state.columns

    @property
    def decode_images(self) -> bool:
        """See the class docstring."""
        return self._state.decode_images

    @decode_images.setter
    def decode_images(self, value: bool) -> None:
        self._state.decode_images = value

    @property
    def resident(self) -> bool:
        """Whether the requested columns are held whole in this process (see the class
        docstring)."""
        return self._state.resident

    @resident.setter
    def resident(self, value: bool) -> None:
        self._state.resident = value

    @property
    def _cache(self) -> Cache:
        """The pinned generation (its manifest), for the video datasets."""
        return self._state.cache

    @property
    def generation(self) -> int:
        """The generation of the cache this dataset reads (pinned when it was opened)."""
        return self._state.cache.generation

    def kept_generations(self) -> list[int]:
        """The generations of the cache whose files are kept now (the current one included)."""
        return self._state.cache.kept_generations()

    @property
    def encoded_columns(self) -> list[str]:
        """The requested columns stored as JPEG/WebP (decoded here unless ``decode_images``
        is False)."""
        return list(self._state.encoded)

    @property
    def shard_ids(self) -> np.ndarray:
        """The shard (in manifest order) of every index, for samplers that keep reads local."""
        return self._state.shard

    @property
    def release_mapped_bytes(self) -> int | None:
        """See the class docstring."""
        return self._state.policy.release_mapped_bytes

    @release_mapped_bytes.setter
    def release_mapped_bytes(self, value: int | None) -> None:
        self._state.policy.release_mapped_bytes = value

    @property
    def max_decoded_bytes(self) -> int:
        """See the class docstring."""
        return self._state.readers.max_decoded_bytes

    @property
    def max_open_shards(self) -> int:
        """Shard files this process may keep open now (see the class docstring)."""
        return self._state.readers.limit()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_state"] = self._state.for_copy()  # (threads, tables, lock: this process's)
        state["_finalizer"] = None  # (a copy makes its own: __setstate__)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # a copy (a worker's, or copy.copy's: it may share the readers and the lease with the
        # original, whose own finalizer lets go of them) stops only the threads it starts
        self._finalizer = weakref.finalize(self, _let_go, None, -1, None,
                                           self._state.policy.warmers)

    def read_ahead(self, indices: Sequence[int]) -> None:
        """Ask the kernel to start reading the mapped columns of these rows; returns at once.
        Indices out of range are ignored. Skipped while reads come from memory (the last batch
        this process gathered read no page from disk): a hint per row would only cost system
        calls (``_engine.gather_shards``)."""
        gather_shards.read_ahead(self._state, indices)

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
        decoding of encoded images run outside it, in parallel.
        """
        state = self._state
        fast = read_complete(state, indices, empty)
        if fast is None:
            fast = read_tables(state, indices, empty, storage_order)
        if fast is not None:
            return fast
        copies: gather_shards.Copies = []
        with state.guard():
            faults = state.policy.begin()
            out, order, groups = gather_shards.gather(state, indices, ahead, storage_order,
                                                      copies, empty)
        gather_shards.copy_rows(copies)
        if not state.resident:
            with state.guard():
                state.policy.after_gather(
                    faults, lambda: [state.readers.get(shard).path for shard, _, _ in groups],
                    state.readers.values())
        for name in state.encoded:
            if name in out and order is not None:
                out[name] = batch_images(state, name, out[name], order, empty)
        return out

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
        step, first = max(1, self.max_open_shards // 2), self._state.first
        shards = len(first) - 1
        parts = [self.read_batch(np.arange(first[s], first[min(s + step, shards)]))[name]
                 for s in range(0, shards, step)]
        spec = self._state.schema[name]
        if spec.kind in ("ndarray", "scalar"):
            return (np.concatenate(parts) if parts
                    else np.empty((0, *spec.shape), np.dtype(spec.dtype)))
        return [value for part in parts for value in part]

    def close_files(self) -> None:
        """Close the shard files this process has open (they open again when next read); the
        generation stays held."""
        with self._state.guard():
            self._state.readers.close()
            self._state.complete = None

    def close(self) -> None:
        """Close the shard files and let go of the generation (its lease); dropping the last
        reference to the dataset does the same."""
        state = self._state
        _let_go(state.cache, self._owner_pid, state.readers, state.policy.warmers)
        state.policy.warmer = None
        state.resident_arrays = None


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
