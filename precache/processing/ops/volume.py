"""Volume ops: the deterministic part of 3D preprocessing, done once in stage 1.

``DecodeVolume`` (read, reorient to RAS) -> ``Resample`` (to a voxel spacing in mm) ->
``NormaliseIntensity`` (clip to percentiles or a window, scale to 0..1, or keep the values with
``normalise="none"``; store as uint8 / float16 / float32) -> ``CropForeground`` (optional) -> ``FitShape`` (centre pad / crop to a
fixed shape). Every op keeps ``affine`` (voxel index of the stored volume -> world mm) up to
date, so a prediction on the stored grid maps back onto the input's world coordinates; ``spacing``
is the stored voxel size, ``original_shape`` / ``original_spacing`` those of the input.

Resampling follows MONAI's ``Spacing``: the stored spacing is exactly the asked one, the
shape follows (``round(extent / spacing + 1)``), and the grid, shape and affine are MONAI's;
voxels are trilinear with border padding, as three 1D interpolations (``grid_sample`` only for
a sheared input).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import numpy as np

from precache.processing.ops.base import Op, Sample
from precache.processing.ops.labels import Labels
from precache.processing.ops.volume_read import DEFAULT_MAX_VOXELS, check_max_voxels, read_volumes

__all__ = ["VOLUME_EXTENSIONS", "DecodeVolume", "Resample", "NormaliseIntensity",
           "CropForeground", "FitShape", "VolumeLabels", "triple", "VOLUME_DTYPES",
           "NORMALISE_MODES"]

VOLUME_EXTENSIONS = (".nii", ".nii.gz", ".npy", ".npz", ".zip")
"""``.zip``: DICOM series, one archive per series folder (``volume_read._dicom_zip``)."""

VOLUME_DTYPES = ("uint8", "float16", "float32")

NORMALISE_MODES = ("scale", "none")
"""``normalise=``: clip to a window or percentiles and scale to 0..1, or keep the values."""


def triple(value: Any, name: str, kind: type = float) -> tuple:
    """One value or one per axis (``2`` or ``(2, 2, 3)``) as a 3-tuple of ``kind``.

    Raises:
        ValueError: not 1 or 3 values.
    """
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if len(values) == 1:
        values = values * 3
    if len(values) != 3:
        raise ValueError(f"{name} takes one value (a cube / isotropic) or three (one per axis), "
                         f"not {len(values)}: {value!r}")
    return tuple(kind(v) for v in values)


def _spacing(affine: np.ndarray) -> np.ndarray:
    """Voxel size along each axis, in mm: the lengths of the affine's columns."""
    return np.sqrt((affine[:3, :3] ** 2).sum(axis=0)).astype(np.float32)


def _shifted(affine: np.ndarray, start: np.ndarray) -> np.ndarray:
    """The affine of a grid whose voxel 0 is voxel ``start`` (may be negative) of this one."""
    out = affine.copy()
    out[:3, 3] = affine[:3, :3] @ start + affine[:3, 3]
    return out


class VolumeLabels(Labels):
    """``Labels``, except that a row whose input gave its own label (a MedMNIST ``.npz``) keeps it."""

    def __call__(self, sample: Sample) -> Sample:
        if "label" in sample:
            return sample
        return super().__call__(sample)


class DecodeVolume(Op):
    """Read a NIfTI / ``.npy`` / ``.npz`` / DICOM ``.zip`` input (``volume_read.read_volumes``)
    into float32 ``volume`` rows in RAS orientation, with ``affine``, ``spacing``,
    ``original_shape``, ``original_spacing`` and ``split`` (``""`` unless an ``.npz`` split). An
    input holding many volumes gives many rows, keyed ``<file>#<split><n>`` (``.npz``),
    ``<file>#t<n>`` (4D) or ``<file>#<SeriesInstanceUID>`` (every DICOM series).

    Args:
        max_voxels: the most voxels one input may decode to, all its volumes together
            (default 2^29: 2 GiB as float32). A file whose header claims more is a failed input,
            refused before anything is decompressed (a tiny ``.nii.gz`` of zeros can claim
            gigabytes). Part of the fingerprint only when not the default, so caches built
            before the limit existed stay valid.
    """

    name = "decode_volume"
    version = "2"  # 2: an .npz file's integer labels are stored as integers, not text

    def __init__(self, *, max_voxels: int = DEFAULT_MAX_VOXELS) -> None:
        self.max_voxels = check_max_voxels(max_voxels)

    @property
    def params(self) -> dict[str, Any]:
        return {} if self.max_voxels == DEFAULT_MAX_VOXELS else {"max_voxels": self.max_voxels}

    def __call__(self, sample: Sample) -> Sample | list[Sample]:
        records = read_volumes(sample["data"], PurePosixPath(sample["source_key"]).name,
                               self.max_voxels)
        rows = []
        for record in records:
            row = {k: v for k, v in sample.items() if k != "data"}
            if record.part:
                row["key"] = f"{sample['key']}#{record.part}"
            if record.label is not None:
                row["label"] = record.label
            spacing = _spacing(record.affine)
            row.update(volume=record.volume, affine=record.affine, spacing=spacing,
                       original_shape=np.asarray(record.volume.shape, dtype=np.int64),
                       original_spacing=spacing.copy(), split=record.split)
            rows.append(row)
        return rows if len(rows) > 1 or records[0].part else rows[0]


class Resample(Op):
    """Resample ``volume`` to exactly ``spacing`` mm (one value: isotropic; 0 on an axis: keep
    that axis's), as MONAI's ``Spacing`` does (``diagonal=False``, ``scale_extent=False``,
    bilinear, ``padding_mode="border"``).

    The grid keeps the input's axis directions (its rotation; a shear is dropped) with exactly
    the asked voxel size; the shape follows: ``round(extent / spacing + 1)`` voxels along each
    axis, where ``extent`` spans the centres of the input's first and last voxels (``np.round``:
    halves to even, as MONAI). Voxel 0 stays where the input's voxel 0 was, so the extent moves
    by under one new voxel; a voxel past the input's last takes the border value. ``spacing``
    is then the asked one and ``affine`` maps each stored voxel to the world point whose
    (trilinear) input value it holds. ``_spacing_grid`` follows ``monai.data.utils.
    compute_shape_offset`` and ``zoom_affine`` line by line, so shape and affine equal MONAI's.

    Args:
        spacing: target voxel size in mm, one value or one per axis. Default 0 (keep).
    """

    name = "resample"
    version = "2"  # 2: exactly the asked spacing, MONAI's grid (1: align_corners, spacing moved)

    def __init__(self, *, spacing: Any = 0.0) -> None:
        self.spacing = triple(spacing, "spacing")
        if any(s < 0 for s in self.spacing):
            raise ValueError(f"spacing must be positive mm (or 0 to keep), not {spacing!r}")

    @property
    def params(self) -> dict[str, Any]:
        return {"spacing": list(self.spacing)}

    def setup(self) -> None:
        import torch  # here, not at import: the CLI starts without torch

        torch.set_num_threads(1)  # parallelism comes from worker processes

    def __call__(self, sample: Sample) -> Sample:
        if not any(self.spacing):
            return sample
        volume, affine = sample["volume"], np.asarray(sample["affine"], dtype=np.float64)
        old = _spacing(affine).astype(np.float64)
        target = np.where(np.asarray(self.spacing) > 0, self.spacing, old)
        shape, new_affine = _spacing_grid(volume.shape, affine, target)
        to_input = np.linalg.solve(affine, new_affine)  # stored voxel index -> input voxel index
        if (tuple(shape) == volume.shape and np.allclose(to_input, np.eye(4), atol=1e-9)):
            resized = volume  # already on that grid (MONAI returns it unchanged too)
        elif np.allclose(to_input[:3, :3], np.diag(np.diag(to_input[:3, :3])), atol=1e-9):
            resized = volume  # no shear: trilinear is three 1D interpolations
            for axis in range(3):
                coords = to_input[axis, axis] * np.arange(shape[axis]) + to_input[axis, 3]
                resized = _interpolate_axis(resized, coords, axis)
        else:
            resized = _grid_sample(volume, to_input, shape)
        return dict(sample, volume=np.ascontiguousarray(resized, dtype=np.float32),
                    affine=new_affine, spacing=target.astype(np.float32))


AFFINE_TOL = 1e-3
"""``monai.data.utils.AFFINE_TOL``: the tolerance MONAI's ``compute_shape_offset`` uses."""


def _spacing_grid(shape: tuple[int, ...], affine: np.ndarray,
                  spacing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The shape and affine MONAI's ``Spacing(pixdim=spacing)`` gives a volume of ``shape`` with
    ``affine``: ``zoom_affine(diagonal=False)`` then ``compute_shape_offset(scale_extent=False)``
    (same operations, same order, so the same float64 results)."""
    rzs = affine[:3, :3]
    zs = np.linalg.cholesky(rzs.T @ rzs).T
    rotation = rzs @ np.linalg.inv(zs)
    new = np.eye(4)
    new[:3, :3] = rotation @ np.diag(np.sign(np.diag(zs)) * np.abs(spacing))
    size = np.array(shape, dtype=float)
    corners = np.asarray(np.meshgrid(*[(0.0, n - 1.0) for n in size], indexing="ij")).reshape(3, -1)
    corners = np.concatenate((corners, np.ones_like(corners[:1])))
    corners_out = np.linalg.solve(new, affine) @ corners
    corners = affine @ corners
    all_dist = corners_out[:-1].copy()
    corners_out = corners_out[:-1] / corners_out[-1]
    out_shape = np.round(np.ptp(corners_out, axis=1) + 1.0)
    offset = None
    for i in range(corners.shape[1]):  # the corner lowest along every new axis keeps its place
        if np.allclose(np.min(all_dist - all_dist[:, i:i + 1], 1), 0.0, rtol=AFFINE_TOL):
            offset = corners[:-1, i]
            break
    if offset is None:  # a sheared input: centre the new grid on the old one
        offset = rzs @ (size / 2.0) + affine[:3, 3] - new[:3, :3] @ (out_shape / 2.0)
    new[:3, 3] = offset
    return out_shape.astype(int), new


def _interpolate_axis(volume: np.ndarray, coords: np.ndarray, axis: int) -> np.ndarray:
    """``volume`` linearly interpolated at voxel positions ``coords`` along ``axis``; positions
    outside take the border voxel (``grid_sample``'s ``padding_mode="border"``)."""
    n = volume.shape[axis]
    x = np.clip(coords, 0, n - 1)
    low = np.clip(np.floor(x).astype(np.intp), 0, max(n - 2, 0))
    high = np.minimum(low + 1, n - 1)
    weight = (x - low).astype(np.float32).reshape([-1 if a == axis else 1 for a in range(3)])
    before = np.take(volume, low, axis=axis)
    return before + (np.take(volume, high, axis=axis) - before) * weight


def _grid_sample(volume: np.ndarray, to_input: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """``volume`` sampled trilinearly (border padding) at ``to_input @ index`` for every index
    of ``shape``: the general case, a sheared input whose new grid is not axis-aligned."""
    import torch

    index = np.stack(np.meshgrid(*[np.arange(n, dtype=np.float64) for n in shape],
                                 indexing="ij"), axis=-1)
    points = index @ to_input[:3, :3].T + to_input[:3, 3]  # input voxel index (i, j, k)
    extent = np.maximum(np.asarray(volume.shape, dtype=np.float64) - 1, 1)
    grid = (2 * points / extent - 1)[..., ::-1]  # grid_sample wants (x, y, z) = (k, j, i)
    out = torch.nn.functional.grid_sample(
        torch.from_numpy(np.ascontiguousarray(volume, dtype=np.float32))[None, None],
        torch.from_numpy(np.ascontiguousarray(grid, dtype=np.float32))[None],
        mode="bilinear", padding_mode="border", align_corners=True)
    return out[0, 0].numpy()


class NormaliseIntensity(Op):
    """Clip ``volume`` to a window and scale it to 0..1, stored as ``dtype``; or, with
    ``normalise="none"``, keep its values and only store them as ``dtype``.

    The window is ``window`` when given (e.g. ``-1000,400`` for CT lungs in HU), else the
    ``percentiles`` of the volume's voxels (default 0.5 and 99.5: robust to a few hot voxels).
    ``uint8`` stores round(255 x value): 4x smaller than float32 and what MedMNIST ships.

    ``normalise="none"`` is for inputs already normalised: MedMNIST ``.npz`` volumes are 0..255
    already (scaling them again moves almost every voxel), and z-scored or 0..1 floats keep
    their meaning with ``dtype`` ``float32``. With ``uint8`` the values are rounded (resampling
    makes fractions); values outside 0..255, or all within 0..1 and not whole (they would round
    to 0 and 1), fail the input with the fix.

    Args:
        percentiles: lower and upper percentile. Default (0.5, 99.5).
        window: fixed lower and upper intensity; (0, 0) (default): use ``percentiles``.
        dtype: ``uint8`` (default), ``float16`` or ``float32``.
        normalise: ``scale`` (default: clip and scale to 0..1) or ``none`` (keep the values).

    A constant volume (the window is empty) fails: it has nothing to learn from.
    """

    name = "normalise_intensity"
    version = "1"

    def __init__(self, *, percentiles: Any = (0.5, 99.5), window: Any = (0.0, 0.0),
                 dtype: str = "uint8", normalise: str = "scale") -> None:
        self.percentiles = tuple(float(p) for p in percentiles)
        self.window = tuple(float(w) for w in window)
        if len(self.percentiles) != 2 or not 0 <= self.percentiles[0] < self.percentiles[1] <= 100:
            raise ValueError(f"percentiles must be two numbers 0 <= low < high <= 100, not "
                             f"{percentiles!r}")
        if len(self.window) != 2 or (any(self.window) and self.window[0] >= self.window[1]):
            raise ValueError(f"window must be low,high with low < high (or 0,0: off), not "
                             f"{window!r}")
        if dtype not in VOLUME_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(VOLUME_DTYPES)}, not {dtype!r}")
        if normalise not in NORMALISE_MODES:
            raise ValueError(f"normalise must be one of {', '.join(NORMALISE_MODES)}, not "
                             f"{normalise!r}")
        if normalise == "none" and (any(self.window) or self.percentiles != (0.5, 99.5)):
            raise ValueError("normalise=none keeps the input's values, so window and percentiles "
                             "do nothing: drop them, or use normalise=scale")
        self.dtype, self.normalise = dtype, normalise

    @property
    def params(self) -> dict[str, Any]:
        params = {"percentiles": list(self.percentiles), "window": list(self.window),
                  "dtype": self.dtype}
        if self.normalise != "scale":  # the default keeps the fingerprint of caches built before
            params["normalise"] = self.normalise
        return params

    def __call__(self, sample: Sample) -> Sample:
        volume = sample["volume"]
        if self.normalise == "none":
            return dict(sample, volume=self._kept(volume))
        if any(self.window):
            low, high = self.window
        else:
            low, high = (float(v) for v in np.percentile(volume, self.percentiles))
        if not high > low:
            low, high = _full_range(volume)  # a mostly constant volume: its full range
        scaled = np.clip((volume - low) / (high - low), 0.0, 1.0)
        if self.dtype == "uint8":
            out = np.rint(scaled * 255).astype(np.uint8)
        else:
            out = scaled.astype(self.dtype)
        return dict(sample, volume=out)

    def _kept(self, volume: np.ndarray) -> np.ndarray:
        """``volume``'s own values as ``dtype`` (normalise=none); ValueError where uint8 would
        change them by more than rounding."""
        low, high = _full_range(volume)
        if self.dtype != "uint8":
            return volume.astype(self.dtype)
        rounded = np.rint(volume)
        if low < -0.5 or high >= 255.5:
            raise ValueError(f"normalise=none keeps the values, but they span {low:g}..{high:g}, "
                             "outside uint8's 0..255: add --set dtype=float32 (or "
                             "normalise=scale)")
        if high <= 1 and not np.array_equal(rounded, volume):
            raise ValueError(f"normalise=none keeps the values, but they lie in {low:g}..{high:g} "
                             "and uint8 would round them to 0 and 1: add --set dtype=float32")
        return rounded.astype(np.uint8)


def _full_range(volume: np.ndarray) -> tuple[float, float]:
    """The volume's min and max; ValueError for a constant volume (nothing to learn from)."""
    low, high = float(volume.min()), float(volume.max())
    if high <= low:
        raise ValueError(f"constant volume (every voxel is {low:g}): nothing to learn "
                         "from; remove the file or check its export")
    return low, high


class CropForeground(Op):
    """Crop ``volume`` to the box of voxels above ``threshold`` (of the normalised 0..1 range),
    plus ``margin`` voxels. A volume with nothing above it is kept whole.

    Args:
        threshold: 0 (default) turns the op off.
        margin: voxels kept around the box. Default 2.
    """

    name = "crop_foreground"
    version = "1"

    def __init__(self, *, threshold: float = 0.0, margin: int = 2) -> None:
        if not 0 <= threshold < 1 or margin < 0:
            raise ValueError(f"foreground threshold must be in [0, 1) and margin >= 0, not "
                             f"{threshold!r}, {margin!r}")
        self.threshold, self.margin = float(threshold), int(margin)

    @property
    def params(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "margin": self.margin}

    def __call__(self, sample: Sample) -> Sample:
        if self.threshold <= 0:
            return sample
        volume = sample["volume"]
        scale = 255.0 if volume.dtype == np.uint8 else 1.0
        inside = np.nonzero(volume > self.threshold * scale)
        if not len(inside[0]):
            return sample
        start = np.maximum(0, [axis.min() - self.margin for axis in inside])
        stop = np.minimum(volume.shape, [axis.max() + 1 + self.margin for axis in inside])
        box = tuple(slice(a, b) for a, b in zip(start, stop))
        return dict(sample, volume=np.ascontiguousarray(volume[box]),
                    affine=_shifted(sample["affine"], start.astype(np.float64)))


class FitShape(Op):
    """Centre-pad (with 0) or centre-crop ``volume`` to ``shape``, so every row has one shape.

    Args:
        shape: one size (a cube) or one per axis. Default 64.
    """

    name = "fit_shape"
    version = "1"

    def __init__(self, *, shape: Any = 64) -> None:
        self.shape = triple(shape, "shape", int)
        if min(self.shape) < 1:
            raise ValueError(f"shape must be positive, not {shape!r}")

    @property
    def params(self) -> dict[str, Any]:
        return {"shape": list(self.shape)}

    def __call__(self, sample: Sample) -> Sample:
        volume = sample["volume"]
        if volume.shape == self.shape:
            return sample
        have, want = np.asarray(volume.shape), np.asarray(self.shape)
        start = (have - want) // 2  # negative: pad before
        out = np.zeros(self.shape, dtype=volume.dtype)
        src = tuple(slice(max(0, s), max(0, s) + min(h, w)) for s, h, w in zip(start, have, want))
        dst = tuple(slice(max(0, -s), max(0, -s) + min(h, w)) for s, h, w in zip(start, have, want))
        out[dst] = volume[src]
        return dict(sample, volume=out, affine=_shifted(sample["affine"], start.astype(np.float64)))
