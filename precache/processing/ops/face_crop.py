"""Crop a square around a detected face, with a margin, and resize it: the training input.

The crop's side is ``(1 + 2 * margin)`` times the longer side of the detector's box, so the
classic 30% margin adds 30% of the face on every side; where the square leaves the photo it is
padded with black. The affine transform from source pixels to crop pixels is stored, so every
point can be mapped back to the photo (``crop_to_source``).
"""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np

from precache.processing.ops.base import Op, Sample

__all__ = ["CropFace", "square_window", "crop_to_source"]


def square_window(box: np.ndarray, margin: float) -> tuple[int, int, int]:
    """(x0, y0, side) of the square crop window around ``box`` (x0, y0, x1, y1), in pixels."""
    x0, y0, x1, y1 = (float(v) for v in box)
    side = max(1, int(round(max(x1 - x0, y1 - y0) * (1 + 2 * margin))))
    left = int(round((x0 + x1) / 2 - side / 2))
    top = int(round((y0 + y1) / 2 - side / 2))
    return left, top, side


def crop_to_source(points: np.ndarray, affine: np.ndarray) -> np.ndarray:
    """Map (N, 2) crop-pixel points back to source-image pixels with the stored ``crop_affine``."""
    scale, shift = affine[:, :2], affine[:, 2]
    return (points - shift) @ np.linalg.inv(scale).T


class CropFace(Op):
    """Replace ``image`` by a ``size`` x ``size`` crop around ``box`` and add ``crop_affine``
    (2 x 3, source pixels -> crop pixels); ``landmarks5`` is moved into crop pixels.

    Points use the pixel-centre convention (pixel ``i`` spans ``[i - 0.5, i + 0.5]``).

    Args:
        size: side of the stored crop in pixels.
        margin: fraction of the face box added on each side (0.3 = the classic 30% margin).
    """

    name = "crop_face"
    version = "1"

    def __init__(self, *, size: int = 224, margin: float = 0.3) -> None:
        if size < 16:
            raise ValueError(f"size must be at least 16 pixels, not {size}")
        if not 0.0 <= margin <= 2.0:
            raise ValueError(f"margin must be between 0 and 2 (a fraction of the face box), not {margin}")
        self.size = int(size)
        self.margin = float(margin)

    @property
    def params(self) -> dict[str, Any]:
        return {"size": self.size, "margin": self.margin}

    def setup(self) -> None:
        cv2.setNumThreads(1)

    def __call__(self, sample: Sample) -> Sample:
        image = sample["image"]
        height, width = image.shape[:2]
        left, top, side = square_window(sample["box"], self.margin)
        window = np.zeros((side, side, 3), dtype=np.uint8)
        sx0, sy0 = max(left, 0), max(top, 0)
        sx1, sy1 = min(left + side, width), min(top + side, height)
        if sx1 > sx0 and sy1 > sy0:
            window[sy0 - top: sy1 - top, sx0 - left: sx1 - left] = image[sy0:sy1, sx0:sx1]
        shrinking = side > self.size
        crop = cv2.resize(window, (self.size, self.size),
                          interpolation=cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR)
        k = self.size / side
        # Pixel centres: source pixel (left + i) maps to crop coordinate (i + 0.5) * k - 0.5.
        affine = np.array([[k, 0.0, (0.5 - left) * k - 0.5],
                           [0.0, k, (0.5 - top) * k - 0.5]], dtype=np.float32)
        out = dict(sample, image=crop, crop_affine=affine)
        if "landmarks5" in sample:
            points = np.asarray(sample["landmarks5"], dtype=np.float32)
            out["landmarks5"] = (points @ affine[:, :2].T + affine[:, 2]).astype(np.float32)
        return out
