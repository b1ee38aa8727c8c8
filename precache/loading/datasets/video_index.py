"""The index of a video-faces cache: which rows belong to which video and face track, as a few
NumPy arrays (no Python object per row, so forked DataLoader workers share it), and the opening
of such a cache that ``ClipDataset`` and ``VideoFrameDataset`` share (``open_video_cache``)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from precache.cache.image_codec import encoded_columns
from precache.loading.datasets.cached import CachedDataset
from precache.loading.datasets.targets import targets_in

__all__ = ["INDEX_COLUMNS", "VideoIndex", "VideoCache", "open_video_cache", "label_targets"]

INDEX_COLUMNS = ("video", "track", "frame_index")
"""The columns a video-faces cache must have."""
_CHUNK = 65536  # rows read at a time while building the index


def _codes(strings: Sequence[str], table: dict[str, int]) -> np.ndarray:
    """Integer codes of ``strings``, adding unseen ones to ``table`` (string -> code)."""
    if not len(strings):
        return np.empty(0, np.int32)
    distinct, inverse = np.unique(np.asarray(strings, dtype=str), return_inverse=True)
    lookup = np.array([table.setdefault(s, len(table)) for s in distinct.tolist()], np.int32)
    return lookup[inverse.reshape(-1)]


class VideoIndex:
    """Which cached rows belong to which video and track, as NumPy arrays.

    Groups are the (video, track) pairs, sorted by video then track; videos are sorted by key.

    Attributes:
        videos: the video keys, sorted (a NumPy string array, ``V``).
        labels: the label of each video (its first row's), or ``None`` without a ``label`` column.
        rows: every cached row index, grouped by (video, track) and sorted by ``frame_index``
            within a group (int64, ``N``).
        group_start: where each group starts in ``rows``; one more entry, ``N`` (int64, ``G + 1``).
        group_track: the track of each group (int64, ``G``).
        video_group_start: where each video's groups start; one more entry, ``G``
            (int64, ``V + 1``).
    """

    def __init__(self, videos: np.ndarray, labels: np.ndarray | None, rows: np.ndarray,
                 group_start: np.ndarray, group_track: np.ndarray,
                 video_group_start: np.ndarray) -> None:
        self.videos, self.labels, self.rows = videos, labels, rows
        self.group_start, self.group_track = group_start, group_track
        self.video_group_start = video_group_start

    @classmethod
    def build(cls, dataset: CachedDataset, chunk: int = _CHUNK) -> VideoIndex:
        """Read ``video``, ``track``, ``frame_index`` (and ``label`` if the dataset reads it) of
        every row, ``chunk`` rows at a time, and index them: one pass and a ``lexsort``.

        Args:
            dataset: a ``CachedDataset`` reading at least the ``INDEX_COLUMNS`` (and no more than
                it needs: every column it reads is read for every row).
            chunk: rows per ``read_batch``.
        """
        with_label = "label" in dataset.columns
        names: dict[str, int] = {}
        label_names: dict[str, int] = {}
        video_parts, track_parts, frame_parts, label_parts = [], [], [], []
        for start in range(0, len(dataset), chunk):
            part = dataset.read_batch(np.arange(start, min(len(dataset), start + chunk)))
            video_parts.append(_codes(part["video"], names))
            track_parts.append(np.asarray(part["track"], dtype=np.int64).reshape(-1))
            frame_parts.append(np.asarray(part["frame_index"], dtype=np.int64).reshape(-1))
            if with_label:
                label_parts.append(_codes(part["label"], label_names))
            del part

        def join(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(parts) if parts else np.empty(0, dtype)

        codes, tracks = join(video_parts, np.int32), join(track_parts, np.int64)
        frames = join(frame_parts, np.int64)
        # video codes in first-seen order -> ranks in sorted key order
        seen = np.array(list(names), dtype=str) if names else np.empty(0, dtype=str)
        by_name = np.argsort(seen, kind="stable")
        rank = np.empty(len(seen), np.int64)
        rank[by_name] = np.arange(len(seen))
        video = rank[codes] if len(codes) else np.empty(0, np.int64)
        rows = np.lexsort((frames, tracks, video)).astype(np.int64)
        sorted_video, sorted_track = video[rows], tracks[rows]
        cuts = np.flatnonzero((np.diff(sorted_video) != 0) | (np.diff(sorted_track) != 0)) + 1
        group_start = np.concatenate([[0], cuts, [len(rows)]]).astype(np.int64)
        if not len(rows):
            group_start = np.zeros(1, np.int64)
        group_video = sorted_video[group_start[:-1]]
        video_group_start = np.searchsorted(group_video, np.arange(len(seen) + 1)).astype(np.int64)
        labels = None
        if with_label:
            label_of_row = join(label_parts, np.int32)[rows]
            first = label_of_row[group_start[video_group_start[:-1]]]  # each video's first row
            mixed = np.unique(sorted_video[label_of_row != first[sorted_video]])
            label_table = np.array(list(label_names), dtype=str)
            labels = label_table[first] if len(first) else np.empty(0, dtype=str)
            if len(mixed):
                warnings.warn(f"{getattr(dataset, 'path', 'the cache')}: {len(mixed)} videos have "
                              f"rows of more than one label (e.g. {seen[by_name][mixed[0]]!r}); "
                              "each is labelled by its first row", stacklevel=2)
        return cls(seen[by_name], labels, rows, group_start, sorted_track[group_start[:-1]],
                   video_group_start)

    def __len__(self) -> int:
        return len(self.videos)

    def groups(self, video: int) -> range:
        """The groups (tracks) of video number ``video``."""
        return range(int(self.video_group_start[video]), int(self.video_group_start[video + 1]))

    def group_rows(self, group: int) -> np.ndarray:
        """The rows of one group, in frame order (a view)."""
        return self.rows[self.group_start[group]:self.group_start[group + 1]]

    def video_rows(self, video: int) -> tuple[int, int]:
        """``(start, stop)`` of the video's rows in ``rows`` (every track, track by track)."""
        groups = self.groups(video)
        return int(self.group_start[groups.start]), int(self.group_start[groups.stop])


@dataclass
class VideoCache:
    """An opened video-faces cache: its index, the dataset that reads the frames' columns, and
    whether it has a ``label`` column."""

    index: VideoIndex
    rows: CachedDataset
    has_label: bool


def open_video_cache(cache: str | os.PathLike[str], columns: Sequence[str] | None,
                     dataset_options: dict[str, Any], user: str) -> VideoCache:
    """Check that ``cache`` is a video-faces cache, build its ``VideoIndex`` and open the
    dataset of the frame columns (``columns``; default: every fixed-shape and decoded image
    column), all at one generation: the one the first dataset pinned (under DDP, rank 0's).
    ``user``: the class asking, named in errors.

    Raises:
        ValueError: not a video-faces cache. KeyError: a column the cache lacks.
    """
    path = os.fspath(cache)
    options = {k: v for k, v in dataset_options.items() if k not in ("resident", "generation")}
    probe = CachedDataset(cache, resident=False, generation=dataset_options.get("generation"),
                          **options)
    try:
        manifest = probe._cache.manifest
        schema, encoded = manifest.schema, encoded_columns(manifest.ops)
        missing = [c for c in INDEX_COLUMNS if c not in schema]
        if missing:
            raise ValueError(
                f"{path}: no column {missing}; {user} needs a video-faces cache (one row per "
                f"video, track and frame, with columns {', '.join(INDEX_COLUMNS)}); this cache "
                f"has {sorted(schema)}")
        unknown = [c for c in columns or () if c not in schema]
        if unknown:
            raise KeyError(f"{path}: no column {unknown} in this cache; it has {sorted(schema)}")
        has_label = "label" in schema
        index_reader = CachedDataset(cache, columns=[*INDEX_COLUMNS, *(["label"] * has_label)],
                                     resident=False, generation=probe.generation, **options)
        try:
            index = VideoIndex.build(index_reader)
        finally:
            index_reader.close()
        if columns is None:  # every fixed-shape column, and the decoded image columns
            wanted = [n for n, spec in schema.items()
                      if spec.kind in ("ndarray", "scalar") or n in encoded]
        else:
            wanted = list(dict.fromkeys(columns))
        wanted += [n for n in ("frame_index", "time_s") if n in schema and n not in wanted]
        clip_level = {"video", "label", "track"}  # from the index, not per row
        rows = CachedDataset(cache, columns=[n for n in wanted if n not in clip_level],
                             generation=probe.generation,
                             resident=dataset_options.get("resident"), **options)
    finally:
        probe.close()
    return VideoCache(index, rows, has_label)


def label_targets(labels: np.ndarray | None, classes: Sequence[Any] | None,
                  path: str) -> tuple[list[Any], np.ndarray | None]:
    """``classes`` (default: the sorted labels, integers kept as integers: ``targets_in``) and
    every video's index into it (int64), from each video's label (``None``: the cache has no
    ``label`` column)."""
    if labels is None:
        if classes is not None:
            raise ValueError(f"{path}: classes given, but the cache has no label column")
        return [], None
    return targets_in(labels, classes, path)
