"""FaceAugment on a batch: the same draws give the same result as one sample at a time, in the
OpenCV form and in the torch form (the GPU's, run here on CPU tensors); groups draw once; the
torch form's region masks cover the hulls. On the astronaut's face (conftest.py's ``face``)."""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np
import pytest
import torch

from precache.augment import FaceAugment
from precache.augment.face_torch import polygon_masks
from precache.faces import topology

S = 128
N = 8
ALL = dict(flip_p=0.5, affine_p=0.8, color_p=0.8, blur_p=0.5, cutout_p=0.8, region_color_p=0.6,
           region_blur_p=0.5, occlude_p=0.5)
OFF = {k: 0.0 for k in ALL}
POINTS = ("landmarks5", "mesh", "regions", "region_sizes")


@pytest.fixture(scope="module")
def batch(face: dict[str, Any]) -> dict[str, np.ndarray]:
    """N versions of the face (moved by a few pixels, brightness shifted); the last has no mesh."""
    rng = np.random.default_rng(0)
    samples = []
    for i in range(N):
        dx, dy = rng.integers(-4, 5, 2)
        image = np.roll(face["image"], (dy, dx), axis=(0, 1)).astype(np.int16) + rng.integers(-20, 21)
        mesh = face["mesh"] + np.float32([dx, dy])
        if i == N - 1:
            mesh = np.full_like(mesh, np.nan)
        regions, sizes = topology.region_hulls(mesh)
        samples.append({"image": np.clip(image, 0, 255).astype(np.uint8),
                        "landmarks5": face["landmarks5"] + np.float32([dx, dy]), "mesh": mesh,
                        "has_mesh": np.bool_(i < N - 1), "regions": regions,
                        "region_sizes": sizes})
    return {k: np.stack([s[k] for s in samples]) for k in samples[0]}


def tensors(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in batch.items()}


def row(batch: dict[str, np.ndarray], i: int) -> dict[str, Any]:
    return {k: v[i] for k, v in batch.items()}


def test_a_batch_equals_its_samples_one_at_a_time_on_the_same_draws(batch):
    aug = FaceAugment(**ALL, seed=0)
    draws = aug.draw(N)
    assert draws.affine.any() and draws.flip.any() and draws.region_on.any()
    whole = aug.apply(tensors(batch), draws)
    assert whole["image"].dtype == torch.uint8 and whole["image"].shape == (N, S, S, 3)
    for i in range(N):
        one = aug.apply({k: v[i:i + 1] for k, v in batch.items()}, draws.take(i))
        for key in ("image", *POINTS):
            np.testing.assert_array_equal(whole[key][i].numpy(), one[key][0], err_msg=key)
    # ... and one sample through __call__ is a batch of one with its own draw
    a, b = FaceAugment(**ALL, seed=1), FaceAugment(**ALL, seed=1)
    for i in range(N):
        single = a(row(batch, i))
        one = b.apply({k: v[i:i + 1] for k, v in batch.items()}, b.draw(1))
        for key in ("image", *POINTS):
            np.testing.assert_array_equal(single[key], one[key][0], err_msg=key)


@pytest.mark.parametrize("steps", [dict(flip_p=0.5, affine_p=0.8), dict(color_p=1.0),
                                   dict(blur_p=1.0), dict(cutout_p=1.0), ALL])
def test_the_torch_form_matches_the_opencv_form(batch, steps):
    """The GPU's form, on CPU tensors: within one grey level, points on the same pixels; where
    a region step runs, the masks may differ along the hull's edge only."""
    aug = FaceAugment(**{**OFF, **steps}, seed=2)
    for _ in range(2):
        draws = aug.draw(N)
        cpu = aug.apply(tensors(batch), draws)
        grid = aug.apply(tensors(batch), draws, form="torch")
        for key in POINTS:
            np.testing.assert_allclose(grid[key].numpy(), cpu[key].numpy(), atol=1e-3, err_msg=key)
        diff = np.abs(grid["image"].numpy().astype(int) - cpu["image"].numpy().astype(int))
        if steps is not ALL:
            assert diff.max() <= 1
            continue
        for i in np.flatnonzero(draws.region_on.any(axis=1) & ~draws.affine & ~draws.flip):
            hulls = topology.region_mask(batch["regions"][i], batch["region_sizes"][i],
                                         aug.params["regions"], (S, S))
            kernel = np.ones((5, 5), np.uint8)
            edge = (cv2.dilate(hulls, kernel) > 0) & ~(cv2.erode(hulls, kernel) > 0)
            assert not ((diff[i] > 1).any(axis=2) & ~edge).any()
        assert (diff > 1).mean() < 0.01


def test_the_torch_form_of_a_batch_equals_its_samples_one_at_a_time(batch):
    """The torch form warps, colours and cuts out the whole batch, with identity parameters for
    the samples a step is off for (an identity or flip warp, an identity colour matrix, no hole):
    each sample comes out bit for bit as alone, where the steps it has off do not run at all.
    The input is left as it was."""
    aug = FaceAugment(**{**ALL, "affine_p": 0.5, "color_p": 0.5, "cutout_p": 0.5}, seed=7)
    inputs = tensors(batch)
    before = {k: v.clone() for k, v in inputs.items()}
    mixed = np.zeros(3, bool)
    for _ in range(4):
        draws = aug.draw(N)
        for j, on in enumerate((draws.affine, draws.color | draws.hue_sat,
                                draws.hole_on.any(axis=1))):
            mixed[j] |= on.any() and not on.all()
        whole = aug.apply(inputs, draws, form="torch")
        for i in range(N):
            one = aug.apply({k: v[i:i + 1] for k, v in inputs.items()}, draws.take(i),
                            form="torch")
            for key in ("image", *POINTS):
                np.testing.assert_array_equal(whole[key][i].numpy(), one[key][0].numpy(),
                                              err_msg=f"{key} of sample {i}")
    assert mixed.all()  # each of those steps was on for some samples and off for others
    for key, value in before.items():
        assert torch.equal(inputs[key].nan_to_num(0), value.nan_to_num(0)), f"{key} mutated"


def test_groups_draw_once_per_group(batch):
    same = {k: np.repeat(v[:1], 6, axis=0) for k, v in batch.items()}
    aug = FaceAugment(**ALL, seed=3)
    for _ in range(3):
        out = aug(tensors(same), groups=torch.tensor([5, 5, 1, 1, 7, 7]))["image"]
        for a, b in ((0, 1), (2, 3), (4, 5)):
            assert torch.equal(out[a], out[b])
        assert not (torch.equal(out[0], out[2]) and torch.equal(out[2], out[4]))
    # distinct labels draw as no groups do
    a, b = FaceAugment(**ALL, seed=4), FaceAugment(**ALL, seed=4)
    np.testing.assert_array_equal(a.draw(N, groups=np.arange(N)[::-1].copy()).angle,
                                  b.draw(N).angle)
    with pytest.raises(ValueError, match="groups"):
        a.draw(N, groups=[0, 1])


def test_same_on_a_pair_equals_a_group_of_two(batch):
    pair = [row(batch, 0), row(batch, 1)]
    a, b = FaceAugment(**ALL, seed=5), FaceAugment(**ALL, seed=5)
    one_by_one = a.same(pair)
    together = b({k: v[:2] for k, v in batch.items()}, groups=[0, 0])
    for i in range(2):
        for key in ("image", *POINTS):
            np.testing.assert_array_equal(one_by_one[i][key], together[key][i], err_msg=key)


@pytest.mark.parametrize("flipped", [False, True])
def test_torch_region_masks_cover_the_hull(face, flipped):
    """Each region's rasterised hull holds its mesh points (rounded: within a pixel, as for
    ``cv2.fillPoly``'s in test_face_augment.py) and sits within a pixel of ``cv2.fillPoly``'s,
    whichever way round the hull runs (a flip reverses it)."""
    regions, sizes = face["regions"], face["region_sizes"]
    kernel = np.ones((3, 3), np.uint8)
    for r, name in enumerate(topology.REGIONS):
        hull = regions[r][::-1].copy() if flipped else regions[r]
        mask = polygon_masks(torch.from_numpy(hull)[None], S, S)[0].numpy()
        reference = topology.region_mask(regions, sizes, name, (S, S))
        x, y = np.round(face["mesh"][topology.MESH_REGIONS[name]]).astype(int).T
        assert (cv2.dilate(mask.astype(np.uint8), kernel) > 0)[y, x].all(), name
        assert not (mask & ~(cv2.dilate(reference, kernel) > 0)).any(), name
        assert not (~mask & (cv2.erode(reference, kernel) > 0)).any(), name


def test_types_and_the_input_are_kept(batch):
    aug = FaceAugment(**ALL, seed=6)
    before = {k: v.copy() for k, v in batch.items()}
    as_arrays = aug({**batch, "key": [f"k{i}" for i in range(N)]})
    assert isinstance(as_arrays["image"], np.ndarray) and as_arrays["key"][0] == "k0"
    as_tensors = aug(tensors(batch))
    assert all(isinstance(as_tensors[k], torch.Tensor) for k in ("image", *POINTS))
    assert as_tensors["region_sizes"].dtype == torch.int16
    for key, value in before.items():
        np.testing.assert_array_equal(batch[key], value, err_msg=f"{key} mutated")
    with pytest.raises(ValueError, match="draws"):
        aug.apply(tensors(batch), aug.draw(N - 1))

