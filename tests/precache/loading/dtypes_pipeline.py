"""A test pipeline whose rows hold a fixed-shape column of every dtype a cache can store, plus a
small JPEG crop, without decoding anything: each ``.bin`` input's first byte sets the values."""

from __future__ import annotations

import numpy as np

from precache.processing.ops import FunctionOp, Op
from precache.processing.pipeline import Pipeline

DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128", "datetime64[s]")
"""The ``ndarray`` columns (``a_<name>``): torch has a tensor dtype for each but the last (nor,
before torch 2.3, for unsigned 16-64 bit). A fixed-shape string array cannot be stored."""


def column(dtype: str) -> str:
    return "a_" + "".join(c for c in dtype if c.isalnum())


def rows_of_every_dtype(sample: dict) -> dict:
    value = int.from_bytes(sample["data"][:1] or b"\0", "little")
    for dtype in DTYPES:
        base = np.array([value, value + 1, value * 3]) % 7
        sample[column(dtype)] = base.astype(dtype)
    sample["flag"] = bool(value % 2)  # scalars
    sample["score"] = np.float32(value / 4)
    image = np.zeros((8, 8, 3), dtype=np.uint8)
    image[..., 0], image[:4, :, 1] = value, 255 - value
    sample["image"] = image
    return sample


def make_ops() -> list[Op]:
    from precache.processing.ops.image import EncodeImage

    return [FunctionOp(rows_of_every_dtype), EncodeImage(codec="jpeg", quality=95)]


pipeline = Pipeline(name="dtypes", make_ops=make_ops, extensions=(".bin",),
                    description="a fixed-shape column of every storable dtype and a JPEG crop")
