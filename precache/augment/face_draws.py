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

__all__ = ["FaceDraws", "draw_face", "draw_layout", "geometry_matrices", "colour_matrices", "hole_boxes",
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


def draw_face(rng: np.random.Generator, n: int, p: dict[str, Any],
              layout: tuple[Any, ...] | None = None) -> FaceDraws:
    """Draw ``n`` samples' parameters from ``rng`` (two calls) with ``FaceAugment``'s ``p``.

    One uniform matrix: the flag columns are compared with their probabilities, every other
    column is scaled into its range, in one expression each (a few microseconds for one sample).
    ``layout`` is ``draw_layout(p)``, which a caller drawing often keeps.
    """
    lo, hi, flag_columns, probabilities = layout or draw_layout(p)
    u = rng.random((n, len(lo)))
    seeds = rng.integers(0, 2**63 - 1, n, dtype=np.int64)
    v = lo + (hi - lo) * u
    flags = u[:, flag_columns] < probabilities
    max_holes = int(p["cutout_holes"][1])
    count = np.minimum(np.floor(v[:, 32]), max_holes)
    return FaceDraws(
        region_on=flags[:, 0:3], region_pick=v[:, 3:6], region_gain=v[:, 6:9],
        region_bias=v[:, 9:12], region_sigma=v[:, 12], occlude_noise=flags[:, 3],
        occlude_colour=v[:, 14:17].astype(np.uint8), noise_seed=seeds,
        flip=flags[:, 4], affine=flags[:, 5], zoom=v[:, 19], angle=v[:, 20], shift=v[:, 21:23],
        color=flags[:, 6], contrast=v[:, 24], brightness=v[:, 25],
        hue_sat=flags[:, 7], hue=v[:, 27], saturation=v[:, 28],
        blur=flags[:, 8], blur_sigma=v[:, 30],
        hole_on=flags[:, 9:10] & (np.arange(max_holes) < count[:, None]),
        holes=v[:, 33:].reshape(n, max_holes, 4))


def draw_layout(p: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, list[int], np.ndarray]:
    """Each uniform column's range (``lo``, ``hi``), and which columns are flags, with their
    probabilities; a flag column's range is unused."""
    rc, turn = p["region_color"], math.radians(p["rotate"])
    ranges = [(0, 1)] * 6 + [(1 - rc, 1 + rc)] * 3 + [(-64 * rc, 64 * rc)] * 3 + [
        p["region_blur_sigma"], (0, 1), (0, 256), (0, 256), (0, 256), (0, 1), (0, 1), p["scale"],
        (-turn, turn), (-p["shift"], p["shift"]), (-p["shift"], p["shift"]), (0, 1),
        (1 - p["contrast"], 1 + p["contrast"]), (-p["brightness"], p["brightness"]), (0, 1),
        (-p["hue"], p["hue"]), (1 - p["saturation"], 1 + p["saturation"]), (0, 1),
        p["blur_sigma"], (0, 1), (p["cutout_holes"][0], p["cutout_holes"][1] + 1)]
    ranges += [p["cutout_size"], p["cutout_size"], (0, 1), (0, 1)] * int(p["cutout_holes"][1])
    lo, hi = np.array(ranges, dtype=np.float64).T
    flag_columns = [0, 1, 2, 13, 17, 18, 23, 26, 29, 31]
    probabilities = np.array([p["region_color_p"], p["region_blur_p"], p["occlude_p"], 0.5,
                              p["flip_p"], p["affine_p"], p["color_p"], p["color_p"] / 2,
                              p["blur_p"], p["cutout_p"]])
    return lo, hi, flag_columns, probabilities


def geometry_matrices(draws: FaceDraws, width: int, height: int) -> np.ndarray:
    """(n, 2, 3) float32 source -> output matrices: identity where neither flip nor affine.

    Pixel centres sit at integers, so a flip maps x to ``width - 1 - x`` and the affine turns
    and scales about ``((width - 1) / 2, (height - 1) / 2)``: x' = R (F (x - c)) + c + shift.
    """
    centre = np.array([(width - 1) / 2, (height - 1) / 2])
    mirror = 1.0 - 2.0 * draws.flip
    zoom = np.where(draws.affine, draws.zoom, 1.0)
    angle = draws.angle * draws.affine
    cos, sin = zoom * np.cos(angle), zoom * np.sin(angle)
    matrix = np.empty((len(draws), 2, 3))
    matrix[:, 0, 0], matrix[:, 0, 1] = cos * mirror, sin
    matrix[:, 1, 0], matrix[:, 1, 1] = -sin * mirror, cos
    shift = draws.shift * draws.affine[:, None] * [width, height]
    matrix[:, :, 2] = centre + shift - matrix[:, :, :2] @ centre
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
