"""``volumes``: read 3D images once: reorient to RAS, resample, clip and scale intensities, crop.

    precache run volumes --input scans/ --output cache/ --set spacing=2 --set shape=64
    precache run volumes -i organmnist3d.npz -o cache/ --set shape=28 --set normalise=none
    precache run volumes -i ct/ -o cache/ --set window=-1000,400 --set spacing=1.5,1.5,3 \
        --set shape=128,128,96 --set foreground=0.05 --set labels=meta.csv
    precache run volumes -i big/ -o cache/ --set max_voxels=1073741824   # inputs over 2^29 voxels
    precache run volumes -i dicom/ -o cache/ --set spacing=1 --set shape=128  # DICOM series

Inputs: NIfTI (``.nii``, ``.nii.gz``; a 4D file gives one row per volume), ``.npy`` (one volume,
or a stack N x D x H x W), MedMNIST-style ``.npz`` (``train_images`` / ``train_labels`` and
``val_`` / ``test_``: one row per volume, with its label and ``split``) and DICOM series: a
folder holding DICOM files (``*.dcm``, ``*.dicom``, ``*.ima``, or DICOM files without a suffix)
is one input keyed by its path, as is a ``.zip`` of such a folder (read with pydicom; one row per
``SeriesInstanceUID``, keyed ``<folder or file>#<uid>``; a slice missing or of another geometry
fails the input; a changed slice recomputes its series).

``spacing`` is MONAI's ``Spacing``: the stored spacing is exactly the asked one, the shape follows.

Intensities are clipped to ``window`` (or the ``percentiles``) and scaled to 0..1 by default;
``normalise=none`` keeps the input's values (inputs already normalised: MedMNIST's 0..255).

Columns: ``volume`` (``shape``, ``dtype``: uint8 = round(255 x the 0..1 intensity) by default),
``affine`` (4 x 4 float64: stored voxel index -> world mm, after resampling and cropping),
``spacing`` (mm, stored), ``original_shape``, ``original_spacing``, ``split`` (``""`` unless an
``.npz`` split), ``label`` (the first folder, a .csv/.json file, or the ``.npz``; none with
``labels=none``), plus ``key``, ``source_key`` and ``source_hash``. See docs/volumes.md.

An input whose header claims more than ``max_voxels`` voxels (all its volumes together; default
2^29 = 536,870,912, 2 GiB as float32) is a failed input, refused before it is decompressed: a
210 KB ``.nii.gz`` of zeros can claim 1024^3 voxels. ``--max-input-bytes`` bounds only the file's
own (compressed) bytes.
"""

from __future__ import annotations

from precache.processing.ops import (DEFAULT_MAX_VOXELS, VOLUME_EXTENSIONS, CropForeground,
                                     DecodeVolume, FitShape, NormaliseIntensity, Op, Resample,
                                     VolumeLabels)
from precache.processing.pipeline import Pipeline
from precache.processing.sources import DICOM_SERIES_FOLDERS


def make_ops(spacing: tuple = (0.0,), shape: tuple = (64,), percentiles: tuple = (0.5, 99.5),
             window: tuple = (0.0, 0.0), dtype: str = "uint8", foreground: float = 0.0,
             margin: int = 2, labels: str = "folder",
             max_voxels: int = DEFAULT_MAX_VOXELS, normalise: str = "scale") -> list[Op]:
    """Decode and reorient (refusing inputs over ``max_voxels`` voxels, all volumes together,
    before decompressing them); resample to ``spacing`` mm (0: keep); clip to ``window`` (or the
    ``percentiles``) and scale to 0..1, or keep the values (``normalise=none``), as ``dtype``;
    crop to voxels over ``foreground`` (0: off) with ``margin``; centre pad / crop to ``shape``; label (``labels``: folder, none, or a file)."""
    return [DecodeVolume(max_voxels=max_voxels), Resample(spacing=spacing),
            NormaliseIntensity(percentiles=percentiles, window=window, dtype=dtype,
                               normalise=normalise),
            CropForeground(threshold=foreground, margin=margin), FitShape(shape=shape),
            VolumeLabels(labels=labels)]


pipeline = Pipeline(
    name="volumes",
    make_ops=make_ops,
    extensions=(*VOLUME_EXTENSIONS, DICOM_SERIES_FOLDERS),  # a DICOM folder is one input
    description="3D volumes (NIfTI, .npy, MedMNIST .npz, DICOM series folders or .zip) reoriented, "
                "resampled, normalised, cropped to a fixed shape",
    shard_rows=32,  # inputs a shard: 32 volumes of 256^3 uint8 are 512 MB
)
