"""Stage-1 ops by name: the one place a new op is registered."""

from __future__ import annotations

from precache.processing.ops.base import FunctionOp, Op, OpResult, Sample, Skip
from precache.processing.ops.face_crop import CropFace
from precache.processing.ops.face_detect import DetectFaces
from precache.processing.ops.face_mesh import FaceMesh, FaceRegions
from precache.processing.ops.image import IMAGE_EXTENSIONS, DecodeImage, EncodeImage, ResizeCenterCrop
from precache.processing.ops.labels import Labels
from precache.processing.ops.text import TEXT_EXTENSIONS, DecodeText, Tokenize
from precache.processing.ops.video_decode import VIDEO_EXTENSIONS
from precache.processing.ops.video_faces import VideoFaces
from precache.processing.ops.volume import (VOLUME_EXTENSIONS, CropForeground, DecodeVolume,
                                            FitShape, NormaliseIntensity, Resample, VolumeLabels)

__all__ = ["OPS", "get_op", "Op", "Skip", "FunctionOp", "OpResult", "Sample",
           "DecodeImage", "ResizeCenterCrop", "IMAGE_EXTENSIONS", "DetectFaces", "CropFace",
           "FaceMesh", "FaceRegions", "DecodeText", "Tokenize", "TEXT_EXTENSIONS", "EncodeImage",
           "Labels", "VideoFaces", "VIDEO_EXTENSIONS", "VOLUME_EXTENSIONS", "DecodeVolume",
           "Resample", "NormaliseIntensity", "CropForeground", "FitShape", "VolumeLabels"]

OPS: dict[str, type[Op]] = {
    DecodeImage.name: DecodeImage,
    ResizeCenterCrop.name: ResizeCenterCrop,
    DetectFaces.name: DetectFaces,
    CropFace.name: CropFace,
    FaceMesh.name: FaceMesh,
    FaceRegions.name: FaceRegions,
    DecodeText.name: DecodeText,
    Tokenize.name: Tokenize,
    EncodeImage.name: EncodeImage,
    Labels.name: Labels,
    VideoFaces.name: VideoFaces,
    DecodeVolume.name: DecodeVolume,
    Resample.name: Resample,
    NormaliseIntensity.name: NormaliseIntensity,
    CropForeground.name: CropForeground,
    FitShape.name: FitShape,
}


def get_op(name: str, **params: object) -> Op:
    """Build the registered op called ``name`` with ``params``.

    Raises:
        ValueError: no such op.
    """
    try:
        cls = OPS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; registered ops: {sorted(OPS)}") from None
    return cls(**params)  # type: ignore[arg-type]
