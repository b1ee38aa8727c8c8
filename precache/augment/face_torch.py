"""The batched torch form of ``FaceAugment``, for batches on a GPU: each step is a few tensor
ops over the batch, on the batch's device.

One ``grid_sample`` warps every sample (source positions computed as ``cv2.warpAffine``
computes them, so the forms agree), a batched matrix product changes colour, a grouped
convolution blurs, cutout and region edits are masks (a region's hull is rasterised by scanline,
as many rows as the crop, so no host round trip is needed). On a CPU this form measured 5-60x
slower per step than ``face_opencv`` (see there), so it is used for CUDA tensors, or when asked
for (``FaceAugment.apply(..., form="torch")``), which is how the tests run it here.

On a GPU the cost of this form is on the host: each tensor op is a dispatch and a kernel launch
(~25 us on an H100, where the kernels of a batch of 256 take ~3.5 ms in all). So it dispatches
few ops: ~150 for a batch of 256 at the default probabilities (310 when each step gathered its
samples and uploaded its own arrays):

- One upload a batch. The draws are host arrays; everything derived from them (region picks,
  gains and fills, the warp's source position terms, colour matrices, blur kernels and indices,
  hole rows and columns, the flip flags and re-indexings) is computed on the host first, packed
  into one buffer, copied to the device once, and taken apart there as views (``_Upload``).
  Nothing comes back: device data (the region hulls and sizes) is only read on the device.
- The image is worked on as float (N, H, W, 3) holding integers: every step rounds and clamps
  as its uint8 round trip did, so one conversion each way replaces two per step.
- The warp, the colour matrix and cutout run on the whole batch, instead of a gather and a
  scatter of the samples they apply to: the other samples get identity parameters, which give
  back every pixel exactly (an identity matrix multiplies by 1 and adds 0; an empty mask keeps
  all; an identity or flip warp reads each pixel at its own or its mirror's centre, off by a
  float error that moves the value far less than the half grey level it would take to round to
  another). A flip with no affine warp in the batch is one ``where`` over the batch. Blur and
  the region steps, whose samples are few and whose kernels cost more, still gather theirs
  (``index_select``, which gathers the (m, 3, H, W) planes a convolution takes, and
  ``index_copy_`` back).

The results are those of running each step on its samples alone, to the bit: the arithmetic of
every step is unchanged, and so is the layout of the colour product's operands (on which its
rounding depends). The whole-batch steps do more device work where a step is rare in a batch
(not yet timed on a GPU); on a CPU that work shows: at 32 px this form is a few percent slower
there than when it gathered, at 12 px ~15% faster.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from precache.augment.face_draws import (FaceDraws, blur_kernel, colour_matrices,
                                         geometry_matrices, hole_boxes)
from precache.augment.face_opencv import FLIPS, POINT_KEYS, occlusion_noise

__all__ = ["apply_torch", "polygon_masks"]

_HALF_UP = 0.5 + 1 / 4096  # the warp's rounding: cv2's fixed-point sums round half up


def apply_torch(batch: dict[str, Any], draws: FaceDraws,
                region_rows: Sequence[int]) -> dict[str, Any]:
    """Augment a batch of tensors (``image`` (n, H, W, 3) uint8, any device); returns a new dict.

    First every host array the steps need is computed and uploaded at once, then the steps run
    on the device in order: regions, warp (or flip), colour, blur, cutout."""
    image = batch["image"]
    n, height, width = image.shape[:3]
    matrices = geometry_matrices(draws, width, height)
    up = _Upload()
    regions = _regions_host(up, batch, draws, region_rows, height, width)
    warp = bool(draws.affine.any())
    if warp:  # every sample, flips included (see above)
        _warp_host(up, matrices, height, width)
    elif draws.flip.any():
        up.add("flip_image", draws.flip.reshape(n, 1, 1, 1))
    coloured = bool((draws.color | draws.hue_sat).any())
    if coloured:
        up.add("colour", colour_matrices(draws))  # (n, 3, 4), identity where off
    blur = np.flatnonzero(draws.blur)
    if len(blur):
        up.add("blur_index", blur, np.int64)
        _blur_host(up, "blur", draws.blur_sigma[blur])
    holed = bool(draws.hole_on.any())
    if holed:
        _cutout_host(up, draws, height, width)
    points = _points_host(up, batch, matrices, draws.flip)
    dev = up.send(image.device)

    out = _Working(image)
    if regions is not None:
        _regions(out, batch, dev, regions)
    if warp:
        out.image = _warp(out.as_float(), dev)
    elif draws.flip.any():
        out.image = torch.where(dev["flip_image"], out.image.flip(2), out.image)
    if coloured:
        # The operands laid out exactly as a gather of the samples laid them out (the pixels
        # contiguous, the colour matrix read transposed): a product's rounding can depend on
        # its operands' layout (the matrix's does, measured on the CPU).
        x = out.as_float().contiguous().view(n, -1, 3)  # a copy after the warp
        bias = dev.strided("colour", (n, 1, 3), (12, 12, 4), offset=3)
        matrix_t = dev.strided("colour", (n, 3, 3), (12, 1, 4))
        out.image = _round(torch.baddbmm(bias, x, matrix_t)).view(n, height, width, 3)
    if len(blur):
        index = dev["blur_index"]
        planes = out.as_float().permute(0, 3, 1, 2)  # gathers (m, 3, H, W) contiguous
        planes.index_copy_(0, index, _round(_blur(planes.index_select(0, index), dev, "blur")))
    if holed:
        mask = (dev["hole_rows"] & dev["hole_cols"]).any(dim=1)  # (n, H, W, 1)
        out.image = out.image.masked_fill(mask, 0)
    result = dict(batch)
    result["image"] = out.result()
    result.update(_move_points(batch, dev, points))
    return result


class _Working:
    """The image as the steps change it: the input (never written to) until a step needs it as
    float (N, H, W, 3), then a float copy that steps may change in place."""

    def __init__(self, image: torch.Tensor) -> None:
        self.input = image
        self.image = image

    def as_float(self) -> torch.Tensor:
        if not self.image.is_floating_point() or self.image is self.input:
            self.image = self.image.to(torch.float32, copy=True)
        return self.image

    def result(self) -> torch.Tensor:
        """The augmented image as the input's dtype, contiguous; a copy even if unchanged."""
        if self.image is self.input:
            return self.input.clone()
        return self.image.to(self.input.dtype, memory_format=torch.contiguous_format)


class _Upload:
    """The host arrays one batch needs on the device, copied there in one go.

    Each host-to-device copy of its own costs several dispatched ops (and, to a GPU, a staging
    copy into page-locked memory), and a batch needs about twenty small arrays (indices,
    matrices, kernels, masks). So ``add`` collects them, ``send`` writes them into one uint8
    buffer, each at a 16-byte aligned offset (page-locked memory for a GPU, so the copy does not
    wait), copies that once, and returns a ``_Views`` of the device copy."""

    ALIGN = 16

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def add(self, name: str, array: Any, dtype: Any = None) -> None:
        self._arrays[name] = np.ascontiguousarray(array, dtype=dtype)

    def send(self, device: torch.device) -> _Views:
        offsets, size = {}, 0
        for name, array in self._arrays.items():
            offsets[name] = size
            size += -(-array.nbytes // self.ALIGN) * self.ALIGN
        if device.type == "cuda":
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        else:
            host = torch.from_numpy(np.empty(size, np.uint8))
        buffer = host.numpy()
        for name, array in self._arrays.items():
            buffer[offsets[name]:offsets[name] + array.nbytes] = array.reshape(-1).view(np.uint8)
        if device.type != "cpu" and size:
            host = host.to(device, non_blocking=device.type == "cuda")
        return _Views(host, {name: (a.dtype, a.shape, offsets[name])
                             for name, a in self._arrays.items()})


class _Views:
    """Typed views of an uploaded buffer: one dtype view of the whole buffer per dtype, then one
    ``as_strided`` per array (a slice, a dtype view and a reshape would be three ops each)."""

    def __init__(self, buffer: torch.Tensor,
                 layout: dict[str, tuple[np.dtype, tuple[int, ...], int]]) -> None:
        self._buffer = buffer
        self._layout = layout
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._layout

    def shape(self, name: str) -> tuple[int, ...]:
        return self._layout[name][1]

    def __getitem__(self, name: str) -> torch.Tensor:
        """The array ``name`` as it was added."""
        return self.view(name, self._layout[name][1])

    def view(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The array ``name`` reshaped (contiguous) to ``shape``."""
        return self.strided(name, shape, _contiguous_strides(shape))

    def strided(self, name: str, shape: tuple[int, ...], strides: tuple[int, ...],
                offset: int = 0) -> torch.Tensor:
        """A strided view into the array ``name`` (``strides`` and ``offset`` in elements)."""
        np_dtype, _, start = self._layout[name]
        dtype = _TORCH_DTYPES[np_dtype]
        typed = self._buffer if dtype == torch.uint8 else self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self._buffer.view(dtype)
        return typed.as_strided(shape, strides, start // np_dtype.itemsize + offset)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


_TORCH_DTYPES = {np.dtype(d): t for d, t in [(np.bool_, torch.bool), (np.uint8, torch.uint8),
                                              (np.int32, torch.int32), (np.int64, torch.int64),
                                              (np.float32, torch.float32)]}


def polygon_masks(polygons: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(m, H, W) bool masks of convex polygons (m, K, 2) (repeated vertices allowed): a pixel is
    in when its centre is within half a pixel of the polygon along its row, a scanline cousin of
    ``cv2.fillPoly``'s rule (which also draws the outline), computed without leaving the device."""
    ys = torch.arange(height, device=polygons.device, dtype=torch.float32)[:, None]
    xs = torch.arange(width, device=polygons.device, dtype=torch.float32)
    return _polygon_masks(polygons.float()[:, None], ys, xs)


def _polygon_masks(polygons: torch.Tensor, ys: torch.Tensor, xs: torch.Tensor,
                   valid: torch.Tensor | None = None) -> torch.Tensor:
    """``polygon_masks`` of float ``polygons`` shaped to broadcast against the row centres ``ys``
    (H, 1) and column centres ``xs`` (W,): (m, 1, K, 2) give (m, H, W) masks, (m, 1, 1, K, 2)
    give (m, 1, H, W). ``valid`` (shaped as one edge's values) empties the masks where false."""
    a = polygons  # edge a -> b, each edge against each row
    ax, ay = a.unbind(-1)
    bx, by = a.roll(-1, dims=-2).unbind(-1)
    low, high = torch.minimum(ay, by), torch.maximum(ay, by)
    sloped = high > low  # a flat edge spans no row of its own
    spans = (ys >= low - 0.5) & (ys <= high + 0.5) & (sloped if valid is None else sloped & valid)
    # Where an edge is flat this divides by zero; those positions are never used (not spans).
    t = ((ys - ay) / (by - ay)).clamp_(0, 1)
    x = ax + t * (bx - ax)
    left = torch.where(spans, x, math.inf).amin(dim=-1, keepdim=True)
    right = torch.where(spans, x, -math.inf).amax(dim=-1, keepdim=True)
    return (xs >= left - 0.5) & (xs <= right + 0.5)


def _regions_host(up: _Upload, batch: dict[str, Any], draws: FaceDraws,
                  region_rows: Sequence[int], height: int, width: int,
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """The region steps' host arrays; returns the (sample, step) pairs that run (step-major:
    each step's pairs together), or None where no region step runs.

    Which region a pair edits depends on which regions its sample has (device data), through
    ``count``, the number it has: the pick is the ``k``-th present region, ``k = min(floor(pick *
    count), count - 1)`` (as ``face_opencv.region_picks``). ``k`` is tabled here for every
    possible count, so the device only looks it up."""
    if batch.get("regions") is None or batch.get("region_sizes") is None or not region_rows:
        return None
    samples, steps = np.nonzero(draws.region_on.T)[::-1]
    if not len(samples):
        return None
    n = len(draws)
    counts = np.arange(len(region_rows) + 1)
    pick = draws.region_pick[samples, steps].astype(np.float64)
    up.add("region_rows", list(region_rows), np.int64)
    up.add("region_pairs", samples, np.int64)
    up.add("region_k", np.minimum(np.floor(pick[:, None] * counts), counts - 1), np.int64)
    up.add("region_ys", np.arange(height, dtype=np.float32).reshape(height, 1))
    up.add("region_xs", np.arange(width, dtype=np.float32))
    has_mesh = batch.get("has_mesh")
    if has_mesh is not None and not isinstance(has_mesh, torch.Tensor):
        up.add("has_mesh", np.asarray(has_mesh, bool).reshape(n, 1))
    on = samples[steps == 0]
    if len(on):
        up.add("region_gain", draws.region_gain[on].reshape(-1, 3, 1, 1), np.float32)
        up.add("region_bias", draws.region_bias[on].reshape(-1, 3, 1, 1), np.float32)
    on = samples[steps == 1]
    if len(on):
        _blur_host(up, "region_blur", draws.region_sigma[on])
    on = samples[steps == 2]
    if len(on):
        fill = np.empty((len(on), height, width, 3), np.uint8)
        for j, i in enumerate(on.tolist()):
            fill[j] = (occlusion_noise(int(draws.noise_seed[i]), height, width)
                       if draws.occlude_noise[i] else draws.occlude_colour[i])
        up.add("region_fill", fill.transpose(0, 3, 1, 2))  # (m, 3, H, W)
    return samples, steps


def _regions(out: _Working, batch: dict[str, Any], dev: _Views,
             pairs: tuple[np.ndarray, np.ndarray]) -> None:
    """The region steps, in place. The regions that every (sample, step) pair picks, and their
    masks, are found together (the hulls do not change between steps); then each step edits
    every sample it runs on at once."""
    samples, steps = pairs
    regions, sizes = batch["regions"], batch["region_sizes"]
    n, p = len(sizes), len(samples)
    rows, index = dev["region_rows"], dev["region_pairs"]
    present = sizes.index_select(1, rows) >= 3  # (n, S)
    has_mesh = batch.get("has_mesh")
    if has_mesh is not None:
        if isinstance(has_mesh, torch.Tensor):
            present &= has_mesh.to(present.device).reshape(n, 1).bool()
        else:
            present &= dev["has_mesh"]  # uploaded (n, 1)
    cumulative = present.cumsum(dim=1).index_select(0, index)  # (P, S): present regions up to each
    count = cumulative[:, -1:]  # (P, 1)
    k = dev["region_k"].gather(1, count)
    row = rows[(cumulative <= k).sum(dim=1)]  # the first region with cumulative > k
    polygons = regions[index, row].float()
    masks = _polygon_masks(polygons.view(p, 1, 1, *polygons.shape[1:]), dev["region_ys"],
                           dev["region_xs"], valid=(count > 0).view(p, 1, 1, 1))  # (P, 1, H, W)
    per_step = np.bincount(steps, minlength=3).tolist()
    planes = out.as_float().permute(0, 3, 1, 2)  # gathers (m, 3, H, W) contiguous
    for step, where, mask in zip(range(3), index.split(per_step), masks.split(per_step)):
        if not per_step[step]:
            continue
        x = planes.index_select(0, where)
        if step == 0:
            edited = _round(x * dev["region_gain"] + dev["region_bias"])
        elif step == 1:
            edited = _round(_blur(x, dev, "region_blur"))
        else:
            edited = dev["region_fill"]
        planes.index_copy_(0, where, torch.where(mask, edited, x))


def _warp_host(up: _Upload, matrices: np.ndarray, height: int, width: int) -> None:
    """The warp's source positions, as ``cv2.warpAffine`` computes them: from the inverse in
    float64, each axis' term in 1/1024 pixel (rounded half to even, to int32); the device adds
    the terms of a pixel's column and row and rounds the sum to 1/32 pixel (with the 16 of that
    rounding added to the row terms here)."""
    inverse = _cv2_inverse(matrices)  # (n, 2, 3) float64
    xs = np.arange(width, dtype=np.float64)
    ys = np.arange(height, dtype=np.float64)
    along_x = np.round(inverse[:, :, 0:1] * xs * 1024).astype(np.int32)  # (n, 2, W)
    along_y = np.round((inverse[:, :, 1:2] * ys + inverse[:, :, 2:3]) * 1024).astype(np.int32)
    up.add("warp_x", along_x.transpose(0, 2, 1)[:, None])  # (n, 1, W, 2): x, then y source
    up.add("warp_y", (along_y + np.int32(16)).transpose(0, 2, 1)[:, :, None])  # (n, H, 1, 2)
    up.add("warp_scale", [32 * (width - 1) / 2, 32 * (height - 1) / 2], np.float32)


def _warp(images: torch.Tensor, dev: _Views) -> torch.Tensor:
    """Bilinear warp of (n, H, W, 3) float by the uploaded positions, black outside: what
    ``cv2.warpAffine`` computes, step for step (source positions in fixed point rounded to 1/32
    pixel, sums rounded half up), so both forms agree to the grey level."""
    positions = torch.div(dev["warp_y"] + dev["warp_x"], 32, rounding_mode="floor")  # (n, H, W, 2)
    grid = positions / dev["warp_scale"] - 1  # align_corners=True: centres at +-1
    y = F.grid_sample(images.permute(0, 3, 1, 2), grid, mode="bilinear", padding_mode="zeros",
                      align_corners=True)
    return y.add_(_HALF_UP).floor_().clamp_(0, 255).permute(0, 2, 3, 1)


def _cv2_inverse(matrices: np.ndarray) -> np.ndarray:
    """``cv2.invertAffineTransform`` of (m, 2, 3) float32 matrices, in float64 as OpenCV does."""
    m = matrices.astype(np.float64)
    det = m[:, 0, 0] * m[:, 1, 1] - m[:, 0, 1] * m[:, 1, 0]
    d = np.where(det != 0, 1 / np.where(det != 0, det, 1), 0)
    a11, a22, a12, a21 = m[:, 1, 1] * d, m[:, 0, 0] * d, -m[:, 0, 1] * d, -m[:, 1, 0] * d
    b1 = -a11 * m[:, 0, 2] - a12 * m[:, 1, 2]
    b2 = -a21 * m[:, 0, 2] - a22 * m[:, 1, 2]
    return np.stack([np.stack([a11, a12, b1], 1), np.stack([a21, a22, b2], 1)], 1)


def _blur_host(up: _Upload, name: str, sigmas: np.ndarray) -> None:
    """Each sample's ``blur_kernel``, zero padded to the largest, once per channel: ``name``
    (m * 3, 2 * radius + 1) float32."""
    kernels = [blur_kernel(float(s)) for s in sigmas]
    radius = max(len(k) for k in kernels) // 2
    weights = np.zeros((len(kernels), 2 * radius + 1))
    for i, k in enumerate(kernels):
        weights[i, radius - len(k) // 2: radius + len(k) // 2 + 1] = k
    up.add(name, np.repeat(weights, 3, axis=0), np.float32)


def _blur(x: torch.Tensor, dev: _Views, name: str) -> torch.Tensor:
    """Gaussian blur of (m, 3, H, W) float, each sample with its kernel (``_blur_host``),
    mirrored at the edges as OpenCV's default ``BORDER_REFLECT_101``."""
    m, _, height, width = x.shape
    size = dev.shape(name)[1]
    planes = F.pad(x.reshape(1, m * 3, height, width), (size // 2,) * 4, mode="reflect")
    planes = F.conv2d(planes, dev.view(name, (m * 3, 1, size, 1)), groups=m * 3)
    planes = F.conv2d(planes, dev.view(name, (m * 3, 1, 1, size)), groups=m * 3)
    return planes.view(m, 3, height, width)


def _cutout_host(up: _Upload, draws: FaceDraws, height: int, width: int) -> None:
    """Each hole's rows (n, holes, H, 1, 1) and columns (n, holes, 1, W, 1): the device makes
    their union (n, H, W, 1) (empty where cutout is off)."""
    boxes = hole_boxes(draws, width, height)[..., None]  # y0, x0, y1, x1: (n, holes, 4, 1)
    ys, xs = np.arange(height), np.arange(width)
    rows = (ys >= boxes[:, :, 0]) & (ys < boxes[:, :, 2])
    cols = (xs >= boxes[:, :, 1]) & (xs < boxes[:, :, 3])
    up.add("hole_rows", rows[:, :, :, None, None])
    up.add("hole_cols", cols[:, :, None, :, None])


def _points_host(up: _Upload, batch: dict[str, Any], matrices: np.ndarray, flip: np.ndarray,
                 ) -> tuple[str, ...]:
    """The point move's host arrays: the matrices' columns (3, n, 1, 2) and, where a sample
    flips, the flags and re-indexings; returns the point keys of the batch."""
    keys = tuple(k for k in POINT_KEYS if batch.get(k) is not None)
    if keys:
        up.add("points_m", matrices.transpose(2, 0, 1)[:, :, None, :])  # x, y, 1 -> (x', y')
    if flip.any() and (keys or batch.get("region_sizes") is not None):
        up.add("points_flip", flip)
        if keys:
            shapes = tuple(tuple(batch[k].shape[1:]) for k in keys)
            up.add("points_order", _flip_order(keys, shapes), np.int64)
        if batch.get("region_sizes") is not None:
            up.add("sizes_order", FLIPS["region_sizes"], np.int64)
    return keys


def _move_points(batch: dict[str, Any], dev: _Views, keys: tuple[str, ...],
                 ) -> dict[str, torch.Tensor]:
    """``face_opencv.move_points`` on tensors, with the same elementwise arithmetic: every point
    set of the batch concatenated, moved and re-indexed in one pass (a handful of tensor ops,
    where one pass per set took four times as many: on a GPU each is a launch)."""
    out: dict[str, torch.Tensor] = {}
    sizes = batch.get("region_sizes")
    flipped = "points_flip" in dev
    n = len(batch["image"])
    if keys:
        sets = [_reshape(batch[k], (n, -1, 2)).float() for k in keys]
        points = torch.cat(sets, dim=1) if len(sets) > 1 else sets[0]  # (n, P, 2)
        x, y = points.split(1, dim=-1)
        along_x, along_y, offset = dev["points_m"].unbind(0)  # (n, 1, 2) each
        moved = x * along_x + y * along_y + offset  # x' = m00 x + m01 y + m02, y' likewise
        if flipped:
            moved = torch.where(dev.view("points_flip", (n, 1, 1)),
                                moved.index_select(1, dev["points_order"]), moved)
        counts = [int(np.prod(batch[k].shape[1:-1])) for k in keys]
        for key, part in zip(keys, moved.split(counts, dim=1)):
            out[key] = _reshape(part, batch[key].shape)
    if sizes is not None:
        out["region_sizes"] = sizes if not flipped else torch.where(
            dev.view("points_flip", (n, 1)), sizes.index_select(1, dev["sizes_order"]), sizes)
    return out


@functools.lru_cache(maxsize=16)
def _flip_order(keys: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """The flip's re-indexing of the concatenated points of ``keys`` (per-sample ``shapes``,
    each ``(A, ..., 2)`` re-indexed along ``A`` by ``FLIPS``)."""
    orders, start = [], 0
    for key, shape in zip(keys, shapes):
        block = int(np.prod(shape[1:-1]))  # points per entry of the re-indexed axis
        count = shape[0] * block
        orders.append(start + np.arange(count).reshape(shape[0], block)[FLIPS[key]].ravel())
        start += count
    return np.concatenate(orders)


def _reshape(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``x.reshape(shape)``, or ``x`` where it has that shape already (a reshape is an op)."""
    if x.dim() == len(shape) and all(s in (-1, t) for s, t in zip(shape, x.shape)):
        return x
    return x.reshape(shape)


def _round(x: torch.Tensor) -> torch.Tensor:
    """Round half to even and clamp to 0..255, in place: the values a uint8 round trip gives."""
    return x.round_().clamp_(0, 255)
