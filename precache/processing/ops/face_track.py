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

A video can be tracked as a stream (``Tracker``, ``TrackRows``): a face is only ever followed
back to the frame after the last full detection, so once a full detection has run on a frame,
nothing at or before it changes, and only the frames since need to be kept (``detect_every`` of
them, plus the two a ``smooth`` row waits for); ``track_faces`` is the same over a whole list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

__all__ = ["Detection", "Track", "TrackRows", "Tracker", "track_faces", "iou", "BOX_MODES"]

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
        return TrackRows(self, mode).extend(self.last, ended=True)


Row = tuple[int, np.ndarray, float, np.ndarray, bool]
"""``(frame, box, score, landmarks, detected)``: one sampled frame of a track."""


class TrackRows:
    """``Track.frames`` made as the track grows, for a video read as a stream: ``extend(upto)``
    returns the rows that became final once the track's detections up to frame ``upto`` are
    (``Tracker.step`` says when: at each full detection, everything before it is), so a frame
    can be cropped and dropped while later frames are still to come. The rows are those
    ``Track.frames`` gives for the whole track, in the same order: ``frame`` rows as soon as
    their frame is final, ``smooth`` rows once the two after them are (or the track ended),
    ``union`` rows only when the track ended (their box depends on all of it).
    """

    def __init__(self, track: Track, mode: str = "frame") -> None:
        if mode not in BOX_MODES:
            raise ValueError(f"box mode must be one of {BOX_MODES}, not {mode!r}")
        self.track, self.mode = track, mode
        self.raw: list[Row] = []  # each frame's own box, from the first frame on
        self.emitted = 0  # rows returned so far
        self.done = track.first - 1 if track.detections else -1  # raw rows made up to here
        self.known: int | None = None  # the last frame of raw with a detection
        self.closed = False

    @property
    def pending(self) -> int | None:
        """The first frame whose row is not returned yet (None if none is waiting)."""
        return self.raw[self.emitted][0] if self.emitted < len(self.raw) else None

    def extend(self, upto: int, ended: bool = False) -> list[Row]:
        """Rows that are final now that the track's detections up to frame ``upto`` are
        (``ended``: and it has no more)."""
        detections = self.track.detections
        for frame in range(self.done + 1, upto + 1):
            found = detections.get(frame)
            if found is None:
                continue
            a = self.known
            if a is not None:  # frames between two detections: interpolated
                da = detections[a]
                for f in range(a + 1, frame):
                    w = (f - a) / (frame - a)
                    self.raw.append((f, ((1 - w) * da.box + w * found.box).astype(np.float32),
                                     min(da.score, found.score),
                                     ((1 - w) * da.landmarks + w * found.landmarks
                                      ).astype(np.float32), False))
            self.raw.append((frame, found.box.astype(np.float32), found.score, found.landmarks,
                             found.detected))
            self.known = frame
        self.done = max(self.done, upto)
        self.closed = ended
        raw, start = self.raw, self.emitted
        if self.mode == "frame":
            rows = raw[start:]
        elif self.mode == "smooth":
            if ended and len(raw) <= 2:
                rows = raw[start:]
            else:
                stop = len(raw) if ended else max(start, len(raw) - 2)
                rows = [(f, np.array([r[1] for r in raw[max(0, i - 2): i + 3]]).mean(axis=0),
                         s, p, d) for i, (f, _, s, p, d) in enumerate(raw[start:stop], start)]
        else:  # union
            if not ended or not raw:
                return []
            boxes = np.array([r[1] for r in raw])
            union = np.concatenate([boxes[:, :2].min(axis=0), boxes[:, 2:].max(axis=0)])
            rows = [(f, union.astype(np.float32), s, p, d) for f, _, s, p, d in raw]
        self.emitted += len(rows)
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


class Tracker:
    """``track_faces`` one sampled frame at a time, for a video read as a stream.

    ``step(frame, found)`` takes the frames in order from 0, with the full detections of a
    frame where the cascade ran (``found``; None on the frames between, where O-Net follows the
    faces). ``refine`` and ``detect`` are called on the frame being stepped and, to follow a new
    face back to where it appeared, on the frames after the last full detection: only those
    frames need to be at hand. ``step`` returns True where a full detection happened (given, or
    run here because O-Net lost a face): from then on no detection at or before that frame
    changes, so their rows can be made (``TrackRows``) and the frames dropped. ``active`` are
    the tracks that may still grow; a track not among them after such a step has ended.
    ``finish()`` numbers the tracks and returns them.
    """

    def __init__(self, refine: Refine, detect: Callable[[int], list[Detection]], *,
                 min_iou: float = 0.3, min_score: float = 0.7) -> None:
        self.refine, self.detect = refine, detect
        self.min_iou, self.min_score = min_iou, min_score
        self.tracks: list[Track] = []
        self.active: list[Track] = []
        self.lost: list[Track] = []  # ended since the last full detection: one may revive them
        self.previous_round = -1

    def step(self, frame: int, found: list[Detection] | None = None) -> bool:
        refine, min_score = self.refine, self.min_score
        if found is None and self.active:
            faces = refine(frame, np.array([t.detections[t.last].box for t in self.active]))
            kept: list[tuple[Track, Detection]] = []
            dropped: list[Track] = []
            vanished = False
            for track, face in sorted(zip(self.active, faces), key=lambda pair: -pair[1].score):
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
                self.active = [track for track, _ in kept]
                self.lost.extend(dropped)
                return False
            found = self.detect(frame)  # a face O-Net lost: the full cascade, here
        if found is None:
            return False
        candidates = self.active + self.lost
        matches, new = _link(candidates, found, self.min_iou)
        self.active = []
        for i, j in sorted(matches.items()):
            track = candidates[i]
            gap_start = track.last + 1
            track.detections[frame] = found[j]
            if gap_start < frame:  # lost for a while: fill what O-Net finds, backwards
                _follow(track, range(frame - 1, gap_start - 1, -1), refine, min_score)
            self.active.append(track)
        for j in new:
            track = Track(-1, {frame: found[j]})
            _follow(track, range(frame - 1, self.previous_round, -1), refine, min_score)
            same = _met(track, self.lost)
            if same is not None:  # followed back onto a face O-Net had lost: one track
                for f, face in track.detections.items():
                    same.detections.setdefault(f, face)
                self.lost = [t for t in self.lost if t is not same]
                self.active.append(same)
                continue
            self.tracks.append(track)
            self.active.append(track)
        self.lost, self.previous_round = [], frame
        return True

    def finish(self) -> list[Track]:
        """The tracks, numbered in order of first appearance."""
        tracks = self.tracks
        tracks.sort(key=lambda t: (t.first, float(t.detections[t.first].box[0])))
        for number, track in enumerate(tracks):
            track.track_id = number
        return tracks


def track_faces(count: int, detections: dict[int, list[Detection]], refine: Refine,
                detect: Callable[[int], list[Detection]], *, min_iou: float = 0.3,
                min_score: float = 0.7) -> list[Track]:
    """Tracks over ``count`` sampled frames from full ``detections`` on some frames (frame ->
    faces) and ``refine`` on the others, numbered in order of first appearance. Where O-Net
    loses a face between two full detections (it left, or moved too far from its last box, as
    when sampled frames are seconds apart), ``detect(frame)`` runs the full cascade there."""
    tracker = Tracker(refine, detect, min_iou=min_iou, min_score=min_score)
    for frame in range(count):
        tracker.step(frame, detections.get(frame))
    return tracker.finish()
