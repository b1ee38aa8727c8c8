"""A video-faces test pipeline whose detector runs in the device stage on the CPU.

A real ``VideoFaces`` declares ``device_stage`` only where its detector runs on a GPU; ``StagedVideoFaces``
declares it always (with ``device="cpu"``), so the device stage's path for an op's device parts
runs here. Its detector's networks log each ``setup``, ``detect`` and ``refine`` with the pid of
the process that ran it and the largest side of what it was sent to ``$PRECACHE_DETECT_LOG``,
and raise ``DetectorFault`` on frames of ``BROKEN`` size (the video ``make_videos`` writes as
``broken.mp4``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import av
import numpy as np

from precache.loading import CachedDataset
from precache.processing.ops import Op
from precache.processing.ops.face_detect import FaceNets
from precache.processing.ops.video_faces import VideoFaces
from precache.processing.pipeline import Pipeline
from tests.helpers import REPO, load_script

PIPELINE = "tests.precache.processing.video_device_pipeline:pipeline"
BROKEN = (96, 128)  # height, width of the frames the detector fails on
DETECT_SIZE = 160  # under the videos' 320 px: the worker sends the detector shrunk frames
COLUMNS = ["key", "box", "score", "landmarks5", "image", "detected", "track", "frame_index"]


class DetectorFault(RuntimeError):
    """The detector's failure on a ``BROKEN`` frame."""


def _log(what: str, arrays: Sequence[np.ndarray] = ()) -> None:
    """One line: what ran, in which process, and the largest side of the arrays it was sent."""
    path = os.environ.get("PRECACHE_DETECT_LOG")
    if path:
        side = max((max(a.shape[:2]) for a in arrays if a.size), default=0)
        with open(path, "a") as f:
            f.write(f"{what} {os.getpid()} {side}\n")


def _check(images: list[np.ndarray]) -> None:
    for image in images:
        if image.shape[:2] == BROKEN:
            raise DetectorFault(f"cannot detect on {BROKEN[1]}x{BROKEN[0]} frames")


class LoggedNets(FaceNets):
    """The detector's networks, logging each call with what it was sent."""

    def setup(self) -> None:
        if self.detector is None:
            _log("setup")
        super().setup()

    def detect(self, images: list[np.ndarray], min_faces: list[float]) -> list[Any]:
        _log("detect", images)
        _check(images)
        return super().detect(images, min_faces)

    def refine(self, squared: list[np.ndarray], patches: list[np.ndarray]) -> list[Any]:
        _log("refine", [p for stack in patches for p in stack])
        return super().refine(squared, patches)


class StagedVideoFaces(VideoFaces):
    device_stage = True  # type: ignore[assignment]  # on the CPU, for the test

    def __init__(self, **params: Any) -> None:
        super().__init__(device="cpu", **params)
        detect = self.detect
        detect.nets = LoggedNets("mtcnn", "cpu", detect.min_face, detect.thresholds)  # type: ignore[arg-type]


def make_ops() -> list[Op]:
    return [StagedVideoFaces(frames=6, detect_every=2, keep="all", size=32,
                             detect_size=DETECT_SIZE)]


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
        what, pid, _ = line.split()
        found.setdefault(what, set()).add(int(pid))
    return found


def largest_sent(path: Path) -> dict[str, int]:
    """``detect``/``refine`` -> the largest side of an image (a frame, a patch) it was sent."""
    found: dict[str, int] = {}
    for line in path.read_text().splitlines():
        what, _, side = line.split()
        if what != "setup":
            found[what] = max(found.get(what, 0), int(side))
    return found
