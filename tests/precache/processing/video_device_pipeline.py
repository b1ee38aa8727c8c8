"""A video-faces test pipeline whose detector runs in the device stage on the CPU.

A real ``VideoFaces`` declares ``device_stage`` only where its detector runs on a GPU; ``StagedVideoFaces``
declares it always (with ``device="cpu"``), so the device stage's path for an op's device parts
runs here. Its detector logs each ``setup``, ``detect`` and ``refine`` with the pid of the
process that ran it to ``$PRECACHE_DETECT_LOG``, and raises ``DetectorFault`` on frames of
``BROKEN`` size (the video ``make_videos`` writes as ``broken.mp4``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import av
import numpy as np

from precache.loading import CachedDataset
from precache.processing.ops import Op
from precache.processing.ops.face_detect import DetectFaces
from precache.processing.ops.video_faces import VideoFaces
from precache.processing.pipeline import Pipeline
from tests.helpers import REPO, load_script

PIPELINE = "tests.precache.processing.video_device_pipeline:pipeline"
BROKEN = (96, 128)  # height, width of the frames the detector fails on
COLUMNS = ["key", "box", "score", "landmarks5", "image", "detected", "track", "frame_index"]


class DetectorFault(RuntimeError):
    """The detector's failure on a ``BROKEN`` frame."""


def _log(what: str) -> None:
    path = os.environ.get("PRECACHE_DETECT_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{what} {os.getpid()}\n")


def _check(images: list[np.ndarray]) -> None:
    for image in images:
        if image.shape[:2] == BROKEN:
            raise DetectorFault(f"cannot detect on {BROKEN[1]}x{BROKEN[0]} frames")


class LoggedDetect(DetectFaces):
    def setup(self) -> None:
        _log("setup")
        super().setup()

    def detect_many(self, images: list[np.ndarray]) -> list[Any]:
        _log("detect")
        _check(images)
        return super().detect_many(images)

    def refine_many(self, images: list[np.ndarray], boxes: list[np.ndarray]) -> list[Any]:
        _log("refine")
        _check(images)
        return super().refine_many(images, boxes)


class StagedVideoFaces(VideoFaces):
    device_stage = True  # type: ignore[assignment]  # on the CPU, for the test

    def __init__(self, **params: Any) -> None:
        super().__init__(device="cpu", **params)
        self.detect = LoggedDetect(min_face=self.detect.min_face,
                                   thresholds=self.detect.thresholds,  # type: ignore[arg-type]
                                   keep="all", detect_size=self.detect.detect_size, device="cpu")


def make_ops() -> list[Op]:
    return [StagedVideoFaces(frames=6, detect_every=2, keep="all", size=32)]


pipeline = Pipeline(name="video-device", make_ops=make_ops, extensions=(".mp4",),
                    description="video faces with the detector in the device stage, on the CPU")


def make_videos(folder: Path) -> Path:
    """Two 1 s face videos of ``data/make_videos.py`` (a face moving, and a fake of it), and
    ``broken.mp4``: 3 frames of ``BROKEN`` size, which the detector fails on."""
    load_script(REPO / "data" / "make_videos.py", "make_videos").write_videos(
        folder, per_label=1, seconds=1.0)
    container = av.open(str(folder / "broken.mp4"), "w")
    stream = container.add_stream("libx264", rate=15)
    stream.height, stream.width = BROKEN
    stream.pix_fmt = "yuv420p"
    for _ in range(3):
        frame = av.VideoFrame.from_ndarray(np.zeros((*BROKEN, 3), np.uint8), format="rgb24")
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)
    container.close()
    return folder


def rows_of(cache: Path) -> list[dict[str, Any]]:
    """Every row's ``COLUMNS``, in storage order."""
    data = CachedDataset(cache, columns=COLUMNS, resident=False)
    return data.__getitems__(list(range(len(data))))


def logged(path: Path) -> dict[str, set[int]]:
    """What the detectors logged: ``setup``/``detect``/``refine`` -> the pids that ran it."""
    found: dict[str, set[int]] = {}
    for line in path.read_text().splitlines():
        what, pid = line.split()
        found.setdefault(what, set()).add(int(pid))
    return found
