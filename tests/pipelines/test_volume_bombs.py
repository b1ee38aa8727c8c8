"""Volume decompression bombs: an input is bounded by the voxels its header claims, before it is
decompressed. A 650 KB ``.nii.gz`` of zeros can claim 1024 x 1024 x 640 voxels: it used to be
inflated whole (640 MB) and converted to float32 (2.5 GB more) before anything said no. The
run here is the real volumes pipeline under an address-space limit of 1 GiB more than the test
process maps, so a regression fails the test (a MemoryError row) instead of eating the
machine's memory."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from precache import Cache
from precache.processing.ops.volume import DecodeVolume
from precache.processing.ops.volume_read import DEFAULT_MAX_VOXELS, read_volumes
from tests.helpers import build_cache, memory_cap


def nifti_bomb(shape: tuple[int, ...]) -> bytes:
    """A valid ``.nii.gz`` of ``shape`` uint8 zeros, made without holding its voxels: the deflate
    blocks of 1 MiB of zeros after a full flush are the same every time, so they are repeated;
    the gzip trailer (CRC-32 and size) is computed over the whole stream."""
    header = nib.Nifti1Header()
    header.set_data_shape(shape)
    header.set_data_dtype(np.uint8)
    header.set_data_offset(352)
    head = header.binaryblock + b"\0" * 4
    chunk = bytes(1 << 20)
    count, rest = divmod(int(np.prod(shape)), len(chunk))
    assert rest == 0
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)
    start = deflate.compress(head) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(chunk) + deflate.flush(zlib.Z_FULL_FLUSH)
    end = deflate.flush()[:-8]  # the final block, without the trailer of what it saw
    crc = zlib.crc32(head)
    for _ in range(count):
        crc = zlib.crc32(chunk, crc)
    size = (len(head) + count * len(chunk)) & 0xFFFFFFFF
    return start + block * count + end + struct.pack("<II", crc, size)


def npy_header_only(shape: tuple[int, ...]) -> bytes:
    """A ``.npy`` whose header claims ``shape`` of float32 and that holds no data."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return buf.getvalue()


@pytest.fixture(scope="module")
def bombs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of one real small volume and three bombs past the default ``max_voxels``."""
    folder = tmp_path_factory.mktemp("bombs") / "in"
    folder.mkdir()
    volume = np.random.default_rng(0).random((12, 12, 12)).astype(np.float32)
    nib.save(nib.Nifti1Image(volume, np.eye(4)), folder / "ok.nii.gz")
    (folder / "bomb.nii.gz").write_bytes(nifti_bomb((1024, 1024, 640)))
    (folder / "lying.npy").write_bytes(npy_header_only((4096, 4096, 4096)))
    with zipfile.ZipFile(folder / "lying.npz", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("train_images.npy", npy_header_only((10_000, 256, 256, 256)))
    return folder


def test_a_volume_bomb_is_one_failed_input_and_its_voxels_are_never_decoded(
        bombs: Path, tmp_path: Path) -> None:
    assert (bombs / "bomb.nii.gz").stat().st_size < 1024**2
    import torch  # noqa: F401 - the pipeline's resampling loads it: mapped before the cap

    with memory_cap():
        build_cache(bombs, tmp_path / "c", pipeline="volumes", params={"shape": (8,)},
                    workers=1)
    errors = {r["key"]: r["message"] for r in Cache(tmp_path / "c").read_errors().to_pylist()}
    assert set(errors) == {"bomb.nii.gz", "lying.npy", "lying.npz"}, errors
    assert errors["bomb.nii.gz"].startswith(
        "the NIfTI header says shape (1024, 1024, 640) of uint8 (671,088,640 voxels, 2.5 GiB as "
        "float32): more than max_voxels (536,870,912)")
    assert "--set max_voxels=N" in errors["bomb.nii.gz"]
    assert "the .npy header says shape (4096, 4096, 4096)" in errors["lying.npy"]
    assert "'train_images' says shape (10000, 256, 256, 256)" in errors["lying.npz"]
    assert all("\n" not in message for message in errors.values())
    assert Cache(tmp_path / "c").manifest.counts["ok"] == 1


def test_max_voxels_bounds_compressed_npz_and_npy_and_is_a_pipeline_parameter(
        tmp_path: Path) -> None:
    buf = io.BytesIO()  # 64 real volumes of 32^3 zeros: 2 Mi voxels in 3 KB
    np.savez_compressed(buf, train_images=np.zeros((64, 32, 32, 32), np.uint8),
                        train_labels=np.zeros((64, 1), np.uint8))
    assert len(buf.getvalue()) < 10_000
    with pytest.raises(ValueError, match=r"'train_images' says shape \(64, 32, 32, 32\) of "
                       r"uint8 \(2,097,152 voxels.*more than max_voxels \(1,000,000\)"):
        read_volumes(buf.getvalue(), "set.npz", max_voxels=1_000_000)
    assert len(read_volumes(buf.getvalue(), "set.npz", max_voxels=3_000_000)) == 64
    stack = io.BytesIO()
    np.save(stack, np.ones((4, 8, 8, 8), np.int16))
    with pytest.raises(ValueError, match=r"the .npy header says shape \(4, 8, 8, 8\)"):
        read_volumes(stack.getvalue(), "stack.npy", max_voxels=2000)
    assert len(read_volumes(stack.getvalue(), "stack.npy", max_voxels=2048)) == 4
    # the default keeps the fingerprint of caches built before the limit; another one is in it
    assert DecodeVolume().params == {} and DEFAULT_MAX_VOXELS == 2**29
    assert DecodeVolume(max_voxels=1000).params == {"max_voxels": 1000}
    with pytest.raises(ValueError, match="max_voxels must be a positive number"):
        DecodeVolume(max_voxels=0)
