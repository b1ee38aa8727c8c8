"""A stage-1 pipeline shaped like the faces pipeline's output, without its models: each input
(a small JSON file ``{"seed": S, "rows": R}``) yields R rows of a 128x128x3 crop, 5 landmarks,
a 468-point mesh, a box and a label (about 53 KB per row), fast enough to write caches larger
than RAM for ``bench_loading.py``."""

from __future__ import annotations

import json

import numpy as np

from precache.processing.ops import FunctionOp, Op
from precache.processing.pipeline import Pipeline


def face_rows(sample: dict) -> list[dict]:
    spec = json.loads(sample["data"])
    rng = np.random.default_rng(int(spec["seed"]))
    base = {k: v for k, v in sample.items() if k != "data"}
    return [{**base, "image": rng.integers(0, 255, (128, 128, 3), dtype=np.uint8),
             "landmarks": rng.random((5, 2), dtype=np.float32),
             "mesh": rng.random((468, 2), dtype=np.float32),
             "box": rng.random(4, dtype=np.float32),
             "label": np.int64(int(spec["seed"]) % 10)} for _ in range(int(spec["rows"]))]


def make_ops() -> list[Op]:
    return [FunctionOp(face_rows)]


pipeline = Pipeline(name="synthetic_faces", make_ops=make_ops, extensions=(".json",),
                    description="face-shaped random rows (crop, landmarks, mesh, box, label)")
