"""Corrupt images never pass as good rows, and the decoders' messages never reach the terminal.

libjpeg decodes a JPEG with part of its data missing (end marker kept) into a garbled picture
and says so only on C stderr ("Corrupt JPEG data: premature end of data segment"); OpenCV, libpng
and libtiff print there too. ``DecodeImage`` reads what they print and fails the input with it.
"""

from __future__ import annotations

import io
import os

import cv2
import numpy as np
import pytest
from PIL import Image
from skimage import data as skdata

from precache import Cache
from precache.processing.ops.image import DecodeImage
from tests.helpers import precache_cli, write_photos

PHOTO = skdata.coffee()  # 400x600x3 RGB: a real photo, enough scan data to cut from

DECODER_TEXT = ("Corrupt JPEG", "premature end", "libpng", "TIFF", "[ERROR", "[ WARN")


def encode(fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(PHOTO).save(buf, fmt, **kwargs)
    return buf.getvalue()


def cut_middle(data: bytes) -> bytes:
    """The file with its middle third removed; its start (headers) and end (EOI) kept."""
    n = len(data)
    return data[: n // 3] + data[2 * n // 3:]


def flip_bytes(data: bytes) -> bytes:
    """Some bytes in the middle of the scan data changed: a bit-rotted file, same length."""
    bad = bytearray(data)
    for i in range(len(data) // 2, len(data) // 2 + 200, 7):
        bad[i] ^= 0x55
    return bytes(bad)


def decode(data: bytes) -> dict:
    op = DecodeImage()
    op.setup()
    return op({"key": "k", "data": data})


def decode_error(data: bytes) -> str:
    with pytest.raises(ValueError) as info:
        decode(data)
    return str(info.value)


def assert_no_decoder_text(text: str) -> None:
    for fragment in DECODER_TEXT:
        assert fragment not in text, text


@pytest.mark.parametrize("progressive", [False, True])
def test_a_jpeg_with_its_middle_cut_out_fails_with_libjpegs_reason(progressive, capfd):
    data = cut_middle(encode("JPEG", quality=90, progressive=progressive))
    assert data.endswith(b"\xff\xd9")  # the end marker is there: not "truncated"
    assert cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR) is not None
    capfd.readouterr()  # OpenCV alone decodes it (garbled) and prints libjpeg's warning

    message = decode_error(data)
    assert "corrupt JPEG" in message and "Corrupt JPEG data: " in message and "re-export" in message
    if not progressive:  # a progressive file's later scans can say "extraneous bytes" instead
        assert "premature end of data segment" in message
    out, err = capfd.readouterr()
    assert_no_decoder_text(out + err)


def test_a_bit_rotted_jpeg_fails(capfd):
    message = decode_error(flip_bytes(encode("JPEG", quality=90)))
    assert "corrupt JPEG" in message and "Corrupt JPEG data" in message
    assert_no_decoder_text("".join(capfd.readouterr()))


@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "BMP", "TIFF"])
@pytest.mark.parametrize("damage", ["truncated", "middle cut"])
def test_damaged_png_webp_bmp_tiff_fail_quietly(fmt, damage, capfd):
    data = encode(fmt)
    data = data[: len(data) // 2] if damage == "truncated" else cut_middle(data)
    message = decode_error(data)
    assert message
    assert_no_decoder_text("".join(capfd.readouterr()))


def test_decoders_reason_is_quoted_for_a_failed_decode():
    message = decode_error(cut_middle(encode("PNG")))
    assert "could not decode this PNG" in message and "libpng error" in message


def test_good_images_decode_and_print_nothing(capfd):
    for fmt in ("JPEG", "PNG", "WEBP", "BMP", "TIFF"):
        out = decode(encode(fmt))
        assert out["image"].shape == PHOTO.shape
    assert "".join(capfd.readouterr()) == ""


def test_other_text_on_stderr_during_a_decode_is_not_lost(monkeypatch, capfd):
    """fd 2 is the process's: what is not a decoder's (another thread's) is written back."""
    real = cv2.imdecode

    def chatty(*args, **kwargs):
        os.write(2, b"a line from another thread\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(cv2, "imdecode", chatty)
    decode_error(cut_middle(encode("JPEG", quality=90)))
    err = capfd.readouterr().err
    assert "a line from another thread" in err
    assert_no_decoder_text(err)


def test_a_run_stores_the_corrupt_jpeg_as_an_error_and_the_terminal_stays_clean(tmp_path):
    """The issue's case end to end: the real command, workers in their own processes, with
    the progress bar on: '1 failed', the reason in the errors table, nothing from libjpeg."""
    folder = tmp_path / "in"
    write_photos(folder, 4)
    (folder / "cut.jpg").write_bytes(cut_middle(encode("JPEG", quality=90)))
    result = precache_cli("run", "images", "-i", str(folder), "-o", str(tmp_path / "c"),
                          "-j", "2", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "4 ok, 0 skipped, 1 failed" in result.stdout
    assert_no_decoder_text(result.stderr)
    errors = {r["key"]: r for r in Cache(tmp_path / "c").read_errors().to_pylist()}
    assert list(errors) == ["cut.jpg"]
    assert errors["cut.jpg"]["stage"] == "decode_image"
    assert "premature end of data segment" in errors["cut.jpg"]["message"]
