"""Encoded image columns: JPEG or WebP bytes instead of raw pixels, decoded again in stage 2.

A 128 px face crop is 48 KB raw and a few KB as JPEG at quality 95. Stage 1 encodes
(``precache.processing.ops.image.EncodeImage``) and records the codec in its op parameters; stage 2 finds
the encoded columns in the manifest (``encoded_columns``) and decodes each row with a fast
decoder: libjpeg-turbo through ``simplejpeg`` for JPEG, libwebp through OpenCV for WebP (not PIL,
which is several times slower per image).
"""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np

__all__ = ["CODECS", "encode_image", "decode_image", "encoded_columns", "ENCODE_OP"]

CODECS = ("raw", "jpeg", "webp")
"""``raw``: the pixels as a fixed-shape array (mapped in stage 2); ``jpeg``/``webp``: bytes."""

ENCODE_OP = "encode_image"
"""The op name whose ``column`` and ``codec`` parameters mark an encoded column."""


def encode_image(image: np.ndarray, codec: str, quality: int) -> bytes:
    """RGB uint8 ``image`` as ``codec`` bytes at ``quality`` (1-100).

    Raises:
        ValueError: unknown codec, or an image that is not H x W x 3 uint8.
    """
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"only H x W x 3 uint8 images can be encoded, not {image.dtype}"
                         f"{list(image.shape)}")
    if codec == "jpeg":
        import simplejpeg

        return simplejpeg.encode_jpeg(np.ascontiguousarray(image), quality=int(quality),
                                      colorspace="RGB", colorsubsampling="444")
    if codec == "webp":
        ok, data = cv2.imencode(".webp", cv2.cvtColor(image, cv2.COLOR_RGB2BGR),
                                [cv2.IMWRITE_WEBP_QUALITY, int(quality)])
        if not ok:
            raise ValueError("OpenCV could not encode the image as WebP")
        return data.tobytes()
    raise ValueError(f"image codec must be one of {CODECS[1:]} to encode, not {codec!r}")


def decode_image(data: bytes | memoryview | np.ndarray,
                 out: np.ndarray | None = None) -> np.ndarray:
    """An RGB uint8 array from JPEG or WebP bytes (the format is read from the first bytes).

    Args:
        data: the encoded image (any buffer: a view of a mapped shard is read in place).
        out: an ``(h, w, 3)`` uint8 array to decode into (a slot of a batch), instead of a new
            array; the image must have exactly that size.

    Raises:
        ValueError: the bytes are neither, do not decode (libjpeg's recoverable errors, such as
            a truncated file, included), or their size is not ``out``'s.
    """
    # (numpy's stubs declare an ndarray a buffer only for Python >= 3.12)
    head = bytes(memoryview(data)[:12])  # type: ignore[arg-type]
    if head[:2] == b"\xff\xd8":
        import simplejpeg

        if out is None:
            return simplejpeg.decode_jpeg(data, colorspace="RGB")
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        _check_size((height, width, 3), out)
        return simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=out)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        if image is not None:
            if out is None:
                return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
            _check_size(image.shape, out)
            return cv2.cvtColor(image, cv2.COLOR_BGR2RGB, dst=out)
    raise ValueError(f"not a JPEG or WebP image (first bytes {head!r})")


def _check_size(shape: tuple[int, ...], out: np.ndarray) -> None:
    if tuple(shape) != out.shape or out.dtype != np.uint8:
        raise ValueError(f"the image is {shape[1]} x {shape[0]} px, the batch's others "
                         f"{out.shape[1]} x {out.shape[0]} px: the crops of one column must "
                         "share a size")


def encoded_columns(ops: list[dict[str, Any]]) -> dict[str, str]:
    """Column -> codec of the encoded image columns, from a manifest's ``ops`` list."""
    found: dict[str, str] = {}
    for op in ops:
        params = op.get("params", {})
        if op.get("name") == ENCODE_OP and params.get("codec", "raw") != "raw":
            found[str(params.get("column", "image"))] = str(params["codec"])
    return found
