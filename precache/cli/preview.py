"""Contact sheets of a face cache: crops with their 5 landmarks, mesh and region outlines drawn,
and the same samples after ``FaceAugment``, to see with one's own eyes what training will get."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import cv2
import numpy as np

from precache.cache import Cache
from precache.faces.topology import REGIONS
from precache.loading.datasets.cached import CachedDataset

__all__ = ["draw_face", "contact_sheet", "write_previews", "FACE_COLUMNS"]

FACE_COLUMNS = ("key", "image", "landmarks5", "mesh", "has_mesh", "regions", "region_sizes")

# RGB colours: one per region, one per 5-point landmark.
REGION_COLOURS = {"face_oval": (255, 255, 255), "left_eye": (0, 200, 255), "right_eye": (0, 255, 120),
                  "left_brow": (0, 120, 255), "right_brow": (0, 160, 60), "nose": (255, 200, 0),
                  "mouth": (255, 60, 60)}
LANDMARK_COLOURS = ((255, 0, 0), (0, 255, 0), (255, 255, 0), (255, 0, 255), (0, 255, 255))


def draw_face(sample: dict[str, Any], scale: int = 2) -> np.ndarray:
    """The crop enlarged ``scale`` times with region outlines, mesh points and 5 landmarks."""
    image = np.ascontiguousarray(sample["image"])
    size = image.shape[0] * scale
    canvas = cv2.resize(image, (size, size), interpolation=cv2.INTER_NEAREST)

    def at(points: np.ndarray) -> np.ndarray:
        return np.round((np.asarray(points, dtype=np.float64) + 0.5) * scale * 16 - 8).astype(np.int32)

    if "regions" in sample and "region_sizes" in sample:
        for r, name in enumerate(REGIONS):
            n = int(sample["region_sizes"][r])
            if n >= 3:
                cv2.polylines(canvas, [at(sample["regions"][r, :n])], True, REGION_COLOURS[name], 1,
                              cv2.LINE_AA, shift=4)
    mesh = sample.get("mesh")
    if mesh is not None and np.isfinite(mesh).all():
        for point in at(mesh):
            cv2.circle(canvas, tuple(int(v) for v in point), 8, (200, 200, 200), -1, cv2.LINE_AA, shift=4)
    if "landmarks5" in sample:
        for point, colour in zip(at(sample["landmarks5"]), LANDMARK_COLOURS):
            cv2.circle(canvas, tuple(int(v) for v in point), 3 * 16, colour, -1, cv2.LINE_AA, shift=4)
    return canvas


def contact_sheet(tiles: list[np.ndarray], columns: int, gap: int = 4) -> np.ndarray:
    """Tiles (same size) in a grid on a dark background."""
    rows = -(-len(tiles) // columns)
    th, tw = tiles[0].shape[:2]
    sheet = np.full((rows * (th + gap) + gap, columns * (tw + gap) + gap, 3), 32, dtype=np.uint8)
    for i, tile in enumerate(tiles):
        y, x = gap + (i // columns) * (th + gap), gap + (i % columns) * (tw + gap)
        sheet[y: y + th, x: x + tw] = tile
    return sheet


def write_previews(cache_path: str | os.PathLike[str], output: str | os.PathLike[str], n: int = 64,
                   scale: int = 2, augment: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                   ) -> list[Path]:
    """Write the sheet of ``n`` samples spread evenly over the cache to ``output`` and, if
    ``augment`` is given, the same samples after it to ``<output stem>_augmented<suffix>``.

    Raises:
        ValueError: the cache has no ``image`` column or no rows.
    """
    cache = Cache(cache_path)
    if "image" not in cache.manifest.schema:
        raise ValueError(f"{cache_path}: the cache has no 'image' column to preview")
    total = len(cache)
    if total == 0:
        raise ValueError(f"{cache_path}: the cache has no rows to preview")
    rows = sorted({int(r) for r in np.linspace(0, total - 1, min(n, total))})
    wanted = [c for c in FACE_COLUMNS if c in cache.manifest.schema]
    samples = CachedDataset(cache_path, columns=wanted, resident=False).__getitems__(rows)
    columns = max(1, int(np.ceil(np.sqrt(len(samples)))))
    output = Path(output)
    sheets = [(output, [draw_face(s, scale) for s in samples])]
    if augment is not None:
        augmented = [draw_face(augment(s), scale) for s in samples]
        sheets.append((output.with_name(f"{output.stem}_augmented{output.suffix}"), augmented))
    written = []
    for path, tiles in sheets:
        path.parent.mkdir(parents=True, exist_ok=True)
        sheet = contact_sheet(tiles, columns)
        quality = [cv2.IMWRITE_JPEG_QUALITY, 85] if path.suffix.lower() in (".jpg", ".jpeg") else []
        if not cv2.imwrite(str(path), cv2.cvtColor(sheet, cv2.COLOR_RGB2BGR), quality):
            raise ValueError(f"could not write {path}: use a .png or .jpg file name")
        written.append(path)
    return written
