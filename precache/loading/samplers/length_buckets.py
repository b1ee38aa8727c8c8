"""``LengthBucketSampler``: batches of similar lengths (little padding), every sample at least once
per epoch across ranks (a few repeated to fill the last global batch, or dropped with
``drop_last``), equal batch counts on every rank, resumable mid-epoch on any world size.

The plan of an epoch is global and the same on every rank: shuffle all indices by seed and epoch;
cut them into windows of ``bucket_batches`` global batches (a global batch is ``batch_size`` x
``world_size`` samples); sort each window by length and cut it into global batches, so each holds
neighbours in length; shuffle the order of the global batches. Rank r takes slice r of each.
Samples left over are padded to whole global batches by repeating the first ones (at most one
global batch minus one sample per epoch), or dropped with ``drop_last``.

After every rank has taken k batches, the samples seen are exactly those of the first k global
batches. A resume on another world size replays that plan to find them and plans the rest anew
for the new world size, so the state is a short list of ``(world_size, batch_size, batches)``.

``ExactOnceBucketSampler`` (``PrecacheTrainer``'s and ``make_loader(bucket_by=...)``'s) repeats
nothing: the left-over samples make a smaller last global batch. ``cache_lengths`` reads the
lengths from a cache's column.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler, Subset

from precache.loading.datasets.cached import CachedDataset

__all__ = ["LengthBucketSampler", "ExactOnceBucketSampler", "cache_lengths"]


class LengthBucketSampler(Sampler[list[int]]):
    """A batch sampler (``make_loader(dataset, batch_sampler=...)``, or
    ``DataLoader(dataset, batch_sampler=...)``) over samples of ``lengths``.

    Args:
        lengths: the length of every sample (e.g. the cache's ``length`` column).
        batch_size: samples per batch on each rank.
        seed: seed of the plan, the same on every rank.
        bucket_batches: global batches per sorting window; larger means less padding and a less
            random batch composition.
        drop_last: drop the samples that do not fill a last global batch instead of repeating.
        rank, world_size: default from ``torch.distributed`` when initialised, else 0 and 1.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, batch_size: int, *, seed: int = 0,
                 bucket_batches: int = 50, drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = world_size if world_size is not None else (
            dist.get_world_size() if distributed else 1)
        self.rank = rank if rank is not None else (dist.get_rank() if distributed else 0)
        if batch_size < 1 or bucket_batches < 1 or seed < 0:
            raise ValueError("batch_size and bucket_batches must be >= 1 and seed >= 0")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), not {self.rank}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size, self.seed = batch_size, seed
        self.bucket_batches, self.drop_last = bucket_batches, drop_last
        self.epoch = 0
        self._done: list[tuple[int, int, int]] = []  # (world_size, batch_size, batches) before now
        self._resumed_epoch: int | None = None

    def _plan(self, remaining: np.ndarray, world: int, batch: int, part: int) -> np.ndarray:
        """Global batches (rows) of ``remaining`` for ``world`` ranks of ``batch`` samples."""
        size = world * batch
        if self.drop_last:
            remaining = remaining[: len(remaining) // size * size]
        elif len(remaining) % size:
            remaining = np.resize(remaining, -(-len(remaining) // size) * size)  # repeat the first
        rng = np.random.default_rng([self.seed, self.epoch, part])
        order = remaining[rng.permutation(len(remaining))]
        window = size * self.bucket_batches
        for start in range(0, len(order), window):
            chunk = order[start:start + window]
            order[start:start + window] = chunk[np.argsort(self.lengths[chunk], kind="stable")]
        batches = order.reshape(-1, size)
        return batches[rng.permutation(len(batches))]

    def _current(self) -> np.ndarray:
        """The plan of the part of this epoch that is still to come."""
        remaining = np.arange(len(self.lengths))
        for part, (world, batch, taken) in enumerate(self._done):
            seen = self._plan(remaining, world, batch, part)[:taken].ravel()
            remaining = np.setdiff1d(remaining, seen)  # sorted, so the replay is deterministic
        return self._plan(remaining, self.world_size, self.batch_size, len(self._done))

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from the beginning, except right after ``load_state_dict`` of it."""
        if self._resumed_epoch == epoch:
            self._resumed_epoch = None
            return
        self.epoch, self._done, self._resumed_epoch = epoch, [], None

    def epoch_batches(self) -> int:
        """This rank's batches in a whole epoch from its start, on this world size (``len()``
        counts those left after a resume): what a loader's ``len()`` is."""
        everything = np.arange(len(self.lengths))
        return len(self._plan(everything, self.world_size, self.batch_size, 0))

    def __len__(self) -> int:
        """The batches left in this epoch on this rank (all of them unless resumed)."""
        return len(self._current())

    def __iter__(self) -> Iterator[list[int]]:
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        for global_batch in self._current():
            yield global_batch[lo:hi].tolist()

    def state_dict(self, batches: int) -> dict[str, Any]:
        """The position after this rank took ``batches`` batches (all ranks in lock-step)."""
        if not 0 <= batches <= len(self):
            raise ValueError(f"batches must be in [0, {len(self)}], not {batches}")
        done = self._done + [(self.world_size, self.batch_size, batches)]
        return {"epoch": self.epoch, "seed": self.seed, "size": len(self.lengths),
                "bucket_batches": self.bucket_batches, "drop_last": self.drop_last,
                "done": [list(d) for d in done]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # drop_last too: the replay of the parts before must plan them as they were planned.
        for key, mine in (("size", len(self.lengths)), ("seed", self.seed),
                          ("bucket_batches", self.bucket_batches), ("drop_last", self.drop_last)):
            if state[key] != mine:
                raise ValueError(f"the state was saved with {key}={state[key]}, this sampler "
                                 f"has {key}={mine}")
        self.epoch = int(state["epoch"])
        self._done = [tuple(int(v) for v in d) for d in state["done"]]  # type: ignore[misc]
        self._resumed_epoch = self.epoch


class ExactOnceBucketSampler(LengthBucketSampler):
    """``LengthBucketSampler`` that never repeats a sample: the samples that do not fill a last
    global batch (``batch_size`` x ``world_size``) make a smaller last one, split over the ranks
    as evenly as they go, instead of being padded with repeats. Which samples are left over
    changes every epoch (with ``drop_last`` too: those are dropped).

    Every rank still gets the same number of batches (DDP needs it) and every batch at least one
    sample: when fewer samples than ranks are left over, the last two global batches share them.
    That cannot be done with ``batch_size`` 1 (or fewer samples than ranks); then the left-over
    samples are padded with repeats as ``LengthBucketSampler`` does, with a warning.

    Args: as ``LengthBucketSampler``.
    """

    def _plan(self, remaining: np.ndarray, world: int, batch: int, part: int) -> np.ndarray:
        size = world * batch
        extra = len(remaining) % size
        if not extra:
            return super()._plan(remaining, world, batch, part)
        rng = np.random.default_rng([self.seed, self.epoch, part, 1])
        order = remaining[rng.permutation(len(remaining))]  # the left-over: new every epoch
        full = len(order) - extra
        if self.drop_last:
            return super()._plan(order[:full], world, batch, part)
        if extra < world:
            full -= size  # the last two global batches share the left-over samples
        if full < 0 or (extra < world and batch == 1):
            warnings.warn(f"{len(remaining)} samples do not split into batches of at least one "
                          f"sample on each of {world} ranks: {size - extra} are repeated this "
                          "epoch (use a larger batch_size, or drop_last)", stacklevel=3)
            return super()._plan(remaining, world, batch, part)
        tail = order[full:]
        rows = -(-len(tail) // size)
        slots = np.full((rows * world, batch), -1, dtype=np.int64)  # -1: no sample
        for j, index in enumerate(tail):  # round robin: slot sizes differ by at most one
            slots[j % (rows * world), j // (rows * world)] = index
        return np.concatenate([super()._plan(order[:full], world, batch, part),
                               slots.reshape(rows, size)])

    def __iter__(self) -> Iterator[list[int]]:
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        for global_batch in self._current():
            yield [int(i) for i in global_batch[lo:hi] if i >= 0]


def cache_lengths(dataset: Any, column: str = "length") -> np.ndarray:
    """The ``column`` value (a token count: the text pipeline's ``length``) of every row of
    ``dataset``, a ``CachedDataset`` (the rows it holds: ``where=``, ``select``, ``split``) or a
    ``Subset`` of one, in its order; the column need not be among the dataset's ``columns``.

    Raises:
        TypeError: ``dataset`` is not a ``CachedDataset`` or a ``Subset`` of one.
        KeyError: the cache has no such column.
    """
    base, rows = dataset, None
    if isinstance(dataset, Subset):
        base, rows = dataset.dataset, np.asarray(dataset.indices, dtype=np.int64)
    if not isinstance(base, CachedDataset):
        raise TypeError(f"cache_lengths takes a CachedDataset or a Subset of one, not "
                        f"{type(dataset).__name__}; pass lengths= yourself")
    lengths = np.asarray(base.read_column(column))
    return lengths if rows is None else lengths[rows]
