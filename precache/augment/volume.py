"""Batched 3D augmentation of volumes or patches: one call per batch, on CPU or CUDA tensors.

``VolumeAugment`` takes a float tensor ``(B, C, D, H, W)`` (or ``(B, D, H, W)``) with intensities
in 0..1 and returns a new one of the same shape. Every sample gets its own draw (flip per axis,
a 90-degree rotation, intensity scale and shift, gamma, a small affine), but the draws for the
whole batch are made at once, as tensors on the batch's device, and applied with a few batched
tensor operations: no Python loop over samples, no host round trip on a GPU. That is the
difference from per-sample transform chains (MONAI's ``RandFlip``, ``RandRotate90``,
``RandAffine`` ... in ``Compose``), which run once per volume in DataLoader workers.

Geometric steps move the voxels only (these are classification inputs; there is no label map to
move along). 90-degree rotations turn a plane whose two sides are equal (any plane of a cubic
patch); a plane with unequal sides is turned by 180 degrees or not at all, which keeps the shape.
The affine step (rotation about each axis, isotropic scale, translation) resamples with
``grid_sample`` (trilinear, zeros outside) and runs only on the samples that drew it.

Use::

    augment = VolumeAugment(affine_p=0.3)
    x = batch["volume"].to(device).float().div_(255).unsqueeze(1)  # (B, 1, D, H, W)
    x = augment(x)
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

__all__ = ["VolumeAugment"]

_PLANES = ((2, 3), (2, 4), (3, 4))  # spatial planes of (B, C, D, H, W)


class VolumeAugment:
    """Random flips, 90-degree rotations, intensity scale/shift, gamma and a small affine.

    Args:
        flip_p: probability of flipping each spatial axis, per sample. Default 0.5.
        rot90_p: probability of a 90/180/270-degree turn in a random plane, per sample.
            Default 0.5.
        scale: intensities are multiplied by a factor in ``[1 - scale, 1 + scale]``. Default 0.1.
        shift: and shifted by an amount in ``[-shift, shift]``. Default 0.1.
        gamma: ``x ** g`` with ``log g`` in ``[-gamma, gamma]`` (on 0..1 values). Default 0.2.
        affine_p: probability of the small affine, per sample. Default 0 (off).
        degrees: its largest rotation about each axis. Default 10.
        zoom: its largest isotropic scale change (0.1: 0.9-1.1x). Default 0.1.
        translate: its largest shift, as a fraction of the size. Default 0.05.
        generator: a ``torch.Generator`` on the batch's device (default: torch's global one).

    Raises:
        ValueError: a probability outside 0..1 or a negative range.
    """

    thread_safe = True
    """A call changes nothing of the augment: its draws come from a torch ``Generator``, whose
    every call holds the generator's own lock, so ``make_loader`` keeps its worker threads. (In
    threads, which batch gets which draws follows the threads' timing.)"""

    def __init__(self, *, flip_p: float = 0.5, rot90_p: float = 0.5, scale: float = 0.1,
                 shift: float = 0.1, gamma: float = 0.2, affine_p: float = 0.0,
                 degrees: float = 10.0, zoom: float = 0.1, translate: float = 0.05,
                 generator: torch.Generator | None = None) -> None:
        for name, p in (("flip_p", flip_p), ("rot90_p", rot90_p), ("affine_p", affine_p)):
            if not 0 <= p <= 1:
                raise ValueError(f"{name} must be in [0, 1], not {p}")
        for name, r in (("scale", scale), ("shift", shift), ("gamma", gamma),
                        ("degrees", degrees), ("zoom", zoom), ("translate", translate)):
            if r < 0:
                raise ValueError(f"{name} must be >= 0, not {r}")
        self.flip_p, self.rot90_p, self.affine_p = flip_p, rot90_p, affine_p
        self.scale, self.shift, self.gamma = scale, shift, gamma
        self.degrees, self.zoom, self.translate = degrees, zoom, translate
        self.generator = generator

    def _uniform(self, n: int, low: float, high: float, like: torch.Tensor) -> torch.Tensor:
        u = torch.rand(n, generator=self.generator, device=like.device)
        return (low + (high - low) * u).to(like.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The augmented batch (a new tensor; ``x`` is not modified)."""
        squeeze = x.dim() == 4
        if squeeze:
            x = x.unsqueeze(1)
        if x.dim() != 5 or not x.is_floating_point():
            raise ValueError(f"expected a float (B, C, D, H, W) or (B, D, H, W) tensor, got "
                             f"{x.dtype} {tuple(x.shape)}")
        x = self._flip(x)
        x = self._rot90(x)
        x = self._intensity(x)
        x = self._affine(x)
        return x.squeeze(1) if squeeze else x

    def _flip(self, x: torch.Tensor) -> torch.Tensor:
        if not self.flip_p:
            return x
        n, first = len(x), x
        for axis in (2, 3, 4):
            chosen = torch.nonzero(torch.rand(n, generator=self.generator, device=x.device)
                                   < self.flip_p).flatten()
            if len(chosen):
                x = x.clone() if x is first else x
                x[chosen] = x.index_select(0, chosen).flip(axis)
        return x

    def _rot90(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rot90_p:
            return x
        n = len(x)
        turn = torch.rand(n, generator=self.generator, device=x.device) < self.rot90_p
        plane = torch.randint(0, 3, (n,), generator=self.generator, device=x.device)
        times = torch.randint(1, 4, (n,), generator=self.generator, device=x.device)
        out = None
        for p, dims in enumerate(_PLANES):
            square = x.shape[dims[0]] == x.shape[dims[1]]
            for k in (1, 2, 3) if square else (2,):
                mask = turn & (plane == p) & ((times == k) if square else True)
                chosen = torch.nonzero(mask).flatten()
                if not len(chosen):
                    continue
                if out is None:
                    out = x.clone()
                # only the samples that drew this turn are rotated (a gather, not the batch)
                out[chosen] = torch.rot90(x.index_select(0, chosen), k, dims)
        return x if out is None else out

    def _intensity(self, x: torch.Tensor) -> torch.Tensor:
        n, shape = len(x), (len(x), 1, 1, 1, 1)
        if self.gamma:
            g = torch.exp(self._uniform(n, -self.gamma, self.gamma, x)).view(shape)
            x = x.clamp(0, 1).pow(g)
        if self.scale or self.shift:
            a = self._uniform(n, 1 - self.scale, 1 + self.scale, x).view(shape)
            b = self._uniform(n, -self.shift, self.shift, x).view(shape)
            x = x * a + b
        return x

    def _affine(self, x: torch.Tensor) -> torch.Tensor:
        if not self.affine_p:
            return x
        n = len(x)
        chosen = torch.nonzero(torch.rand(n, generator=self.generator, device=x.device)
                               < self.affine_p).flatten()
        if not len(chosen):
            return x
        m = len(chosen)
        angles = self._uniform(3 * m, -1, 1, x).view(m, 3) * math.radians(self.degrees)
        cos, sin = angles.cos(), angles.sin()
        one, zero = torch.ones_like(cos[:, 0]), torch.zeros_like(cos[:, 0])

        def rotation(c: torch.Tensor, s: torch.Tensor, axes: tuple[int, int]) -> torch.Tensor:
            r = torch.stack([one, zero, zero, zero, one, zero, zero, zero, one], 1).view(m, 3, 3)
            i, j = axes
            r[:, i, i], r[:, j, j], r[:, i, j], r[:, j, i] = c, c, -s, s
            return r

        r = (rotation(cos[:, 0], sin[:, 0], (1, 2)) @ rotation(cos[:, 1], sin[:, 1], (0, 2))
             @ rotation(cos[:, 2], sin[:, 2], (0, 1)))
        r = r * self._uniform(m, 1 - self.zoom, 1 + self.zoom, x).view(m, 1, 1)
        t = self._uniform(3 * m, -1, 1, x).view(m, 3, 1) * (2 * self.translate)
        theta = torch.cat([r, t], dim=2)
        part = x.index_select(0, chosen)
        grid = F.affine_grid(theta, list(part.shape), align_corners=False)
        warped = F.grid_sample(part, grid, mode="bilinear", padding_mode="zeros",
                               align_corners=False)
        out = x.clone()
        out[chosen] = warped
        return out
