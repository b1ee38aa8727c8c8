"""What the cached face columns mean, shared by stage 1 (which writes them) and stage 2 (which
augments and draws them) without importing any model.

Columns of a face cache (all coordinates are crop pixels, x then y, float32):

- ``landmarks5`` (5, 2): MTCNN's points in ``LANDMARKS5`` order. "image_left" is the point with
  the smaller x in an upright face (the subject's right eye), as MTCNN reports them.
- ``mesh`` (468, 2): MediaPipe face-mesh points. MediaPipe names sides from the subject's view:
  its ``left_eye`` is the subject's left eye, on the image's right. NaN where ``has_mesh`` is False.
- ``regions`` (R, K, 2) and ``region_sizes`` (R,): one convex hull per name in ``REGIONS``, padded
  to ``K`` vertices by repeating the last vertex (so drawing all K vertices draws the same
  polygon); ``region_sizes`` gives the true vertex count, 0 where the mesh is missing.
"""

from __future__ import annotations

import cv2
import numpy as np

from precache.faces.topology_data import MESH_FLIP as _MESH_FLIP
from precache.faces.topology_data import MESH_REGIONS

__all__ = ["LANDMARKS5", "LANDMARKS5_FLIP", "MESH_POINTS", "MESH_FLIP", "REGIONS", "REGION_FLIP",
           "MESH_REGIONS", "HULL_VERTICES", "region_hulls", "region_mask", "region_box"]

LANDMARKS5 = ("eye_image_left", "eye_image_right", "nose", "mouth_image_left", "mouth_image_right")
LANDMARKS5_FLIP = np.array([1, 0, 2, 4, 3])
"""After a horizontal flip, new point ``i`` is old point ``LANDMARKS5_FLIP[i]`` (mirrored)."""

MESH_POINTS = 468
MESH_FLIP = np.asarray(_MESH_FLIP, dtype=np.int64)
"""After a horizontal flip, new mesh point ``i`` is old point ``MESH_FLIP[i]`` (mirrored)."""

REGIONS = tuple(MESH_REGIONS)
_SWAPS = {"left_eye": "right_eye", "left_brow": "right_brow"}
_SWAPS.update({right: left for left, right in _SWAPS.items()})
REGION_FLIP = np.array([REGIONS.index(_SWAPS.get(name, name)) for name in REGIONS])
"""After a horizontal flip, new region ``i`` is old region ``REGION_FLIP[i]`` (mirrored)."""

HULL_VERTICES = max(len(indices) for indices in MESH_REGIONS.values())
"""K: a region's hull has at most as many vertices as the region has mesh points."""


def region_hulls(mesh: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Convex hull of each region of a (468, 2) mesh: ``(regions (R, K, 2), sizes (R,))``."""
    regions = np.full((len(REGIONS), HULL_VERTICES, 2), np.nan, dtype=np.float32)
    sizes = np.zeros(len(REGIONS), dtype=np.int16)
    if not np.isfinite(mesh).all():
        return regions, sizes
    for r, name in enumerate(REGIONS):
        hull = cv2.convexHull(mesh[MESH_REGIONS[name]].astype(np.float32))[:, 0]
        regions[r, : len(hull)] = hull
        regions[r, len(hull):] = hull[-1]
        sizes[r] = len(hull)
    return regions, sizes


def region_mask(regions: np.ndarray, sizes: np.ndarray, names: str | tuple[str, ...],
                shape: tuple[int, int]) -> np.ndarray:
    """A uint8 mask (255 inside) of the named regions, rasterised at ``shape`` (height, width)."""
    mask = np.zeros(shape, dtype=np.uint8)
    for name in (names,) if isinstance(names, str) else names:
        r = REGIONS.index(name)
        if sizes[r] >= 3:
            polygon = np.round(regions[r, : sizes[r]] * 16).astype(np.int32)  # 4 fractional bits
            cv2.fillPoly(mask, [polygon], 255, lineType=cv2.LINE_8, shift=4)
    return mask


def region_box(regions: np.ndarray, sizes: np.ndarray, name: str) -> np.ndarray | None:
    """The region's axis-aligned box (x0, y0, x1, y1) in crop pixels, or None if it is missing."""
    r = REGIONS.index(name)
    if sizes[r] == 0:
        return None
    points = regions[r, : sizes[r]]
    return np.concatenate([points.min(axis=0), points.max(axis=0)])
