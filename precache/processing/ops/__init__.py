"""Stage-1 ops: what a pipeline is a list of, and the limits and helpers a pipeline passes on.

A pipeline (``pipelines/``, or your own file) imports its ops from here; ``Op`` and
``FunctionOp`` are how you write one of your own. Also here: the default input limits the
built-in pipelines expose as parameters (``DEFAULT_MAX_PIXELS``, ``DEFAULT_MAX_VOXELS``,
``MAX_FRAMES``) and ``resolve_tokenizer``, the ``tokenizer.json`` behind a ``tokenizer`` name
(a trainer checks that its model's tokenizer is the one the cache was built with).
"""

from __future__ import annotations

from precache.processing.ops.base import FunctionOp, Op, OpResult, Sample, Skip
from precache.processing.ops.face_crop import CropFace
from precache.processing.ops.face_detect import DetectFaces
from precache.processing.ops.face_mesh import FaceMesh, FaceRegions
from precache.processing.ops.image import (DEFAULT_MAX_PIXELS, IMAGE_EXTENSIONS, DecodeImage,
                                           EncodeImage, ResizeCenterCrop)
from precache.processing.ops.labels import Labels
from precache.processing.ops.text import (TEXT_EXTENSIONS, DecodeText, Tokenize,
                                          TokenizerNotFoundError, resolve_tokenizer)
from precache.processing.ops.video_decode import VIDEO_EXTENSIONS
from precache.processing.ops.video_faces import MAX_FRAMES, VideoFaces
from precache.processing.ops.volume import (VOLUME_EXTENSIONS, CropForeground, DecodeVolume,
                                            FitShape, NormaliseIntensity, Resample, VolumeLabels)
from precache.processing.ops.volume_read import DEFAULT_MAX_VOXELS

__all__ = ["Op", "Skip", "FunctionOp", "OpResult", "Sample",
           "DecodeImage", "ResizeCenterCrop", "IMAGE_EXTENSIONS", "DetectFaces", "CropFace",
           "FaceMesh", "FaceRegions", "DecodeText", "Tokenize", "TEXT_EXTENSIONS", "EncodeImage",
           "Labels", "VideoFaces", "VIDEO_EXTENSIONS", "VOLUME_EXTENSIONS", "DecodeVolume",
           "Resample", "NormaliseIntensity", "CropForeground", "FitShape", "VolumeLabels",
           "DEFAULT_MAX_PIXELS", "DEFAULT_MAX_VOXELS", "MAX_FRAMES", "resolve_tokenizer",
           "TokenizerNotFoundError"]
