"""Stage-2 face augmentation: region edits from the cached hulls, one keypoint-aware warp,
then Albumentations' photometric steps.

Runs on one cached face sample (``image`` plus any of ``landmarks5``, ``mesh``, ``has_mesh``,
``regions``, ``region_sizes``; see ``precache.faces.topology``) inside DataLoader workers.
Flip, scale, rotation and shift are composed into one 2 x 3 matrix: one ``cv2.warpAffine`` moves
the pixels and one matrix product moves every point, so image and points always agree, and a
flip re-indexes the points so that names keep meaning the same side of the face. (Albumentations'
own ``Affine`` cost ~400 us per 128 px sample here, 7x the warp itself: the largest cost of a
cached epoch.) Colour, blur and cutout move no point and stay Albumentations transforms.
"""

from __future__ import annotations

import math
import os
import random
from typing import Any, Callable

import albumentations as A
import cv2
import numpy as np
import torch.utils.data

from precache.faces import topology

__all__ = ["FaceAugment"]

_POINT_KEYS = ("landmarks5", "mesh", "regions")  # the point sets a warp moves
_FLIPS = {"landmarks5": topology.LANDMARKS5_FLIP, "mesh": topology.MESH_FLIP,
          "regions": topology.REGION_FLIP, "region_sizes": topology.REGION_FLIP}


class FaceAugment:
    """Augment a cached face sample: ``sample -> new sample``; the input is not modified.

    Region steps (on the crop, before geometry) each pick one of ``regions`` that has a hull and
    edit only the pixels inside its mask. Then one warp (flip and affine) moves pixels and points
    together; points use the pixel-centre convention of stage 1 and Albumentations (pixel ``i``
    has its centre at ``i``, so a flip maps x to ``width - 1 - x``). Points that leave the crop are
    kept; NaN points stay NaN. Last, Albumentations' colour, blur and cutout steps.

    The generator is reseeded on the first call in each process: from the DataLoader worker's
    seed in a worker (so workers differ, and ``torch.manual_seed`` makes runs repeatable), from
    ``seed`` in the process that built the object, and from ``seed`` and the pid elsewhere.

    ``same(samples)`` augments several samples with one random draw (the frames of a clip, or a
    real/fake pair), so they move and change alike.

    Args:
        flip_p (float): probability of a horizontal flip. Default: ``0.5``.
        affine_p (float): probability of the affine step. Default: ``0.7``.
        scale (tuple[float, float]): zoom range of the affine step (same on both axes).
            Default: ``(0.9, 1.1)``.
        rotate (float): rotation limit in degrees (uniform in ``±rotate``). Default: ``15.0``.
        shift (float): translation limit, a fraction of the size per axis. Default: ``0.05``.
        color_p (float): probability of ``RandomBrightnessContrast``; ``HueSaturationValue`` runs
            with half of it. Default: ``0.5``.
        brightness (float): brightness limit (fraction of the range). Default: ``0.2``.
        contrast (float): contrast limit. Default: ``0.2``.
        saturation (float): saturation shift limit (fraction of the range). Default: ``0.2``.
        hue (float): hue shift limit (fraction of the hue circle). Default: ``0.03``.
        blur_p (float): probability of a Gaussian blur. Default: ``0.1``.
        blur_sigma (tuple[float, float]): its sigma range in pixels. Default: ``(0.5, 1.5)``.
        cutout_p (float): probability of ``CoarseDropout``. Default: ``0.2``.
        cutout_holes (tuple[int, int]): number of holes. Default: ``(1, 2)``.
        cutout_size (tuple[float, float]): hole side, a fraction of the size.
            Default: ``(0.1, 0.25)``.
        region_color_p (float): probability of a colour change inside one region. Default: ``0.2``.
        region_color (float): its per-channel gain limit; the bias limit is ``64 * region_color``.
            Default: ``0.3``.
        region_blur_p (float): probability of blurring one region. Default: ``0.1``.
        region_blur_sigma (tuple[float, float]): its sigma range in pixels. Default: ``(1.0, 2.5)``.
        occlude_p (float): probability of filling one region with a random colour (or, half the
            time, uniform noise). Default: ``0.05``.
        regions (tuple[str, ...]): names from ``topology.REGIONS`` the region steps pick from.
            Default: ``("left_eye", "right_eye", "mouth")``.
        seed (int, optional): seed in the building process (reproducible there). Default: ``None``.
    """

    def __init__(
        self,
        *,
        flip_p: float = 0.5,
        affine_p: float = 0.7,
        scale: tuple[float, float] = (0.9, 1.1),
        rotate: float = 15.0,
        shift: float = 0.05,
        color_p: float = 0.5,
        brightness: float = 0.2,
        contrast: float = 0.2,
        saturation: float = 0.2,
        hue: float = 0.03,
        blur_p: float = 0.1,
        blur_sigma: tuple[float, float] = (0.5, 1.5),
        cutout_p: float = 0.2,
        cutout_holes: tuple[int, int] = (1, 2),
        cutout_size: tuple[float, float] = (0.1, 0.25),
        region_color_p: float = 0.2,
        region_color: float = 0.3,
        region_blur_p: float = 0.1,
        region_blur_sigma: tuple[float, float] = (1.0, 2.5),
        occlude_p: float = 0.05,
        regions: tuple[str, ...] = ("left_eye", "right_eye", "mouth"),
        seed: int | None = None,
    ) -> None:
        self.params: dict[str, Any] = {k: v for k, v in locals().items() if k != "self"}
        self.params["regions"] = tuple(regions)
        unknown = set(regions) - set(topology.REGIONS)
        if unknown:
            raise ValueError(f"unknown regions {sorted(unknown)}; known: {topology.REGIONS}")
        self._region_rows = [topology.REGIONS.index(name) for name in regions]
        steps = [
            A.RandomBrightnessContrast(brightness_limit=brightness, contrast_limit=contrast,
                                       p=color_p),
            A.HueSaturationValue(hue_shift_limit=round(hue * 180), sat_shift_limit=round(saturation * 255),
                                 val_shift_limit=0, p=color_p / 2),
            A.GaussianBlur(blur_limit=0, sigma_limit=blur_sigma, p=blur_p),
            A.CoarseDropout(num_holes_range=cutout_holes, hole_height_range=cutout_size,
                            hole_width_range=cutout_size, fill=0, p=cutout_p),
        ]
        self._compose = A.Compose(steps)
        self._owner_pid = os.getpid()
        self._seeded_pid: int | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.params.items())})"

    def __getstate__(self) -> dict[str, Any]:
        # Rebuild the Compose on unpickling rather than ship its RNG state to spawned workers.
        return {"params": self.params, "owner_pid": self._owner_pid}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state["params"])  # type: ignore[misc]
        self._owner_pid = state["owner_pid"]

    def _reseed_if_new_process(self) -> None:
        """Give each process its own stream; a forked copy would repeat its parent's otherwise."""
        pid = os.getpid()
        if pid == self._seeded_pid:
            return
        seed = self.params["seed"]
        info = torch.utils.data.get_worker_info()
        if info is not None:
            entropy: Any = info.seed if seed is None else [seed, info.seed]
        elif pid == self._owner_pid:
            entropy = seed
        else:
            entropy = None if seed is None else [seed, pid]
        sequence = np.random.SeedSequence(entropy)
        self._compose.set_random_state(np.random.default_rng(sequence),
                                       random.Random(int(sequence.generate_state(1)[0])))
        self._seeded_pid = pid

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        """Return an augmented copy of ``sample``; keys other than the face columns pass through."""
        self._reseed_if_new_process()
        rng = self._compose.random_generator
        return self._augment(sample, rng, rng)

    def same(self, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Augment every sample with ONE random draw: the same flip, affine, colour, blur, cutout
        and region choices for all; returns the augmented copies in order.

        For the frames of a clip (``ClipDataset`` calls it once per clip), or a real/fake pair
        requested together, which must move and change alike. One seed is drawn from this
        augment's stream (which advances by that one draw, so successive calls differ); before
        each sample every random source the steps use (the region steps' and the warp's NumPy
        generators, and the Albumentations ``Compose``'s NumPy and Python generators, which its
        steps share) is reseeded from it, then put back. Samples of the same size therefore get
        identical draws (Albumentations' cutout holes are fractions of the size). Each phase
        (regions, warp, Albumentations) has its own generator, so what one sample's region step
        consumes cannot shift another phase's draws.

        A region step picks among the configured regions present in each sample (a hull of at
        least 3 points), so a region missing from one frame may change that frame's pick (and
        a sample without a mesh skips the region steps); with the same regions present, every
        sample edits the same region with the same parameters (each at its own hull).
        """
        self._reseed_if_new_process()
        compose = self._compose
        generator, py_random = compose.random_generator, compose.py_random
        seed = int(generator.integers(2**63))
        out = []
        try:
            for sample in samples:
                compose.set_random_state(np.random.default_rng([seed, 2]), random.Random(seed))
                out.append(self._augment(sample, np.random.default_rng([seed, 0]),
                                         np.random.default_rng([seed, 1])))
        finally:
            compose.set_random_state(generator, py_random)
        return out

    def _augment(self, sample: dict[str, Any], region_rng: np.random.Generator,
                 geometry_rng: np.random.Generator) -> dict[str, Any]:
        """One sample: region steps (``region_rng``), the warp (``geometry_rng``), then the
        Albumentations steps (the ``Compose``'s own generators)."""
        out = dict(sample)
        image = self._augment_regions(sample, region_rng)
        matrix, flipped = self._draw_geometry(image.shape[1], image.shape[0], geometry_rng)
        if matrix is not None:
            image = cv2.warpAffine(image, matrix, (image.shape[1], image.shape[0]),
                                   flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT,
                                   borderValue=(0, 0, 0))
            for key in _POINT_KEYS:
                if sample.get(key) is not None:
                    points = np.asarray(sample[key], dtype=np.float32)
                    out[key] = (points @ matrix[:, :2].T + matrix[:, 2]).astype(np.float32)
        if flipped:
            for key in ("landmarks5", "mesh", "regions", "region_sizes"):
                if sample.get(key) is not None:
                    out[key] = np.asarray(out[key])[_FLIPS[key]]
        out["image"] = self._compose(image=image)["image"]
        if np.may_share_memory(out["image"], sample["image"]):
            out["image"] = out["image"].copy()
        return out

    def _draw_geometry(self, width: int, height: int, rng: np.random.Generator | None = None,
                       ) -> tuple[np.ndarray | None, bool]:
        """The 2 x 3 source -> output matrix of this call's flip and affine (None: neither),
        drawn from ``rng`` (default: the ``Compose``'s generator).

        Pixel centres sit at integers, so a flip maps x to ``width - 1 - x`` and the affine turns
        and scales about ``((width - 1) / 2, (height - 1) / 2)``.
        """
        rng = self._compose.random_generator if rng is None else rng
        p = self.params
        flipped = bool(rng.random() < p["flip_p"])
        affine = bool(rng.random() < p["affine_p"])
        if not (flipped or affine):
            return None, False
        cx, cy = (width - 1) / 2, (height - 1) / 2
        mirror = -1.0 if flipped else 1.0
        cos, sin, tx, ty = 1.0, 0.0, cx, cy  # plain floats: a few microseconds, not tens
        if affine:
            zoom = float(rng.uniform(*p["scale"]))
            angle = math.radians(float(rng.uniform(-p["rotate"], p["rotate"])))
            cos, sin = zoom * math.cos(angle), zoom * math.sin(angle)
            shift = rng.uniform(-p["shift"], p["shift"], 2)
            tx, ty = cx + float(shift[0]) * width, cy + float(shift[1]) * height
        # x' = R (F (x - c)) + c + shift, with F the flip and R the scaled rotation.
        matrix = np.array([[cos * mirror, sin, tx - cos * mirror * cx - sin * cy],
                           [-sin * mirror, cos, ty + sin * mirror * cx - cos * cy]],
                          dtype=np.float32)
        return matrix, flipped

    def _augment_regions(self, sample: dict[str, Any],
                         rng: np.random.Generator | None = None) -> np.ndarray:
        """Edit pixels inside one region's hull per step, working only on the region's box
        (draws from ``rng``; default: the ``Compose``'s generator)."""
        image = sample["image"]
        regions, sizes = sample.get("regions"), sample.get("region_sizes")
        rng = self._compose.random_generator if rng is None else rng
        draws = rng.random(3) < [self.params["region_color_p"], self.params["region_blur_p"],
                                 self.params["occlude_p"]]
        if not draws.any() or regions is None or sizes is None or not sample.get("has_mesh", True):
            return image
        present = [r for r in self._region_rows if sizes[r] >= 3]
        if not present:
            return image
        image = image.copy()
        for step in np.flatnonzero(draws):
            name = topology.REGIONS[present[rng.integers(len(present))]]
            if step == 0:
                self._region_color(image, regions, sizes, name, rng)
            elif step == 1:
                self._region_blur(image, regions, sizes, name, rng)
            else:
                self._region_occlude(image, regions, sizes, name, rng)
        return image

    def _region_color(self, image: np.ndarray, regions: np.ndarray, sizes: np.ndarray,
                      name: str, rng: np.random.Generator) -> None:
        limit = self.params["region_color"]
        gain = rng.uniform(1 - limit, 1 + limit, 3).astype(np.float32)
        bias = rng.uniform(-64 * limit, 64 * limit, 3).astype(np.float32)
        _paste(image, regions, sizes, name, 0, lambda crop: crop * gain + bias)

    def _region_blur(self, image: np.ndarray, regions: np.ndarray, sizes: np.ndarray,
                     name: str, rng: np.random.Generator) -> None:
        sigma = rng.uniform(*self.params["region_blur_sigma"])
        _paste(image, regions, sizes, name, int(np.ceil(3 * sigma)),
               lambda crop: cv2.GaussianBlur(crop, (0, 0), sigma))

    def _region_occlude(self, image: np.ndarray, regions: np.ndarray, sizes: np.ndarray,
                        name: str, rng: np.random.Generator) -> None:
        noise = rng.random() < 0.5
        colour = rng.integers(0, 256, 3)
        _paste(image, regions, sizes, name, 0, lambda crop: (
            rng.integers(0, 256, crop.shape) if noise else np.broadcast_to(colour, crop.shape)))


def _paste(image: np.ndarray, regions: np.ndarray, sizes: np.ndarray, name: str, margin: int,
           edit: Callable[[np.ndarray], np.ndarray]) -> None:
    """Apply ``edit`` to the region's box (grown by ``margin`` for context) and keep its result
    inside the region's mask only, in place; rasterising just the box keeps this cheap."""
    box = topology.region_box(regions, sizes, name)
    height, width = image.shape[:2]
    x0, y0 = (max(int(np.floor(v)) - margin, 0) for v in box[:2])
    x1 = min(int(np.ceil(box[2])) + 1 + margin, width)
    y1 = min(int(np.ceil(box[3])) + 1 + margin, height)
    if x1 <= x0 or y1 <= y0:
        return
    offset = np.array([x0, y0], dtype=np.float32)
    mask = topology.region_mask(regions - offset, sizes, name, (y1 - y0, x1 - x0)).astype(bool)
    crop = image[y0:y1, x0:x1]
    edited = np.clip(edit(crop.astype(np.float32)), 0, 255).astype(np.uint8)
    crop[mask] = edited[mask]
