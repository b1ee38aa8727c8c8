"""Timing one loader setting: epoch 1 apart from the later epochs, worker memory after each
epoch; for the cached loader (``make_loader`` over ``CachedDataset``), the per-file baseline
(one picture file per sample, ``cv2.imread``) and the limit (a NumPy gather of memory-mapped
arrays). See ``precache.cli.bench`` for what is measured and why."""

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
from precache.loading.dataset import CachedDataset
from precache.loading.loader import make_loader
from precache.threads import pin_threads

__all__ = ["Rates", "CACHED_CUT", "cores", "default_worker_counts", "measure_cached",
           "measure_per_file", "measure_gather", "drop_page_cache", "shard_paths"]

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
                   seconds: float) -> Rates:
    """Samples/s a training loop receives from ``make_loader`` over ``CachedDataset``; epoch 1
    starts with the shards out of the page cache (``drop_page_cache``)."""
    drop_page_cache(shard_paths(cache))
    dataset = CachedDataset(cache, columns)
    loader = make_loader(dataset, batch_size, shuffle=True, num_workers=workers)
    rss: list[list[int]] = []
    anon: list[list[int]] = []
    uss: list[list[int]] = []
    pss: list[list[int]] = []

    def epoch(e: int) -> Iterator[int]:
        loader.set_epoch(e)
        return (_batch_len(b) for b in loader)

    def after_epoch() -> None:
        if workers:
            pids = _worker_pids(loader.loader)
            rss.append([_proc_status_kb(p, "VmRSS") for p in pids])
            anon.append([_proc_status_kb(p, "RssAnon") for p in pids])
            smaps = [_smaps_kb(p) for p in pids]
            uss.append([m.get("Private_Clean", 0) + m.get("Private_Dirty", 0) for m in smaps])
            pss.append([m.get("Pss", 0) for m in smaps])

    try:
        rates = _run_epochs(epoch, seconds, after_epoch, cut=CACHED_CUT * seconds)
    finally:
        _shutdown(loader.loader)
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


class _MemmapRows(Dataset):
    """The limit's dataset: ``__getitems__`` is one ``np.take`` per memory-mapped column."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def __getitems__(self, indices: list[int]) -> dict[str, np.ndarray]:
        return {name: np.take(array, indices, axis=0) for name, array in self.arrays.items()}


def _as_tensors(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(values) for name, values in batch.items()}


def measure_gather(arrays: dict[str, np.ndarray], batch_size: int, seconds: float) -> Rates:
    """Samples/s of the limit: a ``DataLoader`` (no workers, shuffled) over a dataset whose
    ``__getitems__`` is one ``np.take`` per memory-mapped column, batches as tensors. Arrays
    mapped from ``.npy`` files are mapped afresh after ``drop_page_cache``, so epoch 1 reads
    them from disk."""
    files = {k: getattr(a, "filename", None) for k, a in arrays.items()}
    if all(files.values()):
        drop_page_cache(list(files.values()))
        arrays = {k: np.load(f, mmap_mode="r") for k, f in files.items()}
    dataset = _MemmapRows(arrays)
    generator = torch.Generator()
    generator.manual_seed(0)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator,
                        collate_fn=_as_tensors)
    return _run_epochs(lambda e: (_batch_len(b) for b in loader), seconds)
