"""The random part of ``FaceAugment``: every per-sample parameter of a batch, drawn at once.

``draw_face`` turns one ``rng.random((n, D))`` call into a ``FaceDraws`` (arrays with a leading
sample dimension); the forms that apply them (``face_opencv``, ``face_torch``) consume no
randomness, so the same draws give the same augmentation whether a batch is augmented whole, one
sample at a time, on the CPU or on a GPU. Sizes are stored as fractions of the crop, so draws do
not depend on the crop's size.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["FaceDraws", "draw_face", "geometry_matrices", "colour_matrices", "hole_boxes",
           "blur_kernel"]

_LUMA = np.array([0.299, 0.587, 0.114])  # the grey a saturation change blends towards
_AXIS = np.ones(3) / math.sqrt(3)  # a hue change turns colours about the grey axis
_CROSS = np.array([[0, -1, 1], [1, 0, -1], [-1, 1, 0]]) / math.sqrt(3)


@dataclass(frozen=True)
class FaceDraws:
    """Per-sample parameters of one batch (index ``i`` is sample ``i``); ``take`` selects samples.

    Region steps (colour, blur, occlusion; column ``j`` of the ``region_*`` arrays) come first,
    then the geometry (flip, then zoom/rotation/shift), then brightness/contrast, hue/saturation,
    blur and cutout. A flag says whether a step runs; its other fields are drawn either way.
    """

    region_on: np.ndarray  # (n, 3) bool: region colour, region blur, occlusion
    region_pick: np.ndarray  # (n, 3) in [0, 1): which of the sample's present regions
    region_gain: np.ndarray  # (n, 3) per channel
    region_bias: np.ndarray  # (n, 3) grey levels
    region_sigma: np.ndarray  # (n,) pixels
    occlude_noise: np.ndarray  # (n,) bool: uniform noise instead of one colour
    occlude_colour: np.ndarray  # (n, 3) uint8
    noise_seed: np.ndarray  # (n,) int64: seeds the occlusion noise
    flip: np.ndarray  # (n,) bool
    affine: np.ndarray  # (n,) bool
    zoom: np.ndarray  # (n,)
    angle: np.ndarray  # (n,) radians
    shift: np.ndarray  # (n, 2) fractions of width, height
    color: np.ndarray  # (n,) bool: brightness/contrast
    contrast: np.ndarray  # (n,) gain
    brightness: np.ndarray  # (n,) offset, a fraction of 255
    hue_sat: np.ndarray  # (n,) bool: hue/saturation
    hue: np.ndarray  # (n,) turn about the grey axis, a fraction of the circle
    saturation: np.ndarray  # (n,) gain of the distance from grey
    blur: np.ndarray  # (n,) bool
    blur_sigma: np.ndarray  # (n,) pixels
    hole_on: np.ndarray  # (n, holes) bool
    holes: np.ndarray  # (n, holes, 4): height, width (fractions of the size), y, x in [0, 1)

    def __len__(self) -> int:
        return len(self.flip)

    def take(self, index: Any) -> FaceDraws:
        """The draws of samples ``index`` (an integer array, a slice or a boolean mask)."""
        if isinstance(index, (int, np.integer)):
            index = [index]
        return FaceDraws(**{f.name: getattr(self, f.name)[index]
                            for f in dataclasses.fields(self)})


def draw_face(rng: np.random.Generator, n: int, p: dict[str, Any]) -> FaceDraws:
    """Draw ``n`` samples' parameters from ``rng`` (two calls) with ``FaceAugment``'s ``p``."""
    max_holes = int(p["cutout_holes"][1])
    u = rng.random((n, 33 + 4 * max_holes))
    seeds = rng.integers(0, 2**63 - 1, n, dtype=np.int64)
    lo, hi = p["cutout_holes"]
    count = lo + np.minimum(np.floor(u[:, 32] * (hi - lo + 1)), hi - lo)
    holes = u[:, 33:].reshape(n, max_holes, 4).copy()
    holes[:, :, :2] = _between(holes[:, :, :2], *p["cutout_size"])
    rc = p["region_color"]
    return FaceDraws(
        region_on=u[:, 0:3] < [p["region_color_p"], p["region_blur_p"], p["occlude_p"]],
        region_pick=u[:, 3:6],
        region_gain=_between(u[:, 6:9], 1 - rc, 1 + rc),
        region_bias=_between(u[:, 9:12], -64 * rc, 64 * rc),
        region_sigma=_between(u[:, 12], *p["region_blur_sigma"]),
        occlude_noise=u[:, 13] < 0.5,
        occlude_colour=np.minimum(u[:, 14:17] * 256, 255).astype(np.uint8),
        noise_seed=seeds,
        flip=u[:, 17] < p["flip_p"],
        affine=u[:, 18] < p["affine_p"],
        zoom=_between(u[:, 19], *p["scale"]),
        angle=np.radians(_between(u[:, 20], -p["rotate"], p["rotate"])),
        shift=_between(u[:, 21:23], -p["shift"], p["shift"]),
        color=u[:, 23] < p["color_p"],
        contrast=_between(u[:, 24], 1 - p["contrast"], 1 + p["contrast"]),
        brightness=_between(u[:, 25], -p["brightness"], p["brightness"]),
        hue_sat=u[:, 26] < p["color_p"] / 2,
        hue=_between(u[:, 27], -p["hue"], p["hue"]),
        saturation=_between(u[:, 28], 1 - p["saturation"], 1 + p["saturation"]),
        blur=u[:, 29] < p["blur_p"],
        blur_sigma=_between(u[:, 30], *p["blur_sigma"]),
        hole_on=(u[:, 31:32] < p["cutout_p"]) & (np.arange(max_holes) < count[:, None]),
        holes=holes,
    )


def _between(u: np.ndarray, lo: float, hi: float) -> np.ndarray:
    return lo + (hi - lo) * u


def geometry_matrices(draws: FaceDraws, width: int, height: int) -> np.ndarray:
    """(n, 2, 3) float32 source -> output matrices: identity where neither flip nor affine.

    Pixel centres sit at integers, so a flip maps x to ``width - 1 - x`` and the affine turns
    and scales about ``((width - 1) / 2, (height - 1) / 2)``: x' = R (F (x - c)) + c + shift.
    """
    cx, cy = (width - 1) / 2, (height - 1) / 2
    mirror = np.where(draws.flip, -1.0, 1.0)
    zoom = np.where(draws.affine, draws.zoom, 1.0)
    angle = np.where(draws.affine, draws.angle, 0.0)
    cos, sin = zoom * np.cos(angle), zoom * np.sin(angle)
    tx = cx + np.where(draws.affine, draws.shift[:, 0], 0.0) * width
    ty = cy + np.where(draws.affine, draws.shift[:, 1], 0.0) * height
    matrix = np.empty((len(draws), 2, 3))
    matrix[:, 0] = np.stack([cos * mirror, sin, tx - cos * mirror * cx - sin * cy], axis=1)
    matrix[:, 1] = np.stack([-sin * mirror, cos, ty + sin * mirror * cx - cos * cy], axis=1)
    return matrix.astype(np.float32)


def colour_matrices(draws: FaceDraws) -> np.ndarray:
    """(n, 3, 4) float32 RGB -> RGB affine maps: brightness/contrast (``contrast * x + 255 *
    brightness``, as Albumentations' ``RandomBrightnessContrast``) after a hue turn about the
    grey axis and a saturation gain about the pixel's luma; identity where neither step runs."""
    theta = 2 * np.pi * np.where(draws.hue_sat, draws.hue, 0.0)
    cos, sin = np.cos(theta)[:, None, None], np.sin(theta)[:, None, None]
    turn = cos * np.eye(3) + sin * _CROSS + (1 - cos) * np.outer(_AXIS, _AXIS)
    s = np.where(draws.hue_sat, draws.saturation, 1.0)[:, None, None]
    grey = s * np.eye(3) + (1 - s) * np.outer(np.ones(3), _LUMA)
    gain = np.where(draws.color, draws.contrast, 1.0)[:, None, None]
    out = np.empty((len(draws), 3, 4))
    out[:, :, :3] = gain * (grey @ turn)
    out[:, :, 3] = (255 * np.where(draws.color, draws.brightness, 0.0))[:, None]
    return out.astype(np.float32)


def hole_boxes(draws: FaceDraws, width: int, height: int) -> np.ndarray:
    """(n, holes, 4) int64 boxes ``y0, x0, y1, x1`` of the cutout holes (empty where off)."""
    h = np.maximum(np.rint(draws.holes[:, :, 0] * height), 1).astype(np.int64)
    w = np.maximum(np.rint(draws.holes[:, :, 1] * width), 1).astype(np.int64)
    y0 = np.floor(draws.holes[:, :, 2] * (height - h + 1)).astype(np.int64)
    x0 = np.floor(draws.holes[:, :, 3] * (width - w + 1)).astype(np.int64)
    boxes = np.stack([y0, x0, y0 + h, x0 + w], axis=-1)
    boxes[~draws.hole_on] = 0
    return boxes


def blur_kernel(sigma: float) -> np.ndarray:
    """The 1-D Gaussian both forms blur with: radius ``ceil(3 sigma)``, normalised (float64)."""
    radius = math.ceil(3 * sigma)
    x = np.arange(-radius, radius + 1)
    kernel = np.exp(-(x**2) / (2 * sigma**2))
    return kernel / kernel.sum()
