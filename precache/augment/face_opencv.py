"""The CPU form of ``FaceAugment``: OpenCV on each uint8 crop, in one loop over the batch.

Measured on this 2-core machine (one thread, 128 px, batch 256; ``tests/benchmarks/
bench_augment.py``), OpenCV per sample beat every batched float form on the CPU: its uint8 warp
is ~9x faster than torch's ``affine_grid`` + ``grid_sample`` over the batch, a colour matrix
(``cv2.transform``) ~50x faster than a batched ``baddbmm``, and kornia's float ops were slower
still. So the batch is augmented sample by sample with every step of a sample done while its
crop is in cache; what is vectorised is everything around the kernels: the draws, the matrices,
the region picks and all point sets (one expression for the whole batch).
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import cv2
import numpy as np

from precache.augment.face_draws import (FaceDraws, colour_matrices, geometry_matrices,
                                         hole_boxes)
from precache.faces import topology

__all__ = ["apply_opencv", "region_picks", "move_points", "occlusion_noise"]

POINT_KEYS = ("landmarks5", "mesh", "regions")  # the point sets a warp moves
FLIPS = {"landmarks5": topology.LANDMARKS5_FLIP, "mesh": topology.MESH_FLIP,
         "regions": topology.REGION_FLIP, "region_sizes": topology.REGION_FLIP}


OFF_DIAGONAL = 1e-5
"""Added to every colour matrix's red-from-green term (below 1/300 of a grey level). For a
diagonal matrix ``cv2.transform`` takes an exact but scalar path (30-44 us a 128 px crop); for any
other its vectorised fixed-point one (7 us), which full hue/saturation matrices already take and
which rounds 3% of pixels one grey level differently from exact arithmetic."""

_OPENCV_PINNED = [0]  # the pid of the process whose OpenCV was set to one thread


def _one_opencv_thread() -> None:
    """Set OpenCV to one thread in this process, once, before its first call here: a 128 px
    crop is too small for OpenCV's own pool to pay, and the parallelism comes from the loader's
    threads or processes (a pool that did start is also stopped before every fork:
    ``precache.threads.guard_opencv_forks``)."""
    if _OPENCV_PINNED[0] != os.getpid():
        _OPENCV_PINNED[0] = os.getpid()
        cv2.setNumThreads(1)


def apply_opencv(batch: dict[str, Any], draws: FaceDraws,
                 region_rows: Sequence[int]) -> dict[str, Any]:
    """Augment a batch of NumPy arrays (``image`` (n, H, W, 3) uint8); returns a new dict."""
    _one_opencv_thread()
    images = batch["image"]
    n, height, width = images.shape[:3]
    matrices = geometry_matrices(draws, width, height)
    coloured, holed = draws.color | draws.hue_sat, draws.hole_on.any(axis=1)
    colours = colour_matrices(draws) if coloured.any() else None
    if colours is not None:
        colours[:, 0, 1] += OFF_DIAGONAL
    holes = hole_boxes(draws, width, height) if holed.any() else None
    picks = region_picks(batch, draws, region_rows)
    flags = np.stack([draws.affine, draws.flip, coloured, draws.blur, holed,
                      (picks >= 0).any(axis=1)], axis=1).tolist()
    out = np.empty_like(images)
    # The crop a region step edits or a warp reads, copied in order first: a rotated warp reads
    # its source across rows, and from the CPU's cache it takes ~55 us at 128 px, not ~75 us.
    scratch = np.empty_like(images[0]) if n else None
    for i, (affine, flip, colour, blur, cutout, regional) in enumerate(flags):
        image, dst = images[i], out[i]
        if regional or affine:
            np.copyto(scratch, image)
            image = scratch
        if regional:
            _edit_regions(image, batch["regions"][i], picks[i], draws, i)
        if affine:
            cv2.warpAffine(image, matrices[i], (width, height), dst=dst, flags=cv2.INTER_LINEAR,
                           borderMode=cv2.BORDER_CONSTANT, borderValue=(0, 0, 0))
        elif flip:
            cv2.flip(image, 1, dst=dst)  # 17x faster than NumPy's reversed copy here
        else:
            np.copyto(dst, image)
        if colour:
            cv2.transform(dst, colours[i], dst=dst)
        if blur:
            sigma = float(draws.blur_sigma[i])
            size = 2 * math.ceil(3 * sigma) + 1
            cv2.GaussianBlur(dst, (size, size), sigma, dst=dst)
        if cutout:
            for y0, x0, y1, x1 in holes[i].tolist():
                dst[y0:y1, x0:x1] = 0
    result = dict(batch)
    result["image"] = out
    result.update(move_points(batch, matrices, draws.flip))
    return result


def region_picks(batch: dict[str, Any], draws: FaceDraws,
                 region_rows: Sequence[int]) -> np.ndarray:
    """(n, 3) row in ``topology.REGIONS`` each region step edits, -1 where it does not run: a
    step picks among the configured regions the sample has (a hull of 3 points or more)."""
    n = len(draws)
    if (batch.get("regions") is None or batch.get("region_sizes") is None or not region_rows
            or not draws.region_on.any()):
        return np.full((n, 3), -1)
    has_mesh = np.asarray(batch.get("has_mesh", np.ones(n, bool)), bool).reshape(n)
    present = (np.asarray(batch["region_sizes"])[:, list(region_rows)] >= 3) & has_mesh[:, None]
    count = present.sum(axis=1)[:, None]
    k = np.minimum(np.floor(draws.region_pick * count), count - 1)  # (n, 3)
    which = (np.cumsum(present, axis=1)[:, None, :] > k[:, :, None]).argmax(axis=2)
    return np.where(draws.region_on & (count > 0), np.asarray(region_rows)[which], -1)


def move_points(batch: dict[str, Any], matrices: np.ndarray, flip: np.ndarray,
                ) -> dict[str, np.ndarray]:
    """Every point set of the batch through its sample's matrix (one stacked product per set),
    then re-indexed where flipped, so that names keep meaning the same side of the face."""
    out: dict[str, np.ndarray] = {}
    n = len(matrices)
    m = matrices.astype(np.float32, copy=False)[:, :, :, None]  # (n, 2, 3, 1) against (n, points)
    flipped = flip.any()
    for key in (*POINT_KEYS, "region_sizes"):
        if batch.get(key) is None:
            continue
        values = np.asarray(batch[key])
        if key != "region_sizes":
            points = values.astype(np.float32, copy=False).reshape(n, -1, 2)
            x, y = points[:, :, 0], points[:, :, 1]
            moved = np.empty_like(points)  # elementwise: 4x faster than a stacked (2 x 2) matmul
            moved[:, :, 0] = x * m[:, 0, 0] + y * m[:, 0, 1] + m[:, 0, 2]
            moved[:, :, 1] = x * m[:, 1, 0] + y * m[:, 1, 1] + m[:, 1, 2]
            values = moved.reshape(values.shape)
        elif flipped:
            values = values.copy()
        if flipped:
            values[flip] = values[flip][:, FLIPS[key]]
        out[key] = values
    return out


def occlusion_noise(seed: int, height: int, width: int) -> np.ndarray:
    """The uniform noise an occlusion fills with, from its drawn seed (the same in both forms)."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _edit_regions(image: np.ndarray, regions: np.ndarray, picks: np.ndarray, draws: FaceDraws,
                  i: int) -> None:
    """The region steps of sample ``i``, in place, each on its region's box only."""
    for step, row in enumerate(picks.tolist()):
        if row < 0:
            continue
        margin = 0
        if step == 1:
            sigma = float(draws.region_sigma[i])
            margin = math.ceil(3 * sigma)
        box = _box(regions[row], image.shape, margin)
        if box is None:
            continue
        x0, y0, x1, y1 = box
        crop = image[y0:y1, x0:x1]
        polygon = regions[row] - np.array([x0, y0], dtype=np.float32)
        mask = np.zeros(crop.shape[:2], np.uint8)
        cv2.fillPoly(mask, [np.round(polygon * 16).astype(np.int32)], 255, lineType=cv2.LINE_8,
                     shift=4)  # as topology.region_mask; the padded vertices repeat the last
        if step == 0:
            matrix = np.zeros((3, 4), np.float32)
            matrix[[0, 1, 2], [0, 1, 2]] = draws.region_gain[i]
            matrix[:, 3] = draws.region_bias[i]
            matrix[0, 1] = OFF_DIAGONAL
            edited = cv2.transform(crop, matrix)
        elif step == 1:
            edited = cv2.GaussianBlur(crop, (2 * margin + 1,) * 2, sigma)
        elif draws.occlude_noise[i]:
            height, width = image.shape[:2]
            edited = occlusion_noise(int(draws.noise_seed[i]), height, width)[y0:y1, x0:x1]
        else:
            edited = np.broadcast_to(draws.occlude_colour[i], crop.shape)
        np.copyto(crop, edited, where=mask[:, :, None] > 0)


def _box(polygon: np.ndarray, shape: tuple[int, ...], margin: int,
         ) -> tuple[int, int, int, int] | None:
    """The polygon's pixel box grown by ``margin`` and clipped to the image (None: empty)."""
    low, high = polygon.min(axis=0), polygon.max(axis=0)
    height, width = shape[:2]
    x0, y0 = max(math.floor(low[0]) - margin, 0), max(math.floor(low[1]) - margin, 0)
    x1 = min(math.ceil(high[0]) + 1 + margin, width)
    y1 = min(math.ceil(high[1]) + 1 + margin, height)
    return None if x1 <= x0 or y1 <= y0 else (x0, y0, x1, y1)
