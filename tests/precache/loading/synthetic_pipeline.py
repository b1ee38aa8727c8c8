"""A test pipeline that makes a tiny image per input without decoding anything, so tests can
build caches of many thousands of rows in seconds."""

from __future__ import annotations

import numpy as np

from precache.processing.ops import FunctionOp, Op
from precache.processing.pipeline import Pipeline


def tiny_image(sample: dict) -> dict:
    value = int.from_bytes(sample["data"][:1] or b"\0", "little")
    sample["image"] = np.full((4, 4, 3), value, dtype=np.uint8)
    return sample


def make_ops() -> list[Op]:
    return [FunctionOp(tiny_image)]


pipeline = Pipeline(name="synthetic", make_ops=make_ops, extensions=(".bin",),
                    description="a 4x4 image per input, no decoding")
