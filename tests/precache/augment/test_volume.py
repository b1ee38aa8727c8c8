"""VolumeAugment: per-sample draws over a whole batch; flips and 90-degree turns only move
voxels; intensity steps change values; an affine of zero range leaves the batch as it was."""

from __future__ import annotations

import pytest
import torch

from precache.augment.volume import VolumeAugment

GEOMETRY_ONLY = dict(scale=0.0, shift=0.0, gamma=0.0)


def batch(n: int = 12, shape: tuple = (6, 6, 6)) -> torch.Tensor:
    return torch.rand(n, 1, *shape, generator=torch.Generator().manual_seed(0))


def symmetries(x: torch.Tensor) -> list[torch.Tensor]:
    """The 48 flips and turns of a cube (C, D, H, W)."""
    out = []
    for perm in ((1, 2, 3), (1, 3, 2), (2, 1, 3), (2, 3, 1), (3, 1, 2), (3, 2, 1)):
        p = x.permute(0, *perm)
        for flips in range(8):
            dims = [d for d in (1, 2, 3) if flips >> (d - 1) & 1]
            out.append(p.flip(dims) if dims else p)
    return out


def test_flips_and_turns_move_each_sample_by_its_own_symmetry_of_the_cube():
    x = batch()
    y = VolumeAugment(generator=torch.Generator().manual_seed(1), **GEOMETRY_ONLY)(x)
    assert y.shape == x.shape
    changed = 0
    for a, b in zip(x, y):
        assert any(torch.equal(b, s) for s in symmetries(a))
        changed += not torch.equal(a, b)
    assert 0 < changed < len(x)  # each sample its own draw: some moved, some not


def test_a_plane_with_unequal_sides_is_turned_only_by_180_degrees():
    x = batch(16, (4, 6, 8))
    y = VolumeAugment(flip_p=0.0, rot90_p=1.0, generator=torch.Generator().manual_seed(2),
                      **GEOMETRY_ONLY)(x)
    assert y.shape == x.shape
    for a, b in zip(x, y):
        turns = [a.flip(dims) for dims in ((1, 2), (1, 3), (2, 3))]
        assert any(torch.equal(b, t) for t in turns)


def test_intensity_draws_differ_per_sample_and_the_input_is_not_modified():
    x = batch()
    before = x.clone()
    y = VolumeAugment(flip_p=0.0, rot90_p=0.0, generator=torch.Generator().manual_seed(3))(x)
    assert torch.equal(x, before)
    ratios = (y.mean(dim=(1, 2, 3, 4)) / x.mean(dim=(1, 2, 3, 4)))
    assert ratios.unique().numel() == len(x) and not torch.allclose(ratios, torch.ones(len(x)))


def test_the_affine_resamples_only_the_samples_that_drew_it():
    x = batch(4, (8, 8, 8)).squeeze(1)  # (B, D, H, W) works too
    still = VolumeAugment(flip_p=0.0, rot90_p=0.0, affine_p=1.0, degrees=0.0, zoom=0.0,
                          translate=0.0, **GEOMETRY_ONLY)(x)
    torch.testing.assert_close(still, x)
    moved = VolumeAugment(flip_p=0.0, rot90_p=0.0, affine_p=1.0, degrees=20.0,
                          generator=torch.Generator().manual_seed(4), **GEOMETRY_ONLY)(x)
    assert moved.shape == x.shape and all(not torch.allclose(a, b) for a, b in zip(moved, x))


def test_bad_arguments_and_inputs_are_refused():
    with pytest.raises(ValueError, match="flip_p must be in"):
        VolumeAugment(flip_p=2.0)
    with pytest.raises(ValueError, match="expected a float"):
        VolumeAugment()(torch.zeros(2, 1, 4, 4, 4, dtype=torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_it_runs_on_the_gpu_without_leaving_it():
    x = batch().cuda()
    y = VolumeAugment(affine_p=0.5, generator=torch.Generator("cuda").manual_seed(0))(x)
    assert y.device == x.device and y.shape == x.shape
