"""Datasets whose items are videos, over a video-faces cache (one row per video, track and frame).

A video-faces cache stores one row per sampled frame of every face track, so a ``CachedDataset``
over it is a dataset of frames: a long video contributes hundreds of rows, a short one a few, and
an epoch sees each frame, not each video, once. Models of face videos usually want something else:

- **clip models** (temporal deepfake detectors, video transformers) need T frames of ONE face
  track, in order, evenly spaced (``ClipDataset``);
- **per-video balance**: a frame model trained on "k frames per video per epoch" weighs every
  video the same, however long it is (``VideoFrameDataset``);
- **exactly once at the video level**: both datasets have one item per video, so ``make_loader``'s
  ``DistributedShardSampler`` gives every video exactly once per epoch across DDP ranks (up to
  its pad), and ``CacheLoader.state_dict()`` / ``load_state_dict()`` resume mid-epoch by video.

Both build a ``VideoIndex`` once, reading only the ``video``, ``track``, ``frame_index`` (and
``label``) columns, and keep it as a few NumPy arrays (no Python object per row), so forked
DataLoader workers share it. A batch of items is read with ONE ``CachedDataset.read_batch`` of the
rows its clips need (mapped columns: a gather from the page cache). Each process draws clip starts,
tracks and frames from its own generator, seeded from ``seed`` and ``torch.initial_seed()`` (which
DataLoader sets per worker; ``make_loader`` seeds it by rank), so workers and ranks differ, runs
repeat, and persistent workers draw new clips every epoch. (``make_loader``'s read-ahead hints
are not used: which rows a later item reads is drawn only when it is read.)

Use::

    from precache.augment import FaceAugment
    from precache.loading import make_loader
    from precache.loading.datasets.video_clips import ClipDataset, collate_clips

    clips = ClipDataset("cache/", frames=8, stride=2, transform=FaceAugment())
    loader = make_loader(clips, batch_size=4, collate_fn=collate_clips)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:  # batch["image"]: (4, 8, H, W, 3) uint8, batch["target"]: (4,)
            ...
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from precache.loading.datasets.cache_backed import CacheBackedByRows
from precache.loading.datasets.video_index import VideoIndex, label_targets, open_video_cache

__all__ = ["ClipDataset", "VideoFrameDataset", "collate_clips"]

Sample = dict[str, Any]

_STARTS = ("random", "first", "center")
_TRACKS = ("longest", "random")


def _take(values: Any, positions: np.ndarray) -> Any:
    """``values`` at ``positions``: an array (a copy) or a list."""
    if isinstance(values, np.ndarray):
        return values[positions]
    return [values[int(p)] for p in positions]


def _stack(values: list[Any]) -> Any:
    """Per-frame values as one value with a leading frame dimension (lists stay lists)."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(values)
    if isinstance(first, (np.ndarray, np.generic, bool, int, float)):
        return np.stack([np.asarray(v) for v in values])
    return list(values)


def collate_clips(samples: list[Sample]) -> dict[str, Any]:
    """Collate ``ClipDataset`` / ``VideoFrameDataset`` items: arrays and numbers as torch's
    ``default_collate`` stacks them (``image``: (B, T, H, W, 3)), strings as a list of B, and
    per-frame string columns (lists of T) as a list of B lists (``default_collate`` would
    transpose those). Pass it as ``make_loader(..., collate_fn=collate_clips)``."""
    if not samples:
        return {}
    out: dict[str, Any] = {}
    for name, first in samples[0].items():
        values = [s[name] for s in samples]
        if first is None or isinstance(first, (str, bytes, list)):
            out[name] = values
        else:
            out[name] = default_collate(values)
    return out


collate_clips.thread_safe = True  # type: ignore[attr-defined]  # no state: threads may share it


class _VideoDataset(CacheBackedByRows):
    """What both video datasets share: the index, the inner dataset of the cache's rows
    (``rows``: ``CacheBacked`` is declared through it, with ``shard_ids`` per video), the
    random stream, the batched read and the output layout."""

    def __init__(self, cache: str | os.PathLike[str], columns: Sequence[str] | None,
                 transform: Callable[[Sample], Sample] | None, classes: Sequence[str] | None,
                 seed: int, dataset_options: dict[str, Any]) -> None:
        self.transform = transform
        self.seed = int(seed)
        opened = open_video_cache(cache, columns, dataset_options, type(self).__name__)
        self._index, self.rows, self.has_label = opened.index, opened.rows, opened.has_label
        try:
            self._classes, self._targets = label_targets(self._index.labels, classes, self.path)
        except BaseException:
            self.rows.close()
            raise
        self._generator: np.random.Generator | None = None
        self._generator_pid = 0

    # -- what the video datasets answer --------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    @property
    def videos(self) -> list[str]:
        """The video keys, in item order (sorted)."""
        return self._index.videos.tolist()

    @property
    def labels(self) -> list[str] | None:
        """The label of every video, in item order (``None`` without a ``label`` column)."""
        return None if self._index.labels is None else self._index.labels.tolist()

    @property
    def targets(self) -> np.ndarray | None:
        """``target`` of every video (int64), e.g. for a class-balanced sampler's weights."""
        return self._targets

    @property
    def classes(self) -> list[str]:
        """The label names; ``target`` is an index into it."""
        return list(self._classes)

    @property
    def index(self) -> VideoIndex:
        """The video index (NumPy arrays)."""
        return self._index

    @property
    def shard_ids(self) -> np.ndarray:
        """The shard of each video's first row (one entry per video, not per row), for
        ``make_loader(shard_window=...)``."""
        first_rows = self._index.rows[self._index.group_start[self._index.video_group_start[:-1]]]
        return self.rows.shard_ids[first_rows]

    # -- reading -------------------------------------------------------------------------------

    def _rng(self) -> np.random.Generator:
        """This process's generator: from ``seed`` and ``torch.initial_seed()`` (DataLoader sets
        it per worker, ``make_loader`` per rank), made again in a new (forked) process."""
        if self._generator is None or self._generator_pid != os.getpid():
            self._generator = np.random.default_rng([self.seed, torch.initial_seed()])
            self._generator_pid = os.getpid()
        return self._generator

    def _plan(self, video: int, rng: np.random.Generator) -> tuple[np.ndarray, Any, int]:
        """``(rows in output order, track, valid)`` of one item."""
        raise NotImplementedError

    def _apply(self, frames: list[Sample]) -> list[Sample]:
        """The transform on one item's frames."""
        assert self.transform is not None
        return [self.transform(frame) for frame in frames]

    def __getitems__(self, indices: Sequence[int]) -> list[Sample]:
        """The items of a batch: their rows are read in one ``read_batch``."""
        size = len(self)
        videos = []
        for i in indices:
            i = int(i)
            if not -size <= i < size:
                raise IndexError(f"video index {i} out of range for {size} videos")
            videos.append(i + size if i < 0 else i)
        rng = self._rng()
        plans = [self._plan(v, rng) for v in videos]
        if not plans:
            return []
        wanted = np.concatenate([rows for rows, _, _ in plans])
        unique, inverse = np.unique(wanted, return_inverse=True)
        batch = self.rows.read_batch(unique)  # one read for the whole batch, rows ascending
        inverse = inverse.reshape(-1)
        labels, targets = self._index.labels, self._targets  # (both set where has_label)
        out, start = [], 0
        for video, (rows, track, valid) in zip(videos, plans):
            positions = inverse[start:start + len(rows)]
            start += len(rows)
            frames = {name: _take(values, positions) for name, values in batch.items()}
            if self.transform is not None:
                each = [{name: values[t] for name, values in frames.items()}
                        for t in range(len(rows))]
                done = self._apply(each)
                frames = {name: _stack([frame[name] for frame in done]) for name in done[0]}
            item: Sample = dict(frames)
            item["video"] = str(self._index.videos[video])
            item["track"] = track
            if labels is not None and targets is not None:
                item["label"] = str(labels[video])
                item["target"] = np.int64(targets[video])
            item["valid"] = valid
            out.append(item)
        return out

    def __getitem__(self, index: int) -> Sample:
        return self.__getitems__([index])[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}('{self.path}', {len(self)} videos)"


class ClipDataset(_VideoDataset):
    """Clips of one face track per video: T frames, in order, ``stride`` cached frames apart.

    Item ``i`` is video ``videos[i]`` (sorted keys). It picks one track of the video, then
    ``frames`` of its rows spaced ``stride`` rows apart (the track's cached frames, sorted by
    ``frame_index``), from a start chosen by ``start``. A track with fewer rows than a clip spans
    (``(frames - 1) * stride + 1``) gives the frames it has from its first one and repeats its last
    to fill the clip; ``valid`` says how many are real.

    An item is a dict:

    - every per-frame column read, stacked with a leading T: ``image`` (T, H, W, 3) uint8,
      ``landmarks5`` (T, 5, 2), ..., ``frame_index`` (T,) int64, ``time_s`` (T,) float64
      (string columns asked for by name: a list of T);
    - ``video`` (str), ``track`` (int), ``label`` (str), ``target`` (np.int64, the index of
      ``label`` in ``classes``), ``valid`` (int, real frames; the rest repeat the last).
      Without a ``label`` column there are no ``label`` and ``target``.

    Collate with ``collate_clips`` (``make_loader(ClipDataset(...), batch_size=4,
    collate_fn=collate_clips)``): ``image`` (B, T, H, W, 3), strings as lists.

    Args:
        cache: a video-faces cache: one row per (video, track, frame) with columns ``video``
            (str), ``track`` (int), ``frame_index`` (int), and usually ``label`` (str),
            ``time_s``, ``image``.
        frames: T, the frames of a clip. Default ``8``.
        stride: rows (cached frames) between consecutive clip frames. Default ``1``.
        start: where a clip starts in its track: ``"random"`` (uniform over the starts that
            fit, new on every call), ``"first"`` (the first frame: deterministic) or
            ``"center"`` (centred in the track). Default ``"random"``.
        track: ``"longest"`` (the track with the most cached frames; the lowest track number on
            a tie) or ``"random"`` (uniform over the video's tracks). Default ``"longest"``.
        columns: per-frame columns to read (default: every fixed-shape column and image column;
            ``frame_index`` and ``time_s`` are always read). Reading fewer reads fewer bytes.
        transform: applied to the frames of a clip: with a ``same(samples) -> samples`` method
            (``FaceAugment``), once per clip, so every frame gets the same random draw;
            otherwise called on each frame dict. Frame dicts hold the per-frame columns.
        classes: label names, in ``target`` order (default: the sorted labels of the cache).
        seed: mixed into every process's random stream (with ``torch.initial_seed()``).
        **dataset_options: passed to the inner ``CachedDataset`` (``generation``,
            ``max_decoded_bytes``, ``disk_cache_dir``, ...).

    Raises:
        ValueError: the cache is not a video-faces cache (no ``video``, ``track`` or
            ``frame_index`` column); ``frames`` or ``stride`` below 1; an unknown ``start`` or
            ``track``; labels missing from ``classes``.
        KeyError: a requested column is not in the cache.
    """

    def __init__(self, cache: str | os.PathLike[str], frames: int = 8, stride: int = 1,
                 start: str = "random", track: str = "longest",
                 columns: Sequence[str] | None = None,
                 transform: Callable[[Sample], Sample] | None = None,
                 classes: Sequence[str] | None = None, seed: int = 0,
                 **dataset_options: Any) -> None:
        if int(frames) < 1:
            raise ValueError(f"frames must be at least 1, not {frames}")
        if int(stride) < 1:
            raise ValueError(f"stride must be at least 1, not {stride}")
        if start not in _STARTS:
            raise ValueError(f"start must be one of {_STARTS}, not {start!r}")
        if track not in _TRACKS:
            raise ValueError(f"track must be one of {_TRACKS}, not {track!r}")
        self.frames, self.stride, self.start, self.track = int(frames), int(stride), start, track
        super().__init__(cache, columns, transform, classes, seed, dataset_options)

    def _plan(self, video: int, rng: np.random.Generator) -> tuple[np.ndarray, Any, int]:
        index = self._index
        groups = index.groups(video)
        lengths = np.diff(index.group_start[groups.start:groups.stop + 1])
        if self.track == "longest":
            group = groups.start + int(np.argmax(lengths))  # the first maximum: lowest track
        else:
            group = groups.start + int(rng.integers(len(groups)))
        count = int(lengths[group - groups.start])
        span = (self.frames - 1) * self.stride + 1
        steps = np.arange(self.frames, dtype=np.int64)
        if count >= span:
            first = {"random": lambda: int(rng.integers(count - span + 1)),
                     "first": lambda: 0,
                     "center": lambda: (count - span) // 2}[self.start]()
            positions, valid = first + steps * self.stride, self.frames
        else:  # short track: what it has from its first frame, then its last one again
            valid = (count - 1) // self.stride + 1
            positions = np.minimum(steps, valid - 1) * self.stride
        return index.group_rows(group)[positions], int(index.group_track[group]), valid

    def _apply(self, frames: list[Sample]) -> list[Sample]:
        same = getattr(self.transform, "same", None)
        if callable(same):
            return same(frames)
        return super()._apply(frames)


class VideoFrameDataset(_VideoDataset):
    """``frames_per_video`` random frames of each video per epoch, from any of its tracks.

    Item ``i`` is video ``videos[i]``: k rows of it chosen at random on every call (without
    replacement when it has k; else all its rows plus random repeats), sorted by track and
    frame, so a long video contributes as many frames per epoch as a short one. The transform
    runs on each frame independently (no shared draw).

    An item has ``ClipDataset``'s layout with k in place of T, except that ``track`` is per
    frame (a (k,) int64 array) and ``valid`` is the number of distinct rows (``min(k, rows)``).

    Args:
        cache: a video-faces cache (see ``ClipDataset``).
        frames_per_video: k, frames per video per item. Default ``4``.
        columns: per-frame columns to read (default: every fixed-shape column and image column;
            ``frame_index`` and ``time_s`` are always read).
        transform: called on each frame dict.
        classes: label names, in ``target`` order (default: the sorted labels of the cache).
        seed: mixed into every process's random stream (with ``torch.initial_seed()``).
        **dataset_options: passed to the inner ``CachedDataset``.

    Raises:
        ValueError: the cache is not a video-faces cache; ``frames_per_video`` below 1; labels
            missing from ``classes``.
        KeyError: a requested column is not in the cache.
    """

    def __init__(self, cache: str | os.PathLike[str], frames_per_video: int = 4,
                 columns: Sequence[str] | None = None,
                 transform: Callable[[Sample], Sample] | None = None,
                 classes: Sequence[str] | None = None, seed: int = 0,
                 **dataset_options: Any) -> None:
        if int(frames_per_video) < 1:
            raise ValueError(f"frames_per_video must be at least 1, not {frames_per_video}")
        self.frames_per_video = int(frames_per_video)
        super().__init__(cache, columns, transform, classes, seed, dataset_options)

    def _plan(self, video: int, rng: np.random.Generator) -> tuple[np.ndarray, Any, int]:
        index = self._index
        start, stop = index.video_rows(video)
        count, k = stop - start, self.frames_per_video
        if count >= k:
            positions = np.sort(rng.choice(count, k, replace=False))
        else:
            positions = np.sort(np.concatenate([np.arange(count),
                                                rng.integers(0, count, k - count)]))
        at = start + positions
        groups = np.searchsorted(index.group_start, at, side="right") - 1
        return index.rows[at], index.group_track[groups].astype(np.int64), min(count, k)
