"""Faces followed across a video's sampled frames: full detection every few frames, O-Net between.

MTCNN's whole cascade (an image pyramid through P-Net, then R-Net and O-Net) runs on every
``detect_every``-th sampled frame. On the frames between, each face's box from the previous frame
is given to O-Net alone (``refine``: one 48 px patch, ~60x cheaper than the cascade), which
scores it, moves the box onto the face and places the five landmarks, so every frame gets a
measured box, not an interpolated one. Where O-Net loses a face (its score falls below the
threshold: the face left, is hidden, or moved too far from its last box, as when the sampled
frames are seconds apart), that frame gets the whole cascade too, and a track whose face it
does not find again ends; a face first found by a full detection is followed
backwards frame by frame to where it appeared, so a track starts where it would with detection
on every frame. Full detections are linked to tracks by box overlap (greedy, highest IoU first,
at least ``min_iou``); two tracks that converge on one face become one.

Box modes: ``frame`` (each frame's box), ``smooth`` (a centred moving average over 5 frames, so
crops jitter less) or ``union`` (one box per track, the union of its boxes: the crop stays still
and the face moves in it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

__all__ = ["Detection", "Track", "track_faces", "iou", "BOX_MODES"]

BOX_MODES = ("frame", "smooth", "union")


@dataclass(frozen=True)
class Detection:
    """One face on sampled frame ``frame`` (box x0, y0, x1, y1; landmarks 5 x 2), found by the
    full detector (``detected``) or by O-Net on the track's previous box."""

    frame: int
    box: np.ndarray
    score: float
    landmarks: np.ndarray
    detected: bool = True


@dataclass
class Track:
    """One face over consecutive sampled frames: its ``detections`` by frame (``frames()``
    fills any frame between two of them by interpolation)."""

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
            rows.append((a, da.box.astype(np.float32), da.score, da.landmarks, da.detected))
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


Refine = Callable[[int, np.ndarray], list[Detection]]
"""``refine(frame, boxes)``: O-Net on these boxes (N, 4) of that frame, one Detection each."""


def _link(candidates: list[Track], found: list[Detection], min_iou: float
          ) -> tuple[dict[int, int], list[int]]:
    """Greedy IoU matching: {candidate index: detection index}, unmatched detection indices."""
    matches: dict[int, int] = {}
    if candidates and found:
        overlap = iou(np.array([t.detections[t.last].box for t in candidates]),
                      np.array([d.box for d in found]))
        taken: set[int] = set()
        for flat in np.argsort(-overlap, axis=None):
            i, j = divmod(int(flat), len(found))
            if overlap[i, j] < min_iou:
                break
            if i not in matches and j not in taken:
                matches[i] = j
                taken.add(j)
    return matches, [j for j in range(len(found)) if j not in matches.values()]


def _follow(track: Track, frames: range, refine: Refine, min_score: float) -> None:
    """Extend ``track`` frame by frame over ``frames`` (forwards or backwards) with O-Net,
    stopping at the first frame where the face is not found."""
    for frame in frames:
        previous = track.detections[frame - frames.step]
        found = refine(frame, previous.box[None])[0]
        if not (found.score >= min_score and _plausible(found.box, previous.box)):
            return
        track.detections[frame] = found


def _plausible(box: np.ndarray, previous: np.ndarray) -> bool:
    """A refined box that still overlaps the one it came from (O-Net did not jump away)."""
    return bool(box[2] > box[0] and box[3] > box[1] and iou(box, previous)[0, 0] > 0.1)


def _met(track: Track, others: list[Track]) -> Track | None:
    """The track of ``others`` whose box on some frame is the same face as ``track``'s."""
    for other in others:
        for frame, face in track.detections.items():
            known = other.detections.get(frame)
            if known is not None and iou(face.box, known.box)[0, 0] > 0.5:
                return other
    return None


def track_faces(count: int, detections: dict[int, list[Detection]], refine: Refine,
                detect: Callable[[int], list[Detection]], *, min_iou: float = 0.3,
                min_score: float = 0.7) -> list[Track]:
    """Tracks over ``count`` sampled frames from full ``detections`` on some frames (frame ->
    faces) and ``refine`` on the others, numbered in order of first appearance. Where O-Net
    loses a face between two full detections (it left, or moved too far from its last box, as
    when sampled frames are seconds apart), ``detect(frame)`` runs the full cascade there."""
    detections = dict(detections)
    tracks: list[Track] = []
    active: list[Track] = []
    lost: list[Track] = []  # ended since the last full detection: a detection may revive them
    previous_round = -1
    for frame in range(count):
        if frame not in detections and active:
            found = refine(frame, np.array([t.detections[t.last].box for t in active]))
            kept: list[tuple[Track, Detection]] = []
            dropped: list[Track] = []
            vanished = False
            for track, face in sorted(zip(active, found), key=lambda pair: -pair[1].score):
                duplicate = any(iou(face.box, k.box)[0, 0] > 0.5 for _, k in kept)
                if (face.score >= min_score and not duplicate
                        and _plausible(face.box, track.detections[track.last].box)):
                    kept.append((track, face))
                else:
                    dropped.append(track)
                    vanished = vanished or not duplicate
            if not vanished:
                for track, face in kept:
                    track.detections[frame] = face
                active = [track for track, _ in kept]
                lost.extend(dropped)
                continue
            detections[frame] = detect(frame)  # a face O-Net lost: the full cascade, here
        if frame in detections:
            candidates = active + lost
            matches, new = _link(candidates, detections[frame], min_iou)
            active = []
            for i, j in sorted(matches.items()):
                track = candidates[i]
                gap_start = track.last + 1
                track.detections[frame] = detections[frame][j]
                if gap_start < frame:  # lost for a while: fill what O-Net finds, backwards
                    _follow(track, range(frame - 1, gap_start - 1, -1), refine, min_score)
                active.append(track)
            for j in new:
                track = Track(-1, {frame: detections[frame][j]})
                _follow(track, range(frame - 1, previous_round, -1), refine, min_score)
                same = _met(track, lost)
                if same is not None:  # followed back onto a face O-Net had lost: one track
                    for f, face in track.detections.items():
                        same.detections.setdefault(f, face)
                    lost.remove(same)
                    active.append(same)
                    continue
                tracks.append(track)
                active.append(track)
            lost, previous_round = [], frame
    tracks.sort(key=lambda t: (t.first, float(t.detections[t.first].box[0])))
    for number, track in enumerate(tracks):
        track.track_id = number
    return tracks
