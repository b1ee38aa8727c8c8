"""Read 3D volumes from bytes: NIfTI (``.nii``, ``.nii.gz``, through nibabel), ``.npy`` and
MedMNIST-style ``.npz`` files, each as a list of ``VolumeRecord`` (one input may hold many).

NIfTI volumes come back in RAS+ orientation (``nibabel.as_closest_canonical``: a permutation and
flips of the voxel axes, no resampling) with their affine; NumPy volumes have no header, so
their affine is the identity (1 mm voxels, axes taken as RAS). A 4D NIfTI or a 4D ``.npy`` gives
one record per volume of its last (NIfTI) or first (NumPy) axis. Every failure is a
``ValueError`` that says what is wrong with the file and what to do about it.
"""

from __future__ import annotations

import gzip
import io
import zlib
from dataclasses import dataclass, field

import numpy as np

__all__ = ["VolumeRecord", "read_volumes", "NPZ_SPLITS"]

NPZ_SPLITS = ("train", "val", "test")
"""MedMNIST's ``.npz`` splits: ``<split>_images`` (N x D x H x W) and ``<split>_labels`` (N x 1)."""


@dataclass
class VolumeRecord:
    """One volume read from an input: voxels (D, H, W) as float32, its voxel-to-world affine,
    and where it came from within the input (``part``: ``""`` for a single volume)."""

    volume: np.ndarray
    affine: np.ndarray
    part: str = ""
    label: str | None = None
    split: str = ""
    extra: dict = field(default_factory=dict)


def _check_3d(array: np.ndarray, what: str) -> None:
    if array.ndim != 3:
        raise ValueError(f"{what} has shape {tuple(array.shape)}; the volumes pipeline needs 3D "
                         "volumes (D x H x W), or a stack of them")
    if min(array.shape) < 2:
        raise ValueError(f"{what} has shape {tuple(array.shape)}: a volume needs at least 2 "
                         "voxels along every axis (is it a 2D image saved as 3D?)")


def _nifti(data: bytes) -> list[VolumeRecord]:
    import nibabel as nib

    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (EOFError, OSError, zlib.error) as e:
            raise ValueError(f"the gzip stream is broken ({e}): the .nii.gz file is truncated or "
                             "corrupt; copy it again from its source") from None
    if len(data) < 348:
        raise ValueError(f"{len(data)} bytes: too short for a NIfTI header (348 bytes)")
    sizeof_hdr = {int.from_bytes(data[:4], order) for order in ("little", "big")}
    cls = nib.Nifti2Image if 540 in sizeof_hdr else nib.Nifti1Image
    if not sizeof_hdr & {348, 540}:
        raise ValueError("not a NIfTI-1 or NIfTI-2 file (its first 4 bytes are not 348 or 540, "
                         "the header size)")
    try:
        image = cls.from_bytes(data)
    except Exception as e:  # noqa: BLE001 - nibabel's header checks raise many kinds
        raise ValueError(f"the NIfTI header does not parse ({type(e).__name__}: {e})") from None
    shape = tuple(int(n) for n in image.shape)
    needed = int(np.prod(shape)) * image.get_data_dtype().itemsize + int(image.dataobj.offset)
    if needed > len(data):
        raise ValueError(f"the header says shape {shape} of {image.get_data_dtype()} "
                         f"({needed:,} bytes with its offset), the file holds {len(data):,}: "
                         "it is truncated or its header is wrong; re-export the volume")
    if len(shape) == 2 or (len(shape) >= 3 and min(shape[:3]) < 2):
        raise ValueError(f"the image has shape {shape}: a 2D image, not a volume; the volumes "
                         "pipeline needs 3D data")
    if len(shape) > 4 or (len(shape) == 4 and shape[3] < 1):
        raise ValueError(f"the image has shape {shape}; give 3D or 4D (a series of volumes)")
    image = nib.as_closest_canonical(image)
    voxels = np.asarray(image.dataobj, dtype=np.float32)
    affine = np.asarray(image.affine, dtype=np.float64)
    if voxels.ndim == 3:
        return [VolumeRecord(voxels, affine)]
    return [VolumeRecord(np.ascontiguousarray(voxels[..., t]), affine, part=f"t{t}")
            for t in range(voxels.shape[3])]


def _npz(data: bytes) -> list[VolumeRecord]:
    try:
        archive = np.load(io.BytesIO(data), allow_pickle=False)
        arrays = {name: archive[name] for name in archive.files}
    except Exception as e:  # noqa: BLE001 - zipfile.BadZipFile, zlib.error, ValueError ...
        raise ValueError(f"not a readable .npz archive ({type(e).__name__}: {e}); write it with "
                         "numpy.savez") from None
    records: list[VolumeRecord] = []
    splits = [s for s in NPZ_SPLITS if f"{s}_images" in arrays]
    if not splits:
        raise ValueError(f"the .npz holds {sorted(arrays)}; expected MedMNIST-style "
                         "'train_images' / 'train_labels' (and val_, test_): N x D x H x W "
                         "volumes and N labels")
    identity = np.eye(4)
    for split in splits:
        images = arrays[f"{split}_images"]
        labels = arrays.get(f"{split}_labels")
        if images.ndim == 5 and images.shape[-1] == 1:  # N x D x H x W x 1
            images = images[..., 0]
        if images.ndim != 4:
            raise ValueError(f"'{split}_images' has shape {images.shape}; expected N x D x H x W "
                             "(3D volumes; 2D MedMNIST sets are not volumes)")
        if labels is not None and len(labels) != len(images):
            raise ValueError(f"'{split}_labels' has {len(labels)} rows, '{split}_images' "
                             f"{len(images)}")
        for i in range(len(images)):
            label = None
            if labels is not None:
                value = np.asarray(labels[i]).reshape(-1)
                label = str(int(value[0])) if value.dtype.kind in "biu" else str(value[0])
            records.append(VolumeRecord(images[i].astype(np.float32), identity,
                                        part=f"{split}{i:06d}", label=label, split=split))
    return records


def _npy(data: bytes) -> list[VolumeRecord]:
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"not a readable .npy file ({e}); write it with numpy.save") from None
    if array.dtype.kind not in "biuf":
        raise ValueError(f"the .npy holds {array.dtype} values; a volume needs numbers")
    if array.ndim == 4:
        return [VolumeRecord(array[i].astype(np.float32), np.eye(4), part=f"{i:06d}")
                for i in range(len(array))]
    return [VolumeRecord(array.astype(np.float32), np.eye(4))]


def read_volumes(data: bytes, name: str) -> list[VolumeRecord]:
    """The volumes in one input's bytes, by the input's file name ending.

    Args:
        data: the file's bytes.
        name: its name (``.nii``, ``.nii.gz``, ``.npy`` or ``.npz``).

    Returns:
        One record per volume, each checked to be 3D and to hold finite numbers somewhere
        (NaN voxels are set to the smallest finite value).

    Raises:
        ValueError: the file is truncated, lies about its shape, is 2D, all NaN, or not a
            volume file; the message says which and what to do.
    """
    if not data:
        raise ValueError("empty file (0 bytes)")
    lowered = name.lower()
    if lowered.endswith(".npz"):
        records = _npz(data)
    elif lowered.endswith(".npy"):
        records = _npy(data)
    else:
        records = _nifti(data)
    for record in records:
        what = f"volume {record.part!r}" if record.part else "the volume"
        _check_3d(record.volume, what)
        finite = np.isfinite(record.volume)
        if not finite.any():
            raise ValueError(f"{what} has no finite voxel (all NaN or infinite): nothing to "
                             "learn from; remove the file or fix its export")
        if not finite.all():
            record.volume = np.where(finite, record.volume,
                                     record.volume[finite].min()).astype(np.float32)
    return records
