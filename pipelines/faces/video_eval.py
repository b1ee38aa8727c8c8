"""Scoring a face-video classifier per video, like the DFDC and FaceForensics++ evaluations:
frame scores to one video score, ROC AUC and log-loss over videos, and a held-out split that
keeps a fake with its original (``pipelines/faces/train_classifier.py`` validates with them)."""

from __future__ import annotations

import math
import zlib
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from precache.cache import Cache
from precache.loading import CachedDataset

__all__ = ["aggregate", "held_out", "log_loss", "roc_auc", "split_videos"]


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (the Mann-Whitney U statistic, ties counted half); NaN without
    both classes."""
    labels, scores = np.asarray(labels, bool), np.asarray(scores, np.float64)
    positives, negatives = scores[labels], scores[~labels]
    if not len(positives) or not len(negatives):
        return float("nan")
    greater = (positives[:, None] > negatives[None, :]).sum()
    ties = (positives[:, None] == negatives[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(positives) * len(negatives)))


def log_loss(labels: np.ndarray, scores: np.ndarray, eps: float = 1e-6) -> float:
    """Mean binary cross-entropy of the scores (clipped to ``[eps, 1 - eps]``)."""
    p = np.clip(np.asarray(scores, np.float64), eps, 1 - eps)
    y = np.asarray(labels, np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def aggregate(scores: np.ndarray, how: str) -> float:
    """One video score from its frame scores: ``mean``, or ``confident``: the mean of the half
    of the frames farthest from 0.5 (a few confident fake frames are not averaged away). A
    video without frames (no face found) scores 0.5."""
    if not len(scores):
        return 0.5
    if how == "mean":
        return float(np.mean(scores))
    far = np.argsort(-np.abs(scores - 0.5))[: max(1, math.ceil(len(scores) / 2))]
    return float(np.mean(scores[far]))


def split_videos(videos: list[str], labels: list[str], groups: list[str],
                 fraction: float) -> set[str]:
    """Held-out videos: whole groups (a fake with its original: a scene must not be on both
    sides, or the model learns scenes instead of fakes), taken in the order of a hash of the
    group name until they hold ``fraction`` of the videos and every label that has more than
    one group. The same on every rank and every run."""
    order = sorted(set(groups), key=lambda g: (zlib.crc32(g.encode()), g))
    members: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    groups_of = {label: {g for g, lab in zip(groups, labels) if lab == label}
                 for label in set(labels)}
    wanted = {label for label, found in groups_of.items() if len(found) > 1}
    held: set[int] = set()
    for group in order:
        covered = {labels[i] for i in held}
        if len(held) >= fraction * len(videos) and wanted <= covered:
            break
        if len(held) + len(members[group]) > max(1, fraction * len(videos)) and (
                {labels[i] for i in members[group]} <= covered):
            continue  # would overshoot and adds no missing label
        held.update(members[group])
    return {videos[i] for i in held}


def held_out(train_set: Any, skipped: list[tuple[str, str]], fraction: float,
             positive: str) -> tuple[list[tuple[str, bool]], list[tuple[str, int]], list[int]]:
    """The split of a ``VideoFrameDataset`` or ``ClipDataset``'s videos, by ``split_videos``.

    A fake's group is its ``original`` where the cache has that column (a metadata file names
    it by bare file name); only each video's first row is read for it, of the dataset's
    generation.

    Args:
        train_set: the training dataset (its index, videos, labels and cache).
        skipped: (video, label) of the inputs stage 1 found no face in; held out ones score 0.5.
        fraction: of the videos to hold out.
        positive: the label scored as positive.

    Returns:
        ``(truth, rows, train_items)``: (video, is positive) of each held-out video; (video,
        row) of every cached frame of them; the dataset's items (videos) to train on.
    """
    index, videos, generation = train_set.index, train_set.videos, train_set.generation
    originals = [""] * len(videos)
    if "original" in Cache(train_set.path, generation=generation).manifest.schema:
        meta = CachedDataset(train_set.path, columns=["original"], generation=generation)
        firsts = index.rows[index.group_start[index.video_group_start[:-1]]]
        originals = list(meta.read_batch(firsts)["original"])
        meta.close()
    by_name = {PurePosixPath(v).name: v for v in videos}
    group = {v: by_name.get(o, o) if o else v for v, o in zip(videos, originals)}
    names = videos + [v for v, _ in skipped]
    labels = list(train_set.labels) + [label for _, label in skipped]
    held = split_videos(names, labels, [group.get(v, v) for v in names], fraction)
    truth = [(v, label == positive) for v, label in zip(names, labels) if v in held]
    rows = [(v, int(r)) for i, v in enumerate(videos) if v in held
            for r in index.rows[slice(*index.video_rows(i))]]
    return truth, rows, [i for i, v in enumerate(videos) if v not in held]
