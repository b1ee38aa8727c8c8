"""The batched torch form of ``FaceAugment``, for batches on a GPU: each step is a few tensor
ops over the samples it applies to, on the batch's device.

One ``grid_sample`` warps every sample with an affine draw (source positions computed as
``cv2.warpAffine`` computes them, so the forms agree), a batched matrix product changes colour, a grouped convolution blurs, cutout and region edits are masks (a region's
hull is rasterised by scanline, as many rows as the crop, so no host round trip is needed). The
draws are host arrays; only indices, matrices and kernels travel to the device, and nothing comes
back. On a CPU this form measured 5-60x slower per step than ``face_opencv`` (see there), so it is
used for CUDA tensors, or when asked for (``FaceAugment.apply(..., form="torch")``), which is how
the tests run it here.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from precache.augment.face_draws import (FaceDraws, blur_kernel, colour_matrices,
                                         geometry_matrices, hole_boxes)
from precache.augment.face_opencv import FLIPS, POINT_KEYS, occlusion_noise

__all__ = ["apply_torch", "polygon_masks"]


def apply_torch(batch: dict[str, Any], draws: FaceDraws,
                region_rows: Sequence[int]) -> dict[str, Any]:
    """Augment a batch of tensors (``image`` (n, H, W, 3) uint8, any device); returns a new dict."""
    image = batch["image"]
    device = image.device
    n, height, width = image.shape[:3]
    out = image.clone()
    _regions(out, batch, draws, region_rows)
    matrices = geometry_matrices(draws, width, height)
    affine = np.flatnonzero(draws.affine)
    if len(affine):
        index = _on(affine, device)
        out[index] = _warp(out[index], matrices[affine])
    flip = np.flatnonzero(draws.flip & ~draws.affine)
    if len(flip):
        index = _on(flip, device)
        out[index] = out[index].flip(2)
    colour = np.flatnonzero(draws.color | draws.hue_sat)
    if len(colour):
        index = _on(colour, device)
        m = _on(colour_matrices(draws)[colour], device)
        x = out[index].reshape(len(colour), -1, 3).float()
        y = torch.baddbmm(m[:, None, :, 3], x, m[:, :, :3].transpose(1, 2))
        out[index] = _to_uint8(y).view(-1, height, width, 3)
    blur = np.flatnonzero(draws.blur)
    if len(blur):
        index = _on(blur, device)
        out[index] = _to_uint8(_blur(out[index].float(), draws.blur_sigma[blur]))
    holes = np.flatnonzero(draws.hole_on.any(axis=1))
    if len(holes):
        index = _on(holes, device)
        boxes = _on(hole_boxes(draws, width, height)[holes], device)
        out[index] = out[index].masked_fill(_box_masks(boxes, height, width)[..., None], 0)
    result = dict(batch)
    result["image"] = out
    result.update(_move_points(batch, matrices, draws.flip))
    return result


def polygon_masks(polygons: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(m, H, W) bool masks of convex polygons (m, K, 2) (repeated vertices allowed): a pixel is
    in when its centre is within half a pixel of the polygon along its row, a scanline cousin of
    ``cv2.fillPoly``'s rule (which also draws the outline), computed without leaving the device."""
    a, b = polygons.float(), polygons.float().roll(-1, dims=1)
    ys = torch.arange(height, device=polygons.device, dtype=torch.float32)[None, :, None]
    ay, by = a[:, None, :, 1], b[:, None, :, 1]
    low, high = torch.minimum(ay, by), torch.maximum(ay, by)
    spans = (ys >= low - 0.5) & (ys <= high + 0.5) & (high > low)  # (m, H, K)
    t = ((ys - ay) / torch.where(high > low, by - ay, torch.ones_like(ay))).clamp(0, 1)
    x = a[:, None, :, 0] + t * (b[:, None, :, 0] - a[:, None, :, 0])
    inf = torch.tensor(float("inf"), device=polygons.device)
    left = torch.where(spans, x, inf).amin(dim=2)
    right = torch.where(spans, x, -inf).amax(dim=2)
    xs = torch.arange(width, device=polygons.device, dtype=torch.float32)[None, None, :]
    return (xs >= left[..., None] - 0.5) & (xs <= right[..., None] + 0.5)


def _regions(out: torch.Tensor, batch: dict[str, Any], draws: FaceDraws,
             region_rows: Sequence[int]) -> None:
    """The region steps, in place. The regions that every (sample, step) pair picks, and their
    masks, are found together (the hulls do not change between steps); then each step edits
    every sample it runs on at once."""
    if batch.get("regions") is None or batch.get("region_sizes") is None or not region_rows:
        return
    samples, steps = np.nonzero(draws.region_on.T)[::-1]  # step-major: each step's pairs together
    if not len(samples):
        return
    device, (n, height, width) = out.device, out.shape[:3]
    regions, sizes = batch["regions"], batch["region_sizes"]
    has_mesh = batch.get("has_mesh")
    has_mesh = (torch.ones(n, dtype=torch.bool, device=device) if has_mesh is None
                else _on(has_mesh, device).reshape(n).bool())
    rows = _on(list(region_rows), device)
    present = (sizes[:, rows] >= 3) & has_mesh[:, None]  # (n, S)
    count = present.sum(dim=1)
    cumulative = present.cumsum(dim=1)
    index = _on(samples, device)
    pick = _on(draws.region_pick[samples, steps], device, torch.float64)
    k = torch.minimum((pick * count[index]).floor(), count[index] - 1)
    row = rows[(cumulative[index] > k[:, None]).int().argmax(dim=1)]
    masks = polygon_masks(regions[index, row], height, width) & (count[index] > 0)[:, None, None]
    bounds = np.searchsorted(steps, np.arange(4))
    for step in range(3):
        first, last = int(bounds[step]), int(bounds[step + 1])
        if first == last:
            continue
        on, where, mask = samples[first:last], index[first:last], masks[first:last]
        x = out[where].float()
        if step == 0:
            gain = _on(draws.region_gain[on], device, torch.float32)
            bias = _on(draws.region_bias[on], device, torch.float32)
            edited = _to_uint8(x * gain[:, None, None] + bias[:, None, None])
        elif step == 1:
            edited = _to_uint8(_blur(x, draws.region_sigma[on]))
        else:
            fill = np.empty((len(on), height, width, 3), np.uint8)
            for j, i in enumerate(on.tolist()):
                fill[j] = (occlusion_noise(int(draws.noise_seed[i]), height, width)
                           if draws.occlude_noise[i] else draws.occlude_colour[i])
            edited = _on(fill, device)
        out[where] = torch.where(mask[..., None], edited, out[where])


def _warp(images: torch.Tensor, matrices: np.ndarray) -> torch.Tensor:
    """Bilinear warp of (m, H, W, 3) uint8 by source -> output matrices, black outside: what
    ``cv2.warpAffine`` computes, step for step (its inverse in float64, source positions in fixed
    point rounded to 1/32 pixel, sums rounded half up), so both forms agree to the grey level."""
    m, height, width = images.shape[:3]
    device = images.device
    inverse = _on(_cv2_inverse(matrices), device)  # (m, 2, 3) float64
    xs = torch.arange(width, device=device, dtype=torch.float64)
    ys = torch.arange(height, device=device, dtype=torch.float64)
    axes = []
    for r in range(2):  # x, then y, in 1/32 pixel: (m, H, W) integers
        along_x = (inverse[:, r, 0:1] * xs * 1024).round().to(torch.int32)  # (m, W)
        along_y = ((inverse[:, r, 1:2] * ys + inverse[:, r, 2:3]) * 1024).round().to(torch.int32)
        axes.append(torch.div(along_y[:, :, None] + along_x[:, None, :] + 16, 32,
                              rounding_mode="floor"))
    scale = torch.tensor([32 * (width - 1) / 2, 32 * (height - 1) / 2], device=device)
    grid = torch.stack(axes, dim=-1).float() / scale - 1  # align_corners=True: centres at +-1
    x = images.permute(0, 3, 1, 2).float()
    y = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=True)
    return (y.permute(0, 2, 3, 1) + (0.5 + 1 / 4096)).floor_().clamp_(0, 255).to(torch.uint8)


def _cv2_inverse(matrices: np.ndarray) -> np.ndarray:
    """``cv2.invertAffineTransform`` of (m, 2, 3) float32 matrices, in float64 as OpenCV does."""
    m = matrices.astype(np.float64)
    det = m[:, 0, 0] * m[:, 1, 1] - m[:, 0, 1] * m[:, 1, 0]
    d = np.where(det != 0, 1 / np.where(det != 0, det, 1), 0)
    a11, a22, a12, a21 = m[:, 1, 1] * d, m[:, 0, 0] * d, -m[:, 0, 1] * d, -m[:, 1, 0] * d
    b1 = -a11 * m[:, 0, 2] - a12 * m[:, 1, 2]
    b2 = -a21 * m[:, 0, 2] - a22 * m[:, 1, 2]
    return np.stack([np.stack([a11, a12, b1], 1), np.stack([a21, a22, b2], 1)], 1)


def _blur(x: torch.Tensor, sigmas: np.ndarray) -> torch.Tensor:
    """Gaussian blur of (m, H, W, 3) float, each sample with its sigma (``blur_kernel``, zero
    padded to the largest), mirrored at the edges as OpenCV's default ``BORDER_REFLECT_101``."""
    m, height, width = x.shape[:3]
    kernels = [blur_kernel(float(s)) for s in sigmas]
    radius = max(len(k) for k in kernels) // 2
    weights = np.zeros((m, 2 * radius + 1))
    for i, k in enumerate(kernels):
        weights[i, radius - len(k) // 2: radius + len(k) // 2 + 1] = k
    w = _on(weights, x.device, torch.float32).repeat_interleave(3, dim=0)
    planes = F.pad(x.permute(0, 3, 1, 2).reshape(1, m * 3, height, width),
                   (radius,) * 4, mode="reflect")
    planes = F.conv2d(planes, w[:, None, :, None], groups=m * 3)
    planes = F.conv2d(planes, w[:, None, None, :], groups=m * 3)
    return planes.view(m, 3, height, width).permute(0, 2, 3, 1)


def _box_masks(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(m, H, W) union of each sample's boxes (m, holes, 4: y0, x0, y1, x1)."""
    ys = torch.arange(height, device=boxes.device)[None, None, :]
    xs = torch.arange(width, device=boxes.device)[None, None, :]
    rows = (ys >= boxes[..., 0:1]) & (ys < boxes[..., 2:3])  # (m, holes, H)
    cols = (xs >= boxes[..., 1:2]) & (xs < boxes[..., 3:4])
    return (rows[:, :, :, None] & cols[:, :, None, :]).any(dim=1)


def _move_points(batch: dict[str, Any], matrices: np.ndarray, flip: np.ndarray,
                 ) -> dict[str, torch.Tensor]:
    """``face_opencv.move_points`` on tensors, with the same elementwise arithmetic: every point
    set of the batch concatenated, moved and re-indexed in one pass (a dozen tensor ops, where
    one pass per set took four times as many: on a GPU each is a launch)."""
    out: dict[str, torch.Tensor] = {}
    keys = tuple(k for k in POINT_KEYS if batch.get(k) is not None)
    sizes = batch.get("region_sizes")
    device = (batch[keys[0]] if keys else sizes).device if keys or sizes is not None else None
    flipped = _on(flip, device) if device is not None and flip.any() else None
    if keys:
        n = len(matrices)
        points = torch.cat([batch[k].reshape(n, -1, 2).float() for k in keys], dim=1)  # (n, P, 2)
        m = _on(matrices, device)
        x, y = points[..., 0], points[..., 1]
        moved = torch.stack([m[:, 0, 0:1] * x + m[:, 0, 1:2] * y + m[:, 0, 2:3],
                             m[:, 1, 0:1] * x + m[:, 1, 1:2] * y + m[:, 1, 2:3]], dim=-1)
        if flipped is not None:
            order = _on(_flip_order(keys, tuple(tuple(batch[k].shape[1:]) for k in keys)), device)
            moved = torch.where(flipped[:, None, None], moved[:, order], moved)
        start = 0
        for key in keys:
            count = int(np.prod(batch[key].shape[1:-1]))
            out[key] = moved[:, start:start + count].reshape(batch[key].shape)
            start += count
    if sizes is not None:
        out["region_sizes"] = sizes if flipped is None else torch.where(
            flipped[:, None], sizes[:, _on(FLIPS["region_sizes"], device)], sizes)
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


def _on(values: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values (a NumPy array, a list) as a tensor on ``device``. To a GPU the copy is made
    from page-locked memory without waiting: a plain copy from pageable memory synchronises
    with the device, and a batch makes about twenty of them (indices, matrices, kernels)."""
    if isinstance(values, torch.Tensor):
        return values.to(device, dtype)
    tensor = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _to_uint8(x: torch.Tensor) -> torch.Tensor:
    return x.round().clamp_(0, 255).to(torch.uint8)
