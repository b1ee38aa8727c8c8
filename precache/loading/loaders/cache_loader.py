"""``make_loader``: a DataLoader over a cache with the right defaults, DDP-aware and resumable.

What it sets, and why:

- the sampler is ``DistributedShardSampler``: every sample exactly once per epoch across ranks,
  equal batch counts on every rank, and a mid-epoch state that survives a change of world size;
- ``num_workers`` from the cores this rank may use, minus one for the training loop (0 on a
  machine with one core per rank). Cached batches are cheap: on 2 cores the main process alone
  was faster than 2 workers (every batch crosses shared memory). ``precache bench`` measures it;
- each worker pins OpenMP/BLAS/OpenCV/torch to one thread, so workers do not fight;
- ``pin_memory`` when CUDA is present (``tensor.pin_memory()`` fails without it); worker
  threads then read each batch straight into pinned memory (``ThreadedBatches``), so it is not
  copied a second time to be pinned;
- ``persistent_workers`` (no worker start-up, no re-opened shards each epoch) and seeded workers
  (a generator seeded from ``seed`` and the rank, so augmentations differ across ranks and
  workers and repeat across runs);
- read-ahead: each batch of indices (an ``IndexBatch``) carries ``ahead``, the indices of the
  batch the same worker gets next (DataLoader hands batches to workers in turn, so that is
  ``num_workers`` batches later). ``CachedDataset`` asks the kernel to start reading those rows
  before it gathers this batch, so a cold or larger-than-RAM cache keeps the disk busy.

``CacheLoader`` counts the samples it has handed out, which is what its ``state_dict()`` records:
the DataLoader's own position runs ahead of the training loop by the prefetched batches.

``make_loader(dataset, batch_sampler=...)`` takes the batches from a resumable batch sampler
instead (e.g. ``LengthBucketSampler``: documents of similar length together), read by the same
threads or processes, with the same contract: the batch sampler's state and epochs, counted in
samples as ``DistributedShardSampler``'s are (``BatchSamplerPosition``).
"""

from __future__ import annotations

import os
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler

from precache.loading.datasets.cache_backed import CacheBacked
from precache.loading.datasets.batches import collate_samples
from precache.loading.datasets.cached import CachedDataset
from precache.loading.samplers.length_buckets import ExactOnceBucketSampler, cache_lengths
from precache.loading.samplers.shard_sampler import DistributedShardSampler
from precache.loading.loaders.threaded import ThreadedBatches, declares_thread_safe
from precache.threads import guard_opencv_forks, pin_threads

__all__ = ["make_loader", "CacheLoader", "loader_workers", "IndexBatch", "ReadAheadBatches",
           "BatchSamplerPosition", "RESUMABLE_BATCH_SAMPLER"]

guard_opencv_forks()  # worker processes are forked after loader threads may have used OpenCV


def loader_workers() -> int:
    """Worker processes for one rank: its share of the usable cores, minus one for the loop."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, min(8, cores // max(1, local_ranks) - 1))


def _pin_worker_threads(_: int) -> None:
    pin_threads()


_INDEX_SPAN = 1 << 16  # indices a read-ahead batch sampler asks of the sampler at a time


class IndexBatch(list):
    """The indices of one batch, plus ``ahead``: those of a later batch the same worker will
    read (``None`` near the end of the epoch), and ``storage_order``: the dataset may return
    the samples in the order it stores them (the batch holds the same samples; a shuffled
    batch is as random in any order). ``array``: the same indices as an int64 array (a dataset
    that reads batches need not convert the list back). ``empty``: set by ``ThreadedBatches``
    when it pins, the ``empty(shape, dtype)`` the dataset makes the batch's arrays with
    (``pinned_empty``). A list, so every dataset and collate accepts it; it keeps its
    attributes when pickled to a worker."""

    ahead: list[int] | None = None
    storage_order = True
    array: np.ndarray | None = None
    empty: Callable[..., np.ndarray] | None = None


class ReadAheadBatches(Sampler[list[int]]):
    """Batches of a ``DistributedShardSampler``'s indices, each with the indices of the batch
    ``ahead_by`` later attached (``IndexBatch.ahead``).

    Args:
        sampler: the epoch's indices of this rank (``indices()``).
        batch_size: indices per batch; the last batch may be smaller.
        ahead_by: how many batches later the attached batch is (the number of workers: a
            DataLoader hands batches to its workers in turn; 1 without workers).
    """

    def __init__(self, sampler: DistributedShardSampler, batch_size: int, ahead_by: int) -> None:
        self.sampler, self.batch_size, self.ahead_by = sampler, batch_size, max(1, ahead_by)

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        total, size = len(self.sampler), self.batch_size
        span = max(_INDEX_SPAN, size * (self.ahead_by + 1))  # indices asked of the sampler at once
        first, held = 0, self.sampler.indices_between(0, span)  # positions first.. of the pass
        for start in range(0, total, size):
            needed = min(total, start + (self.ahead_by + 1) * size)
            if needed > first + len(held):  # ask for the next span (a lazy order costs per index)
                more = self.sampler.indices_between(first + len(held), needed + span)
                held, first = np.concatenate([held[start - first:], more]), start
            chunk = held[start - first:start - first + size]
            batch = IndexBatch(chunk.tolist())
            batch.array = chunk
            later = start + self.ahead_by * size - first
            if later + first < total:
                batch.ahead = held[later:later + size].tolist()
            yield batch


RESUMABLE_BATCH_SAMPLER = ("batch_size", "epoch", "set_epoch", "epoch_batches", "state_dict",
                           "load_state_dict", "__iter__", "__len__")
"""What ``make_loader(batch_sampler=...)`` needs of a batch sampler (``LengthBucketSampler`` has
it all): ``batch_size`` (samples per batch on this rank); ``epoch`` and ``set_epoch(epoch)``
(which starts that epoch at its beginning, except right after ``load_state_dict`` of it, which it
keeps); ``epoch_batches()`` (this rank's batches in a whole epoch); ``len()`` (the batches left
in the current pass); ``state_dict(batches)`` (the position after this rank took ``batches``
batches of the pass) and ``load_state_dict(state)``."""


class BatchSamplerPosition:
    """A resumable batch sampler as ``CacheLoader`` counts it: the interface of
    ``DistributedShardSampler`` (positions in samples, ``begin_pass``, ``position_id``), so that
    the loader's contract holds for it unchanged: ``len()`` a whole epoch, every pass the next
    epoch unless ``set_epoch`` or ``load_state_dict`` chose one, a state between any two batches.

    Args:
        batch_sampler: has ``RESUMABLE_BATCH_SAMPLER``'s attributes.
    """

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler
        self.batch_size = int(batch_sampler.batch_size)
        self._chosen = False  # set_epoch chose the next pass's epoch
        self._loaded = False  # load_state_dict set the next pass's position
        self._passes = 0  # passes begun (begin_pass)
        self.position_id = 0
        """Changes whenever the epoch or its start are set anew (``DistributedShardSampler``'s)."""

    @property
    def epoch(self) -> int:
        return int(self.batch_sampler.epoch)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its beginning, unless ``load_state_dict`` just set this epoch."""
        self.batch_sampler.set_epoch(epoch)
        self._chosen, self._loaded = True, False
        self.position_id += 1

    def begin_pass(self) -> None:
        """A loader starts a pass: the epoch ``set_epoch`` chose; else the rest of a loaded
        epoch (the next epoch if nothing is left of it); else, after an earlier pass, the next
        epoch; else (the first pass) the current one."""
        sampler = self.batch_sampler
        if not self._chosen and (self._loaded or self._passes):
            finished = not self._loaded or len(sampler) == 0
            # set_epoch of the loaded epoch keeps its rest, and makes a later one start over
            sampler.set_epoch(sampler.epoch + 1 if finished else sampler.epoch)
            if finished:
                self.position_id += 1
        self._chosen = self._loaded = False
        self._passes += 1

    def epoch_length(self) -> int:
        """Samples of a whole epoch on this rank (batches x ``batch_size``)."""
        return int(self.batch_sampler.epoch_batches()) * self.batch_size

    def __len__(self) -> int:
        """Samples left in this pass (batches x ``batch_size``)."""
        return len(self.batch_sampler) * self.batch_size

    def state_dict(self, consumed: int) -> dict[str, Any]:
        """The batch sampler's state after this rank trained on ``consumed`` samples of the
        pass (a batch counts ``batch_size``; a smaller last one counts whole)."""
        if not 0 <= consumed <= len(self):
            raise ValueError(f"consumed must be in [0, {len(self)}], not {consumed}")
        return dict(self.batch_sampler.state_dict(-(-consumed // self.batch_size)))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)
        self._chosen, self._loaded = False, True
        self.position_id += 1


class _SampledBatches(Sampler[list[int]]):
    """A batch sampler's batches as ``IndexBatch``es in the order it made them (not storage
    order: it may have ordered them), each with the indices of the batch ``ahead_by`` later
    attached where ``ahead_by`` > 0 (``ReadAheadBatches``'s read-ahead)."""

    def __init__(self, batch_sampler: Any, ahead_by: int) -> None:
        self.batch_sampler, self.ahead_by = batch_sampler, ahead_by
        self.batch_size = batch_sampler.batch_size

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[int]]:
        source = iter(self.batch_sampler)
        window = deque(islice(source, self.ahead_by + 1))  # this batch and the next ahead_by
        while window:
            batch = IndexBatch(int(i) for i in window.popleft())
            batch.array = np.asarray(batch, dtype=np.int64)
            batch.storage_order = False
            if self.ahead_by and len(window) == self.ahead_by:
                batch.ahead = [int(i) for i in window[-1]]
            yield batch
            window.extend(islice(source, 1))


class CacheLoader:
    """A DataLoader plus its sampler, counting what the training loop has received.

    It keeps the contract of torch's ``DataLoader(shuffle=True)`` and torchdata's
    ``StatefulDataLoader``, which Lightning, accelerate and Hugging Face build on (the whole
    contract: ``docs/stage2-loading.md``, "The loader contract"):

    - ``len()`` is the number of batches of a whole epoch on this rank, always (also while a
      resumed epoch yields only its rest);
    - every ``iter()`` is a pass over one epoch: the epoch ``set_epoch`` chose, else the rest of
      the epoch ``load_state_dict`` restored, else the epoch after the last pass (finished or
      abandoned), so epochs advance and reshuffle without ``set_epoch``;
    - ``state_dict()`` may be called between any two batches: plain data (the epoch, the
      position and the generation read) that survives ``torch.save`` and
      ``torch.load(weights_only=True)``; ``load_state_dict`` makes the next pass the samples of
      that epoch not yet seen (split among the ranks it runs on now), and the pass after it the
      next epoch.
    """

    def __init__(self, loader: DataLoader | ThreadedBatches,
                 sampler: DistributedShardSampler | BatchSamplerPosition,
                 batch_size: int | None = None,
                 worker_kind: tuple[str, int, str] = ("processes", 0, "")) -> None:
        self.loader = loader
        self.sampler = sampler
        self.batch_size = batch_size or loader.batch_size or 1
        self.worker_kind, self.num_workers, self._why = worker_kind
        self._consumed = 0  # samples handed out in the pass counted from _counted_from
        self._counted_from = -1  # the sampler's position_id when that pass began
        # start_epoch's pass: (the sampler's position_id, its running iterator)
        self._started: tuple[int, Iterator[Any]] | None = None

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_sampler(self) -> Any:
        """The DataLoader's (Lightning reads it to tell whether a validation loader shuffles)."""
        return self.loader.batch_sampler

    @property
    def epoch(self) -> int:
        """The epoch of the current (or last) pass; the next pass's once ``set_epoch`` or
        ``load_state_dict`` chose it."""
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass ``epoch`` (keeps a resumed position if ``load_state_dict`` set that
        epoch, and the batches ``start_epoch`` already asked for)."""
        if self._started is not None and self.sampler.epoch == epoch \
                and self._started[0] == self.sampler.position_id:
            return
        self._started = None
        self.sampler.set_epoch(epoch)

    def describe(self) -> str:
        """Who reads the batches, and why (``make_loader``'s choice), e.g. for a training log."""
        if self.worker_kind == "none":
            return f"batches read in the training loop ({self._why})"
        return f"{self.num_workers} worker {self.worker_kind} ({self._why})"

    def close(self) -> None:
        """Stop the loader's worker threads (worker processes stop with the DataLoader)."""
        if isinstance(self.loader, ThreadedBatches):
            self.loader.close()

    def start_epoch(self, epoch: int) -> None:
        """Set ``epoch`` and have the workers start on its first batches now, e.g. before
        validation, so the next epoch does not begin with a wait. A later ``set_epoch`` of the
        same epoch keeps them. Its position is 0 until iteration starts."""
        self.set_epoch(epoch)
        self.sampler.begin_pass()
        self._started = (self.sampler.position_id, iter(self.loader))

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank (a resumed pass yields fewer: its rest)."""
        return -(-self.sampler.epoch_length() // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        # A generator: nothing is settled until the first batch is asked for (Lightning calls
        # iter() before it calls set_epoch).
        started, self._started = self._started, None
        if started is None or started[0] != self.sampler.position_id:
            self.sampler.begin_pass()
            started = (self.sampler.position_id, iter(self.loader))
        self._consumed, self._counted_from = 0, started[0]
        total = len(self.sampler)
        for batch in started[1]:
            self._consumed = min(total, self._consumed + self.batch_size)
            yield batch

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where this epoch stands: plain data, the same on every rank that moves in lock-step.

        Args:
            consumed: samples this rank has trained on this epoch (since the resume, if any);
                default: the samples this loader has yielded in its current pass. Pass it when
                something between the loader and the step (a ``DevicePrefetcher`` on CUDA)
                holds a batch ahead.
        """
        if consumed is None:  # 0 once set_epoch or load_state_dict moved on from that pass
            consumed = self._consumed if self._counted_from == self.sampler.position_id else 0
        state = self.sampler.state_dict(consumed=consumed)
        cached = self.cached_dataset()
        if cached is not None:
            state["generation"] = cached.generation  # the order is an order of its rows
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next pass the rest of a saved epoch (see
        ``DistributedShardSampler.load_state_dict``), and the pass after it the next epoch.

        Raises:
            ValueError: the state was saved reading another generation of the cache than this
                loader's dataset reads (its positions would name other samples); the message
                says whether the saved generation is still kept and how to resume.
        """
        cached = self.cached_dataset()
        saved = state.get("generation")
        if cached is not None and saved is not None and saved != cached.generation:
            kept = saved in cached.kept_generations()
            fix = (f"to resume exactly, open {type(cached).__name__}('{cached.path}', "
                   f"generation={saved}), "
                   "which is still kept" if kept else
                   f"generation {saved} is no longer kept (precache gc or a re-run removed it)")
            raise ValueError(
                f"this loader state was saved reading generation {saved} of '{cached.path}', "
                f"but the dataset reads generation {cached.generation}; {fix}; or start the "
                "epoch over on the new generation: set_epoch without load_state_dict")
        self.sampler.load_state_dict(state)
        self._started = None

    def cached_dataset(self) -> CacheBacked | None:
        """The dataset over a cache under the loader's dataset, through ``Subset``s (a
        ``CacheBacked`` one: a ``CachedDataset``, ``ClipDataset``, ``PackedBlocks``...), or
        None."""
        return _beneath_subsets(self.loader.dataset, lambda d: isinstance(d, CacheBacked))


WORKER_KINDS = ("auto", "threads", "processes")
"""``make_loader``'s ``worker_kind`` choices (and the trainers' ``--worker-kind``)."""


def check_worker_kind(worker_kind: str) -> None:
    """Raise ``ValueError`` unless ``worker_kind`` is one of ``WORKER_KINDS``."""
    if worker_kind not in WORKER_KINDS:
        raise ValueError(f"worker_kind must be one of {', '.join(WORKER_KINDS)}, not "
                         f"{worker_kind!r}")


def make_loader(
    dataset: Any, batch_size: int | None = None, shuffle: bool = True,
    num_workers: int | None = None, *, seed: int = 0, drop_last: bool = False,
    shard_window: int | None = None, pin_memory: bool | None = None,
    persistent_workers: bool | None = None, prefetch_factor: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None, read_ahead: bool = True,
    multiprocessing_context: Any = None, rank: int | None = None, world_size: int | None = None,
    worker_kind: str = "auto", batch_transform: Callable[[Any], Any] | None = None,
    batch_sampler: Any = None, bucket_by: str | None = None,
) -> CacheLoader:
    """A ``CacheLoader`` over ``dataset`` (usually a ``CachedDataset``).

    Args:
        dataset: a map-style dataset; with ``__getitems__`` a batch is one read per shard.
        batch_size: samples per batch on each rank (required unless ``batch_sampler`` is given).
        shuffle: shuffle by ``seed`` and epoch (the same order on every rank).
        num_workers: DataLoader workers; default ``loader_workers()``.
        seed: seed of the epoch order and of the workers' random streams.
        drop_last: drop up to world_size - 1 samples per epoch instead of repeating as many.
        shard_window: shuffle shards, then samples within windows of this many shards (reads
            stay local, e.g. for Parquet caches larger than memory); default: global shuffle.
        pin_memory: default: when CUDA is available (``True`` without CUDA warns and does not
            pin, as ``DataLoader`` does). Worker threads read each batch straight
            into pinned memory; worker processes' batches are pinned by the DataLoader, the
            loop's own (``num_workers=0``) by a copy after reading.
        persistent_workers: default: when there are workers.
        prefetch_factor: batches each worker prepares ahead (torch's default 2).
        collate_fn: default: ``collate_samples``, torch's ``default_collate`` (dicts of stacked
            tensors) that turns an untransformed cached batch into tensors without re-stacking.
        read_ahead: attach the indices of each worker's next batch to its current one, so
            the dataset can start reading them (``CachedDataset`` does, for mapped columns).
        multiprocessing_context: worker start method (default torch's: fork on Linux).
        rank, world_size: default from ``torch.distributed`` when initialised, else 0 and 1.
        worker_kind: what the ``num_workers`` workers are: ``"threads"`` of this process
            (``ThreadedBatches``: the batch is handed over as is), ``"processes"`` (DataLoader
            worker processes), or ``"auto"``: threads for a ``CachedDataset`` (or a ``Subset``
            of one) without a per-sample ``transform`` whose ``collate_fn`` and
            ``batch_transform`` (if any) declare ``thread_safe = True`` (``TokenCollate``,
            ``FaceAugment``... do), else processes (per-sample Python holds the GIL).
            ``CacheLoader.worker_kind`` and ``describe()`` say which, and why.
        batch_transform: applied to each collated batch by the worker that read it (a thread
            or a process), e.g. a batched ``FaceAugment``; with threads it is called from
            several threads at once.
        batch_sampler: the batches' indices come from it instead (e.g. a
            ``LengthBucketSampler``), read by the same threads or processes (with read-ahead,
            in the order it gives). It must be resumable (``RESUMABLE_BATCH_SAMPLER``); the
            loader's ``len()``, epochs and state are its own, counted in samples
            (``BatchSamplerPosition``). Its batch size, shuffle and ranks are its own:
            ``batch_size``, ``shuffle=False``, ``drop_last``, ``shard_window``, ``rank`` and
            ``world_size`` are refused beside it.
        bucket_by: a column of token counts (``"length"``): batches of similar lengths from an
            ``ExactOnceBucketSampler`` (``PrecacheTrainer``'s: every sample exactly once per
            epoch across ranks, resumable on any world size) of ``batch_size``, ``seed``,
            ``drop_last``, ``rank`` and ``world_size``; not with ``shuffle=False`` or
            ``shard_window``.

    Raises:
        ValueError: a bad ``batch_size``, ``num_workers`` or ``worker_kind``; a
            ``batch_sampler`` that is not resumable, or given with what it decides.
    """
    workers = loader_workers() if num_workers is None else int(num_workers)
    if workers < 0:
        raise ValueError(f"num_workers must be >= 0, not {workers}")
    check_worker_kind(worker_kind)
    plan = _batches(dataset, workers, read_ahead, batch_sampler, bucket_by, batch_size=batch_size,
                    shuffle=shuffle, seed=seed, drop_last=drop_last, shard_window=shard_window,
                    rank=rank, world_size=world_size)
    pin = _pin(pin_memory)
    kind, reason = _worker_kind(dataset, workers, worker_kind, collate_fn, batch_transform)
    collate = collate_fn or collate_samples
    reader: DataLoader | ThreadedBatches
    if kind in ("threads", "none"):  # none: ThreadedBatches reads in the loop's own thread
        reader = ThreadedBatches(dataset, plan.batches, collate, workers, prefetch_factor or 2,
                                 pin, batch_transform)
    else:
        reader = _worker_processes(dataset, plan.batches, workers, _then(collate, batch_transform),
                                   pin, seed * 1_000_003 + plan.rank, persistent_workers,
                                   prefetch_factor, multiprocessing_context)
    return CacheLoader(reader, plan.sampler, plan.batch_size, worker_kind=(kind, workers, reason))


class _Batches(NamedTuple):
    """Where a loader's batches of indices come from (``make_loader``'s first choice)."""

    sampler: DistributedShardSampler | BatchSamplerPosition
    """What ``CacheLoader`` counts, resumes and advances epochs with."""
    batches: Sampler[list[int]]
    """The batches of indices the workers read (``IndexBatch``es with read-ahead)."""
    batch_size: int
    rank: int
    """This rank: the worker processes' seeds differ by it."""


def _batches(dataset: Any, workers: int, read_ahead: bool, batch_sampler: Any,
             bucket_by: str | None, **options: Any) -> _Batches:
    """``make_loader``'s batches of indices: of ``batch_sampler``, of length buckets of the
    ``bucket_by`` column, or of a ``DistributedShardSampler`` (``options`` are its keywords)."""
    if bucket_by is not None:
        if batch_sampler is not None:
            raise ValueError("make_loader: give bucket_by or batch_sampler, not both")
        batch_sampler = _length_buckets(dataset, bucket_by, **options)
        options = {}
    if batch_sampler is None:
        return _shard_sampler_batches(dataset, workers=workers, read_ahead=read_ahead, **options)
    given = {"batch_size": options.get("batch_size") is not None,
             "shuffle=False": not options.get("shuffle", True),
             "drop_last": options.get("drop_last"),
             "shard_window": options.get("shard_window") is not None,
             "rank": options.get("rank") is not None,
             "world_size": options.get("world_size") is not None}
    return _batch_sampler_batches(batch_sampler, workers, read_ahead,
                                  [name for name, set_ in given.items() if set_])


def _length_buckets(dataset: Any, column: str, *, batch_size: int | None, shuffle: bool,
                    seed: int, drop_last: bool, shard_window: int | None, rank: int | None,
                    world_size: int | None) -> ExactOnceBucketSampler:
    """``make_loader(bucket_by=column)``'s batch sampler: exact-once length buckets of the
    column's values, refused in one line beside what it decides itself."""
    if batch_size is None or batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    refused = [name for name, set_ in (("shuffle=False", not shuffle),
                                        ("shard_window", shard_window is not None)) if set_]
    if refused:
        raise ValueError(f"make_loader: {', '.join(refused)} given beside bucket_by="
                         f"{column!r}, whose batches are shuffled length buckets; leave "
                         f"{' and '.join(refused)} out, or bucket_by")
    return ExactOnceBucketSampler(cache_lengths(dataset, column), batch_size, seed=seed,
                                  drop_last=drop_last, rank=rank, world_size=world_size)


def _shard_sampler_batches(dataset: Any, batch_size: int | None, *, workers: int,
                           read_ahead: bool, shuffle: bool, seed: int, drop_last: bool,
                           shard_window: int | None, rank: int | None,
                           world_size: int | None) -> _Batches:
    """Batches of ``batch_size`` of a ``DistributedShardSampler``'s indices (the keywords are
    its arguments), each with the indices of the same worker's next batch when ``read_ahead``."""
    if batch_size is None or batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    sampler = DistributedShardSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                      shard_window=shard_window, rank=rank, world_size=world_size)
    batches = (ReadAheadBatches(sampler, batch_size, workers) if read_ahead else
               BatchSampler(sampler, batch_size, drop_last=False))
    return _Batches(sampler, batches, batch_size, sampler.rank)


def _batch_sampler_batches(batch_sampler: Any, workers: int, read_ahead: bool,
                           also_given: list[str]) -> _Batches:
    """The batches of a resumable ``batch_sampler``, with read-ahead as ``ReadAheadBatches``;
    refused in one line if it is not resumable or ``also_given`` names what it decides."""
    _check_batch_sampler(batch_sampler, also_given)
    position = BatchSamplerPosition(batch_sampler)
    batches = _SampledBatches(batch_sampler, workers if read_ahead else 0)
    return _Batches(position, batches, position.batch_size,
                    int(getattr(batch_sampler, "rank", 0)))


def _pin(pin_memory: bool | None) -> bool:
    """Whether batches are pinned: ``pin_memory``, by default when CUDA is available. ``True``
    without CUDA warns and does not pin (``tensor.pin_memory()`` raises without it)."""
    pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
    if pin and not torch.cuda.is_available():
        warnings.warn("make_loader: pin_memory=True, but CUDA is not available: batches are "
                      "not pinned (pinned memory needs CUDA; leave pin_memory at its default)",
                      stacklevel=3)  # make_loader's caller
        return False
    return pin


def _worker_processes(dataset: Any, batches: Sampler[list[int]], workers: int,
                      collate: Callable[[Any], Any], pin: bool, seed: int,
                      persistent_workers: bool | None, prefetch_factor: int | None,
                      multiprocessing_context: Any) -> DataLoader:
    """A DataLoader whose ``workers`` processes read ``batches``, each pinned to one thread,
    their random streams seeded from ``seed``."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(
        dataset,
        batch_sampler=batches,
        num_workers=workers,
        collate_fn=collate,
        pin_memory=pin,
        generator=generator,
        persistent_workers=True if persistent_workers is None else persistent_workers,
        prefetch_factor=prefetch_factor or 2,
        worker_init_fn=_pin_worker_threads,
        multiprocessing_context=multiprocessing_context,
    )  # no drop_last: the sampler already gives every rank the same count


def _check_batch_sampler(batch_sampler: Any, also_given: list[str]) -> None:
    """Refuse, in one line, a batch sampler ``CacheLoader`` cannot resume, or one given with
    ``make_loader`` arguments that it decides itself."""
    name = type(batch_sampler).__name__
    missing = [a for a in RESUMABLE_BATCH_SAMPLER if not hasattr(batch_sampler, a)]
    if missing:
        raise ValueError(f"make_loader: batch_sampler {name} has no {', '.join(missing)}: the "
                         "loader counts, resumes and advances epochs through "
                         f"{', '.join(RESUMABLE_BATCH_SAMPLER)} (LengthBucketSampler has them); "
                         "or leave batch_sampler out and pass batch_size")
    if also_given:
        raise ValueError(f"make_loader: {', '.join(also_given)} given beside batch_sampler "
                         f"{name}, which decides them itself: pass them to the batch sampler")


def _then(collate: Callable[[Any], Any],
          transform: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """``collate``, then ``transform`` on the batch (run by the worker process)."""
    return collate if transform is None else _CollateThen(collate, transform)


class _CollateThen:
    """A picklable ``transform(collate(samples))`` (spawned workers receive it pickled)."""

    def __init__(self, collate: Callable[[Any], Any], transform: Callable[[Any], Any]) -> None:
        self.collate, self.transform = collate, transform

    def __call__(self, samples: Any) -> Any:
        return self.transform(self.collate(samples))


def _worker_kind(dataset: Any, workers: int, asked: str,
                 collate_fn: Callable[[list[Any]], Any] | None,
                 batch_transform: Callable[[Any], Any] | None) -> tuple[str, str]:
    """(``"threads"``, ``"processes"`` or ``"none"``, why) for ``make_loader``: threads only
    where every call a batch makes releases the GIL or declares itself thread-safe."""
    if workers == 0:
        return "none", "num_workers=0: batches are read by the training loop itself"
    if asked != "auto":
        return asked, f"worker_kind={asked!r}"
    base = _beneath_subsets(dataset, lambda d: isinstance(d, CachedDataset))
    if base is None:
        return "processes", (f"{type(dataset).__name__} is not a CachedDataset: its Python "
                             "work per sample could hold the GIL")
    if base.transform is not None:
        return "processes", "the dataset has a per-sample transform, which holds the GIL"
    declared = []
    for role, function in (("collate_fn", collate_fn), ("batch_transform", batch_transform)):
        if function is None or function is collate_samples:
            continue
        name = getattr(function, "__name__", None) or type(function).__name__
        if not declares_thread_safe(function):
            return "processes", (f"the {role} {name} does not declare thread_safe = True, so "
                                 "it may do Python work per sample or share state between "
                                 "threads (set the attribute if it is thread-safe)")
        declared.append(f"{role} {name}")
    return "threads", ("the cache's own columns: gather and decode release the GIL"
                       + (f"; {' and '.join(declared)} declare thread_safe" if declared else ""))


def _beneath_subsets(dataset: Any, found: Callable[[Any], bool]) -> Any:
    """``dataset``, or the first dataset under its ``Subset``s (``.dataset``), for which
    ``found`` holds; None if none does."""
    while not found(dataset) and hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    return dataset if found(dataset) else None
