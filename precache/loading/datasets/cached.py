"""``CachedDataset``: a map-style PyTorch dataset over a finished cache, a façade over the
private engine (``precache.loading._engine``): ``read_state`` (what every read path shares),
the gathers (``gather_fixed``: fixed-shape columns, one gather a column; ``gather_rows``:
variable-length rows through a row table; ``gather_shards``: the general path, shard by shard,
and read-ahead; ``resident``: columns held whole), ``encoded_images`` (JPEG/WebP decoding) and
``page_policy`` (faults, warming, release of mapped pages), ``row_selection`` (the rows held:
``where=``, ``select``, ``split``; ``target=``). Their docstrings say why each works as it
does."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from precache.cache import Cache
from precache.loading.datasets.batches import CachedBatch
from precache.loading._engine import gather_shards, read_batch, row_selection
from precache.loading._engine.generation_pin import let_go, open_pinned
from precache.loading._engine.open_shards import open_readers
from precache.loading._engine.page_policy import PagePolicy, available_memory
from precache.loading._engine.read_state import ReadState
from precache.loading._engine.resident import fits_in_memory
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
        where: hold only the matching rows, e.g. ``{"split": "train"}``: a scalar or string
            column (``split``, ``label``, ``key``, ``source_key``) -> a value, a list of values,
            or a callable of the column's values (a NumPy array; strings as a ``str`` array)
            returning one bool a row; all must match. Chosen once, on open: every fast path
            reads the rows held, indexed ``0 .. len - 1`` in the order they are stored.
        target: a label column (integers or strings): each sample then has ``target``, an
            ``int64`` index into ``classes`` (a batch: an ``int64`` column); ``targets`` holds
            every row's. ``classes``: the column's sorted distinct values over the whole cache
            (integers kept), so every selection of one cache has the same classes.

    Raises:
        ManifestError: ``cache`` holds no finished cache.
        GenerationError: ``generation`` is not kept any more.
        KeyError: a requested, ``where`` or ``target`` column is not in the cache.
        ValueError: ``where`` keeps no row (the message shows values the column holds).
    """

    def __init__(self, cache: str | os.PathLike[str], columns: Sequence[str] | None = None,
                 transform: Callable[[Sample], Sample] | None = None,
                 max_decoded_bytes: int = 1 << 30, resident: bool | None = None,
                 max_open_shards: int | None = None, release_mapped_bytes: int | None = None,
                 disk_cache_dir: str | os.PathLike[str] | None = None,
                 disk_cache_bytes: int | None = None, generation: int | None = None,
                 decode_images: bool = True, where: Mapping[str, Any] | None = None,
                 target: str | None = None) -> None:
        path = os.fspath(cache)
        self._options: dict[str, Any] = dict(  # for select(): the same options and generation
            columns=None if columns is None else list(columns), transform=transform,
            max_decoded_bytes=max_decoded_bytes, resident=resident,
            max_open_shards=max_open_shards, release_mapped_bytes=release_mapped_bytes,
            disk_cache_dir=disk_cache_dir, disk_cache_bytes=disk_cache_bytes,
            decode_images=decode_images)
        self._open(path, generation, lambda pinned, names: row_selection.choose(
            pinned, path, names, where, target), **self._options)

    def _open(self, path: str, generation: int | None, choose: row_selection.Chooser,
              columns: Sequence[str] | None, transform: Callable[[Sample], Sample] | None,
              max_decoded_bytes: int, resident: bool | None, max_open_shards: int | None,
              release_mapped_bytes: int | None, disk_cache_dir: str | os.PathLike[str] | None,
              disk_cache_bytes: int | None, decode_images: bool) -> None:
        """Open the generation and hold the rows ``choose`` picks (see the class docstring)."""
        self._owner_pid = os.getpid()
        pinned = open_pinned(path, DiskCache(disk_cache_dir, disk_cache_bytes), generation)
        schema = pinned.manifest.schema
        names = list(columns) if columns else list(schema)
        try:
            selection = choose(pinned, names)  # (checks the columns)
        except BaseException:
            pinned.close()  # (no dataset holds the lease)
            raise
        self.transform = transform
        policy = PagePolicy(  # warm whole shards when the cache fits in memory
            sum(s.bytes for s in pinned.manifest.shards) <= available_memory() // 2,
            release_mapped_bytes, local=pinned.disk_cache is None)
        readers = open_readers(pinned, path, names, max_open_shards, max_decoded_bytes)
        self._state = state = ReadState(pinned, path, names, readers, policy, decode_images)
        state.hold(selection)
        # dropped without close(): let go of the lease and stop the threads all the same (the
        # finalizer holds what it releases, not the dataset)
        self._finalizer = weakref.finalize(self, let_go, pinned, self._owner_pid, readers,
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
        self._finalizer = weakref.finalize(self, let_go, None, -1, None,
                                           self._state.policy.warmers)

    def read_ahead(self, indices: Sequence[int] | np.ndarray) -> None:
        """Ask the kernel to start reading the mapped columns of these rows; returns at once.
        Indices out of range are ignored. Skipped while reads come from memory (the last batch
        this process gathered read no page from disk): a hint per row would only cost system
        calls (``_engine.gather_shards``)."""
        gather_shards.read_ahead(self._state, indices)

    def read_batch(self, indices: Sequence[int] | np.ndarray,
                   ahead: Sequence[int] | np.ndarray | None = None, storage_order: bool = False,
                   empty: Callable[..., np.ndarray] | None = None) -> dict[str, Any]:
        """Columns of the given rows: arrays of shape (len(indices), ...), in the given order.

        Args:
            indices: the rows.
            ahead: rows a later batch will read, to start reading now (``read_ahead``), after
                this batch's own rows were asked for.
            storage_order: return the same rows in the order they are stored (by shard, then
                row) instead: each mapped column is then copied once, straight into the batch,
                not gathered and then put in order (a shuffled batch is as random either way).
                ``make_loader``'s batches ask for it.
            empty: ``empty(shape, dtype)`` makes each fixed-shape column's and the decoded
                images' array (``pinned_empty`` when a thread loader pins). Default: arrays on
                a 64-byte boundary where safe (docs/stage2-loading.md, "Where a batch lands").

        With ``target=``, the batch also has ``target`` (``int64``, the rows' ``targets``).

        Safe to call from several threads at once: which shards to open, and the row tables,
        are handled under this dataset's lock; the copies of mapped rows into the batch and the
        decoding of encoded images run outside it, in parallel.
        """
        return read_batch.read_batch(self._state, indices, ahead, storage_order, empty)

    def __getitems__(self, indices: Sequence[int] | np.ndarray) -> list[Sample]:
        # make_loader's IndexBatch: a later batch of this worker, and any order will do; and
        # ThreadedBatches' pinned allocation (not for a transform: its samples are re-stacked)
        empty = getattr(indices, "empty", None) if self.transform is None else None
        batch = self.read_batch(indices, ahead=getattr(indices, "ahead", None),
                                storage_order=getattr(indices, "storage_order", False),
                                empty=empty)
        if self.transform is None:
            return CachedBatch(batch, len(indices))
        samples = [{name: values[i] for name, values in batch.items()} for i in range(len(indices))]
        return [self.transform(s) for s in samples]

    def __getitem__(self, index: int) -> Sample:
        return self.__getitems__([index])[0]

    def read_column(self, name: str) -> Any:
        """Every row of column ``name`` (in ``columns``, or any scalar or string column), in
        index order: an array for a fixed-shape column, else a list. A few shards at a time: a
        read holds the files of every shard it touches (``max_open_shards``) until it returns."""
        if name not in self.columns:  # read alone, for the rows held
            return row_selection.held_values(self._state, name)
        return read_batch.read_column(self._state, name, max(1, self.max_open_shards // 2))

    @property
    def classes(self) -> list[Any]:
        """With ``target=``: the column's sorted distinct values in the whole cache, else []."""
        return list(self._state.selection.classes)

    @property
    def targets(self) -> np.ndarray | None:
        """With ``target=``: every row's ``target`` (``int64``), e.g. for a class-balanced
        sampler's weights. Else ``None``."""
        return self._state.selection.targets

    def select(self, indices: Sequence[int] | np.ndarray) -> CachedDataset:
        """A dataset of these rows only (integers, negative ones from the end, or a boolean
        mask of ``len(self)``), e.g. ``train, val = ds.select(a), ds.select(b)``: a
        ``CachedDataset`` with the same options, generation (its own lease) and fast paths,
        unlike a ``Subset``. Its rows keep their stored order, each once (its row ``i`` is
        ``sorted(set(indices))[i]`` of this one).

        Raises:
            IndexError: an index is out of range.
            ValueError: no index.
        """
        positions = row_selection.positions_of(indices, len(self))
        return self._reopen(self._state.selection.part(positions))

    def split(self, fractions: Mapping[str, float], by: str = "source_key",
              seed: int = 0) -> dict[str, CachedDataset]:
        """This dataset's rows in parts that keep each group of column ``by`` whole (a source
        video's or volume's rows on one side), e.g. ``ds.split({"train": 0.8, "val": 0.2})``:
        name -> dataset (``select``), each about its fraction of the rows, every row in one;
        the same parts for the same ``seed``.

        Raises:
            KeyError: no column ``by``.
            ValueError: fractions not positive or not summing to 1, or a part with no group.
        """
        parts = row_selection.split_by(self._state.cache, self.path, self._state.selection,
                                       fractions, by, seed)
        return {name: self._reopen(part) for name, part in parts.items()}

    def _reopen(self, selection: row_selection.Selection) -> CachedDataset:
        """A dataset of ``selection``'s rows, with this one's options and generation."""
        other = object.__new__(CachedDataset)
        other._options = self._options
        other._open(self.path, self.generation, lambda pinned, names: selection, **self._options)
        return other

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
        let_go(state.cache, self._owner_pid, state.readers, state.policy.warmers)
        state.policy.warmer = None
        state.resident_arrays = None

