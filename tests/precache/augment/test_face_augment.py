"""FaceAugment on a real face: scikit-image's astronaut, cropped to 128 px, with MediaPipe's mesh,
the cached region hulls, and landmarks5 derived from the mesh (the ``face`` fixture, conftest.py)."""

from __future__ import annotations

import pickle
from typing import Any

import cv2
import numpy as np
import pytest
import torch

from precache.augment import FaceAugment
from precache.faces import topology

S = 128
OFF = dict(flip_p=0.0, affine_p=0.0, color_p=0.0, blur_p=0.0, cutout_p=0.0,
           region_color_p=0.0, region_blur_p=0.0, occlude_p=0.0)
POINTS = ("landmarks5", "mesh", "regions")
EYES = ("left_eye", "right_eye")


def only(**params: Any) -> FaceAugment:
    """A FaceAugment with every step off except those given."""
    return FaceAugment(**{**OFF, "seed": 0, **params})


def mirrored(points: np.ndarray) -> np.ndarray:
    """Albumentations' flip: pixel centres at integers, so x -> (S - 1) - x."""
    return np.stack([(S - 1) - points[..., 0], points[..., 1]], axis=-1)


def region_mask(sample: dict[str, Any], names: str | tuple[str, ...], grow: int = 0) -> np.ndarray:
    """The sample's mask of ``names`` as bools, dilated by ``grow`` pixels."""
    mask = topology.region_mask(sample["regions"], sample["region_sizes"], names, (S, S))
    return cv2.dilate(mask, np.ones((2 * grow + 1, 2 * grow + 1), np.uint8)) > 0


def snapshot(sample: dict[str, Any]) -> dict[str, Any]:
    return {k: np.array(v, copy=True) for k, v in sample.items()}


def assert_unchanged(sample: dict[str, Any], before: dict[str, Any]) -> None:
    for key, value in before.items():
        np.testing.assert_array_equal(np.asarray(sample[key]), value, err_msg=f"{key} mutated")


def test_flip_mirrors_the_image_and_reindexes_every_point_set(face: dict[str, Any]) -> None:
    before = snapshot(face)
    flip = only(flip_p=1.0)
    out = flip(face)
    assert_unchanged(face, before)

    np.testing.assert_array_equal(out["image"], face["image"][:, ::-1])
    lm = out["landmarks5"]
    assert lm[0, 0] < lm[1, 0] and lm[3, 0] < lm[4, 0]
    flipped = {"landmarks5": topology.LANDMARKS5_FLIP, "mesh": topology.MESH_FLIP,
               "regions": topology.REGION_FLIP}
    for key, order in flipped.items():
        np.testing.assert_allclose(out[key], mirrored(face[key][order]), atol=1e-4, err_msg=key)
    left, right = (out["mesh"][topology.MESH_REGIONS[n], 0].mean() for n in EYES)
    assert left > S / 2 > right  # MediaPipe's left eye is on the image's right again
    np.testing.assert_array_equal(out["region_sizes"], face["region_sizes"][topology.REGION_FLIP])
    for name in ("left_eye", "left_brow", "mouth"):  # each region's hull holds its own points again
        inside = region_mask(out, name, grow=1)
        x, y = np.round(out["mesh"][topology.MESH_REGIONS[name]]).astype(int).T
        assert inside[y, x].all(), name

    back = flip(out)
    np.testing.assert_array_equal(back["image"], face["image"])
    for key in (*POINTS, "region_sizes"):
        np.testing.assert_allclose(back[key], face[key], atol=1e-4)
    assert back["key"] == "astronaut" and back["has_mesh"]


def gaussian_dots(points: np.ndarray, sigma: float = 1.2) -> np.ndarray:
    """A black image with one bright Gaussian dot centred exactly on each point."""
    ys, xs = np.mgrid[0:S, 0:S].astype(np.float32)
    image = np.zeros((S, S), np.float32)
    for x, y in points:
        image += 255 * np.exp(-((xs - x) ** 2 + (ys - y) ** 2) / (2 * sigma**2))
    return np.repeat(np.clip(image, 0, 255).astype(np.uint8)[:, :, None], 3, axis=2)


def test_affine_moves_each_dot_with_its_keypoint(face: dict[str, Any]) -> None:
    chin, forehead = 152, 10
    dots = gaussian_dots(np.concatenate([face["landmarks5"], face["mesh"][[chin, forehead]]]))
    sample = {"image": dots, "landmarks5": face["landmarks5"], "mesh": face["mesh"]}
    aug = only(affine_p=1.0, scale=(0.8, 1.2), rotate=30.0, shift=0.1)
    moved = 0.0
    for _ in range(6):
        out = aug(sample)
        expected = np.concatenate([out["landmarks5"], out["mesh"][[chin, forehead]]])
        gray = out["image"][:, :, 0].astype(np.float64)
        count, labels = cv2.connectedComponents((gray > 8).astype(np.uint8))
        assert count - 1 == len(expected)
        for x, y in expected:
            label = labels[int(round(y)), int(round(x))]
            assert label > 0, "no dot under a transformed keypoint"
            ys, xs = np.nonzero(labels == label)
            weights = gray[ys, xs]
            centroid = np.array([xs @ weights, ys @ weights]) / weights.sum()
            assert np.hypot(*(centroid - (x, y))) < 1.5
        moved = max(moved, float(np.abs(expected[:5] - face["landmarks5"]).max()))
    assert moved > 3, "the affine step never moved the points"


@pytest.mark.parametrize("geometry", [{}, dict(flip_p=1.0, affine_p=1.0, rotate=25.0)])
def test_region_masks_cover_their_mesh_points(face: dict[str, Any],
                                              geometry: dict[str, float]) -> None:
    sample = only(**geometry)(face)
    for name in topology.REGIONS:
        inside = region_mask(sample, name, grow=1)
        x, y = np.round(sample["mesh"][topology.MESH_REGIONS[name]]).astype(int).T
        assert inside[np.clip(y, 0, S - 1), np.clip(x, 0, S - 1)].all(), name


@pytest.mark.parametrize("step", ["region_color_p", "region_blur_p", "occlude_p"])
@pytest.mark.parametrize("regions", [("mouth",), ("left_eye", "right_eye")])
def test_region_steps_change_pixels_only_inside_the_region(face: dict[str, Any], step: str,
                                                          regions: tuple[str, ...]) -> None:
    before = snapshot(face)
    aug = only(**{step: 1.0}, regions=regions)
    inside, near = region_mask(face, regions), region_mask(face, regions, grow=2)
    for _ in range(3):
        out = aug(face)
        changed = (out["image"] != face["image"]).any(axis=2)
        assert not (changed & ~near).any(), "pixels changed outside the region"
        assert (changed & inside).sum() > 0.2 * region_mask(face, regions[0]).sum()
        for key in POINTS:
            np.testing.assert_array_equal(out[key], face[key])
    assert_unchanged(face, before)


def test_missing_mesh_stays_nan_and_skips_region_steps(face: dict[str, Any]) -> None:
    regions, sizes = topology.region_hulls(np.full((topology.MESH_POINTS, 2), np.nan, np.float32))
    sample = {**face, "mesh": np.full_like(face["mesh"], np.nan), "has_mesh": False,
              "regions": regions, "region_sizes": sizes}
    regional = dict(region_color_p=1.0, region_blur_p=1.0, occlude_p=1.0)
    np.testing.assert_array_equal(only(**regional)(sample)["image"], face["image"])

    out = FaceAugment(**regional, flip_p=1.0, affine_p=1.0, seed=0)(sample)
    assert np.isnan(out["mesh"]).all() and np.isnan(out["regions"]).all()
    assert not out["region_sizes"].any() and out["has_mesh"] is False
    lm = out["landmarks5"]
    assert np.isfinite(lm).all() and lm[0, 0] < lm[1, 0]


def test_a_subset_of_keys_works(face: dict[str, Any]) -> None:
    sample = {"key": "astronaut", "image": face["image"], "landmarks5": face["landmarks5"]}
    out = FaceAugment(flip_p=1.0, affine_p=1.0, cutout_p=1.0, region_color_p=1.0, seed=0)(sample)
    assert set(out) == set(sample) and out["key"] == "astronaut"
    assert out["image"].shape == (S, S, 3) and out["image"].dtype == np.uint8
    assert out["landmarks5"].shape == (5, 2) and out["landmarks5"][0, 0] < out["landmarks5"][1, 0]
    assert FaceAugment(seed=0)({"image": face["image"]})["image"].shape == (S, S, 3)


class _Repeat(torch.utils.data.Dataset):
    """The same sample at every index, augmented, tagged with the worker that made it."""

    def __init__(self, sample: dict[str, Any], augment: FaceAugment, size: int = 4) -> None:
        self.sample, self.augment, self.size = sample, augment, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        out = self.augment(self.sample)
        return {"worker": torch.utils.data.get_worker_info().id, "image": out["image"],
                "landmarks5": out["landmarks5"]}


def load(dataset: _Repeat, seed: int) -> list[dict[str, Any]]:
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2,
                                         generator=torch.Generator().manual_seed(seed))
    return list(loader)


@pytest.mark.slow
def test_workers_get_different_streams_and_seeded_runs_repeat(face: dict[str, Any]) -> None:
    augment = FaceAugment(affine_p=1.0, seed=0)
    augment(face)  # seeded in this process first, so the workers inherit a used generator
    first = load(_Repeat(face, augment), seed=0)
    by_worker = {w: [item for item in first if item["worker"] == w] for w in (0, 1)}
    assert all(len(items) == 2 for items in by_worker.values())
    assert not torch.equal(by_worker[0][0]["landmarks5"], by_worker[1][0]["landmarks5"])
    assert not torch.equal(by_worker[0][0]["image"], by_worker[1][0]["image"])

    again = load(_Repeat(face, augment), seed=0)
    assert len(again) == len(first) == 4
    for a, b in zip(first, again):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["landmarks5"], b["landmarks5"])


def run(augment: FaceAugment, sample: dict[str, Any], calls: int = 4) -> list[dict[str, Any]]:
    return [augment(sample) for _ in range(calls)]


def assert_same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        for key in ("image", *POINTS, "region_sizes"):
            np.testing.assert_array_equal(x[key], y[key])


def test_a_seed_repeats_in_the_main_process(face: dict[str, Any]) -> None:
    everything = dict(region_color_p=0.5, region_blur_p=0.5, occlude_p=0.5)
    reference = run(FaceAugment(seed=0, **everything), face)
    assert_same(reference, run(FaceAugment(seed=0, **everything), face))
    with pytest.raises(AssertionError):
        assert_same(reference, run(FaceAugment(seed=1, **everything), face))


def test_pickle_round_trip(face: dict[str, Any]) -> None:
    augment = FaceAugment(rotate=20.0, regions=("mouth",), seed=3)
    copy = pickle.loads(pickle.dumps(augment))
    assert repr(copy) == repr(augment)
    assert "rotate=20.0" in repr(copy) and "regions=('mouth',)" in repr(copy)
    reference = run(copy, face)
    assert_same(reference, run(augment, face))
    # After use too: the stream is not pickled, so a copy made here starts it from the seed again.
    assert_same(run(pickle.loads(pickle.dumps(augment)), face), reference)


def test_rejects_unknown_regions() -> None:
    with pytest.raises(ValueError, match="unknown regions"):
        FaceAugment(regions=("left_ear",))
