"""The ``DetectFaces`` op: MTCNN (``precache.faces.mtcnn``) over each photo or frame, on a copy
shrunk to ``detect_size``, with boxes and points mapped back to source pixels, on the CPU or a
CUDA GPU (``device``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, ClassVar

import cv2
import numpy as np

from precache.faces.mtcnn import MTCNN, Cascade, Faces, mtcnn_weight_files, refine_inputs
from precache.processing.ops.base import Op, Sample, Skip

__all__ = ["DetectFaces", "FaceNets", "DEVICES", "DETECTORS", "check_device", "make_mtcnn"]

DETECTORS = ("mtcnn", "blazeface")
"""``detector`` values: ``mtcnn`` (the cascade, on the CPU or a GPU) or ``blazeface``
(``precache.faces.blazeface``: MediaPipe's BlazeFace proposes, MTCNN's R-Net and O-Net check and
place the points; CPU only, ~7x MTCNN's speed, 0.96 of its faces of 40 px and more)."""

BLAZEFACE_THRESHOLDS = (0.02, 0.3)
"""BlazeFace's proposal score and R-Net's screen with ``detector=blazeface``; O-Net keeps a face
at ``thresholds[2]``, as in MTCNN (measured in ``precache.faces.blazeface``)."""

DEVICES = ("auto", "cpu", "cuda")
"""``device`` values: ``auto`` (a CUDA GPU where torch sees one, else the CPU), ``cpu``,
``cuda`` (or ``cuda:N``)."""

CPU_ENGINE = "opencv"
"""The MTCNN engine on the CPU (``device=cpu``, and ``auto`` without a GPU): ``opencv``
(``MTCNN``) or ``torch`` (``precache.faces.mtcnn_torch``). OpenCV: on this project's 2-core
machine, one thread, the torch engine was 0.98-1.15x OpenCV's speed (CPU time,
``tests/benchmarks/bench_mtcnn.py``; both near the core's peak on the same convolutions), so
not worth importing torch into every stage-1 worker (its start-up and memory), and OpenCV's
results are the ones earlier caches hold. The environment variable
``PRECACHE_MTCNN_CPU_ENGINE`` (``torch`` or ``opencv``) overrides it in the process that sets
up the op (stage-1 workers inherit it): the benchmark compares both in the pipeline with it."""


def check_device(device: str) -> str:
    """``device`` if it is one of ``DEVICES`` (or ``cuda:N``) and present, else a one-line
    ``ValueError`` naming the fix. Only a CUDA device imports torch here (to ask for it)."""
    if device not in DEVICES and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ValueError(f"device must be auto, cpu or cuda (or cuda:N), not {device!r}")
    if device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device[5:]) if ":" in device else 0
        if index >= count:
            raise ValueError(f"device={device} asked for, but torch {torch.__version__} sees "
                             f"{count} CUDA GPU(s) here; use device=cpu or device=auto")
    return device


def _cuda_available() -> bool:
    """Whether torch sees a CUDA GPU; on Linux without NVIDIA's driver files, False without
    importing torch (``auto`` on a CPU machine keeps torch out of the workers)."""
    if sys.platform.startswith("linux") and not (
            Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia").exists()):
        return False
    import torch

    return bool(torch.cuda.is_available())


def make_mtcnn(device: str, min_face: float, thresholds: tuple[float, float, float]) -> Cascade:
    """The MTCNN cascade for ``device`` (``check_device``): on a CUDA GPU the torch engine;
    on the CPU ``CPU_ENGINE``."""
    if device == "auto":
        device = "cuda" if _cuda_available() else "cpu"
    engine = os.environ.get("PRECACHE_MTCNN_CPU_ENGINE", CPU_ENGINE)
    if engine not in ("torch", "opencv"):
        raise ValueError(f"PRECACHE_MTCNN_CPU_ENGINE must be torch or opencv, not {engine!r}")
    if device == "cpu" and engine == "opencv":
        return MTCNN(min_face, thresholds)
    from precache.faces.mtcnn_torch import TorchMTCNN

    return TorchMTCNN(min_face, thresholds, device=device)


class FaceNets:
    """The networks of a ``DetectFaces``: the part of it that runs in a run's device stage
    (``device_parts``) while the rest of it (shrinking an image to ``detect_size``, cutting
    O-Net's patches, mapping boxes and points back to source pixels) runs in the worker. So
    what travels to the device is a shrunk image or 48 px patches, not the source photo (36 MB
    for 12 megapixels) or frame (6.2 MB at 1080p). A plain run calls the same methods in the
    worker: one code path.

    Each method takes lists with one entry per item and returns one result per item, so the
    device stage batches several workers' calls by joining their lists.

    Args:
        detector, device, min_face, thresholds, tile: as ``DetectFaces``'s.
    """

    def __init__(self, detector: str, device: str, min_face: int,
                 thresholds: tuple[float, float, float], tile: int = 640) -> None:
        self.detector_name, self.device = detector, device
        self.min_face, self.thresholds, self.tile = min_face, thresholds, tile
        self.detector: Any = None  # a Cascade (MTCNN) or a BlazeFace, made by setup

    def setup(self) -> None:
        """Load the networks (once)."""
        if self.detector is not None:
            return
        if self.detector_name == "blazeface":  # made here: MediaPipe aborts in forked children
            from precache.faces.blazeface import BlazeFace

            self.detector = BlazeFace(self.min_face, (*BLAZEFACE_THRESHOLDS, self.thresholds[2]),
                                      tile=self.tile)
            return
        self.detector = make_mtcnn(self.device, self.min_face, self.thresholds)

    def detect(self, images: list[np.ndarray], min_faces: list[float]) -> list[Faces]:
        """Faces in each (already shrunk) image, looking for faces of ``min_faces[k]`` pixels
        and more: one ``detect_batch`` per image size and smallest face (one pyramid each)."""
        self.setup()
        groups: dict[tuple[tuple[int, ...], float], list[int]] = {}
        for k, (image, min_face) in enumerate(zip(images, min_faces)):
            groups.setdefault((image.shape[:2], float(min_face)), []).append(k)
        results: list[Any] = [None] * len(images)
        for (_, min_face), members in groups.items():
            self.detector.min_face = min_face
            for k, found in zip(members, self.detector.detect_batch([images[k] for k in members])):
                results[k] = found
        return results

    def refine(self, squared: list[np.ndarray], patches: list[np.ndarray]) -> list[Faces]:
        """O-Net on each image's squared boxes and their 48 px patches (``refine_inputs``)."""
        self.setup()
        return self.detector.refine_patches(squared, patches)


class DetectFaces(Op):
    """Find faces with MTCNN; adds ``box`` (x0, y0, x1, y1, the detector's box before any
    margin), ``score`` and ``landmarks5`` (5 x 2), all in source-image pixels.

    Args:
        min_face: smallest face side (source pixels) searched for; larger is faster.
        thresholds: P-, R- and O-Net score thresholds.
        keep: ``"largest"`` keeps the largest face (one row per image, the image's key);
            ``"all"`` keeps every face, one row each, keys ``<image key>#<i>`` in score order.
        detect_size: the detector sees the photo shrunk so its longer side is at most this many
            pixels (0: full size); boxes and points are mapped back to source pixels and the crop
            is cut from the full-size photo. A 12-megapixel phone photo costs ~40x a 640x480
            one at full size. Faces under ``12 / shrink`` source pixels are then not found.
        device: where the networks run: ``auto`` (a CUDA GPU if torch sees one, else the CPU),
            ``cpu`` or ``cuda`` / ``cuda:N`` (``DEVICES``). Not part of ``params``, so not of the
            cache's fingerprint: every device runs the same weights through the same cascade
            code and gives the same faces, boxes and points within 1 px (float rounding in the
            networks only), so moving a cache's run from the CPU to a GPU (or back) does not
            recompute what is cached. On a CUDA GPU the networks (``nets``) run in the run's
            device stage (``device_stage``, ``device_parts``): one process for all workers,
            which detects on every worker's photos in one batch
            (``precache.processing.executors.device_stage``); the worker sends it each photo
            shrunk to ``detect_size``, and maps the faces back.
        detector: ``mtcnn`` (default) or ``blazeface`` (``DETECTORS``): BlazeFace proposes
            faces in one pass instead of MTCNN's pyramid, MTCNN's R-Net and O-Net check them and
            give box, score and 5 points in MTCNN's style; CPU only. ``thresholds[0]`` and
            ``[1]`` are then not used (``BLAZEFACE_THRESHOLDS``). In ``params`` only when it is
            ``blazeface``, so MTCNN caches keep their fingerprint.
        tile: with ``detector=blazeface``, a shrunk image with a side longer than this is also
            searched in overlapping tiles of this side, a BlazeFace pass each (0: the whole
            image only: ~1.5x faster on the sample photos, recall of MTCNN's faces of 40 px and
            more 0.954 instead of 0.973). In ``params`` only when it is not 640 (the default),
            and only for blazeface (MTCNN ignores it).

    An image without a face is skipped with reason ``no_face``. Photos are detected a batch at
    a time (``call_batch``: one batch per shrunk size), with the same faces as one by one.
    """

    name = "detect_faces"
    version = "1"
    batched = True
    device_parts: ClassVar[dict[str, tuple[str, ...]]] = {"nets": ("detect", "refine")}
    """What runs in the device stage where the op has one (``device_stage``): these methods of
    ``self.nets`` (``FaceNets``; ``precache.processing.executors.device_stage.DevicePart``)."""

    def __init__(self, *, min_face: int = 20, thresholds: tuple[float, float, float] = (0.6, 0.7, 0.7),
                 keep: str = "largest", detect_size: int = 1024, device: str = "auto",
                 detector: str = "mtcnn", tile: int = 640) -> None:
        if detect_size != 0 and detect_size < 48:
            raise ValueError(f"detect_size must be 0 (full size) or at least 48 pixels, not {detect_size}")
        if keep not in ("largest", "all"):
            raise ValueError(f"keep must be 'largest' or 'all', not {keep!r}")
        if min_face < 12:
            raise ValueError(f"min_face must be at least 12 pixels (the P-Net window), not {min_face}")
        if len(thresholds) != 3 or not all(0.0 <= t <= 1.0 for t in thresholds):
            raise ValueError(f"thresholds must be three scores in [0, 1], not {thresholds!r}")
        self.min_face = int(min_face)
        self.thresholds = tuple(float(t) for t in thresholds)
        self.keep = keep
        self.detect_size = int(detect_size)
        if detector not in DETECTORS:
            raise ValueError(f"detector must be mtcnn or blazeface, not {detector!r}")
        if detector == "blazeface" and device.startswith("cuda"):
            raise ValueError("detector=blazeface runs on the CPU only; use device=cpu or auto, "
                             "or detector=mtcnn")
        if tile != 0 and tile < 48:
            raise ValueError(f"tile must be 0 (the whole image only) or at least 48 pixels, "
                             f"not {tile}")
        self.device = check_device(device)
        self.detector_name = detector
        self.tile = int(tile)
        self.nets = FaceNets(detector, self.device, self.min_face, self.thresholds,  # type: ignore[arg-type]
                             self.tile)

    @property
    def detector(self) -> Any:
        """The detector (a ``Cascade`` or a ``BlazeFace``) once set up, else ``None``."""
        return self.nets.detector

    @detector.setter
    def detector(self, detector: Any) -> None:
        self.nets.detector = detector

    @property
    def params(self) -> dict[str, Any]:
        found = {"min_face": self.min_face, "thresholds": list(self.thresholds),
                 "keep": self.keep, "detect_size": self.detect_size}
        if self.detector_name == "mtcnn":
            return found
        return {**found, "detector": self.detector_name,
                **({"tile": self.tile} if self.tile != 640 else {})}

    def weight_files(self) -> list[Path]:
        if self.detector_name == "blazeface":
            from precache.faces.blazeface import blazeface_weight_files

            return blazeface_weight_files()
        return list(mtcnn_weight_files().values())

    def setup(self) -> None:
        self.nets.setup()

    def _detect(self, image: np.ndarray) -> Faces:
        """Detect on a copy shrunk to ``detect_size``; return source-pixel boxes and points."""
        return self.detect_many([image])[0]

    def _shrunk(self, image: np.ndarray) -> tuple[np.ndarray, float]:
        """The image the detector sees (a copy shrunk so its longer side is ``detect_size``,
        INTER_AREA, or the image itself) and the shrink factor."""
        height, width = image.shape[:2]
        shrink = min(1.0, self.detect_size / max(height, width)) if self.detect_size else 1.0
        if shrink == 1.0:
            return image, 1.0
        size = (max(1, round(width * shrink)), max(1, round(height * shrink)))
        return cv2.resize(image, size, interpolation=cv2.INTER_AREA), shrink

    def detect_many(self, images: list[np.ndarray]) -> list[Faces]:
        """``(boxes, scores, landmarks)`` in source pixels for each image: each is shrunk here
        (``_shrunk``), detected on by ``nets`` (in the device stage where the op has one;
        same-sized images in one batch per network), and its faces mapped back here."""
        shrunk = [self._shrunk(image) for image in images]
        found = self.nets.detect([small for small, _ in shrunk],
                                 [max(12.0, self.min_face * shrink) for _, shrink in shrunk])
        return [faces if shrink == 1.0 else _to_source(faces, shrink)
                for faces, (_, shrink) in zip(found, shrunk)]

    def refine_many(self, images: list[np.ndarray], boxes: list[np.ndarray]) -> list[Faces]:
        """``MTCNN.refine`` on each image's boxes, in source pixels: O-Net's patches are cut
        here from the full-size image (``refine_inputs``) and only they go to ``nets``."""
        inputs = [refine_inputs(image, b) for image, b in zip(images, boxes)]
        return self.nets.refine([squared for squared, _ in inputs],
                                [patches for _, patches in inputs])

    @property
    def device_stage(self) -> bool:
        """Whether the op's networks (``nets``) run in the run's device stage: where they run
        on a GPU."""
        return self.detector_name == "mtcnn" and (
            self.device.startswith("cuda") or (self.device == "auto" and _cuda_available()))

    def call_batch(self, samples: list[Sample]) -> list[Any]:
        """Every sample's faces (``__call__``'s result, or ``Skip``), detected in one batch per
        shrunk size (``detect_many``)."""
        found = self.detect_many([sample["image"] for sample in samples])
        return [self._faces(sample, *faces) for sample, faces in zip(samples, found)]

    def __call__(self, sample: Sample) -> Sample | list[Sample]:
        result = self._faces(sample, *self._detect(sample["image"]))
        if isinstance(result, Skip):
            raise result
        return result

    def _faces(self, sample: Sample, boxes: np.ndarray, scores: np.ndarray,
               landmarks: np.ndarray) -> Sample | list[Sample] | Skip:
        """The rows of ``sample``'s detections as ``keep`` says, or ``Skip`` without a face."""
        if len(boxes) == 0:
            return Skip("no_face")
        faces = [dict(sample, box=boxes[i], score=np.float32(scores[i]), landmarks5=landmarks[i])
                 for i in range(len(boxes))]
        if self.keep == "all":
            return faces
        areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
        return faces[int(np.argmax(areas))]


def _to_source(faces: Faces, shrink: float) -> Faces:
    """Boxes and points found on an image shrunk by ``shrink``, in the source image's pixels."""
    boxes, scores, landmarks = faces
    # Pixel centres: small pixel i covers source pixels around (i + 0.5) / shrink - 0.5.
    return (boxes + 0.5) / shrink - 0.5, scores, (landmarks + 0.5) / shrink - 0.5
