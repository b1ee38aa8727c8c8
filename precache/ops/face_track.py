"""Faces followed across a video's sampled frames: an IoU tracker, boxes filled between detections.

Detection runs on every ``detect_every``-th sampled frame. Detections are linked into tracks by
box overlap (greedy, highest IoU first, at least ``min_iou``); a track survives one detection
round without a match. Where the faces present change between two detection rounds (a face
enters or leaves, or a cut), the frames in between are detected too (``gaps_to_detect``), so a
track starts and ends where it would with detection on every frame. Between a track's
detections, box and landmarks are interpolated linearly (``detected`` is False there).

Box modes: ``frame`` (each frame's box), ``smooth`` (a centred moving average over 5 frames, so
crops jitter less) or ``union`` (one box per track, the union of its boxes: the crop stays still
and the face moves in it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Detection", "Track", "link_tracks", "gaps_to_detect", "iou", "BOX_MODES"]

BOX_MODES = ("frame", "smooth", "union")


@dataclass(frozen=True)
class Detection:
    """One detected face on sampled frame ``frame`` (box x0, y0, x1, y1; landmarks 5 x 2)."""

    frame: int
    box: np.ndarray
    score: float
    landmarks: np.ndarray


@dataclass
class Track:
    """One face over consecutive sampled frames: ``detections`` by frame, then ``fill``-ed."""

    track_id: int
    detections: dict[int, Detection] = field(default_factory=dict)

    @property
    def first(self) -> int:
        return min(self.detections)

    @property
    def last(self) -> int:
        return max(self.detections)

    def mean_area(self) -> float:
        boxes = np.array([d.box for d in self.detections.values()])
        return float(np.mean((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])))

    def frames(self, mode: str = "frame") -> list[tuple[int, np.ndarray, float, np.ndarray, bool]]:
        """``(frame, box, score, landmarks, detected)`` for every sampled frame from the first
        detection to the last; frames between detections interpolated."""
        if mode not in BOX_MODES:
            raise ValueError(f"box mode must be one of {BOX_MODES}, not {mode!r}")
        known = sorted(self.detections)
        rows = []
        for a, b in zip(known, known[1:] + [None]):
            da = self.detections[a]
            rows.append((a, da.box.astype(np.float32), da.score, da.landmarks, True))
            if b is None:
                continue
            db = self.detections[b]
            for f in range(a + 1, b):
                w = (f - a) / (b - a)
                rows.append((f, ((1 - w) * da.box + w * db.box).astype(np.float32),
                             min(da.score, db.score),
                             ((1 - w) * da.landmarks + w * db.landmarks).astype(np.float32), False))
        if mode == "smooth" and len(rows) > 2:
            boxes = np.array([r[1] for r in rows])
            smoothed = np.empty_like(boxes)
            for i in range(len(rows)):
                smoothed[i] = boxes[max(0, i - 2): i + 3].mean(axis=0)
            rows = [(f, smoothed[i], s, p, d) for i, (f, _, s, p, d) in enumerate(rows)]
        elif mode == "union":
            boxes = np.array([r[1] for r in rows])
            union = np.concatenate([boxes[:, :2].min(axis=0), boxes[:, 2:].max(axis=0)])
            rows = [(f, union.astype(np.float32), s, p, d) for f, _, s, p, d in rows]
        return rows


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Intersection over union of every box in ``a`` (N, 4) with every box in ``b`` (M, 4)."""
    a, b = np.asarray(a, np.float64).reshape(-1, 4), np.asarray(b, np.float64).reshape(-1, 4)
    x0 = np.maximum(a[:, None, 0], b[None, :, 0])
    y0 = np.maximum(a[:, None, 1], b[None, :, 1])
    x1 = np.minimum(a[:, None, 2], b[None, :, 2])
    y1 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x1 - x0, 0, None) * np.clip(y1 - y0, 0, None)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    return inter / np.maximum(area_a[:, None] + area_b[None, :] - inter, 1e-9)


def link_tracks(detections: dict[int, list[Detection]], min_iou: float = 0.3) -> list[Track]:
    """Link the detections of the detected frames (frame -> its faces) into tracks, numbered
    in order of first appearance. A track not matched in two detection rounds in a row ends."""
    tracks: list[Track] = []
    active: list[tuple[Track, int]] = []  # (track, detection rounds since it was last matched)
    for frame in sorted(detections):
        found = detections[frame]
        if active and found:
            overlap = iou(np.array([t.detections[t.last].box for t, _ in active]),
                          np.array([d.box for d in found]))
        else:
            overlap = np.zeros((len(active), len(found)))
        matched_tracks: set[int] = set()
        matched_faces: set[int] = set()
        for flat in np.argsort(-overlap, axis=None):
            i, j = divmod(int(flat), max(1, len(found)))
            if overlap[i, j] < min_iou:
                break
            if i in matched_tracks or j in matched_faces:
                continue
            active[i][0].detections[frame] = found[j]
            matched_tracks.add(i)
            matched_faces.add(j)
        still = [(t, 0 if i in matched_tracks else missed + 1) for i, (t, missed) in enumerate(active)]
        active = [(t, missed) for t, missed in still if missed < 2]
        for j, face in enumerate(found):
            if j not in matched_faces:
                track = Track(len(tracks), {frame: face})
                tracks.append(track)
                active.append((track, 0))
    return tracks


def gaps_to_detect(tracks: list[Track], detected: list[int]) -> list[int]:
    """Frames between two detection rounds whose faces differ (a track ends after the first or
    starts at the second): to be detected too, so tracks start and end on the right frame."""
    extra: list[int] = []
    for a, b in zip(detected, detected[1:]):
        if b - a < 2:
            continue
        at_a = {t.track_id for t in tracks if a in t.detections}
        at_b = {t.track_id for t in tracks if b in t.detections}
        if at_a != at_b:
            extra.extend(range(a + 1, b))
    return extra
