"""Image ops: decode any common picture to RGB uint8, and resize / center-crop it."""

from __future__ import annotations

import io
import os
import re
import sys
import tempfile
import threading
import warnings
from typing import IO, Any

import cv2
import numpy as np
from PIL import Image, UnidentifiedImageError

from precache.cache.image_codec import CODECS, ENCODE_OP, encode_image
from precache.processing.ops.base import Op, Sample

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


# What OpenCV's decoders write to stderr while decoding: libjpeg's warnings (its catalogue in
# jerror.h), libpng's messages, and OpenCV's own log lines (which carry libtiff's and its own
# decoding errors).
_LIBJPEG_CORRUPT = re.compile(
    r"^(Corrupt JPEG data: .*|Premature end of JPEG file|Invalid SOS parameters for sequential JPEG"
    r"|Inconsistent progression sequence .*|Unknown Adobe color transform code .*)$")
_DECODER_LINE = re.compile(
    r"^(Corrupt JPEG data: |Premature end of JPEG file|Invalid SOS parameters|Inconsistent "
    r"progression sequence|Unknown Adobe color transform|Warning: unknown JFIF revision|Warning: "
    r"thumbnail image size|Application transferred too many scanlines|libpng (warning|error): "
    r"|\[ ?(WARN|ERROR|INFO|DEBUG|FATAL|VERBOSE) ?:)")
_OPENCV_LOG_PREFIX = re.compile(r"^\[[^\]]*\] global \S+ \S+ ")
_OPENCV_ERROR = re.compile(r"error: \(-?\d+:[^)]*\) (.*?)(?: in function '[^']*')?$")

_stderr_lock = threading.Lock()
_stderr_file: tuple[int, IO[bytes]] | None = None  # (pid, file): one per process, made on first use


def _capture_file() -> IO[bytes]:
    global _stderr_file
    if _stderr_file is None or _stderr_file[0] != os.getpid():  # a forked child makes its own
        _stderr_file = (os.getpid(), tempfile.TemporaryFile(prefix="precache-decode-"))
    return _stderr_file[1]


def _decode_quietly(data: bytes, flags: int) -> tuple[np.ndarray | None, list[str]]:
    """``cv2.imdecode`` with file descriptor 2 pointed at a scratch file: returns the image (or
    None) and the decoders' messages, which never reach the terminal.

    Why: OpenCV hands libjpeg's *warnings* nowhere but C ``stderr``, and a warning is how libjpeg
    reports corrupt data that it decoded anyway (a JPEG with bytes missing from its middle gives
    "Corrupt JPEG data: premature end of data segment" and a garbled picture, with no error).
    Reading fd 2 around the call tells us so for the very decode whose pixels are kept, for about
    5 microseconds an image (two ``dup2`` and an ``fstat``; measured on JPEGs: 20 -> 25 us at
    48x48, lost in the noise of 0.9 ms at 512x512 and 30 ms at 12 MP). The alternative, a strict
    second decode with ``simplejpeg`` (libjpeg-turbo, stop on warning), costs another 80% of the
    decode (40-60% at 1/8 scale) and would still leave OpenCV printing to the terminal.

    fd 2 belongs to the process, so a lock keeps two threads of one process from swapping it
    under each other (stage-1 workers run their ops one at a time), and any line that is not a
    decoder's (another thread's, written in that millisecond) is written back to the real stderr.
    """
    try:
        sys.stderr.flush()  # Python text written before the call goes where it was going
    except (AttributeError, OSError, ValueError):
        pass
    buffer = np.frombuffer(data, dtype=np.uint8)
    with _stderr_lock:
        try:
            scratch = _capture_file()
            saved = os.dup(2)
        except OSError:  # no fd 2 (a daemon) or no temporary folder: decode without capturing
            return cv2.imdecode(buffer, flags), []
        try:
            os.dup2(scratch.fileno(), 2)
            try:
                image = cv2.imdecode(buffer, flags)
            finally:
                os.dup2(saved, 2)
                text = _drain(scratch)
                others = [line for line in text.splitlines(keepends=True)
                          if line.strip() and not _DECODER_LINE.match(line)]
                if others:
                    os.write(saved, "".join(others).encode())
        finally:
            os.close(saved)
    return image, [line.strip() for line in text.splitlines() if _DECODER_LINE.match(line)]


def _drain(scratch: IO[bytes]) -> str:
    """What was written to ``scratch``; it is emptied for the next decode."""
    if os.fstat(scratch.fileno()).st_size == 0:
        return ""
    scratch.seek(0)
    text = scratch.read().decode("utf-8", "replace")
    scratch.seek(0)
    scratch.truncate()
    return text


def _reason(messages: list[str]) -> str:
    """The decoder's own words for a failed decode, shortest useful form, or ``""``."""
    best = next((m for m in messages if "error" in m.lower()[:12] or "ERROR" in m[:8]), None)
    best = best or (messages[0] if messages else "")
    best = _OPENCV_LOG_PREFIX.sub("", best)
    if match := _OPENCV_ERROR.search(best):
        best = match.group(1)
    return best[:300]


class DecodeImage(Op):
    """Decode image bytes (JPEG, PNG, BMP, TIFF, WebP) to an RGB uint8 ``image`` column.

    The header is read first (Pillow, no pixel decoding) to refuse images over ``max_pixels``;
    pixels are decoded with OpenCV. EXIF orientation is applied; grayscale, palette, RGBA (alpha
    dropped), 16-bit and CMYK inputs all come out as HxWx3 RGB uint8. Adds ``orig_height`` and
    ``orig_width`` (upright size).

    A file that does not decode whole fails (``ValueError``, with the decoder's own words), never
    becomes a row: a truncated file, one OpenCV cannot decode, and a JPEG that libjpeg decodes
    with a corrupt-data warning ("Corrupt JPEG data: ...", "Premature end of JPEG file", ...).
    Such a JPEG fails rather than becoming a row with a warning: its picture is garbled (or may
    be: a few bytes flipped mid-scan show up only as "N extraneous bytes before marker 0xd9"),
    and a ``warning`` column would change the schema of every image cache. What the decoders
    print never reaches the terminal (see ``_decode_quietly``).

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
        image, messages = _decode_quietly(data, flags)
        if image is None:
            reason = _reason(messages)
            raise ValueError(f"OpenCV could not decode this {fmt} file (corrupt or truncated)"
                             + (f": {reason}" if reason else ""))
        corrupt = next((m for m in messages if _LIBJPEG_CORRUPT.match(m)), None)
        if corrupt is not None:
            raise ValueError(f"corrupt {fmt}: libjpeg decoded it with the warning \"{corrupt}\" "
                             "(part of its data is missing or damaged, so the picture would be "
                             "garbled); re-export or replace the file")
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
