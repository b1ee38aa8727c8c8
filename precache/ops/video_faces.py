"""Face crops from a video: sampled frames, batched MTCNN, an IoU tracker, one row per face frame.

One op does decode, detection, tracking and cropping, so a worker holds one video's decoded
frames at a time (32 frames of 1080p are 200 MB) and hands on only the crops. Each row is one
(track, sampled frame), keyed ``<video>#t<track>#f<frame index>``: fixed-shape columns that
stage 2 maps from the shard, a frame dataset and a clip dataset read from the same rows, and
rows of one video are stored together in frame order, so a clip is one contiguous read.

Columns added: ``image`` (the crop), ``box`` (x0, y0, x1, y1 source pixels, before the margin),
``score``, ``landmarks5`` (crop pixels), ``crop_affine`` (source -> crop), ``detected`` (True
where the whole cascade found the face, False where O-Net followed it from the previous frame), ``video``, ``track``, ``frame_index``,
``time_s``, ``fps``, ``duration_s``, ``frame_count`` (decoded), ``orig_height``, ``orig_width``,
``warning`` (what was wrong with the video but did not stop it, else ``""``). A video with no
face is skipped (``no_face``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from precache.ops.base import Op, Sample, Skip
from precache.ops.face_crop import CropFace
from precache.ops.face_detect import DetectFaces
from precache.ops.face_track import BOX_MODES, Detection, track_faces
from precache.ops.video_decode import read_frames

__all__ = ["VideoFaces"]


class VideoFaces(Op):
    """Decode a video's sampled frames, detect and track faces, crop every tracked face frame.

    Args:
        frames: frames sampled evenly in time (used when ``every`` and ``fps`` are 0).
        every: sample every k-th decoded frame instead.
        fps: sample this many frames per second instead.
        detect_every: run the whole MTCNN cascade on every k-th sampled frame (R-Net and O-Net
            over the candidates of all of them at once) and follow each face through the frames
            between with O-Net alone (``precache.ops.face_track``). 1: the cascade on every
            sampled frame.
        keep: ``largest`` (the track with the largest mean box) or ``all`` tracks.
        track_box: ``frame``, ``smooth`` or ``union`` (``precache.ops.face_track``).
        min_iou: box overlap that links a detection to a track.
        min_face, thresholds, detect_size: as ``DetectFaces``.
        size, margin: as ``CropFace``.
        decode_timeout_s: a video that takes longer to decode fails alone.
        max_pixels: frames larger than this are refused.
    """

    name = "video_faces"
    version = "1"

    def __init__(self, *, frames: int = 32, every: int = 0, fps: float = 0.0,
                 detect_every: int = 8, keep: str = "largest", track_box: str = "frame",
                 min_iou: float = 0.3, min_face: int = 20,
                 thresholds: tuple[float, float, float] = (0.6, 0.7, 0.7), detect_size: int = 640,
                 size: int = 224, margin: float = 0.3, decode_timeout_s: float = 120.0,
                 max_pixels: int = 150_000_000) -> None:
        if frames < 1 and every < 1 and fps <= 0:
            raise ValueError("sample with frames >= 1, every >= 1 or fps > 0")
        if every < 0 or fps < 0:
            raise ValueError(f"every and fps must be >= 0, not {every} and {fps}")
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
        self.detect_every, self.keep, self.track_box = int(detect_every), keep, track_box
        self.min_iou = float(min_iou)
        self.decode_timeout_s, self.max_pixels = float(decode_timeout_s), int(max_pixels)
        self.detect = DetectFaces(min_face=min_face, thresholds=thresholds, keep="all",
                                  detect_size=detect_size)
        self.crop = CropFace(size=size, margin=margin)

    @property
    def params(self) -> dict[str, Any]:
        return {"frames": self.frames, "every": self.every, "fps": self.fps,
                "detect_every": self.detect_every, "keep": self.keep, "track_box": self.track_box,
                "min_iou": self.min_iou, **{k: v for k, v in self.detect.params.items() if k != "keep"},
                **self.crop.params, "decode_timeout_s": self.decode_timeout_s,
                "max_pixels": self.max_pixels}

    def weight_files(self) -> list[Path]:
        return self.detect.weight_files()

    def setup(self) -> None:
        self.detect.setup()
        self.crop.setup()

    def _detections(self, images: list[np.ndarray], frames: list[int]) -> dict[int, list[Detection]]:
        found = self.detect.detect_many([images[f] for f in frames])
        return {f: [Detection(f, boxes[i], float(scores[i]), landmarks[i])
                    for i in range(len(boxes))]
                for f, (boxes, scores, landmarks) in zip(frames, found)}

    def __call__(self, sample: Sample) -> list[Sample]:
        video = read_frames(sample["data"], frames=self.frames, every=self.every, fps=self.fps,
                            timeout_s=self.decode_timeout_s, max_pixels=self.max_pixels)
        count = len(video.images)
        rounds = sorted(set(range(0, count, self.detect_every)) | {count - 1})

        def refine(frame: int, boxes: np.ndarray) -> list[Detection]:
            found, scores, points = self.detect.refine_many([video.images[frame]], [boxes])[0]
            return [Detection(frame, found[i], float(scores[i]), points[i], detected=False)
                    for i in range(len(found))]

        def detect(frame: int) -> list[Detection]:
            return self._detections(video.images, [frame])[frame]

        tracks = track_faces(count, self._detections(video.images, rounds), refine, detect,
                             min_iou=self.min_iou, min_score=self.detect.thresholds[2])
        if not tracks:
            raise Skip("no_face")
        warnings = list(video.warnings)
        if self.keep == "largest":
            kept = max(tracks, key=lambda t: (t.mean_area(), len(t.detections)))
            with_face = len({f for t in tracks for f in t.detections})
            if len(kept.detections) < with_face / 2:  # faces were found, but not linked
                gap = float(np.median(np.diff(video.times))) if count > 1 else 0.0
                warnings.append(
                    f"keep=largest kept one track, on {len(kept.detections)} of the {with_face} "
                    f"sampled frames with a face: faces could not be followed across frames "
                    f"{gap:.2f} s apart ({len(tracks)} tracks); sample more densely (e.g. fps=4) "
                    "or keep=all")
            tracks = [kept]
        height, width = video.images[0].shape[:2]
        common = {"video": sample["source_key"], "fps": float(video.fps),
                  "duration_s": float(video.duration_s),
                  "frame_count": np.int64(video.frame_count), "orig_height": int(height),
                  "orig_width": int(width), "warning": "; ".join(warnings)}
        rows = []
        for track in tracks:
            for f, box, score, landmarks, detected in track.frames(self.track_box):
                frame_index = int(video.indices[f])
                row = dict(sample, **common, image=video.images[f], box=box,
                           score=np.float32(score), landmarks5=landmarks, detected=bool(detected),
                           track=np.int32(track.track_id), frame_index=np.int64(frame_index),
                           time_s=float(video.times[f]))
                row["key"] = f"{sample['source_key']}#t{track.track_id}#f{frame_index}"
                rows.append(self.crop(row))
        return rows
