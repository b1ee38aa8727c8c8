"""``cache_transforms(..., track_meta=False)``: the random tail served as plain tensors
(``precache.transforms_tail.PlainTail``) gives, for the same seed, the values MONAI's own tail
gives on MetaTensors: the crops and flips precache runs itself draw from the MONAI transform
objects in MONAI's order, and what follows an unknown transform runs through MONAI. Real
MONAI transforms on real NIfTI files (data/make_volumes.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from precache.bring_your_own import cache_transforms
from precache.loading import make_loader
from precache.transforms_tail import PlainTail
from tests.helpers import REPO, load_script

T = pytest.importorskip("monai.transforms")
A = pytest.importorskip("albumentations")

make_volumes = load_script(REPO / "data" / "make_volumes.py", "make_volumes")
KEYS = ["image", "label"]


@pytest.fixture(scope="module")
def volumes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    folder = tmp_path_factory.mktemp("plain_tail_volumes")
    items = []
    for i in range(4):
        volume, _ = make_volumes.make_volume(i, 24)
        image, label = folder / f"vol{i}.nii.gz", folder / f"vol{i}_label.nii.gz"
        make_volumes.write_nifti(image, volume, flip=i % 2 == 1)
        make_volumes.write_nifti(label, (volume > 300).astype(np.float32), flip=i % 2 == 1)
        items.append({"image": str(image), "label": str(label)})
    return items


def chain(*tail: object) -> object:
    return T.Compose([
        T.LoadImaged(KEYS), T.EnsureChannelFirstd(KEYS), T.Orientationd(KEYS, axcodes="RAS"),
        T.Spacingd(KEYS, pixdim=(1.5, 1.5, 1.5), mode=("bilinear", "nearest")),
        T.ScaleIntensityRanged("image", a_min=0, a_max=1000, b_min=0, b_max=1, clip=True),
        T.CropForegroundd(KEYS, source_key="image"), *tail])


def both(volumes: list[dict[str, str]], pipeline: object, out: Path) -> tuple[object, object]:
    """The same cache served with MetaTensors (MONAI's tail) and as plain tensors."""
    options = {"workers": 1, "progress": False, "log": lambda _: None}
    meta = cache_transforms(volumes, pipeline, out, **options)
    plain = cache_transforms(volumes, pipeline, out, track_meta=False, **options)
    return meta, plain


def assert_same(meta_samples: list[dict], plain_samples: list[dict]) -> None:
    for ours, theirs in zip(plain_samples, meta_samples, strict=True):
        assert set(ours) == set(theirs) - {"__meta__"}
        for key in KEYS:
            assert type(ours[key]) is torch.Tensor  # plain, as under set_track_meta(False)
            assert torch.equal(ours[key], theirs[key].as_tensor()), key


@pytest.mark.parametrize("tail, native", ids=["crop-flip", "sizes-axes-unknown"], argvalues=[
    # the benchmark's tail: a fixed-size random crop and a flip, both run by precache
    ((lambda: [T.RandSpatialCropd(KEYS, roi_size=(8, 8, 8), random_size=False),
               T.RandFlipd(KEYS, prob=0.5, spatial_axis=0)]), 2),
    # random sizes at the centre, flips on every axis and on two, then a transform precache
    # does not know (run by MONAI with track_meta off) and a known one after it
    ((lambda: [T.RandSpatialCropd(KEYS, roi_size=(6, 8, -1), random_size=True,
                                  random_center=False),
               T.RandFlipd(KEYS, prob=0.7), T.RandFlipd(KEYS, prob=0.5, spatial_axis=(1, 2)),
               T.RandScaleIntensityd("image", factors=0.3, prob=0.8),
               T.RandScaleCropd(KEYS, roi_scale=0.5, random_size=True)]), 3),
])
def test_the_plain_tail_gives_monais_values_for_the_same_seed(
        tmp_path: Path, volumes: list[dict[str, str]], tail: object, native: int) -> None:
    pipeline = chain(*tail())
    meta, plain = both(volumes, pipeline, tmp_path / "cache")
    assert isinstance(plain.transform, PlainTail) and plain.transform.native == native
    pipeline.set_random_state(seed=3)  # one chain object: both tails draw from it
    theirs = [meta[i % 4] for i in range(16)]
    pipeline.set_random_state(seed=3)
    ours = [plain[i % 4] for i in range(16)]
    assert_same(theirs, ours)
    assert len({tuple(s["image"].shape) for s in ours} | {s["image"].sum().item() for s in ours}) > 2


def test_the_plain_tail_in_loader_workers_matches_the_metatensor_tail(
        tmp_path: Path, volumes: list[dict[str, str]]) -> None:
    pipeline = chain(T.RandSpatialCropd(KEYS, roi_size=(8, 8, 8), random_size=False),
                     T.RandFlipd(KEYS, prob=0.5, spatial_axis=0))
    meta, plain = both(volumes, pipeline, tmp_path / "cache")

    def epochs(cached: object) -> list[torch.Tensor]:
        loader = make_loader(cached, batch_size=2, num_workers=2, seed=11,
                             persistent_workers=False)
        return [torch.cat([torch.as_tensor(b["image"]).as_subclass(torch.Tensor)
                           for b in loader]) for _ in range(2)]

    theirs, ours = epochs(meta), epochs(plain)
    for a, b in zip(theirs, ours):  # each worker seeds the chain from its seed, as MONAI's does
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], ours[1])  # and each epoch draws afresh


def test_track_meta_off_is_refused_for_a_chain_that_is_not_monais(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="track_meta=False is for MONAI chains"):
        cache_transforms([], A.Compose([A.Resize(8, 8), A.HorizontalFlip(p=0.5)]),
                         tmp_path / "cache", track_meta=False, workers=1)
