"""The ``faces`` and ``video-faces`` pipelines with the opt-in speed settings the built-in
pipelines do not expose yet, for ``bench_detectors_run.py``: ``mesh_roi`` (``FaceMesh(roi=...)``:
``landmarks`` places the mesh by the detector's points instead of MediaPipe's face detector) and
``tile`` (``BlazeFace``'s tile side: 0 searches the whole image only, one BlazeFace pass a photo).
Loaded by the run's workers as ``tests.benchmarks.face_variants:faces`` / ``:video_faces``."""

from __future__ import annotations

from typing import Any

from pipelines.faces import pipeline as faces_pipeline
from pipelines.faces import video as video_pipeline
from precache.processing.ops import DetectFaces, FaceMesh, Op
from precache.processing.pipeline import Pipeline


class TiledDetectFaces(DetectFaces):
    """``DetectFaces`` whose BlazeFace searches tiles of ``tile`` pixels (0: none)."""

    def __init__(self, *, tile: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tile = tile

    def setup(self) -> None:
        super().setup()
        if self.detector_name == "blazeface":
            self.nets.detector.tile = self.tile  # the BlazeFace of DetectFaces' FaceNets


def _with_mesh_roi(ops: list[Op], mesh_roi: str) -> list[Op]:
    return [FaceMesh(min_confidence=op.min_confidence, roi=mesh_roi) if isinstance(op, FaceMesh)
            else op for op in ops]


def make_faces_ops(size: int = 224, labels: str = "folder", detector: str = "mtcnn",
                   mesh_roi: str = "detect", tile: int = 640) -> list[Op]:
    ops = faces_pipeline.make_ops(size=size, labels=labels, detector=detector)
    ops = [TiledDetectFaces(tile=tile, min_face=op.min_face, thresholds=op.thresholds,
                            keep=op.keep, detect_size=op.detect_size, device=op.device,
                            detector=op.detector_name) if isinstance(op, DetectFaces) else op
           for op in ops]
    return _with_mesh_roi(ops, mesh_roi)


def make_video_ops(size: int = 224, labels: str = "folder", frames: int = 32,
                   detector: str = "mtcnn", mesh_roi: str = "detect") -> list[Op]:
    return _with_mesh_roi(video_pipeline.make_ops(size=size, labels=labels, frames=frames,
                                                  detector=detector), mesh_roi)


faces = Pipeline(name="faces-variants", make_ops=make_faces_ops,
                 extensions=faces_pipeline.pipeline.extensions,
                 ref="tests.benchmarks.face_variants:faces")
video_faces = Pipeline(name="video-faces-variants", make_ops=make_video_ops,
                       extensions=video_pipeline.pipeline.extensions,
                       ref="tests.benchmarks.face_variants:video_faces")
