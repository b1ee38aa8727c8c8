"""``DistributedShardSampler``: the index order of each rank, DDP-aware and resumable mid-epoch.

Every rank computes the same epoch order (a permutation of all N indices, from ``seed`` and the
epoch) and takes every ``world_size``-th of the samples not yet consumed. Because the split is
strided, after each rank has consumed k samples the samples seen by all ranks together are exactly
the first ``k * world_size`` of them. So the whole position is one global ``offset`` into the
epoch order: the state is a few integers, the same on every rank, and valid for any world size.

Per epoch, every rank gets the same number of indices (so the same number of batches, and DDP
never waits on a rank that has run out):

- ``drop_last=False`` (default): the samples left are padded to a multiple of ``world_size`` by
  repeating the first of them, so at most ``world_size - 1`` extra indices are yielded (a sample
  repeats more than once only when fewer than ``world_size`` samples are left).
- ``drop_last=True``: the samples left are cut to a multiple of ``world_size``, so at most
  ``world_size - 1`` samples are skipped that epoch.

A resumed epoch pads or cuts what is left after the offset, so these bounds hold per resume.

The order of a shuffled epoch is NumPy's ``permutation`` up to ``LAZY_ORDER_ROWS`` samples; past
that it is a ``LazyOrder``, computed a chunk at a time as the epoch goes, so the first batch of a
cache of millions of rows does not wait for a whole shuffle (1.0-1.6 s for 25 million). The state
records which (``order``), so a saved position always resumes in the order it was saved in.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from precache.loading._engine.lazy_order import LazyOrder

__all__ = ["DistributedShardSampler", "LAZY_ORDER_ROWS", "ORDERS", "shuffle_quality"]

_CHUNK = 8192  # indices turned into Python ints at a time
LAZY_ORDER_ROWS = 1 << 22
"""Above this many samples a shuffled epoch's order is a ``LazyOrder`` (4.2 million: NumPy
shuffles that many in ~0.2 s; the lazy order costs ~4x as much in all, spread over the epoch)."""
ORDERS = ("sequential", "permutation", "windows", "lazy")
"""How an epoch order is made: no shuffle; NumPy's permutation; shards in windows; LazyOrder."""


class DistributedShardSampler(Sampler[int]):
    """Indices of one rank for a map-style dataset: shuffled by seed and epoch, resumable.

    Call ``set_epoch(epoch)`` before iterating each epoch. To resume, call ``load_state_dict``
    before that ``set_epoch``: the first ``set_epoch`` of the saved epoch after
    ``load_state_dict`` keeps the saved position; any other ``set_epoch`` starts its epoch at
    the beginning. A loader that iterates it (``CacheLoader``) calls ``begin_pass`` at the start
    of every pass, which advances to the next epoch where nothing chose one (the contract of
    ``DataLoader(shuffle=True)``; see ``begin_pass``). Iterated directly, it behaves as torch's
    ``DistributedSampler``: the same order until ``set_epoch``.

    Args:
        dataset: anything with ``__len__``. For ``shard_window`` it also needs ``shard_ids``, a
            NumPy array with the shard of every index (``CachedDataset`` has it).
        shuffle: shuffle by ``seed`` and epoch (default ``True``); ``False`` gives 0..N-1.
        seed: seed of the epoch order, the same on every rank (default 0).
        drop_last: cut the samples left to a multiple of ``world_size`` instead of padding them
            (default ``False``). See the module docstring for the exact policy.
        shard_window: shuffle the order of the shards, group them into windows of this many
            consecutive shards, and shuffle samples only within a window (default ``None``:
            global shuffle). Each batch then touches few shards, which keeps reads local (e.g.
            Parquet caches larger than memory) at the price of a less global shuffle.
        rank: this rank (default: ``torch.distributed.get_rank()`` when initialised, else 0).
        world_size: the number of ranks (default: ``torch.distributed.get_world_size()`` when
            initialised, else 1).

    Raises:
        ValueError: an argument is out of range, or ``shard_window`` is given without
            ``shuffle`` or for a dataset without matching ``shard_ids``.
    """

    def __init__(self, dataset: Sized, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, shard_window: int | None = None,
                 rank: int | None = None, world_size: int | None = None) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if distributed else 1
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, not {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), not {rank}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, not {seed}")
        self.size = len(dataset)
        self._shards: np.ndarray | None = None
        if shard_window is not None:
            if shard_window < 1:
                raise ValueError(f"shard_window must be at least 1, not {shard_window}")
            if not shuffle:
                raise ValueError("shard_window only changes a shuffled order; pass shuffle=True")
            shard_ids = getattr(dataset, "shard_ids", None)
            if shard_ids is None:
                raise ValueError(f"shard_window needs a dataset with shard_ids; "
                                 f"{type(dataset).__name__} has none")
            shard_ids = np.asarray(shard_ids)
            if shard_ids.shape != (self.size,):
                raise ValueError(f"shard_ids has shape {shard_ids.shape}; the dataset has "
                                 f"{self.size} samples")
            self._shards = shard_ids
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.shard_window = shard_window
        self.rank, self.world_size = int(rank), int(world_size)
        self.epoch = 0
        self.offset = 0  # samples of this epoch's order consumed by all ranks before this pass
        self._resumed_epoch: int | None = None  # set by load_state_dict until its set_epoch
        self._saved_order: tuple[int, str] | None = None  # (epoch, order) of a loaded state
        self._order: tuple[tuple[int, str], Any] | None = None  # this epoch's order, made once
        self._chosen = False  # set_epoch chose the next pass's epoch
        self._loaded = False  # load_state_dict set the next pass's position
        self._passes = 0  # passes begun (begin_pass)
        self.position_id = 0
        """Changes whenever the epoch or its start are set anew: a loader's count of the samples
        it handed out belongs to the position it counted from."""

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its beginning, unless ``load_state_dict`` just set this epoch."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, not {epoch}")
        if epoch != self._resumed_epoch:
            self.offset = 0
        self.epoch, self._resumed_epoch = int(epoch), None
        self._chosen, self._loaded = True, False
        self.position_id += 1

    def begin_pass(self) -> None:
        """A loader starts a pass over this sampler: settle which epoch and position it reads.

        - ``set_epoch`` was called since the last pass: that epoch, as ``set_epoch`` left it;
        - else ``load_state_dict`` was: the rest of the saved epoch, or the next epoch from its
          start if the saved one was finished;
        - else, after an earlier pass (finished or abandoned): the next epoch from its start;
        - else (the first pass): the current epoch (0 unless set).
        """
        if not self._chosen and (self.offset >= self.size if self._loaded else self._passes):
            self.epoch, self.offset = self.epoch + 1, 0
            self.position_id += 1
        self._chosen = self._loaded = False
        self._resumed_epoch = None
        self._passes += 1

    def epoch_length(self) -> int:
        """This rank's indices in a whole epoch (from its start, whatever the position): what
        ``len()`` is before a resume."""
        return self.size // self.world_size if self.drop_last else -(-self.size // self.world_size)

    def order_kind(self) -> str:
        """How this epoch's order is made (one of ``ORDERS``): as the loaded state says for its
        epoch, else from the settings and the dataset's size."""
        if self._saved_order is not None and self._saved_order[0] == self.epoch:
            return self._saved_order[1]
        if not self.shuffle:
            return "sequential"
        if self._shards is not None:
            return "windows"
        return "lazy" if self.size > LAZY_ORDER_ROWS else "permutation"

    def epoch_order(self) -> np.ndarray:
        """All N indices in this epoch's order (identical on every rank)."""
        return self._order_at(np.arange(self.size, dtype=np.int64))

    def _order_at(self, positions: np.ndarray) -> np.ndarray:
        """The indices at ``positions`` of this epoch's order."""
        kind = self.order_kind()
        if kind == "sequential" or not len(positions):
            return positions.astype(np.int64)
        if self._order is None or self._order[0] != (self.epoch, kind):
            self._order = ((self.epoch, kind), LazyOrder(self.size, [self.seed, self.epoch])
                           if kind == "lazy" else self._whole_order(kind))
        return self._order[1][positions]

    def _whole_order(self, kind: str) -> np.ndarray:
        """NumPy's shuffle of all indices, or of the shards' windows (``shard_window``)."""
        rng = np.random.default_rng([self.seed, self.epoch])
        if kind == "permutation":
            return rng.permutation(self.size)
        if self._shards is None or self.shard_window is None:  # (both set together)
            raise ValueError("a 'windows' order needs shard_window and the dataset's shard_ids")
        shards, shard_of = np.unique(self._shards, return_inverse=True)
        place = np.empty(len(shards), dtype=np.int64)
        place[rng.permutation(len(shards))] = np.arange(len(shards))  # shard -> its place
        window = place[shard_of] // self.shard_window
        shuffled = rng.permutation(self.size)
        return shuffled[np.argsort(window[shuffled], kind="stable")]

    def _count(self) -> int:
        left = self.size - self.offset
        return left // self.world_size if self.drop_last else -(-left // self.world_size)

    def indices_between(self, start: int, stop: int) -> np.ndarray:
        """This rank's indices at its positions ``[start, stop)`` of the pass (``0`` to
        ``len(self)``): only those are computed (a lazy order costs what it hands out)."""
        start, stop = max(0, int(start)), min(int(stop), self._count())
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        left = self.size - self.offset  # padding repeats the first samples left (np.resize)
        strided = self.rank + np.arange(start, stop, dtype=np.int64) * self.world_size
        return self._order_at(self.offset + strided % left)

    def indices(self) -> np.ndarray:
        """This rank's indices for the rest of the epoch (from ``offset``), in order."""
        return self.indices_between(0, self._count())

    def __len__(self) -> int:
        return self._count()

    def __iter__(self) -> Iterator[int]:
        for start in range(0, self._count(), _CHUNK):
            yield from self.indices_between(start, start + _CHUNK).tolist()

    def state_dict(self, consumed: int) -> dict[str, Any]:
        """The epoch's position after this rank's training loop received ``consumed`` samples.

        ``consumed`` counts the samples handed to the training loop since this epoch (or the
        resume) started, not the sampler's own position: a DataLoader draws indices ahead of
        the loop for the batches its workers prefetch. Equal on every rank in lock-step.

        Args:
            consumed: samples this rank's loop received this pass, 0..``len(self)``.

        Returns:
            Plain JSON-able data: ``epoch``, ``seed``, ``offset`` (global: samples of the
            epoch order consumed by all ranks), ``size``, ``shuffle``, ``shard_window``,
            ``drop_last``, ``order`` (``order_kind()``). Once the pass is consumed,
            ``offset`` is ``size`` (epoch done).

        Raises:
            ValueError: ``consumed`` is negative or more than this rank yields.
        """
        if not 0 <= consumed <= len(self):
            raise ValueError(f"consumed must be in [0, {len(self)}], not {consumed}")
        offset = self.size if consumed == len(self) else self.offset + consumed * self.world_size
        return {"epoch": self.epoch, "seed": self.seed, "offset": min(offset, self.size),
                "size": self.size, "shuffle": self.shuffle, "shard_window": self.shard_window,
                "drop_last": self.drop_last, "order": self.order_kind()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved epoch, on any world size; the next ``set_epoch`` of it keeps this.

        Raises:
            ValueError: the state is incomplete, or was saved for another dataset size, seed,
                shuffle or shard_window (the epoch order would differ).
        """
        missing = {"epoch", "offset", "size", "seed", "shuffle", "shard_window"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}")
        ours = {"size": self.size, "seed": self.seed, "shuffle": self.shuffle,
                "shard_window": self.shard_window}
        for name, value in ours.items():
            if state[name] != value:
                raise ValueError(f"sampler state was saved with {name}={state[name]!r}, but "
                                 f"this sampler has {name}={value!r}")
        if not 0 <= state["offset"] <= self.size or state["epoch"] < 0:
            raise ValueError(f"sampler state has epoch {state['epoch']} and offset "
                             f"{state['offset']} (size {self.size})")
        # a state from before "order" was kept: the order those versions made
        order = state.get("order") or ("sequential" if not self.shuffle else "permutation"
                                       if self.shard_window is None else "windows")
        fits = {"sequential": not self.shuffle, "windows": self.shard_window is not None,
                "permutation": self.shuffle and self.shard_window is None,
                "lazy": self.shuffle and self.shard_window is None}
        if not fits.get(order, False):
            raise ValueError(f"sampler state has order {order!r}, which a sampler with "
                             f"shuffle={self.shuffle}, shard_window={self.shard_window} cannot "
                             f"make (known: {', '.join(ORDERS)})")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._resumed_epoch = self.epoch
        self._saved_order = (self.epoch, order)
        self._chosen, self._loaded = False, True
        self.position_id += 1


def shuffle_quality(order: np.ndarray, shard_ids: np.ndarray, batch_size: int) -> dict[str, float]:
    """How well an epoch order mixes shards, so locality (``shard_window``) is chosen knowingly.

    Args:
        order: the epoch's indices (``DistributedShardSampler.epoch_order()``).
        shard_ids: the shard of every index (``CachedDataset.shard_ids``).
        batch_size: samples per batch.

    Returns:
        ``batch_entropy``: the mean Shannon entropy (bits) of the shards in a batch, over the
        same for a full random order of the same indices (seeded, so repeatable): 1.0 mixes as
        a full shuffle does, 0.0 means every batch comes from one shard. ``same_shard``: the
        fraction of neighbouring samples in the order from the same shard (a full shuffle of S
        equal shards gives about 1/S; sequential reading about 1).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    order = np.asarray(order, dtype=np.int64)
    shard_ids = np.asarray(shard_ids)

    def mean_entropy(indices: np.ndarray) -> float:
        entropies = []
        for start in range(0, len(indices), batch_size):
            _, counts = np.unique(shard_ids[indices[start:start + batch_size]], return_counts=True)
            p = counts / counts.sum()
            entropies.append(float(-(p * np.log2(p)).sum()))
        return float(np.mean(entropies)) if entropies else 0.0

    full = mean_entropy(np.random.default_rng(0).permutation(order))
    neighbours = shard_ids[order]
    same = float(np.mean(neighbours[1:] == neighbours[:-1])) if len(order) > 1 else 1.0
    return {"batch_entropy": mean_entropy(order) / full if full > 0 else 1.0, "same_shard": same}
