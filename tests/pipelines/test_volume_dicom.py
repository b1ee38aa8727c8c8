"""DICOM series in the volumes pipeline (issue 39 item 3): real DICOM files written with pydicom
from a known NumPy volume and a known world geometry, zipped one series folder per ``.zip``
(file names shuffled, so only ``ImagePositionPatient`` orders them), come out as the NIfTI file
of the same data and geometry does, and as MONAI's ``PydicomReader`` reads the folder; a series
missing a slice, and an archive holding a file that is not DICOM, are failed inputs with the
file's name and the fix. A plain folder of DICOM files is one input too, read as its ``.zip``."""

from __future__ import annotations

import io
import os
import shutil
import warnings
import zipfile
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from precache import Cache
from precache.loading import CachedDataset
from precache.processing.sources import list_inputs, read_bytes
from tests.helpers import build_cache

pydicom = pytest.importorskip("pydicom")

SHAPE = (16, 12, 8)  # columns (i), rows (j), slices (k): unequal, so a transposition shows
SLOPE, INTERCEPT = 2.0, -1024.0


def rotation(x_deg: float, z_deg: float) -> np.ndarray:
    """A rotation about x, then about z."""
    a, b = np.radians(x_deg), np.radians(z_deg)
    rx = np.array([[1, 0, 0], [0, np.cos(a), -np.sin(a)], [0, np.sin(a), np.cos(a)]])
    rz = np.array([[np.cos(b), -np.sin(b), 0], [np.sin(b), np.cos(b), 0], [0, 0, 1]])
    return rz @ rx


def geometry(matrix: np.ndarray, origin: tuple[float, float, float]) -> np.ndarray:
    """A RAS affine whose direction cosines are rounded to 6 decimals, as DICOM's decimal
    strings hold them (so the NIfTI and the DICOM headers say the same)."""
    affine = np.eye(4)
    spacing = np.linalg.norm(matrix, axis=0)
    affine[:3, :3] = np.round(matrix / spacing, 6) * spacing
    affine[:3, 3] = origin
    return affine


GEOMETRIES = {
    # oblique: 20 degrees about x, 10 about z; 0.8 x 0.9 mm pixels, 2.5 mm slices
    "oblique": geometry(rotation(20, 10) @ np.diag([0.8, 0.9, 2.5]), (-40.0, 12.5, 30.0)),
    # flipped: columns run right to left (LPS's +x), slices head to feet
    "flipped": geometry(np.diag([0.7, -0.7, -2.0]), (10.0, 60.0, -5.0)),
}


def raw_volume(seed: int) -> np.ndarray:
    """The stored integers (before RescaleSlope / Intercept), V[i, j, k]."""
    return np.random.default_rng(seed).integers(0, 1500, SHAPE).astype(np.int16)


def write_series(folder: Path, raw: np.ndarray, affine: np.ndarray, uid: str,
                 seed: int) -> list[str]:
    """One CT slice file per k, named in a shuffled order: pixel (row j, column i) of slice k is
    raw[i, j, k] at world (RAS) point affine @ (i, j, k). Returns the file names by k."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

    folder.mkdir(parents=True)
    lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ affine
    spacing = np.linalg.norm(lps[:3, :3], axis=0)
    row_dir, col_dir = lps[:3, 0] / spacing[0], lps[:3, 1] / spacing[1]
    names = np.random.default_rng(seed).permutation(SHAPE[2])
    for k in range(SHAPE[2]):
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID = CTImageStorage
        meta.MediaStorageSOPInstanceUID = generate_uid()
        meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds = Dataset()
        ds.file_meta = meta
        ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, meta.MediaStorageSOPInstanceUID
        ds.Modality, ds.SeriesInstanceUID, ds.InstanceNumber = "CT", uid, k + 1
        ds.ImageOrientationPatient = [f"{v:.6f}" for v in (*row_dir, *col_dir)]
        ds.ImagePositionPatient = [f"{v:.6f}" for v in lps[:3] @ [0, 0, k, 1]]
        ds.PixelSpacing = [f"{spacing[1]:.6f}", f"{spacing[0]:.6f}"]  # between rows, columns
        ds.SliceThickness = f"{spacing[2]:.6f}"
        ds.RescaleSlope, ds.RescaleIntercept = f"{SLOPE:g}", f"{INTERCEPT:g}"
        ds.Rows, ds.Columns = SHAPE[1], SHAPE[0]
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
        ds.PixelData = np.ascontiguousarray(raw[:, :, k].T).tobytes()
        ds.save_as(folder / f"IM{names[k]:04d}.dcm", enforce_file_format=True)
    return [f"IM{n:04d}.dcm" for n in names]


def zip_folder(folders: list[Path], path: Path, skip: str = "", junk: bool = False) -> None:
    """The folders' files in one ``.zip`` (each under its folder's name), but ``skip``."""
    with zipfile.ZipFile(path, "w") as archive:
        for folder in folders:
            for file in sorted(folder.iterdir()):
                if file.name != skip:
                    archive.write(file, f"{folder.name}/{file.name}")
        if junk:
            archive.writestr(f"{folders[0].name}/IM9999.dcm", b"not a DICOM file" * 20)


@pytest.fixture(scope="module")
def dicom_cache(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both series as DICOM .zip files and as NIfTI files of the same data and geometry, one
    .zip of both series, one missing a slice and one with a file that is not DICOM; the
    pipeline run with values kept (float32) and no resampling."""
    root = tmp_path_factory.mktemp("dicom")
    inputs, folders, names = root / "in", {}, {}
    inputs.mkdir()
    for n, (name, affine) in enumerate(GEOMETRIES.items()):
        raw = raw_volume(n)
        folders[name] = root / "series" / name
        names[name] = write_series(folders[name], raw, affine,
                                   uid=f"1.2.826.0.1.3680043.8.498.{n + 1}", seed=n)
        zip_folder([folders[name]], inputs / f"{name}.zip")
        values = (raw.astype(np.float64) * SLOPE + INTERCEPT).astype(np.float32)
        nib.save(nib.Nifti1Image(values, affine), inputs / f"{name}.nii.gz")
    zip_folder(list(folders.values()), inputs / "both.zip")
    missing = names["oblique"][3]  # the 4th slice by position: a gap inside the series
    zip_folder([folders["oblique"]], inputs / "missing.zip", skip=missing)
    zip_folder([folders["flipped"]], inputs / "junk.zip", junk=True)
    build_cache(inputs, root / "cache", pipeline="volumes", workers=1, params=PARAMS)
    errors = {r["key"]: r["message"] for r in Cache(root / "cache").read_errors().to_pylist()}
    return {"rows": read_rows(root / "cache"), "errors": errors, "folders": folders,
            "names": names, "inputs": inputs}


PARAMS = {"shape": SHAPE, "normalise": "none", "dtype": "float32", "labels": "none"}
"""Values kept (float32), no resampling: the rows are the volumes as read."""


def read_rows(cache: Path) -> dict[str, dict]:
    """key -> row (column -> value) of every row of ``cache``."""
    dataset = CachedDataset(cache)
    try:
        batch = dataset.read_batch(range(len(dataset)))
    finally:
        dataset.close()
    return {key: {name: values[i] for name, values in batch.items()}
            for i, key in enumerate(batch["key"])}


def test_a_dicom_series_is_stored_as_the_nifti_of_the_same_data(dicom_cache):
    rows = dicom_cache["rows"]
    for n, name in enumerate(GEOMETRIES):
        dicom = rows[f"{name}.zip#1.2.826.0.1.3680043.8.498.{n + 1}"]
        nifti = rows[f"{name}.nii.gz"]
        np.testing.assert_array_equal(dicom["volume"], nifti["volume"])
        np.testing.assert_allclose(dicom["affine"], nifti["affine"], atol=1e-5)
        np.testing.assert_allclose(dicom["spacing"], nifti["spacing"], rtol=1e-6)
        assert dicom["original_shape"].tolist() == nifti["original_shape"].tolist()
    # the oblique series: RAS-ish already, so voxel (i, j, k) is column i, row j of slice k
    np.testing.assert_allclose(rows["oblique.zip#1.2.826.0.1.3680043.8.498.1"]["spacing"],
                               [0.8, 0.9, 2.5], rtol=1e-5)
    oblique = rows["oblique.zip#1.2.826.0.1.3680043.8.498.1"]["volume"]
    np.testing.assert_array_equal(oblique, raw_volume(0) * SLOPE + INTERCEPT)
    # one .zip holding both series: a row per SeriesInstanceUID, each as its own .zip gives it
    for n, name in enumerate(GEOMETRIES):
        uid = f"1.2.826.0.1.3680043.8.498.{n + 1}"
        np.testing.assert_array_equal(rows[f"both.zip#{uid}"]["volume"],
                                      rows[f"{name}.zip#{uid}"]["volume"])


def test_a_series_is_read_as_monai_pydicomreader_reads_its_folder(dicom_cache):
    """MONAI's reader orders slices by InstanceNumber (ours by position; the files' names are
    shuffled) and gives LPS turned to RAS: after Orientation("RAS") the same voxels and affine."""
    from monai.transforms import Compose, EnsureChannelFirst, LoadImage, Orientation

    chain = Compose([LoadImage(reader="PydicomReader", image_only=True), EnsureChannelFirst(),
                     Orientation(axcodes="RAS", labels=None)])
    for n, name in enumerate(GEOMETRIES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = chain(str(dicom_cache["folders"][name]))
        row = dicom_cache["rows"][f"{name}.zip#1.2.826.0.1.3680043.8.498.{n + 1}"]
        np.testing.assert_array_equal(row["volume"], image[0].numpy())
        np.testing.assert_allclose(row["affine"], np.asarray(image.affine), atol=1e-5)


def test_a_series_missing_a_slice_or_holding_junk_is_a_failed_input(dicom_cache):
    errors = dicom_cache["errors"]
    assert set(errors) == {"missing.zip", "junk.zip"}
    missing, names = errors["missing.zip"], dicom_cache["names"]["oblique"]
    assert (f"slices 'oblique/{names[2]}' and 'oblique/{names[4]}' are 5 mm apart, the others "
            "2.5 mm (a slice missing") in missing
    assert "add the missing file" in missing and "\n" not in missing
    assert ("'flipped/IM9999.dcm' is not a readable DICOM file" in errors["junk.zip"]
            and "remove it from the series folder or .zip" in errors["junk.zip"])


def test_the_affine_names_the_world_point_written_into_the_headers(dicom_cache):
    """Independently of nibabel: stored voxel 0 of the flipped series sits at the world point
    (RAS) of the voxel the header geometry puts lowest along every axis."""
    row = dicom_cache["rows"]["flipped.zip#1.2.826.0.1.3680043.8.498.2"]
    affine = GEOMETRIES["flipped"]
    corner = affine @ [0, SHAPE[1] - 1, SHAPE[2] - 1, 1]  # -y and -z run backwards
    np.testing.assert_allclose(row["affine"] @ [0, 0, 0, 1], corner, atol=1e-5)
    raw = raw_volume(1)[:, ::-1, ::-1]
    np.testing.assert_array_equal(row["volume"], raw * SLOPE + INTERCEPT)



def test_a_folder_of_dicom_files_is_one_input_read_as_its_zip(dicom_cache, tmp_path):
    """Series kept on disk as folders (beside a NIfTI file) give the rows their .zip files give;
    a re-run computes nothing, and a changed slice recomputes its series alone (a slice only
    touched, its bytes the same, recomputes nothing)."""
    scans = tmp_path / "scans"
    for name, folder in dicom_cache["folders"].items():
        shutil.copytree(folder, scans / "ct" / name)
    shutil.copy(dicom_cache["inputs"] / "oblique.nii.gz", scans / "oblique.nii.gz")
    first = build_cache(scans, tmp_path / "cache", pipeline="volumes", workers=1, params=PARAMS)
    assert (first.inputs, first.computed, first.failed) == (3, 3, 0)
    rows, uids = read_rows(tmp_path / "cache"), {}
    for n, name in enumerate(GEOMETRIES):
        uids[name] = uid = f"1.2.826.0.1.3680043.8.498.{n + 1}"
        zipped, folder = dicom_cache["rows"][f"{name}.zip#{uid}"], rows[f"ct/{name}#{uid}"]
        assert folder["source_key"] == f"ct/{name}"
        for column in ("volume", "affine", "spacing", "original_shape", "original_spacing"):
            np.testing.assert_array_equal(folder[column], zipped[column])
    assert sorted(rows) == ["ct/flipped#" + uids["flipped"], "ct/oblique#" + uids["oblique"],
                            "oblique.nii.gz"]

    again = build_cache(scans, tmp_path / "cache", pipeline="volumes", workers=1, params=PARAMS)
    assert (again.computed, again.reused) == (0, 3)

    changed = scans / "ct" / "oblique" / dicom_cache["names"]["oblique"][0]  # slice k = 0
    data = bytearray(changed.read_bytes())
    data[-2:] = (7).to_bytes(2, "little", signed=True)  # voxel (15, 11, 0): the last pixel
    changed.write_bytes(bytes(data))
    touched = scans / "ct" / "flipped" / dicom_cache["names"]["flipped"][0]
    for path in (changed, touched):  # a newer time, whatever the file system's resolution
        stamp = path.stat().st_mtime_ns + 2_000_000_000
        os.utime(path, ns=(stamp, stamp))
    third = build_cache(scans, tmp_path / "cache", pipeline="volumes", workers=1, params=PARAMS)
    assert (third.computed, third.reused, third.failed) == (1, 2, 0)
    oblique = read_rows(tmp_path / "cache")[f"ct/oblique#{uids['oblique']}"]["volume"]
    expected = raw_volume(0) * SLOPE + INTERCEPT
    expected[SHAPE[0] - 1, SHAPE[1] - 1, 0] = 7 * SLOPE + INTERCEPT
    np.testing.assert_array_equal(oblique, expected)


def test_only_folders_holding_dicom_files_are_series(dicom_cache, tmp_path):
    """A folder without DICOM files is walked as before (a README without a suffix is not
    DICOM); suffix-less DICOM files make a series; the folder given as the input, or named by a
    list, is a series too; a series in the output folder is not an input; a folder named in
    Latin-1 reads back; other pipelines list no folders."""
    from pipelines.volumes.pipeline import pipeline

    oblique = dicom_cache["folders"]["oblique"]
    data = tmp_path / "data"
    (data / "plain" / "sub").mkdir(parents=True)
    (data / "plain" / "README").write_text("not DICOM, and no suffix\n")
    (data / "plain" / "notes.txt").write_text("notes\n")
    np.save(data / "plain" / "sub" / "scan.npy", np.zeros((2, 2, 2), np.float32))
    shutil.copy(dicom_cache["inputs"] / "flipped.nii.gz", data / "plain" / "a.nii.gz")
    (data / "bare").mkdir()  # DICOM files named without a suffix, as many scanners write them
    for n, file in enumerate(sorted(oblique.iterdir())):
        shutil.copy(file, data / "bare" / f"{n:08d}")
    shutil.copytree(oblique, data / "out" / "series")
    latin = os.fsencode(data) + b"/caf\xe9"
    shutil.copytree(oblique, os.fsdecode(latin))

    listed = list_inputs(data, pipeline.extensions, exclude=data / "out")
    assert [i.key for i in listed] == ["bare", "caf\\xe9", "plain/a.nii.gz", "plain/sub/scan.npy"]
    bare, latin_series = listed[0], listed[1]
    assert bare.size == sum(f.stat().st_size for f in oblique.iterdir())
    with zipfile.ZipFile(io.BytesIO(read_bytes(bare.locator))) as archive:
        assert archive.namelist() == [f"bare/{n:08d}" for n in range(SHAPE[2])]
    assert read_bytes(bare.locator) == read_bytes(bare.locator)  # the same bytes: the same hash
    with zipfile.ZipFile(io.BytesIO(read_bytes(latin_series.locator))) as archive:
        assert archive.namelist() == [f"caf\\xe9/{f.name}" for f in sorted(oblique.iterdir())]

    assert [i.key for i in list_inputs(oblique, pipeline.extensions)] == ["oblique"]
    (tmp_path / "series.lst").write_text("data/bare/\ndata/plain/a.nii.gz\n")
    assert [i.key for i in list_inputs(tmp_path / "series.lst", pipeline.extensions)] \
        == ["data/bare", "data/plain/a.nii.gz"]
    assert list_inputs(tmp_path / "series.lst", pipeline.extensions)[0].locator == bare.locator
    assert [i.key for i in list_inputs(data, (".nii.gz", ".npy"))] \
        == ["plain/a.nii.gz", "plain/sub/scan.npy"]
