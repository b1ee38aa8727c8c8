"""Image ops: decode any common picture to RGB uint8, and resize / center-crop it."""

from __future__ import annotations

import io
import warnings
from typing import Any

import cv2
import numpy as np
from PIL import Image, UnidentifiedImageError

from precache.cache.image_codec import CODECS, ENCODE_OP, encode_image
from precache.ops.base import Op, Sample

__all__ = ["DecodeImage", "ResizeCenterCrop", "EncodeImage", "IMAGE_EXTENSIONS", "DEFAULT_MAX_PIXELS",
           "apply_exif_orientation"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")

DEFAULT_MAX_PIXELS = 150_000_000
"""Images whose header claims more pixels than this are refused before any decoding (150 MP,
above any phone or DSLR photo; a decompression bomb claims far more)."""

_EXIF_ORIENTATION = 0x0112


def apply_exif_orientation(image: np.ndarray, orientation: int) -> np.ndarray:
    """Rotate/flip an HxWxC array so it displays upright, for EXIF orientation 1-8."""
    if orientation == 2:
        image = image[:, ::-1]
    elif orientation == 3:
        image = image[::-1, ::-1]
    elif orientation == 4:
        image = image[::-1]
    elif orientation == 5:
        image = image.transpose(1, 0, 2)
    elif orientation == 6:
        image = np.rot90(image, -1)
    elif orientation == 7:
        image = np.rot90(image, 2).transpose(1, 0, 2)
    elif orientation == 8:
        image = np.rot90(image, 1)
    return np.ascontiguousarray(image)


def _jpeg_is_complete(data: bytes) -> bool:
    """True if the last scan of a JPEG is followed by its end-of-image marker.

    OpenCV decodes a truncated JPEG without an error (it fills the missing rows with grey), so
    truncation is checked here. Inside scan data 0xFF is always stuffed, so FFD9 there is a marker.
    """
    return data.rfind(b"\xff\xd9") > data.rfind(b"\xff\xda")


class DecodeImage(Op):
    """Decode image bytes (JPEG, PNG, BMP, TIFF, WebP) to an RGB uint8 ``image`` column.

    The header is read first (Pillow, no pixel decoding) to refuse images over ``max_pixels``;
    pixels are decoded with OpenCV. EXIF orientation is applied; grayscale, palette, RGBA (alpha
    dropped), 16-bit and CMYK inputs all come out as HxWx3 RGB uint8. Adds ``orig_height`` and
    ``orig_width`` (upright size).

    Args:
        max_pixels (int): refuse images whose header claims more pixels. Default 150,000,000.
    """

    name = "decode_image"
    version = "1"

    def __init__(self, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        if max_pixels <= 0:
            raise ValueError(f"max_pixels must be positive, got {max_pixels}")
        self.max_pixels = int(max_pixels)

    @property
    def params(self) -> dict[str, Any]:
        return {"max_pixels": self.max_pixels}

    def setup(self) -> None:
        cv2.setNumThreads(1)
        # Pillow refuses headers over 2 x Image.MAX_IMAGE_PIXELS itself; let max_pixels decide.
        if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < self.max_pixels:
            Image.MAX_IMAGE_PIXELS = self.max_pixels

    def _probe(self, data: bytes) -> tuple[str, int]:
        """Read the header: return (format, EXIF orientation); refuse oversized images."""
        if not data:
            raise ValueError("empty file (0 bytes)")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                header = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:
            raise ValueError(f"refused without decoding, over the pixel limit "
                             f"(max_pixels={self.max_pixels:,}): {e}") from None
        except UnidentifiedImageError:
            raise ValueError("not a recognised image format") from None
        except (OSError, SyntaxError) as e:
            raise ValueError(f"unreadable image header: {e}") from None
        with header:
            width, height = header.size
            fmt = header.format or "unknown"
            if width * height > self.max_pixels:
                raise ValueError(
                    f"header claims {width}x{height} = {width * height:,} pixels, over the limit "
                    f"max_pixels={self.max_pixels:,}; refused without decoding (raise it with "
                    f"--set max_pixels=N if the image is genuine)"
                )
            try:
                # PngImageFile.getexif() decodes every pixel to look for an eXIf chunk after the
                # image data; the base method reads only what the header gave.
                exif = Image.Image.getexif(header) if fmt == "PNG" else header.getexif()
            except (OSError, SyntaxError) as e:
                raise ValueError(f"unreadable image header: {e}") from None
        orientation = exif.get(_EXIF_ORIENTATION, 1)
        return fmt, orientation if orientation in range(1, 9) else 1

    def __call__(self, sample: Sample) -> Sample:
        data = sample.pop("data")
        fmt, orientation = self._probe(data)
        if fmt in ("JPEG", "MPO") and not _jpeg_is_complete(data):  # MPO: phone JPEGs
            raise ValueError("truncated JPEG (no end-of-image marker after the last scan)")
        flags = cv2.IMREAD_COLOR | cv2.IMREAD_ANYDEPTH | cv2.IMREAD_IGNORE_ORIENTATION
        image = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), flags)
        if image is None:
            raise ValueError(f"OpenCV could not decode this {fmt} file (corrupt or truncated)")
        if image.dtype == np.uint16:
            image = ((image.astype(np.uint32) + 128) // 257).astype(np.uint8)
        elif image.dtype != np.uint8:
            raise ValueError(f"unsupported sample type {image.dtype} in this {fmt} file")
        image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
        image = apply_exif_orientation(image, orientation)
        sample["image"] = image
        sample["orig_height"], sample["orig_width"] = image.shape[:2]
        return sample


class ResizeCenterCrop(Op):
    """Resize so the shorter side is ``size``, then cut the central ``size`` x ``size`` square.

    Shrinking uses area interpolation (no aliasing), enlarging uses bilinear.

    Args:
        size (int): side of the square output. Default 128.
    """

    name = "resize_center_crop"
    version = "1"

    def __init__(self, *, size: int = 128) -> None:
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        self.size = int(size)

    @property
    def params(self) -> dict[str, Any]:
        return {"size": self.size}

    def setup(self) -> None:
        cv2.setNumThreads(1)

    def __call__(self, sample: Sample) -> Sample:
        image = sample["image"]
        height, width = image.shape[:2]
        scale = self.size / min(height, width)
        new_w = max(self.size, round(width * scale))
        new_h = max(self.size, round(height * scale))
        interpolation = cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR
        resized = cv2.resize(image, (new_w, new_h), interpolation=interpolation)
        top = (new_h - self.size) // 2
        left = (new_w - self.size) // 2
        sample["image"] = np.ascontiguousarray(
            resized[top : top + self.size, left : left + self.size]
        )
        return sample


class EncodeImage(Op):
    """Store ``column`` as JPEG or WebP bytes at ``quality`` instead of raw pixels (``raw``: keep
    the array). Runs last, after every op that needs the pixels; stage 2 decodes it again
    (``precache.cache.image_codec``). JPEG at quality 95 keeps a face crop at about a sixth of
    its raw bytes; raw columns are read mapped, with no decoding at all.

    Args:
        codec: ``raw``, ``jpeg`` or ``webp``.
        quality: 1-100.
        column: the image column.
    """

    name = ENCODE_OP
    version = "1"

    def __init__(self, *, codec: str = "raw", quality: int = 95, column: str = "image") -> None:
        if codec not in CODECS:
            raise ValueError(f"image_codec must be one of {', '.join(CODECS)}, not {codec!r}")
        if not 1 <= quality <= 100:
            raise ValueError(f"quality must be 1-100, not {quality}")
        self.codec, self.quality, self.column = codec, int(quality), column

    @property
    def params(self) -> dict[str, Any]:
        return {"codec": self.codec, "quality": self.quality, "column": self.column}

    def __call__(self, sample: Sample) -> Sample:
        if self.codec == "raw":
            return sample
        return dict(sample, **{self.column: encode_image(sample[self.column], self.codec,
                                                         self.quality)})
