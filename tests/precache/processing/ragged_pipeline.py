"""A test pipeline with a variable-length column: each input's bytes as uint16 "token ids"."""

from __future__ import annotations

import numpy as np

from precache.cache.schema import ragged
from precache.processing.ops import FunctionOp, Op
from precache.processing.pipeline import Pipeline


def byte_ids(sample: dict) -> dict:
    if sample["data"].startswith(b"BAD"):
        sample["ids"] = np.frombuffer(sample["data"], np.uint8).astype(np.int64)  # wrong dtype
    else:
        sample["ids"] = ragged(np.frombuffer(sample["data"], np.uint8), np.uint16)
    sample["length"] = len(sample["ids"])
    return sample


def make_ops() -> list[Op]:
    return [FunctionOp(byte_ids)]


pipeline = Pipeline(name="ragged", make_ops=make_ops, extensions=(".txt",),
                    description="each file's bytes as a ragged uint16 column")
