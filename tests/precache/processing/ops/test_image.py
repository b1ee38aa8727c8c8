"""DecodeImage and ResizeCenterCrop on real encoded pictures (scikit-image's astronaut)."""

from __future__ import annotations

import io
import struct
import zlib

import cv2
import numpy as np
import pytest
from PIL import Image, ImageOps
from skimage import data as skdata

from precache.processing.ops.image import DecodeImage, ResizeCenterCrop

ASTRONAUT = skdata.astronaut()  # 512x512x3 RGB uint8, distinctly red-heavy (R mean 141, B mean 96)
SMALL = np.asarray(Image.fromarray(ASTRONAUT).resize((96, 64)))  # non-square, 64 tall


def encode(image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    (image if isinstance(image, Image.Image) else Image.fromarray(image)).save(buf, fmt, **kwargs)
    return buf.getvalue()


def decode(data: bytes, **params) -> dict:
    op = DecodeImage(**params)
    op.setup()
    out = op({"key": "k", "data": data})
    image = out["image"]
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    assert (out["orig_height"], out["orig_width"]) == image.shape[:2]
    assert "data" not in out
    return out


def channel_means(image: np.ndarray) -> np.ndarray:
    return image.reshape(-1, 3).mean(axis=0)


# ----------------------------------------------------------------------------- RGB order, formats


def test_png_decodes_to_exact_rgb():
    out = decode(encode(ASTRONAUT, "PNG"))
    np.testing.assert_array_equal(out["image"], ASTRONAUT)
    assert (out["orig_height"], out["orig_width"]) == (512, 512)


def test_jpeg_decodes_to_rgb_not_bgr():
    image = decode(encode(ASTRONAUT, "JPEG", quality=95))["image"]
    means, source = channel_means(image), channel_means(ASTRONAUT)
    assert abs(source[0] - source[2]) > 30  # a BGR result could not pass the next line
    np.testing.assert_allclose(means, source, atol=1.0)
    assert np.abs(image.astype(int) - ASTRONAUT).mean() < 3


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_pillow_exif_transpose(orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(SMALL, "JPEG", quality=95, exif=exif)
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    upright = (64, 96) if orientation <= 4 else (96, 64)
    assert expected.shape[:2] == upright
    out = decode(data)
    assert out["image"].shape == (*upright, 3)
    assert (out["orig_height"], out["orig_width"]) == upright
    assert np.abs(out["image"].astype(int) - expected).mean() < 2


def test_exif_orientation_in_png():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display upright
    out = decode(encode(SMALL, "PNG", exif=exif))
    np.testing.assert_array_equal(out["image"], np.rot90(SMALL, -1))


@pytest.mark.parametrize("fmt, atol", [("PNG", 0), ("JPEG", 3)])
def test_grayscale_becomes_three_equal_channels(fmt, atol):
    gray = np.asarray(Image.fromarray(ASTRONAUT).convert("L"))
    image = decode(encode(gray, fmt, quality=95))["image"]
    assert (image[..., 0] == image[..., 1]).all() and (image[..., 1] == image[..., 2]).all()
    assert np.abs(image[..., 0].astype(int) - gray).mean() <= atol
    assert abs(image.mean() - gray.mean()) < 0.5


def test_palette_png():
    palette = Image.fromarray(ASTRONAUT).convert("P")
    image = decode(encode(palette, "PNG"))["image"]
    np.testing.assert_array_equal(image, np.asarray(palette.convert("RGB")))
    np.testing.assert_allclose(channel_means(image), channel_means(ASTRONAUT), atol=3)


def test_rgba_png_drops_alpha_keeps_rgb():
    alpha = np.tile(np.arange(512, dtype=np.uint16)[None, :] // 2, (512, 1)).astype(np.uint8)
    rgba = np.dstack([ASTRONAUT, alpha])
    np.testing.assert_array_equal(decode(encode(rgba, "PNG"))["image"], ASTRONAUT)


def sixteen_bit(values8: np.ndarray) -> np.ndarray:
    """uint8 -> uint16 spread over the full range, with low bits set so rounding matters."""
    rng = np.random.default_rng(0)
    return np.clip(values8.astype(np.int32) * 257 + rng.integers(-120, 121, values8.shape), 0, 65535
                   ).astype(np.uint16)


def test_16bit_gray_png():
    gray16 = sixteen_bit(ASTRONAUT[..., 1])
    ok, buf = cv2.imencode(".png", gray16)
    assert ok
    image = decode(buf.tobytes())["image"]
    expected = np.round(gray16 / 257).astype(np.uint8)
    for channel in range(3):
        np.testing.assert_array_equal(image[..., channel], expected)


def test_16bit_color_png():
    rgb16 = sixteen_bit(ASTRONAUT)
    ok, buf = cv2.imencode(".png", np.ascontiguousarray(rgb16[..., ::-1]))  # OpenCV writes BGR
    assert ok
    image = decode(buf.tobytes())["image"]
    np.testing.assert_array_equal(image, np.round(rgb16 / 257).astype(np.uint8))


def test_cmyk_jpeg():
    data = encode(Image.fromarray(ASTRONAUT).convert("CMYK"), "JPEG", quality=95)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    image = decode(data)["image"]
    np.testing.assert_allclose(channel_means(image), channel_means(ASTRONAUT), atol=2)
    assert np.abs(image.astype(int) - ASTRONAUT).mean() < 4


# ----------------------------------------------------------------------------- bad inputs


def decode_error(data: bytes, **params) -> str:
    with pytest.raises(ValueError) as info:
        decode(data, **params)
    return str(info.value)


def test_empty_bytes():
    assert "empty" in decode_error(b"")


def test_text_file():
    text = b"name,value\nalpha,1\nbeta,2\n" * 20
    assert "not a recognised image" in decode_error(text)


@pytest.mark.parametrize("progressive", [False, True])
def test_truncated_jpeg(progressive):
    data = encode(ASTRONAUT, "JPEG", quality=90, progressive=progressive)
    assert "truncated" in decode_error(data[: len(data) // 2])


def test_truncated_phone_style_mpo_jpeg():
    """Pillow names phone JPEGs holding a second (preview) image MPO; cut ones are truncated too."""
    small = Image.fromarray(SMALL)
    data = encode(small, "MPO", save_all=True, append_images=[small.rotate(90)])
    assert Image.open(io.BytesIO(data)).format == "MPO"
    assert decode(data)["image"].shape == (64, 96, 3)
    assert "truncated" in decode_error(data[: len(data) * 3 // 4])


def test_truncated_png():
    data = encode(ASTRONAUT, "PNG")
    assert "truncated" in decode_error(data[: len(data) // 2])


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header claiming width x height RGB pixels, followed by almost no image data."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = zlib.crc32(kind + payload)
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


@pytest.fixture
def decoders(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every pixel decoding started from now on: a Pillow decoder made (``ImageFile.load`` and
    ``frombytes`` make one before reading any pixel) or an ``cv2.imdecode`` call."""
    started: list[str] = []
    pillow, opencv = Image._getdecoder, cv2.imdecode

    def getdecoder(mode, decoder_name, *args, **kwargs):
        started.append(f"Pillow {decoder_name}")
        return pillow(mode, decoder_name, *args, **kwargs)

    def imdecode(*args, **kwargs):
        started.append("OpenCV")
        return opencv(*args, **kwargs)

    monkeypatch.setattr(Image, "_getdecoder", getdecoder)
    monkeypatch.setattr(cv2, "imdecode", imdecode)
    return started


def test_the_decoder_count_sees_pillow_and_opencv_decode(decoders):
    png = encode(SMALL, "PNG")
    decoders.clear()  # encode's Image.fromarray made a raw decoder
    decode(png)
    Image.open(io.BytesIO(png)).load()
    assert decoders == ["OpenCV", "Pillow zip"]


def test_decompression_bomb_png_is_refused_without_decoding(decoders):
    message = decode_error(bomb_png(30000, 30000))
    assert decoders == []  # refused from the header: 2.7 GB of pixels were never allocated
    assert "max_pixels" in message


def test_pixel_limit_under_pillows_own_limit_is_checked_before_any_decoding(decoders):
    # 13000x13000 passes Pillow's bomb check but not the default max_pixels (150 MP).
    message = decode_error(bomb_png(13000, 13000))
    assert decoders == []
    assert "13000x13000" in message and "max_pixels" in message


def test_raised_max_pixels_overrides_pillows_own_limit(monkeypatch, decoders):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # setup() raises it
    # 196 MP: over Pillow's default refusal (179 MP), under max_pixels, so OpenCV gets to try.
    message = decode_error(bomb_png(14000, 14000), max_pixels=250_000_000)
    assert "pixel limit" not in message and "could not decode" in message
    assert decoders == ["OpenCV"]


def test_max_pixels_parameter():
    tiny = encode(ASTRONAUT[:20, :20], "PNG")
    assert decode(tiny, max_pixels=400)["image"].shape == (20, 20, 3)
    message = decode_error(tiny, max_pixels=100)
    assert "20x20" in message and "max_pixels=100" in message
    assert DecodeImage(max_pixels=100).params == {"max_pixels": 100}
    with pytest.raises(ValueError, match="max_pixels"):
        DecodeImage(max_pixels=0)


# ----------------------------------------------------------------------------- ResizeCenterCrop


def resize(image: np.ndarray, size: int = 64) -> np.ndarray:
    op = ResizeCenterCrop(size=size)
    op.setup()
    return op({"key": "k", "image": image})["image"]


@pytest.mark.parametrize("shape", [(300, 200), (200, 300), (50, 40), (64, 64)])
def test_resize_center_crop_shape(shape):
    image = np.asarray(Image.fromarray(ASTRONAUT).resize(shape[::-1]))
    out = resize(image)
    assert out.shape == (64, 64, 3) and out.dtype == np.uint8 and out.flags.c_contiguous
    assert np.abs(channel_means(out) - channel_means(image)).max() < 25  # same picture, not black


RED, GREEN, BLUE = (np.array(c, np.uint8) for c in ([220, 20, 20], [20, 220, 20], [20, 20, 220]))


@pytest.mark.parametrize("height, width", [(100, 300), (300, 100), (40, 120), (120, 40)])
def test_resize_center_crop_keeps_the_centre(height, width):
    """Thirds along the long side: red, green, blue. The centred square is exactly the green middle
    third, so red or blue in it means an off-centre crop."""
    long_side = max(height, width)
    stripes = np.repeat(np.stack([RED, GREEN, BLUE]), long_side // 3, axis=0)
    image = np.ascontiguousarray(
        np.broadcast_to(stripes[None] if width > height else stripes[:, None], (height, width, 3))
    )
    out = resize(image).astype(int)
    along = out[32] if width > height else out[:, 32]  # the row (or column) through the centre
    np.testing.assert_array_equal(along[4:-4], np.broadcast_to(GREEN, (56, 3)))
    for end in (along[0], along[-1]):  # the edges may blend with a neighbour, but are mostly green
        assert end[1] > 120, end
    # Symmetric: as much red blended in on one edge as blue on the other.
    np.testing.assert_allclose(along[0] - GREEN, (along[-1] - GREEN)[[2, 1, 0]], atol=1)


def test_resize_center_crop_offcentre_content_moves_out():
    """A marker in the far left of a wide image must be cut away; one in the centre kept."""
    image = np.zeros((100, 300, 3), np.uint8)
    image[40:60, 5:25] = 255
    assert resize(image).max() == 0
    image[40:60, 140:160] = 255
    out = resize(image)
    assert out[28:36, 28:36].min() == 255 and out[:, :16].max() == 0
