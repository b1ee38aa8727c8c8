"""``cache_transforms``: a MONAI or Albumentations chain split at its first random transform;
the deterministic prefix cached by stage 1 equals MONAI's own ``CacheDataset`` (and the
Albumentations prefix run by hand), the random tail runs on every read (new crops and flips
each epoch, in every DataLoader worker), a re-run computes nothing and a rewritten file only
its own sample. Real MONAI transforms on real NIfTI files (data/make_volumes.py), real
Albumentations on crops of real photos."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from precache.bring_your_own import (META_KEYS, Chain, TransformedSample, cache_transforms,
                                     is_random)
from precache.loading import make_loader
from tests.helpers import REPO, load_script, write_photos

monai_transforms = pytest.importorskip("monai.transforms")
A = pytest.importorskip("albumentations")
from monai.data import CacheDataset, MetaTensor  # noqa: E402

make_volumes = load_script(REPO / "data" / "make_volumes.py", "make_volumes")
KEYS = ["image", "label"]
CALLS: list[int] = []


class CountCalls:
    """A deterministic step (in a MONAI ``Lambdad``) that counts the prefix's runs."""

    def __call__(self, value: object) -> object:
        CALLS.append(1)
        return value


class Identityd(monai_transforms.MapTransform):
    """A user's own deterministic MONAI transform (defined outside MONAI)."""

    def __call__(self, data: dict) -> dict:
        return dict(data)


class Brighter(A.ImageOnlyTransform):
    """A user's own deterministic Albumentations transform."""

    def __init__(self) -> None:
        super().__init__(p=1.0)

    def apply(self, img: np.ndarray, **params: object) -> np.ndarray:
        return img + 0.5


class Jitter(Brighter):
    """A user's own random one: it draws its parameters from the transform's generator."""

    def get_params(self) -> dict[str, float]:
        return {"shift": self.py_random.uniform(0, 1)}


def write_volume(folder: Path, i: int, seed: int = 0) -> dict[str, str]:
    volume, _ = make_volumes.make_volume(i, 24, seed=seed)
    image, label = folder / f"vol{i}.nii.gz", folder / f"vol{i}_label.nii.gz"
    make_volumes.write_nifti(image, volume, flip=i % 2 == 1)
    make_volumes.write_nifti(label, (volume > 300).astype(np.float32), flip=i % 2 == 1)
    return {"image": str(image), "label": str(label)}


@pytest.fixture(scope="module")
def volumes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    folder = tmp_path_factory.mktemp("volumes")
    return [write_volume(folder, i) for i in range(6)]


def prefix(*extra: object) -> list[object]:
    T = monai_transforms
    return [T.LoadImaged(KEYS), T.EnsureChannelFirstd(KEYS), T.Orientationd(KEYS, axcodes="RAS"),
            T.Spacingd(KEYS, pixdim=(1.5, 1.5, 1.5), mode=("bilinear", "nearest")),
            T.ScaleIntensityRanged("image", a_min=0, a_max=1000, b_min=0, b_max=1, clip=True),
            T.CropForegroundd(KEYS, source_key="image"), *extra]


def crop_and_flip() -> list[object]:
    T = monai_transforms
    return [T.RandSpatialCropd(KEYS, roi_size=(8, 8, 8), random_size=False),
            T.RandFlipd(KEYS, prob=0.5, spatial_axis=0)]


def epochs(cached: object, n: int = 2, **loader: object) -> list[torch.Tensor]:
    """The images of ``n`` epochs of one loader (in order)."""
    batches = make_loader(cached, batch_size=3, shuffle=False, **loader)
    return [torch.cat([b["image"].as_tensor() if isinstance(b["image"], MetaTensor)
                       else b["image"] for b in batches]) for _ in range(n)]


def test_a_monai_chain_caches_what_cache_dataset_caches_and_runs_its_random_tail_per_epoch(
        tmp_path: Path, volumes: list[dict[str, str]]) -> None:
    T = monai_transforms
    pos_neg = T.Compose(prefix(T.RandCropByPosNegLabeld(KEYS, "label", (8, 8, 8)),
                               T.RandFlipd(KEYS, prob=0.5)))
    assert Chain(pos_neg).split == 6 and Chain(pos_neg).prefix_names[-1] == "CropForegroundd"
    assert is_random(T.RandFlipd(KEYS)) and not is_random(T.Spacingd(KEYS, pixdim=1.0))
    assert Chain(T.Compose([*prefix(Identityd(KEYS)), *crop_and_flip()])).split == 7

    chain = T.Compose(prefix(*crop_and_flip()))
    cached = cache_transforms(volumes, chain, tmp_path / "cache", workers=2, progress=False,
                              log=lambda _: None)
    theirs = CacheDataset(volumes, chain, cache_rate=1.0, num_workers=0, progress=False)
    tail = cached.transform
    assert isinstance(tail, TransformedSample)
    cached.transform = TransformedSample(tail.restore, None)  # the cached prefix alone
    for i, expected in enumerate(theirs._cache):
        ours = cached[i]
        assert set(ours) == set(expected)
        for key in KEYS:  # MetaTensors back, same values, same affine
            assert isinstance(ours[key], MetaTensor)
            assert torch.equal(ours[key].as_tensor(), expected[key].as_tensor())
            assert torch.equal(ours[key].affine, expected[key].affine.to(torch.float64))
            for name in META_KEYS:  # and the metadata later transforms and savers read
                got, want = ours[key].meta[name], expected[key].meta[name]
                assert (np.array_equal(np.asarray(got), np.asarray(want))
                        or (isinstance(want, float) and np.isnan(want) and np.isnan(got))), name
        for key in ("foreground_start_coord", "foreground_end_coord"):
            assert np.array_equal(ours[key], expected[key])

    cached.transform = tail  # the random tail on every read: new crops, same shapes
    first, second = epochs(cached, num_workers=0)
    assert first.shape == second.shape == (6, 1, 8, 8, 8)
    assert not torch.equal(first, second)
    # in worker processes too: each epoch's workers seed the tail afresh (a copied random
    # state would give the same crops every epoch)
    one, two = epochs(cached, num_workers=2, persistent_workers=False)
    assert one.shape == two.shape == (6, 1, 8, 8, 8) and not torch.equal(one, two)


def test_a_rerun_computes_nothing_and_a_rewritten_file_only_its_own_sample(
        tmp_path: Path, volumes: list[dict[str, str]]) -> None:
    folder = tmp_path / "volumes"
    folder.mkdir()
    items = [write_volume(folder, i) for i in range(4)]
    chain = monai_transforms.Compose(prefix(monai_transforms.Lambdad("image", CountCalls()),
                                            *crop_and_flip()))
    out, messages = tmp_path / "cache", []
    CALLS.clear()
    cache_transforms(items, chain, out, workers=1, progress=False, log=messages.append)
    assert len(CALLS) >= 4
    CALLS.clear()
    again = cache_transforms(items, chain, out, workers=1, progress=False, log=messages.append)
    assert CALLS == [] and len(again) == 4

    write_volume(folder, 1, seed=5)  # another volume in the same file
    CALLS.clear()
    changed = cache_transforms(items, chain, out, workers=1, progress=False, log=messages.append)
    assert CALLS == [1]
    changed.transform = TransformedSample(changed.transform.restore, None)
    expected = Chain(chain).prefix(dict(items[1]))
    keys = changed.read_column("key")
    row = next(j for j, k in enumerate(keys) if '"vol1.nii.gz' in k or "vol1.nii.gz" in k)
    assert torch.equal(changed[row]["image"].as_tensor(), expected["image"].as_tensor())

    CALLS.clear()  # a prefix transform's setting changed: every sample again, and says why
    chain.transforms[4].scaler.a_max = 2000.0
    cache_transforms(items, chain, out, workers=1, progress=False, log=messages.append)
    assert len(CALLS) >= 4 and any("fingerprint changed" in m for m in messages)


def test_stage_1_runs_each_items_prefix_once_the_probed_ones_included(
        tmp_path: Path, volumes: list[dict[str, str]]) -> None:
    # stage 1 probes 4 samples to infer the columns; they are stored, not computed again
    chain = monai_transforms.Compose(prefix(monai_transforms.Lambdad("image", CountCalls()),
                                            *crop_and_flip()))
    CALLS.clear()
    cached = cache_transforms(volumes, chain, tmp_path / "cache", workers=1, progress=False,
                              log=lambda _: None)
    assert len(CALLS) == len(volumes)
    # in tasks of about a quarter of a worker's share (a worker importing MONAI is not waited
    # for): 6 samples, one process, tasks (and shards) of one sample
    assert len(set(cached.shard_ids.tolist())) == len(volumes)
    cached.transform = TransformedSample(cached.transform.restore, None)
    for i in (0, 2, 5):  # probed (0, 5) and computed (2) alike: the prefix's values
        expected = Chain(chain).prefix(dict(volumes[i]))
        assert torch.equal(cached[i]["label"].as_tensor(), expected["label"].as_tensor())


def test_an_albumentations_chain_caches_resize_and_normalize_and_flips_per_epoch(
        tmp_path: Path) -> None:
    paths = write_photos(tmp_path / "photos", 6, size=40)
    items = [{"image": str(p), "label": i % 2} for i, p in enumerate(paths)]
    chain = A.Compose([A.Resize(32, 32), A.Normalize(), A.HorizontalFlip(p=0.5),
                       A.RandomBrightnessContrast(p=1.0)])
    assert Chain(chain).split == 2
    assert not is_random(A.HorizontalFlip(p=1.0)) and is_random(A.HorizontalFlip(p=0.5))
    assert is_random(A.RandomBrightnessContrast(p=1.0)) and not is_random(A.Normalize())
    assert not is_random(Brighter()) and is_random(Jitter())

    cached = cache_transforms(items, chain, tmp_path / "cache", workers=1, progress=False,
                              log=lambda _: None)
    tail = cached.transform
    cached.transform = TransformedSample(tail.restore, None)
    by_hand = A.Compose([A.Resize(32, 32), A.Normalize()])
    from PIL import Image
    for i, item in enumerate(items):
        expected = by_hand(image=np.asarray(Image.open(item["image"]).convert("RGB")))["image"]
        assert np.array_equal(cached[i]["image"], expected) and cached[i]["label"] == i % 2
    cached.transform = tail
    first, second = epochs(cached, num_workers=0)
    assert first.shape == second.shape == (6, 32, 32, 3) and not torch.equal(first, second)

    with pytest.raises(ValueError, match="first transform .HorizontalFlip. is random"):
        cache_transforms(items, A.Compose([A.HorizontalFlip(p=0.5), A.Resize(8, 8)]),
                         tmp_path / "other", workers=1, progress=False)


def test_cache_dataset_over_a_monai_dataset_gives_its_metatensors_back(
        tmp_path: Path, volumes: list[dict[str, str]]) -> None:
    from monai.data import Dataset

    from precache.bring_your_own import cache_dataset

    T = monai_transforms
    theirs = Dataset(volumes, T.Compose([T.LoadImaged(KEYS), T.EnsureChannelFirstd(KEYS)]))
    cached = cache_dataset(theirs, tmp_path / "cache", workers=1, progress=False,
                           log=lambda _: None, ragged=KEYS)
    for i in range(len(volumes)):
        ours, expected = cached[i], theirs[i]
        for key in KEYS:  # MetaTensors back: values, affine and metadata
            assert isinstance(ours[key], MetaTensor)
            assert torch.equal(ours[key].as_tensor(), expected[key].as_tensor())
            assert torch.equal(ours[key].affine, expected[key].affine.to(torch.float64))
            assert ours[key].meta["filename_or_obj"] == expected[key].meta["filename_or_obj"]
            assert np.array_equal(ours[key].meta["spatial_shape"],
                                  expected[key].meta["spatial_shape"])
