"""The volumes pipeline on real NIfTI files (nibabel's own test volumes and synthetic ones written
by data/make_volumes.py), a MedMNIST-style .npz and broken inputs: RAS orientation, the affine
that maps a stored voxel back onto the input, labels and splits, and error rows with reasons."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from precache import Cache
from precache.loading import CachedDataset
from precache.processing.ops.volume import FitShape, NormaliseIntensity, Resample
from tests.helpers import REPO, build_cache, load_script

NIBABEL_DATA = Path(nib.__file__).parent / "tests" / "data"
make_volumes = load_script(REPO / "data" / "make_volumes.py", "make_volumes")


@pytest.fixture(scope="module")
def volume_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(inputs, cache): 6 synthetic volumes (3 classes) of 24^3 at 1 x 1 x 1.5 mm, two of them
    the same volume once stored RAS and once LAS; nibabel's anatomical.nii and 4D example;
    and five broken files. Resampled to 2 mm, fitted to 20^3."""
    root = tmp_path_factory.mktemp("volumes")
    inputs = root / "in"
    for i in range(6):
        volume, label = make_volumes.make_volume(i, 24)
        folder = inputs / make_volumes.CLASSES[label]
        folder.mkdir(parents=True, exist_ok=True)
        make_volumes.write_nifti(folder / f"v{i}.nii.gz", volume, flip=False)
    volume, _ = make_volumes.make_volume(0, 24)
    make_volumes.write_nifti(inputs / "ball" / "v0_las.nii.gz", volume, flip=True)
    (inputs / "real").mkdir()
    shutil.copy(NIBABEL_DATA / "anatomical.nii", inputs / "real")
    shutil.copy(NIBABEL_DATA / "example4d.nii.gz", inputs / "real")
    bad = inputs / "bad"
    bad.mkdir()
    data = (inputs / "ball" / "v0.nii.gz").read_bytes()
    (bad / "truncated.nii.gz").write_bytes(data[: len(data) // 2])
    raw = gzip.decompress(data)
    (bad / "lying_header.nii").write_bytes(raw[:-500])  # the header's shape needs 500 bytes more
    nib.save(nib.Nifti1Image(np.ones((16, 16, 1), np.int16), np.eye(4)), bad / "flat.nii")
    np.save(bad / "nan.npy", np.full((8, 8, 8), np.nan, np.float32))
    np.save(bad / "constant.npy", np.full((8, 8, 8), 7, np.int16))
    cache = root / "cache"
    build_cache(inputs, cache, pipeline="volumes", params={"spacing": (2.0,), "shape": (20,)},
                workers=1)
    return inputs, cache


def rows(cache: Path) -> dict[str, dict]:
    dataset = CachedDataset(cache)
    batch = dataset.read_batch(range(len(dataset)))
    dataset.close()
    return {key: {name: values[i] for name, values in batch.items()}
            for i, key in enumerate(batch["key"])}


def test_columns_orientation_and_the_affine_map_back_to_the_input(volume_cache):
    inputs, cache = volume_cache
    found = rows(cache)
    assert set(found) == {f"{c}/v{i}.nii.gz" for i, c in enumerate(["ball", "box", "tube"] * 2)} | {
        "ball/v0_las.nii.gz", "real/anatomical.nii", "real/example4d.nii.gz#t0",
        "real/example4d.nii.gz#t1"}
    row = found["box/v1.nii.gz"]
    assert row["volume"].shape == (20, 20, 20) and row["volume"].dtype == np.uint8
    assert row["label"] == "box" and row["split"] == ""
    np.testing.assert_allclose(row["original_spacing"], [1, 1, 1.5])
    assert list(row["original_shape"]) == [24, 24, 24]
    np.testing.assert_allclose(row["spacing"], [2, 2, 2], atol=0.1)
    # the same picture stored LAS comes out voxel for voxel as its RAS twin
    np.testing.assert_array_equal(found["ball/v0_las.nii.gz"]["volume"],
                                  found["ball/v0.nii.gz"]["volume"])
    np.testing.assert_allclose(found["ball/v0_las.nii.gz"]["affine"],
                               found["ball/v0.nii.gz"]["affine"], atol=1e-6)
    # every stored voxel's world position lands on an input voxel of the same intensity
    for key in ("tube/v2.nii.gz", "real/anatomical.nii"):
        image = nib.load(inputs / key)
        source = np.asarray(image.dataobj, dtype=np.float32)
        stored = found[key]["volume"].astype(np.float32)
        ijk = np.argwhere(stored >= 0)
        world = found[key]["affine"] @ np.c_[ijk, np.ones(len(ijk))].T
        at = np.rint(np.linalg.inv(image.affine) @ world)[:3].T.astype(int)
        inside = ((at >= 0) & (at < source.shape)).all(1)
        values = source[tuple(at[inside].T)]
        assert inside.mean() > 0.3 and np.corrcoef(values, stored[tuple(ijk[inside].T)])[0, 1] > 0.85


def test_broken_inputs_are_error_rows_with_a_reason_and_the_run_goes_on(volume_cache):
    _, cache = volume_cache
    errors = {r["key"]: r["message"] for r in Cache(cache).read_errors().to_pylist()}
    assert set(errors) == {"bad/truncated.nii.gz", "bad/lying_header.nii", "bad/flat.nii",
                           "bad/nan.npy", "bad/constant.npy"}
    assert "truncated or corrupt; copy it again" in errors["bad/truncated.nii.gz"]
    assert "the header says shape (24, 24, 24)" in errors["bad/lying_header.nii"]
    assert "2D image" in errors["bad/flat.nii"]
    assert "no finite voxel (all NaN" in errors["bad/nan.npy"]
    assert "constant volume (every voxel is 7)" in errors["bad/constant.npy"]
    assert Cache(cache).manifest.counts["ok"] == 9


def test_a_medmnist_npz_gives_one_row_per_volume_with_its_label_and_split(tmp_path: Path):
    make_volumes.make_npz(tmp_path / "set.npz", count=20, size=12)
    build_cache(tmp_path / "set.npz", tmp_path / "cache", pipeline="volumes",
                params={"shape": (12,)}, workers=1)
    found = rows(tmp_path / "cache")
    archive = np.load(tmp_path / "set.npz")
    assert len(found) == 20
    for split in ("train", "val", "test"):
        for i, (image, label) in enumerate(zip(archive[f"{split}_images"],
                                               archive[f"{split}_labels"])):
            row = found[f"set.npz#{split}{i:06d}"]
            assert row["split"] == split and str(row["label"]) == str(int(label[0]))
            # percentiles rescale, but the order of intensities is kept
            assert np.corrcoef(row["volume"].ravel(), image.ravel())[0, 1] > 0.95


def test_normalise_none_keeps_a_medmnist_npz_as_it_is(tmp_path: Path):
    """MedMNIST volumes are 0..255 already: the default scaling moves them, normalise=none keeps
    every voxel; an input outside uint8's range is an error row with the fix."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    make_volumes.make_npz(inputs / "set.npz", count=12, size=12)
    np.save(inputs / "wide.npy", np.linspace(-100, 900, 12**3, dtype=np.float32).reshape(12, 12, 12))
    build_cache(inputs, tmp_path / "cache", pipeline="volumes", workers=1,
                params={"shape": (12,), "normalise": "none", "labels": "none"})
    found = rows(tmp_path / "cache")
    archive = np.load(inputs / "set.npz")
    for split in ("train", "val", "test"):
        for i, image in enumerate(archive[f"{split}_images"]):
            volume = found[f"set.npz#{split}{i:06d}"]["volume"]
            assert volume.dtype == np.uint8
            np.testing.assert_array_equal(volume, image)
    errors = {r["key"]: r["message"] for r in Cache(tmp_path / "cache").read_errors().to_pylist()}
    assert set(errors) == {"wide.npy"}
    assert "span -100..900, outside uint8's 0..255: add --set dtype=float32" in errors["wide.npy"]


def test_normalise_none_keeps_floats_and_refuses_what_uint8_would_destroy():
    unit = np.random.default_rng(0).random((6, 6, 6)).astype(np.float32)
    kept = NormaliseIntensity(normalise="none", dtype="float32")({"volume": unit})["volume"]
    np.testing.assert_array_equal(kept, unit)
    with pytest.raises(ValueError, match="round them to 0 and 1: add --set dtype=float32"):
        NormaliseIntensity(normalise="none")({"volume": unit})
    with pytest.raises(ValueError, match="window and percentiles do nothing"):
        NormaliseIntensity(normalise="none", window=(0, 255))
    assert "normalise" not in NormaliseIntensity().params  # old caches keep their fingerprint


def test_resample_and_fit_shape_keep_world_positions():
    affine = np.array([[-1.0, 0, 0, 30], [0, 1, 0, -5], [0, 0, 2.5, 7], [0, 0, 0, 1]])
    volume = np.random.default_rng(0).random((21, 11, 9)).astype(np.float32)
    sample = {"volume": volume, "affine": affine, "spacing": np.array([1, 1, 2.5], np.float32)}
    out = Resample(spacing=2.0)(sample)
    # exactly 2 mm (MONAI's Spacing): round(extent / 2 + 1) voxels, voxel 0 where it was
    assert out["volume"].shape == (11, 6, 11) and out["spacing"].tolist() == [2.0, 2.0, 2.0]
    np.testing.assert_allclose(out["affine"], [[-2, 0, 0, 30], [0, 2, 0, -5], [0, 0, 2, 7],
                                               [0, 0, 0, 1]])
    # stored voxel (3, 2, 4) is input voxel (6, 4, 3.2): the same world point
    np.testing.assert_allclose(out["volume"][3, 2, 4],
                               volume[6, 4, 3] * 0.8 + volume[6, 4, 4] * 0.2, rtol=1e-5)
    fitted = FitShape(shape=(8, 8, 8))(out)
    # stored voxel (0,0,0) of the fitted volume is voxel (1, -1, 1) of the resampled one
    np.testing.assert_allclose(fitted["affine"] @ [0, 0, 0, 1], out["affine"] @ [1, -1, 1, 1])
    np.testing.assert_array_equal(fitted["volume"][:, 1:7], out["volume"][1:9, :, 1:9])
