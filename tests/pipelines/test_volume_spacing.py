"""``resample`` on MONAI's conventions (issue 39 item 3): the stored spacing is exactly the asked
one, and the shape and affine are those MONAI's ``Spacingd`` gives the same NIfTI file (real
MONAI transforms on files from data/make_volumes.py and nibabel's anatomical.nii); every stored
voxel holds the input's trilinear value at the world point its affine names (checked with
scipy, independently of both)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from scipy.ndimage import map_coordinates

from precache.loading import CachedDataset
from precache.processing.ops.volume import DecodeVolume, Resample
from tests.helpers import REPO, build_cache, load_script

monai = pytest.importorskip("monai")

NIBABEL_DATA = Path(nib.__file__).parent / "tests" / "data"
make_volumes = load_script(REPO / "data" / "make_volumes.py", "make_volumes")


def monai_spacing(path: Path, pixdim: tuple[float, float, float]) -> tuple[np.ndarray, np.ndarray]:
    """(volume, affine) from MONAI's own chain: LoadImaged, EnsureChannelFirstd,
    Orientationd(RAS), Spacingd(pixdim, bilinear)."""
    from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, Orientationd, Spacingd

    chain = Compose([LoadImaged("image"), EnsureChannelFirstd("image"),
                     Orientationd("image", axcodes="RAS", labels=None),
                     Spacingd("image", pixdim=pixdim, mode="bilinear")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        image = chain({"image": str(path)})["image"]
    return image[0].numpy(), np.asarray(image.affine, dtype=np.float64)


def input_at(path: Path, affine: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The file's voxels, trilinear with border values (scipy), at the world point of each index
    of ``shape`` under ``affine``."""
    image = nib.load(path)
    ijk = np.indices(shape).reshape(3, -1)
    world = affine @ np.vstack([ijk, np.ones(ijk.shape[1])])
    at = (np.linalg.inv(image.affine) @ world)[:3]
    source = np.asarray(image.dataobj, dtype=np.float64)
    return map_coordinates(source, at, order=1, mode="nearest").reshape(shape)


def test_spacing_is_exactly_the_asked_one_with_monai_shape_and_affine(tmp_path: Path):
    """The pipeline on make_volumes' 1 x 1 x 1.5 mm NIfTI files (one stored LAS) at
    ``spacing=2``: before, align_corners kept the extent and stored 2.09 / 2.03 mm."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    volume, _ = make_volumes.make_volume(3, (23, 20, 17))
    make_volumes.write_nifti(inputs / "ras.nii.gz", volume, flip=False)
    make_volumes.write_nifti(inputs / "las.nii.gz", volume, flip=True)
    expected = {name: monai_spacing(inputs / name, (2.0, 2.0, 2.0))
                for name in ("ras.nii.gz", "las.nii.gz")}
    shape = expected["ras.nii.gz"][0].shape
    assert shape == (12, 10, 13)  # round(22/2 + 1), round(19/2 + 1) (half to even), 16*1.5/2 + 1
    build_cache(inputs, tmp_path / "cache", pipeline="volumes", workers=1,
                params={"spacing": (2.0,), "shape": shape, "normalise": "none",
                        "dtype": "float32", "labels": "none"})
    dataset = CachedDataset(tmp_path / "cache")
    batch = dataset.read_batch(range(len(dataset)))
    dataset.close()
    assert sorted(batch["key"]) == ["las.nii.gz", "ras.nii.gz"]
    for i, key in enumerate(batch["key"]):
        monai_volume, monai_affine = expected[key]
        assert batch["spacing"][i].tolist() == [2.0, 2.0, 2.0]
        np.testing.assert_array_equal(batch["affine"][i], monai_affine)
        stored = batch["volume"][i]
        np.testing.assert_allclose(stored, monai_volume, rtol=0, atol=1e-3 * np.abs(volume).max())
        np.testing.assert_allclose(stored, input_at(inputs / key, batch["affine"][i], shape),
                                   rtol=0, atol=1e-3 * np.abs(volume).max())


@pytest.mark.parametrize("name", ["anatomical.nii", "sheared.nii.gz"])
def test_anisotropic_spacing_equals_monai(tmp_path: Path, name: str):
    """nibabel's anatomical.nii (a real MRI), and a volume whose affine has a shear (MONAI drops
    it: the new grid is not aligned with the old one), to 2.5 x 1.7 x 2 mm, op by op."""
    path = tmp_path / name
    if name == "anatomical.nii":
        shutil.copy(NIBABEL_DATA / name, path)
    else:
        volume, _ = make_volumes.make_volume(1, (20, 18, 12))
        affine = np.array([[1.0, 0.3, 0, 5], [0, 1.1, 0.2, -3], [0, 0, 1.5, 2], [0, 0, 0, 1]])
        nib.save(nib.Nifti1Image(volume, affine), path)
    pixdim = (2.5, 1.7, 2.0)
    decoded = DecodeVolume()({"data": path.read_bytes(), "key": name, "source_key": name})
    out = Resample(spacing=pixdim)(decoded)
    monai_volume, monai_affine = monai_spacing(path, pixdim)
    assert out["spacing"].tolist() == list(np.float32(pixdim))
    assert out["volume"].shape == monai_volume.shape
    # the same float64 matrix, but for the last bits of a sheared input's: MONAI stores
    # input @ solve(input, new), a round trip that leaves 1e-17 where new has 0
    np.testing.assert_allclose(out["affine"], monai_affine, rtol=0, atol=1e-12)
    scale = np.abs(monai_volume).max()
    np.testing.assert_allclose(out["volume"], monai_volume, rtol=0, atol=1e-4 * scale)
    np.testing.assert_allclose(out["volume"], input_at(path, out["affine"], monai_volume.shape),
                               rtol=0, atol=1e-4 * scale)
