"""Feeding the training loop (issue 25): ``make_loader``'s worker threads against its worker
processes and against a NumPy memmap gather in the training process, in one run.

    .venv/bin/python tests/benchmarks/bench_feed.py                     # 12,000 crops, ~1 min
    .venv/bin/python tests/benchmarks/bench_feed.py --rows 20000 --size 224 --augment

Workloads (fixed seeds; the cache is written by stage 1 with ``synthetic_faces.py``'s rows):

- **raw**: ``image`` 128x128x3 uint8 crops stored raw (mapped; a batch is a gather);
- **jpeg**: the same crops as JPEG q95 (``EncodeImage``), decoded into the batch.

Readers, each full shuffle, batch 256, warm (one untimed epoch first), epochs interleaved
(``--epochs`` of each, medians):

1. **limit**: the training process itself takes each batch from a memmapped ``.npy`` of the
   crops (``np.take`` into one array; jpeg: each row decoded by simplejpeg into the batch);
2. **precache w=0**: ``make_loader(..., num_workers=0)``;
3. **processes w=N** / **threads w=N**: ``make_loader(..., num_workers=N, worker_kind=...)``.

With ``--augment`` each reader's batch is also augmented: the limit and the threads with the
batched ``FaceAugment`` (``batch_transform``, OpenCV form), the processes both ways (the
per-sample ``FaceAugment`` as the dataset's transform, the setting before issue 25, and
batched); ``--per-sample-from FILE`` takes the per-sample one from another file (the code
before batching: ``git show d778025:precache/augment/face.py > /tmp/face_before.py``). The cache
then carries the face columns FaceAugment moves (5 landmarks, mesh, region hulls).

The loop touches one pixel row of each batch and counts rows; each reader must hand out every
row once per epoch (checked). Rates are samples/s; ratios to the limit in the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import precache  # noqa: E402
from precache.faces.topology import region_hulls  # noqa: E402
from precache.loading import CachedDataset, make_loader  # noqa: E402
from precache.processing.ops import FunctionOp  # noqa: E402
from precache.processing.ops.image import EncodeImage  # noqa: E402
from precache.processing.pipeline import Pipeline  # noqa: E402
from precache.threads import pin_threads  # noqa: E402

BATCH = 256


def face_rows(sample: dict, size: int) -> list[dict]:
    """16 face-shaped rows of one input: a smooth crop (JPEG spends realistic bytes on it),
    5 landmarks and a 468-point mesh inside it (random points), and the mesh's region hulls."""
    import cv2

    spec = json.loads(sample["data"])
    rng = np.random.default_rng(int(spec["seed"]))
    base = {k: v for k, v in sample.items() if k != "data"}
    rows = []
    for _ in range(int(spec["rows"])):
        coarse = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
        image = cv2.resize(coarse, (size, size), interpolation=cv2.INTER_CUBIC)
        image = np.clip(image + rng.normal(0, 6, image.shape), 0, 255).astype(np.uint8)
        mesh = (0.2 + 0.6 * rng.random((468, 2))).astype(np.float32) * (size - 1)
        regions, sizes = region_hulls(mesh)  # as stage 1's face_regions op
        rows.append({**base, "image": image, "landmarks5": mesh[:5].copy(), "mesh": mesh,
                     "has_mesh": np.bool_(True), "regions": regions, "region_sizes": sizes,
                     "label": np.int64(int(spec["seed"]) % 2)})
    return rows


def make_ops(size: int = 128, codec: str = "raw") -> list:
    ops = [FunctionOp(face_rows, params={"size": size})]
    return ops + ([EncodeImage(codec=codec, quality=95)] if codec != "raw" else [])


pipeline = Pipeline(name="bench_feed", make_ops=make_ops, extensions=(".json",),
                    description="face-shaped rows for bench_feed (issue 25)")


def build(work: Path, rows: int, size: int, codec: str, workers: int = 2) -> Path:
    inputs = work / "inputs"
    if not inputs.exists():
        inputs.mkdir(parents=True)
        for i in range(rows // 16):
            (inputs / f"{i:06d}.json").write_text(json.dumps({"seed": i, "rows": 16}))
    cache = work / f"cache-{codec}"
    summary = precache.run(str(Path(__file__).resolve()), inputs, cache,
                           params={"size": size, "codec": codec}, workers=workers, shard_rows=1024,
                           progress=False, log=lambda line: None)
    if summary.failed:
        raise RuntimeError(f"stage 1 failed: {summary.failures[:3]}")
    return cache


class Limit:
    """The training process gathers each batch itself from a memmapped ``.npy`` (raw), or
    decodes each row's bytes into one batch array (jpeg)."""

    def __init__(self, arrays: dict[str, Any], encoded: list[bytes] | None, seed: int) -> None:
        self.arrays, self.encoded, self.seed = arrays, encoded, seed
        self.rows = len(arrays["label"])

    def epoch(self, number: int, transform: Callable | None):
        import simplejpeg

        order = np.random.default_rng([self.seed, number]).permutation(self.rows)
        for start in range(0, self.rows, BATCH):
            rows = np.sort(order[start:start + BATCH])
            batch = {name: torch.from_numpy(np.take(values, rows, axis=0))
                     for name, values in self.arrays.items()}
            if self.encoded is not None:
                first = simplejpeg.decode_jpeg(self.encoded[rows[0]], colorspace="RGB")
                images = np.empty((len(rows), *first.shape), np.uint8)
                for k, row in enumerate(rows.tolist()):
                    simplejpeg.decode_jpeg(self.encoded[row], colorspace="RGB", buffer=images[k])
                batch["image"] = torch.from_numpy(images)
            yield transform(batch) if transform is not None else batch


def export(cache: Path, work: Path, columns: list[str]) -> tuple[dict[str, Any], Any]:
    """The cache's columns as memmapped ``.npy`` files (image bytes as a list for jpeg)."""
    table = precache.Cache(cache).read_all(columns)
    arrays, encoded = {}, None
    for name in columns:
        values = table[name]
        if isinstance(values, np.ndarray):
            np.save(work / f"{name}.npy", values)
            arrays[name] = np.load(work / f"{name}.npy", mmap_mode="r")
        else:
            encoded = [bytes(v) for v in values]
    return arrays, encoded


def run_reader(epochs: Callable[[int], Any], rows: int, number: int) -> float:
    """Samples/s of one epoch; checks that it handed out ``rows`` rows."""
    seen = 0
    start = time.perf_counter()
    for batch in epochs(number):
        image = batch["image"]
        seen += len(image)
        int(image[:, 0, 0, 0].sum())  # the loop reads the batch
    seconds = time.perf_counter() - start
    assert seen == rows, f"read {seen} rows, not {rows}"
    return rows / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=12_000)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--workload", default="raw,jpeg")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--augment", action="store_true")
    parser.add_argument("--per-sample-from", type=Path, default=None, metavar="FACE.py",
                        help="with --augment: take the per-sample FaceAugment from this file, e.g."
                        " the code before batching (git show d778025:precache/augment/face.py)")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    pin_threads()  # one thread per library pool, as make_loader's workers; threads read
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="bench_feed-"))
    results = []
    try:
        for workload in args.workload.split(","):
            print(f"[{workload}] stage 1: {args.rows:,} rows of {args.size} px", flush=True)
            cache = build(work, args.rows, args.size, workload)
            columns = ["image", "label"] + (["landmarks5", "mesh", "has_mesh", "regions",
                                             "region_sizes"] if args.augment else [])
            arrays, encoded = export(cache, work, columns)
            results += measure(workload, cache, arrays, encoded, columns, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nbatch {BATCH}, full shuffle, warm, {args.size} px, median of {args.epochs} "
          "interleaved epochs; samples/s and the ratio to the limit in this run")
    print(f"{'workload':<8} {'reader':<44} {'samples/s':>10} {'/limit':>7}")
    for workload, name, rate, ratio in results:
        print(f"{workload:<8} {name:<44} {rate:>10,.0f} {ratio:>7.2f}")


def measure(workload: str, cache: Path, arrays: dict[str, Any], encoded: Any,
            columns: list[str], args: argparse.Namespace) -> list[tuple]:
    readers: dict[str, Callable[[int], Any]] = {}
    batched = per_sample = None
    if args.augment:
        from precache.augment import FaceAugment

        batched = FaceAugment(seed=1)
        per_sample = FaceAugment(seed=1)
        if args.per_sample_from is not None:  # e.g. the per-sample code before batching
            import importlib.util

            spec = importlib.util.spec_from_file_location("face_before", args.per_sample_from)
            module = importlib.util.module_from_spec(spec)
            sys.modules["face_before"] = module
            spec.loader.exec_module(module)
            per_sample = module.FaceAugment(seed=1)
    limit = Limit(arrays, encoded, seed=0)
    readers["limit (in-process gather" + (" + batched augment)" if batched else ")")] = (
        lambda e: limit.epoch(e, batched))

    def loader_epochs(loader):
        def epochs(number: int):
            loader.set_epoch(number)
            return iter(loader)
        return epochs

    rows = len(arrays["label"])
    dataset = CachedDataset(cache, columns=columns)
    readers["precache w=0"] = loader_epochs(make_loader(dataset, BATCH, num_workers=0,
                                                        batch_transform=batched))
    for workers in [int(w) for w in args.workers.split(",")]:
        if per_sample is not None:
            transformed = CachedDataset(cache, columns=columns, transform=per_sample)
            readers[f"processes w={workers}, per-sample augment"] = loader_epochs(
                make_loader(transformed, BATCH, num_workers=workers))
        readers[f"processes w={workers}" + (", batched augment" if batched else "")] = (
            loader_epochs(make_loader(dataset, BATCH, num_workers=workers,
                                      worker_kind="processes", batch_transform=batched)))
        readers[f"threads w={workers}" + (", batched augment" if batched else "")] = (
            loader_epochs(make_loader(dataset, BATCH, num_workers=workers,
                                      worker_kind="threads", batch_transform=batched)))
    rates: dict[str, list[float]] = {name: [] for name in readers}
    for name, epochs in readers.items():  # warm: files in the page cache, workers started
        run_reader(epochs, rows, 0)
    for number in range(1, args.epochs + 1):
        for name, epochs in readers.items():
            rates[name].append(run_reader(epochs, rows, number))
            print(f"[{workload}] epoch {number} {name}: {rates[name][-1]:,.0f}/s", flush=True)
    base = statistics.median(next(iter(rates.values())))
    return [(workload, name, statistics.median(r), statistics.median(r) / base)
            for name, r in rates.items()]


if __name__ == "__main__":
    main()
