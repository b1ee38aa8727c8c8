"""Read 3D volumes from bytes: NIfTI (``.nii``, ``.nii.gz``, through nibabel), ``.npy``,
MedMNIST-style ``.npz`` files and ``.zip`` files of DICOM series (through pydicom), each as a
list of ``VolumeRecord`` (one input may hold many).

NIfTI volumes come back in RAS+ orientation (``nibabel.as_closest_canonical``: a permutation and
flips of the voxel axes, no resampling) with their affine; NumPy volumes have no header, so
their affine is the identity (1 mm voxels, axes taken as RAS). A 4D NIfTI or a 4D ``.npy`` gives
one record per volume of its last (NIfTI) or first (NumPy) axis. Every failure is a
``ValueError`` that says what is wrong with the file and what to do about it.

A ``.zip`` holds DICOM series (read with pydicom): one record per ``SeriesInstanceUID``, its
slices ordered by ``ImagePositionPatient`` along the slice normal (the cross product of
``ImageOrientationPatient``'s row and column directions), ``RescaleSlope`` / ``Intercept``
applied, the affine from the headers (LPS) turned to RAS and reoriented as a NIfTI volume is. A
slice missing, repeated or out of line, a slice of another geometry, or a file that does not
parse fails the input with the file's name.

A file is decoded only if its header's shape holds at most ``max_voxels`` voxels (all its
volumes together): a 210 KB ``.nii.gz`` of zeros can claim 1024^3 voxels, gigabytes once
decompressed and converted to float32. The header is read first (a NIfTI header from the
first bytes of the gzip stream, the ``.npy`` header of each array a ``.npz`` member holds),
and a gzip stream is never inflated past the bytes its header says the volume needs.
"""

from __future__ import annotations

import io
import math
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["VolumeRecord", "read_volumes", "NPZ_SPLITS", "DEFAULT_MAX_VOXELS",
           "check_max_voxels", "DICOM_SUFFIXES"]

DEFAULT_MAX_VOXELS = 2**29
"""The most voxels one input may decode to (536,870,912: 2 GiB as float32, e.g. 1024 x 1024 x
512, or 2,000 volumes of 64^3): above any CT or MRI series, and small enough that a file whose
header lies (a decompression bomb) fails its input instead of a worker killed for memory."""


def check_max_voxels(value: object) -> int:
    """``value`` as a voxel limit; ``ValueError`` unless it is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"max_voxels must be a positive number of voxels, got {value!r}")
    return value


def _check_voxels(shape: tuple[int, ...], dtype: np.dtype, max_voxels: int, what: str) -> None:
    """Refuse ``shape`` (from a header, before any data is decoded) above ``max_voxels``."""
    voxels = math.prod(shape)
    if voxels > max_voxels:
        raise ValueError(
            f"{what} says shape {shape} of {dtype} ({voxels:,} voxels, "
            f"{voxels * 4 / 1024**3:.1f} GiB as float32): more than max_voxels "
            f"({max_voxels:,}), so it is not decoded; if the volume is real, raise the limit "
            "with --set max_voxels=N")


def _gunzip(data: bytes, limit: int) -> bytes:
    """The first ``limit`` bytes the gzip stream ``data`` inflates to (all of them if fewer),
    never inflating more: a stream of zeros that inflates to gigabytes costs ``limit`` bytes."""
    out = bytearray()
    rest = data
    while rest and len(out) < limit:
        inflate = zlib.decompressobj(wbits=31)
        try:
            out += inflate.decompress(rest, limit - len(out))
            if not inflate.eof and len(out) >= limit and inflate.unconsumed_tail:
                inflate.decompress(inflate.unconsumed_tail, 1)  # checks the CRC if it ends here
        except zlib.error as e:
            raise ValueError(f"the gzip stream is broken ({e}): the .nii.gz file is truncated "
                             "or corrupt; copy it again from its source") from None
        if not inflate.eof:
            if len(out) >= limit:
                break  # more data than asked for: the caller needs no more
            raise ValueError("the gzip stream is broken (it ends before its end marker): the "
                             ".nii.gz file is truncated or corrupt; copy it again from its source")
        rest = inflate.unused_data
    return bytes(out[:limit])


def _npy_header(f: object) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype in the ``.npy`` header at the start of ``f`` (no data read)."""
    fmt = np.lib.format
    version = fmt.read_magic(f)
    read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
    shape, _, dtype = read(f)
    return tuple(int(n) for n in shape), dtype

NPZ_SPLITS = ("train", "val", "test")
"""MedMNIST's ``.npz`` splits: ``<split>_images`` (N x D x H x W) and ``<split>_labels`` (N x 1)."""


@dataclass
class VolumeRecord:
    """One volume read from an input: voxels (D, H, W) as float32, its voxel-to-world affine,
    and where it came from within the input (``part``: ``""`` for a single volume); an ``.npz``
    volume's ``label`` (an ``int`` where the archive stores integers, as MedMNIST does) and
    ``split``."""

    volume: np.ndarray
    affine: np.ndarray
    part: str = ""
    label: int | str | None = None
    split: str = ""
    extra: dict = field(default_factory=dict)


def _check_3d(array: np.ndarray, what: str) -> None:
    if array.ndim != 3:
        raise ValueError(f"{what} has shape {tuple(array.shape)}; the volumes pipeline needs 3D "
                         "volumes (D x H x W), or a stack of them")
    if min(array.shape) < 2:
        raise ValueError(f"{what} has shape {tuple(array.shape)}: a volume needs at least 2 "
                         "voxels along every axis (is it a 2D image saved as 3D?)")


def _nifti(data: bytes, max_voxels: int) -> list[VolumeRecord]:
    import nibabel as nib

    gzipped = data[:2] == b"\x1f\x8b"
    head = _gunzip(data, 540) if gzipped else data[:540]
    if len(head) < 348:
        raise ValueError(f"{len(head)} bytes: too short for a NIfTI header (348 bytes)")
    sizeof_hdr = {int.from_bytes(head[:4], order) for order in ("little", "big")}
    cls = nib.Nifti2Image if 540 in sizeof_hdr else nib.Nifti1Image
    if not sizeof_hdr & {348, 540}:
        raise ValueError("not a NIfTI-1 or NIfTI-2 file (its first 4 bytes are not 348 or 540, "
                         "the header size)")
    size = 540 if cls is nib.Nifti2Image else 348
    try:
        header = cls.header_class(binaryblock=head[:size], check=False)
        shape = tuple(int(n) for n in header.get_data_shape())
        dtype = header.get_data_dtype()
        offset = max(int(header.get_data_offset()), size + 4)
    except Exception as e:  # noqa: BLE001 - nibabel's header checks raise many kinds
        raise ValueError(f"the NIfTI header does not parse ({type(e).__name__}: {e})") from None
    _check_voxels(shape, dtype, max_voxels, "the NIfTI header")
    if gzipped:
        data = _gunzip(data, offset + math.prod(shape) * dtype.itemsize)
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


def _npz(data: bytes, max_voxels: int) -> list[VolumeRecord]:
    """The volumes of a MedMNIST-style archive; only the ``<split>_images`` / ``_labels``
    members are read, and only once their headers show they hold at most ``max_voxels``."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = {n.removesuffix(".npy"): n for n in archive.namelist()}
            splits = [s for s in NPZ_SPLITS if f"{s}_images" in names]
            wanted = [f"{s}_{kind}" for s in splits for kind in ("images", "labels")
                      if f"{s}_{kind}" in names]
            headers = {}
            for name in wanted:
                with archive.open(names[name]) as member:
                    headers[name] = _npy_header(member)
    except Exception as e:  # noqa: BLE001 - zipfile.BadZipFile, zlib.error, ValueError ...
        raise ValueError(f"not a readable .npz archive ({type(e).__name__}: {e}); write it with "
                         "numpy.savez") from None
    if not splits:
        raise ValueError(f"the .npz holds {sorted(names)}; expected MedMNIST-style "
                         "'train_images' / 'train_labels' (and val_, test_): N x D x H x W "
                         "volumes and N labels")
    for name, (shape, dtype) in headers.items():
        _check_voxels(shape, dtype, max_voxels, f"'{name}'")
    total = sum(math.prod(shape) for shape, _ in headers.values())
    if total > max_voxels:
        raise ValueError(f"the .npz's volumes and labels hold {total:,} voxels in all: more than "
                         f"max_voxels ({max_voxels:,}), so they are not decoded; split the "
                         "archive, or raise the limit with --set max_voxels=N")
    try:
        archive = np.load(io.BytesIO(data), allow_pickle=False)
        arrays = {name: archive[name] for name in wanted}
    except Exception as e:  # noqa: BLE001 - zipfile.BadZipFile, zlib.error, ValueError ...
        raise ValueError(f"not a readable .npz archive ({type(e).__name__}: {e}); write it with "
                         "numpy.savez") from None
    records: list[VolumeRecord] = []
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
                # integer labels (MedMNIST's class indices) stay integers: an int64 column
                label = int(value[0]) if value.dtype.kind in "biu" else str(value[0])
            records.append(VolumeRecord(images[i].astype(np.float32), identity,
                                        part=f"{split}{i:06d}", label=label, split=split))
    return records


def _npy(data: bytes, max_voxels: int) -> list[VolumeRecord]:
    try:
        shape, dtype = _npy_header(io.BytesIO(data))
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"not a readable .npy file ({e}); write it with numpy.save") from None
    _check_voxels(shape, dtype, max_voxels, "the .npy header")
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


DICOM_SUFFIXES = ("", ".dcm", ".dicom", ".ima")
"""Members of a ``.zip`` read as DICOM slices: these endings (``""``: no suffix, as many scanners
write them); other members (a README, a ``DICOMDIR`` index, ``.json`` sidecars) are skipped."""

_PIXEL_TOLERANCE = 0.01
"""How far (a fraction) one slice's ``PixelSpacing`` may differ from the first slice's."""

_GAP_TOLERANCE = (0.05, 0.02)
"""How far a gap between slices may differ from the median gap: 5% of it plus 0.02 mm, above
the rounding of positions written with two decimals; a missing slice doubles a gap."""


def _is_slice_name(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    if not base or base.startswith(".") or base.upper() == "DICOMDIR" or name.endswith("/"):
        return False
    suffix = base[base.rfind("."):].lower() if "." in base else ""
    return suffix in DICOM_SUFFIXES


def _dicom_zip(data: bytes, max_voxels: int) -> list[VolumeRecord]:
    """The DICOM series in a ``.zip``: one record per ``SeriesInstanceUID`` (``part``), slices
    ordered by ``ImagePositionPatient`` along the slice normal, in RAS like a NIfTI volume."""
    try:
        import pydicom
    except ImportError:
        raise ValueError("reading DICOM needs pydicom: pip install 'precache[volumes]' (or "
                         "pip install pydicom)") from None
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = [m for m in archive.infolist() if _is_slice_name(m.filename)]
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"not a readable .zip archive ({e}); zip the series folder again "
                         "(zip -r series.zip folder/)") from None
    if not members:
        raise ValueError("the .zip holds no DICOM files (names ending .dcm, or without a "
                         "suffix); put one series folder's files in it")
    inflated = sum(m.file_size for m in members)
    if inflated > 4 * max_voxels + len(members) * 65536:
        raise ValueError(f"the series' DICOM files hold {inflated:,} bytes: more than "
                         f"max_voxels ({max_voxels:,}) allows, so they are not decoded; if the "
                         "series is real, raise the limit with --set max_voxels=N")
    series: dict[str, list[tuple[str, Any]]] = {}
    with archive:
        for member in members:
            try:
                ds = pydicom.dcmread(io.BytesIO(archive.read(member)))
            except Exception as e:  # noqa: BLE001 - pydicom and zipfile raise many kinds
                raise ValueError(f"'{member.filename}' is not a readable DICOM file "
                                 f"({type(e).__name__}: {e}); remove it from the series "
                                 "folder or .zip or "
                                 "export it again") from None
            uid = str(getattr(ds, "SeriesInstanceUID", "") or "")
            if not uid:
                raise ValueError(f"'{member.filename}' has no SeriesInstanceUID, so its series "
                                 "is unknown; export the series again with its UIDs")
            series.setdefault(uid, []).append((member.filename, ds))
    voxels = sum(len(s) * math.prod(_size(*s[0])) for s in series.values())
    if voxels > max_voxels:
        raise ValueError(f"the DICOM headers say {voxels:,} voxels in all ({len(series)} "
                         f"series): more than max_voxels ({max_voxels:,}), so they are not "
                         "decoded; if the series are real, raise the limit with "
                         "--set max_voxels=N")
    return [_dicom_series(uid, slices) for uid, slices in sorted(series.items())]


def _header(name: str, ds: Any, tag: str, count: int) -> np.ndarray:
    """``ds.<tag>`` as ``count`` floats; ValueError naming the file if it is missing."""
    value = getattr(ds, tag, None)
    try:
        array = np.asarray([float(v) for v in value], dtype=np.float64)
    except (TypeError, ValueError):
        array = np.zeros(0)
    if array.shape != (count,) or not np.isfinite(array).all():
        raise ValueError(f"'{name}' has no valid {tag} ({value!r}); the series' geometry needs "
                         "it in every slice: export the series again with it")
    return array


def _size(name: str, ds: Any) -> tuple[int, int]:
    """A slice's (Rows, Columns); ValueError naming the file if they are missing."""
    try:
        return int(ds.Rows), int(ds.Columns)
    except (AttributeError, TypeError, ValueError):
        raise ValueError(f"'{name}' has no Rows / Columns: not an image slice; remove it from "
                         "the series folder or .zip") from None


def _dicom_series(uid: str, slices: list[tuple[str, Any]]) -> VolumeRecord:
    """One series' slices stacked into a RAS volume: voxel (i, j, k) is column i, row j of the
    k-th slice along the normal, as dcm2niix and nibabel's NIfTI path give it."""
    first_name, first = slices[0]
    orientation = _header(first_name, first, "ImageOrientationPatient", 6)
    row_dir, col_dir = orientation[:3], orientation[3:]  # along a row (i), down a column (j)
    normal = np.cross(row_dir, col_dir)
    pixel = _header(first_name, first, "PixelSpacing", 2)  # (between rows, between columns)
    size = _size(first_name, first)
    for name, ds in slices[1:]:
        if (not np.allclose(_header(name, ds, "ImageOrientationPatient", 6), orientation,
                            atol=1e-4)
                or not np.allclose(_header(name, ds, "PixelSpacing", 2), pixel,
                                   rtol=_PIXEL_TOLERANCE)
                or _size(name, ds) != size):
            raise ValueError(f"'{name}' has another orientation, pixel spacing or size than "
                             f"'{first_name}' in series {uid}: not one volume; export the "
                             "series again, or put the odd slices in a series of their own")
    positions = {name: _header(name, ds, "ImagePositionPatient", 3) for name, ds in slices}
    ordered = sorted(slices, key=lambda item: float(positions[item[0]] @ normal))
    if len(ordered) < 2:
        raise ValueError(f"series {uid} has one slice ('{first_name}'): a 2D image, not a "
                         "volume; the volumes pipeline needs a series of slices")
    depth = np.array([positions[name] @ normal for name, _ in ordered])
    gaps = np.diff(depth)
    median = float(np.median(gaps))
    allowed = _GAP_TOLERANCE[0] * median + _GAP_TOLERANCE[1]
    if median <= 0 or np.abs(gaps - median).max() > allowed:
        k = int(np.argmax(np.abs(gaps - median)))
        raise ValueError(
            f"series {uid}: slices '{ordered[k][0]}' and '{ordered[k + 1][0]}' are "
            f"{gaps[k]:.3g} mm apart, the others {median:.3g} mm (a slice missing, repeated or "
            "from another scan): add the missing file, or remove the stray one")
    volume = np.empty((size[1], size[0], len(ordered)), dtype=np.float32)
    for k, (name, ds) in enumerate(ordered):
        try:
            pixels = np.asarray(ds.pixel_array, dtype=np.float64)
        except Exception as e:  # noqa: BLE001 - pydicom's pixel handlers raise many kinds
            raise ValueError(f"'{name}': its pixel data do not decode ({type(e).__name__}: "
                             f"{e}); install the decoder pydicom names, or decompress the "
                             "series (gdcmconv --raw)") from None
        if pixels.shape != size:
            raise ValueError(f"'{name}' holds pixels of shape {pixels.shape}, not one frame of "
                             f"{size} (multi-frame DICOM is not read): convert it with dcm2niix")
        slope = float(getattr(ds, "RescaleSlope", 1) or 1)
        intercept = float(getattr(ds, "RescaleIntercept", 0) or 0)
        volume[:, :, k] = (pixels * slope + intercept).T  # (row j, column i) -> (i, j)
    lps = np.eye(4)
    lps[:3, 0] = row_dir * pixel[1]  # i runs along a row: the spacing between columns
    lps[:3, 1] = col_dir * pixel[0]
    lps[:3, 2] = (positions[ordered[-1][0]] - positions[ordered[0][0]]) / (len(ordered) - 1)
    lps[:3, 3] = positions[ordered[0][0]]
    return _ras_record(volume, np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps, part=uid)


def _ras_record(volume: np.ndarray, affine: np.ndarray, part: str = "") -> VolumeRecord:
    """``volume`` with its RAS ``affine`` reoriented as a NIfTI file is
    (``nibabel.as_closest_canonical``), so both paths give the same voxels and affine."""
    import nibabel as nib

    image = nib.as_closest_canonical(nib.Nifti1Image(volume, affine))
    return VolumeRecord(np.ascontiguousarray(np.asarray(image.dataobj, dtype=np.float32)),
                        np.asarray(image.affine, dtype=np.float64), part=part)


def read_volumes(data: bytes, name: str,
                 max_voxels: int = DEFAULT_MAX_VOXELS) -> list[VolumeRecord]:
    """The volumes in one input's bytes, by the input's file name ending.

    Args:
        data: the file's bytes.
        name: its name (``.nii``, ``.nii.gz``, ``.npy``, ``.npz``, or ``.zip``: DICOM series;
            a DICOM series folder's bytes are a ``.zip``, whatever its name).
        max_voxels: the most voxels its header may claim, all volumes together (checked
            before any voxel is decoded).

    Returns:
        One record per volume, each checked to be 3D and to hold finite numbers somewhere
        (NaN voxels are set to the smallest finite value).

    Raises:
        ValueError: the file is truncated, lies about its shape, is 2D, all NaN, claims more
            than ``max_voxels``, or is not a volume file; the message says which and what to do.
    """
    if not data:
        raise ValueError("empty file (0 bytes)")
    lowered = name.lower()
    if lowered.endswith(".npz"):
        records = _npz(data, max_voxels)
    elif lowered.endswith(".zip") or data[:4] == b"PK\x03\x04":  # a DICOM series folder,
        records = _dicom_zip(data, max_voxels)                      # packed by sources.py
    elif lowered.endswith(".npy"):
        records = _npy(data, max_voxels)
    else:
        records = _nifti(data, max_voxels)
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
