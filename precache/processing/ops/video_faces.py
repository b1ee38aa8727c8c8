"""Face crops from a video: sampled frames, MTCNN, an IoU tracker, one row per face frame.

One op does decode, detection, tracking and cropping, as a stream: each sampled frame is
detected or followed (``precache.processing.ops.face_track``) as it is decoded, cropped at the output size
as soon as its boxes are final, and dropped, so a worker holds ``detect_every`` + 3 full frames
at most (the frames since the last full detection, which a face first found there is followed
back through, the two a ``smooth`` box waits for, and the next frame), plus the crops. Memory is
bounded by what the op keeps, not by the video's length; ``every=``/``fps=`` sampling stops at
``max_frames`` frames per video (512 by default), saying so in ``warning``. ``track_box=union``
needs a track's every box before its first crop: its frames are decoded a second time for the
crops rather than kept. Each row is one (track, sampled frame), keyed
``<video>#t<track>#f<frame index>``: fixed-shape columns that stage 2 maps from the shard, a frame
dataset and a clip dataset read from the same rows, and rows of one video are stored together
in frame order, so a clip is one contiguous read.

Columns added: ``image`` (the crop), ``box`` (x0, y0, x1, y1 source pixels, before the margin),
``score``, ``landmarks5`` (crop pixels), ``crop_affine`` (source -> crop), ``detected`` (True
where the whole cascade found the face, False where O-Net followed it from the previous
frame), ``video``, ``track``, ``frame_index``, ``time_s``, ``fps``, ``duration_s``,
``frame_count`` (decoded; where ``max_frames`` stopped the decoding, the header's),
``orig_height``, ``orig_width``, ``warning`` (what was wrong with the video but did not stop
it, else ``""``). A video with no face is skipped (``no_face``).
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator

import numpy as np

from precache.processing.ops.base import Op, Sample, Skip
from precache.processing.ops.face_crop import CropFace
from precache.processing.ops.face_detect import DetectFaces
from precache.processing.ops.face_track import BOX_MODES, Detection, Track, Tracker, TrackRows
from precache.processing.ops.video_decode import Frame, VideoError, VideoReader

__all__ = ["VideoFaces", "MAX_FRAMES"]

MAX_FRAMES = 512
"""Default cap on the frames ``every=``/``fps=`` sample per video (20 s at 25 fps with
``every=1``): the rows of one video are returned together, 512 crops of 224 px are 77 MB."""


class VideoFaces(Op):
    """Decode a video's sampled frames, detect and track faces, crop every tracked face frame.

    Args:
        frames: frames sampled evenly in time (used when ``every`` and ``fps`` are 0).
        every: sample every k-th decoded frame instead.
        fps: sample this many frames per second instead.
        max_frames: with ``every`` or ``fps``, keep the first ``max_frames`` sampled frames of
            a video and stop decoding there, with a warning on its rows (0: no cap).
        detect_every: run the whole MTCNN cascade on every k-th sampled frame and follow each
            face through the frames between with O-Net alone (``precache.processing.ops.face_track``).
            1: the cascade on every sampled frame.
        keep: ``largest`` (the track with the largest mean box) or ``all`` tracks.
        track_box: ``frame``, ``smooth`` or ``union`` (``precache.processing.ops.face_track``).
        min_iou: box overlap that links a detection to a track.
        min_face, thresholds, detect_size: as ``DetectFaces``.
        device: where MTCNN runs, as ``DetectFaces`` (``auto``, ``cpu``, ``cuda``); like there,
            not in ``params``: every device gives the same tracks and boxes within 1 px. On a
            CUDA GPU the detector's networks run in the run's device stage (``device_stage``,
            ``device_parts``): one process for all workers, which runs every waiting worker's
            frames in one batch; decoding, shrinking, tracking and cropping stay in the workers.
        detector: ``mtcnn`` or ``blazeface``, as ``DetectFaces`` (the frames between full
            detections are followed by O-Net either way).
        size, margin: as ``CropFace``.
        decode_timeout_s: a video whose decoding takes longer fails alone (the time spent
            decoding; detection and cropping between frames are not counted).
        max_pixels: frames larger than this are refused.
    """

    name = "video_faces"
    version = "1"
    device_parts: ClassVar[dict[str, tuple[str, ...]]] = {
        f"detect.{part}": methods for part, methods in DetectFaces.device_parts.items()}
    """What runs in the device stage where the op has one (``device_stage``): the detector's
    networks (``self.detect.nets``, ``FaceNets``), sent each frame shrunk to ``detect_size``
    and O-Net's patches (``precache.processing.executors.device_stage.DevicePart``)."""

    def __init__(self, *, frames: int = 32, every: int = 0, fps: float = 0.0,
                 max_frames: int = MAX_FRAMES, detect_every: int = 8, keep: str = "largest",
                 track_box: str = "frame", min_iou: float = 0.3, min_face: int = 20,
                 thresholds: tuple[float, float, float] = (0.6, 0.7, 0.7), detect_size: int = 640,
                 size: int = 224, margin: float = 0.3, decode_timeout_s: float = 120.0,
                 max_pixels: int = 150_000_000, device: str = "auto",
                 detector: str = "mtcnn") -> None:
        if frames < 1 and every < 1 and fps <= 0:
            raise ValueError("sample with frames >= 1, every >= 1 or fps > 0")
        if every < 0 or fps < 0:
            raise ValueError(f"every and fps must be >= 0, not {every} and {fps}")
        if max_frames < 0:
            raise ValueError(f"max_frames must be >= 0 (0: no cap), not {max_frames}")
        if detect_every < 1:
            raise ValueError(f"detect_every must be at least 1, not {detect_every}")
        if keep not in ("largest", "all"):
            raise ValueError(f"keep must be 'largest' or 'all', not {keep!r}")
        if track_box not in BOX_MODES:
            raise ValueError(f"track_box must be one of {BOX_MODES}, not {track_box!r}")
        if not 0.0 < min_iou <= 1.0:
            raise ValueError(f"min_iou must be in (0, 1], not {min_iou}")
        if decode_timeout_s <= 0:
            raise ValueError(f"decode_timeout_s must be > 0, not {decode_timeout_s}")
        self.frames, self.every, self.fps = int(frames), int(every), float(fps)
        self.max_frames = int(max_frames)
        self.detect_every, self.keep, self.track_box = int(detect_every), keep, track_box
        self.min_iou = float(min_iou)
        self.decode_timeout_s, self.max_pixels = float(decode_timeout_s), int(max_pixels)
        self.detect = DetectFaces(min_face=min_face, thresholds=thresholds, keep="all",
                                  detect_size=detect_size, device=device, detector=detector)
        self.crop = CropFace(size=size, margin=margin)

    @property
    def params(self) -> dict[str, Any]:
        return {"frames": self.frames, "every": self.every, "fps": self.fps,
                "max_frames": self.max_frames, "detect_every": self.detect_every,
                "keep": self.keep, "track_box": self.track_box, "min_iou": self.min_iou,
                **{k: v for k, v in self.detect.params.items() if k != "keep"},
                **self.crop.params, "decode_timeout_s": self.decode_timeout_s,
                "max_pixels": self.max_pixels}

    def weight_files(self) -> list[Path]:
        return self.detect.weight_files()

    def setup(self) -> None:
        self.detect.setup()
        self.crop.setup()

    @property
    def device_stage(self) -> bool:
        """Whether the detector runs in the run's device stage: where it runs on a GPU."""
        return bool(self.detect.device_stage)

    def __call__(self, sample: Sample) -> list[Sample]:
        reader = VideoReader(sample["data"], frames=self.frames, every=self.every, fps=self.fps,
                             timeout_s=self.decode_timeout_s, max_pixels=self.max_pixels,
                             max_frames=self.max_frames)
        stream: _Stream | None = None
        for frames in reader.passes():  # a second pass starts over
            stream = None
            with closing(frames):
                stream = _Stream(self, frames)
        assert stream is not None and reader.info is not None
        video = reader.info
        count = len(stream.indices)
        tracks = stream.tracks
        if not tracks:
            raise Skip("no_face")
        warnings = list(video.warnings)
        if self.keep == "largest":
            kept = max(tracks, key=lambda t: (t.mean_area(), len(t.detections)))
            with_face = len({f for t in tracks for f in t.detections})
            if len(kept.detections) < with_face / 2:  # faces were found, but not linked
                gap = float(np.median(np.diff(stream.times))) if count > 1 else 0.0
                warnings.append(
                    f"keep=largest kept one track, on {len(kept.detections)} of the {with_face} "
                    f"sampled frames with a face: faces could not be followed across frames "
                    f"{gap:.2f} s apart ({len(tracks)} tracks); sample more densely (e.g. fps=4) "
                    "or keep=all")
            tracks = [kept]
        if self.track_box == "union":
            stream.crop_again(tracks, reader.replay())
        height, width = stream.shape
        common = {"video": sample["source_key"], "fps": float(video.fps),
                  "duration_s": float(video.duration_s),
                  "frame_count": np.int64(video.frame_count), "orig_height": int(height),
                  "orig_width": int(width), "warning": "; ".join(warnings)}
        rows = []
        for track in tracks:
            for (f, box, score, _, detected), crop in stream.crops[id(track)]:
                frame_index = int(stream.indices[f])
                row = dict(sample, **common, image=crop["image"], box=box,
                           score=np.float32(score), landmarks5=crop["landmarks5"],
                           detected=bool(detected), track=np.int32(track.track_id),
                           frame_index=np.int64(frame_index), time_s=float(stream.times[f]))
                row["key"] = f"{sample['source_key']}#t{track.track_id}#f{frame_index}"
                row["crop_affine"] = crop["crop_affine"]
                rows.append(row)
        return rows


class _Stream:
    """One decoding pass of a video through detection, tracking and cropping. Sampled frame
    ``n`` is tracked when frame ``n + 1`` arrives (or the video ends: the last frame gets the
    full cascade); after each full detection the rows up to it are cropped and the full frames
    no later step needs are dropped.

    Each decoded frame is copied into one of a few reused buffers (as many as are ever alive at
    once) and PyAV's array is let go at once. Keeping PyAV's arrays instead made the heap grow
    with the video although only ``detect_every`` + 3 frames were alive: glibc serves a 2.8 MB
    block (a 720p frame) from its heap, not by mmap, once one such block has been freed, and the
    crops and detection arrays made between two frames settle in the holes dropped frames leave,
    so each new frame went past them (``every=1`` over 500 frames of 720p: 0.5-0.8 GB peak,
    against 0.23 GB with the buffers and 0.20 GB for ``frames=8``).
    """

    def __init__(self, op: VideoFaces, frames: Iterable[Frame]) -> None:
        self.op = op
        self.images: dict[int, np.ndarray] = {}  # sampled frame number -> the frame, still needed
        self.spare: list[np.ndarray] = []  # buffers of dropped frames, to reuse
        self.indices: list[int] = []
        self.times: list[float] = []
        self.shape: tuple[int, int] = (0, 0)
        self.rows: dict[int, TrackRows] = {}  # by id(track)
        # by id(track): (row, its crop; None for ``union`` until ``crop_again``)
        self.crops: dict[int, list[tuple[tuple, dict | None]]] = {}
        self.tracker = Tracker(self._refine, self._detect, min_iou=op.min_iou,
                               min_score=op.detect.thresholds[2])
        for frame in frames:
            n = len(self.indices)
            if n == 0:
                self.shape = frame.image.shape[:2]
            self.indices.append(frame.index)
            self.times.append(frame.time)
            self.images[n] = self._keep(frame.image)
            frame = None  # PyAV's array goes now, before anything else is allocated
            if n > 0:
                self._step(n - 1, last=False)
        if self.indices:
            self._step(len(self.indices) - 1, last=True)
        self.images.clear()
        self.spare.clear()
        self.tracks = self.tracker.finish()

    def _keep(self, image: np.ndarray) -> np.ndarray:
        """A copy of ``image`` in a reused buffer."""
        while self.spare:
            buffer = self.spare.pop()
            if buffer.shape == image.shape:
                np.copyto(buffer, image)
                return buffer
        return image.copy()

    def _detect(self, frame: int) -> list[Detection]:
        boxes, scores, landmarks = self.op.detect.detect_many([self.images[frame]])[0]
        return [Detection(frame, boxes[i], float(scores[i]), landmarks[i])
                for i in range(len(boxes))]

    def _refine(self, frame: int, boxes: np.ndarray) -> list[Detection]:
        found, scores, points = self.op.detect.refine_many([self.images[frame]], [boxes])[0]
        return [Detection(frame, found[i], float(scores[i]), points[i], detected=False)
                for i in range(len(found))]

    def _step(self, frame: int, last: bool) -> None:
        detected = self._detect(frame) if last or frame % self.op.detect_every == 0 else None
        if not self.tracker.step(frame, detected):
            return
        # a full detection on ``frame``: no box at or before it changes any more
        active = {id(t) for t in self.tracker.active}
        keep = frame + 1  # the first frame the tracker may still look at
        for track in self.tracker.tracks:
            rows = self.rows.get(id(track))
            if rows is None:
                rows = self.rows[id(track)] = TrackRows(track, self.op.track_box)
                self.crops[id(track)] = []
            if rows.closed:
                continue
            made = rows.extend(frame, ended=last or id(track) not in active)
            if self.op.track_box == "union":  # cropped from a second decoding
                self.crops[id(track)].extend((row, None) for row in made)
                continue
            self.crops[id(track)].extend((row, self._crop(row)) for row in made)
            if rows.pending is not None:
                keep = min(keep, rows.pending)
        for n in [n for n in self.images if n < keep]:
            self.spare.append(self.images.pop(n))

    def _crop(self, row: tuple, image: np.ndarray | None = None) -> dict:
        f, box, _, landmarks, _ = row
        image = self.images[f] if image is None else image
        return self.op.crop({"image": image, "box": box, "landmarks5": landmarks})

    def crop_again(self, tracks: list[Track], frames: Iterator[Frame]) -> None:
        """``union`` boxes: crop ``tracks`` from a second decoding of the same frames (stopped
        once the last frame they need is cropped)."""
        wanted: dict[int, list[tuple[list, int]]] = {}
        for track in tracks:
            entries = self.crops[id(track)]
            for k, (row, _) in enumerate(entries):
                wanted.setdefault(row[0], []).append((entries, k))
        with closing(frames):
            for n, frame in enumerate(frames):
                if not wanted:
                    break
                if n >= len(self.indices) or frame.index != self.indices[n]:
                    break
                for entries, k in wanted.pop(n, ()):
                    entries[k] = (entries[k][0], self._crop(entries[k][0], frame.image))
        if wanted:
            raise VideoError("the video decoded differently the second time (track_box=union "
                             "crops the frames of a second decoding)")
