"""Timing one loader setting: epoch 1 apart from the later epochs, worker memory after each
epoch; for the cached loader (``make_loader`` over ``CachedDataset``), the per-file baseline
(one picture file per sample, ``cv2.imread``) and the limit (a NumPy gather of memory-mapped
arrays; per-row slices of memory-mapped flat values for variable-length columns). See
``precache.cli.bench`` for what is measured and why."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from precache.cache import Cache
from precache.cache.image_codec import decode_image
from precache.loading.datasets.cached import CachedDataset
from precache.loading.loaders.cache_loader import make_loader
from precache.threads import pin_threads

__all__ = ["Rates", "CACHED_CUT", "cores", "default_worker_counts", "measure_cached",
           "measure_per_file", "measure_gather", "drop_page_cache", "shard_paths", "FlatColumn",
           "GatherRows"]

CACHED_CUT = 10
"""A cached-loader epoch is cut after this many times ``seconds`` (a baseline's: ``seconds``)."""


@dataclass
class Rates:
    """Samples/s of one loader setting, epoch 1 apart from the later epochs.

    Args:
        epoch1: samples/s of epoch 1.
        epoch2: samples/s over epochs 2..n together (their harmonic mean for equal epochs).
        epoch_rates: samples/s of every epoch.
        rss_kb: per epoch, ``VmRSS`` of each worker process after it (empty without workers).
        anon_kb: per epoch, ``RssAnon`` of each worker process (memory not shared with files).
        uss_kb: per epoch, each worker's USS (``Private_Clean + Private_Dirty``: pages no other
            process maps; a page of a mapped shard that only this worker touched counts, though
            the page cache holds it once for all).
        pss_kb: per epoch, each worker's PSS (shared pages divided among their processes).
        cut_epochs: how many epochs were cut before their end.
    """

    epoch1: float
    epoch2: float
    epoch_rates: list[float]
    cut_epochs: int = 0
    rss_kb: list[list[int]] = field(default_factory=list)
    anon_kb: list[list[int]] = field(default_factory=list)
    uss_kb: list[list[int]] = field(default_factory=list)
    pss_kb: list[list[int]] = field(default_factory=list)


def cores() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_worker_counts() -> list[int]:
    """0, 1, 2, then powers of two up to the usable cores, and the cores themselves."""
    usable = cores()
    counts, n = [0, 1, 2], 4
    while n <= usable:
        counts.append(n)
        n *= 2
    return counts + ([usable] if usable > 2 and usable not in counts else [])


def _run_epochs(epoch: Callable[[int], Iterator[int]], seconds: float,
                after_epoch: Callable[[], None] | None = None, cut: float | None = None) -> Rates:
    """Time ``epoch(e)`` (yielding batch lengths) for e = 0, 1, ... until the epochs after the
    first have run for ``seconds`` (so at least two epochs); an epoch is cut after ``cut`` seconds
    (default ``seconds``)."""
    cut = seconds if cut is None else cut
    rates, later_n, later_s, cuts = [], 0, 0.0, 0
    while len(rates) < 2 or later_s < seconds:
        count, start = 0, time.perf_counter()
        batches, stopped = epoch(len(rates)), False
        for n in batches:
            count += n
            if time.perf_counter() - start >= cut:
                stopped = True
                break
        elapsed = time.perf_counter() - start
        cuts += stopped and next(batches, None) is not None  # cut if batches were left (untimed)
        rates.append(count / elapsed)
        if len(rates) > 1:
            later_n, later_s = later_n + count, later_s + elapsed
        if after_epoch is not None:
            after_epoch()
    return Rates(rates[0], later_n / later_s, rates, cuts)


def _batch_len(batch: Any) -> int:
    return len(next(iter(batch.values())) if isinstance(batch, dict) else batch)


def _worker_pids(loader: DataLoader) -> list[int]:
    workers = getattr(getattr(loader, "_iterator", None), "_workers", None)
    return [p.pid for p in (workers or multiprocessing.active_children())]


def _proc_status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _smaps_kb(pid: int) -> dict[str, int]:
    """``/proc/PID/smaps_rollup`` as kB per field (empty if unreadable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return {}
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in lines)}


def drop_page_cache(paths: Sequence[str | os.PathLike[str]]) -> None:
    """Evict these files from the page cache, so the next epoch reads them from disk (cold).

    ``os.sync()`` first (dirty pages cannot be dropped), then ``posix_fadvise(DONTNEED)`` per
    file: no root needed, and other files stay cached. It cannot drop pages that a live process
    still maps (so measurements drop before opening their files), and for a remote cache it
    drops the local disk-cache copies, not the bucket."""
    os.sync()
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def shard_paths(cache: str) -> list[Path]:
    """Local paths of every shard of ``cache`` (a remote cache's are fetched first)."""
    opened = Cache(cache)
    return [opened.shard_path(i) for i in range(len(opened.manifest.shards))]


def _shutdown(loader: DataLoader) -> None:
    """Stop a loader's persistent workers now rather than at garbage collection."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None


def measure_cached(cache: str, columns: Sequence[str], batch_size: int, workers: int,
                   seconds: float, worker_kind: str = "auto") -> Rates:
    """Samples/s a training loop receives from ``make_loader`` over ``CachedDataset`` (its
    workers of ``worker_kind``); epoch 1 starts with the shards out of the page cache
    (``drop_page_cache``)."""
    drop_page_cache(shard_paths(cache))
    dataset = CachedDataset(cache, columns)
    loader = make_loader(dataset, batch_size, shuffle=True, num_workers=workers,
                         worker_kind=worker_kind)
    rss: list[list[int]] = []
    anon: list[list[int]] = []
    uss: list[list[int]] = []
    pss: list[list[int]] = []

    def epoch(e: int) -> Iterator[int]:
        loader.set_epoch(e)
        return (_batch_len(b) for b in loader)

    def after_epoch() -> None:
        if loader.worker_kind == "processes":  # threads: their memory is the loop's own
            pids = _worker_pids(loader.loader)
            rss.append([_proc_status_kb(p, "VmRSS") for p in pids])
            anon.append([_proc_status_kb(p, "RssAnon") for p in pids])
            smaps = [_smaps_kb(p) for p in pids]
            uss.append([m.get("Private_Clean", 0) + m.get("Private_Dirty", 0) for m in smaps])
            pss.append([m.get("Pss", 0) for m in smaps])

    try:
        rates = _run_epochs(epoch, seconds, after_epoch, cut=CACHED_CUT * seconds)
    finally:
        if isinstance(loader.loader, DataLoader):
            _shutdown(loader.loader)
        loader.close()
        dataset.close()
    rates.rss_kb, rates.anon_kb, rates.uss_kb, rates.pss_kb = rss, anon, uss, pss
    return rates


class _ImageFiles(Dataset):
    """One picture file per sample, read and decoded with OpenCV in ``__getitem__``."""

    def __init__(self, paths: list[str], color: bool) -> None:
        self.paths = paths
        self.color = color

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        if not self.color:
            return torch.from_numpy(cv2.imread(self.paths[index], cv2.IMREAD_GRAYSCALE))
        image = cv2.imread(self.paths[index], cv2.IMREAD_COLOR)
        return torch.from_numpy(cv2.cvtColor(image, cv2.COLOR_BGR2RGB))


def _pin_worker(_: int) -> None:
    pin_threads()


def measure_per_file(paths: list[str], color: bool, batch_size: int, workers: int,
                     seconds: float) -> Rates:
    """Samples/s of a plain ``DataLoader`` over one picture file per sample."""
    generator = torch.Generator()
    generator.manual_seed(0)
    options: dict[str, Any] = (dict(persistent_workers=True, worker_init_fn=_pin_worker)
                               if workers else {})
    loader = DataLoader(_ImageFiles(paths, color), batch_size=batch_size, shuffle=True,
                        num_workers=workers, pin_memory=torch.cuda.is_available(),
                        generator=generator, **options)
    try:
        return _run_epochs(lambda e: (len(b) for b in loader), seconds)
    finally:
        _shutdown(loader)


class FlatColumn:
    """A variable-length column as the limit reads it: row ``i`` is ``values[offsets[i]:
    offsets[i + 1]]`` of two memory-mapped ``.npy`` files, the way a ``ragged``, ``bytes`` or
    ``str`` column sits in a shard (values without per-row framing, offsets apart).

    Args:
        values_file: a 1-D ``.npy`` of every row's values, rows in ``CachedDataset`` order (the
            values at their own dtype for ``ragged``, raw bytes as uint8 otherwise).
        offsets_file: a 1-D int64 ``.npy`` of ``rows + 1`` positions in ``values``.
        kind: ``ragged``, ``bytes``, ``str``, or ``image`` (JPEG/WebP bytes, decoded per row
            with ``decode_image`` as ``CachedDataset`` does).
    """

    def __init__(self, values_file: str | os.PathLike[str], offsets_file: str | os.PathLike[str],
                 kind: str) -> None:
        self.values_file, self.offsets_file, self.kind = str(values_file), str(offsets_file), kind
        # plain ndarray views of the maps: slicing an np.memmap costs more per row
        self.values = np.asarray(np.load(self.values_file, mmap_mode="r"))
        self.offsets = np.asarray(np.load(self.offsets_file, mmap_mode="r"))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def reopened(self) -> FlatColumn:
        """The same files mapped afresh (after ``drop_page_cache``)."""
        return FlatColumn(self.values_file, self.offsets_file, self.kind)

    def rows(self, indices: Sequence[int]) -> list[Any] | np.ndarray:
        """The rows: 1-D views (``ragged``), ``bytes``, ``str``, or one ``(n, h, w, 3)`` uint8
        array of decoded images (``image``)."""
        rows = np.asarray(indices, dtype=np.int64)
        spans = zip(self.offsets[rows].tolist(), self.offsets[rows + 1].tolist())
        if self.kind == "ragged":
            values = self.values
            return [values[i:j] for i, j in spans]
        data = memoryview(self.values)
        if self.kind == "str":
            return [str(data[i:j], "utf-8") for i, j in spans]
        if self.kind == "bytes":
            return [data[i:j].tobytes() for i, j in spans]
        return _decode_images([data[i:j] for i, j in spans])


def _decode_images(buffers: list[memoryview]) -> np.ndarray:
    """Each image decoded straight into its slot of one preallocated uint8 batch (the first
    decoded alone to learn the size), as ``CachedDataset`` does
    (``precache.loading._engine.encoded_images``)."""
    if not buffers:
        return np.empty((0, 0, 0, 3), np.uint8)
    first = decode_image(buffers[0])
    batch = np.empty((len(buffers), *first.shape), dtype=np.uint8)
    batch[0] = first
    for i in range(1, len(buffers)):
        decode_image(buffers[i], out=batch[i])
    return batch


class GatherRows(Dataset):
    """The limit's dataset: ``__getitems__`` is one ``np.take`` per fixed-shape column (an
    array) and one slice per row of each variable-length column (a ``FlatColumn``), the encoded
    images among them decoded into one preallocated array."""

    def __init__(self, arrays: dict[str, np.ndarray | FlatColumn]) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def __getitems__(self, indices: list[int]) -> dict[str, Any]:
        return {name: column.rows(indices) if isinstance(column, FlatColumn)
                else np.take(column, indices, axis=0) for name, column in self.arrays.items()}


_MemmapRows = GatherRows  # the name tests/benchmarks/bench_loading.py imports


def _as_tensors(batch: dict[str, Any]) -> dict[str, Any]:
    """Arrays as tensors; lists (ragged, bytes and str rows) as they are, as the default
    collate leaves a cached batch's."""
    return {name: torch.from_numpy(values) if isinstance(values, np.ndarray) else values
            for name, values in batch.items()}


def _mapped_afresh(column: np.ndarray | FlatColumn) -> np.ndarray | FlatColumn:
    if isinstance(column, FlatColumn):
        return column.reopened()
    return np.load(column.filename, mmap_mode="r")


def _files(column: np.ndarray | FlatColumn) -> list[str | None]:
    if isinstance(column, FlatColumn):
        return [column.values_file, column.offsets_file]
    return [getattr(column, "filename", None)]


def measure_gather(arrays: dict[str, np.ndarray | FlatColumn], batch_size: int,
                   seconds: float) -> Rates:
    """Samples/s of the limit: a ``DataLoader`` (no workers, shuffled) over ``GatherRows`` (one
    ``np.take`` per fixed-shape column, one slice per row of each variable-length column),
    arrays as tensors. Columns mapped from ``.npy`` files are mapped afresh after
    ``drop_page_cache``, so epoch 1 reads them from disk."""
    files = [f for column in arrays.values() for f in _files(column)]
    if all(files):
        drop_page_cache(files)
        arrays = {k: _mapped_afresh(column) for k, column in arrays.items()}
    dataset = GatherRows(arrays)
    generator = torch.Generator()
    generator.manual_seed(0)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator,
                        collate_fn=_as_tensors)
    return _run_epochs(lambda e: (_batch_len(b) for b in loader), seconds)
