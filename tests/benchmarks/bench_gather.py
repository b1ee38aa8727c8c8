"""Fixed-shape columns of many small shards, warm, one process, against the NumPy limit.

    python tests/benchmarks/bench_gather.py                 # 12,000 rows, ~1-2 minutes on 2 cores
    python tests/benchmarks/bench_gather.py --rows 48000 --rounds 5

The ``faces`` pipeline's shape (issue 37): raw 128 px crops (``image``, 49,152 bytes a row),
5 landmarks (``landmarks``, 40 bytes a row) and ``label`` (8 bytes) of ``synthetic_faces.py``,
in 256-row shards (the faces pipeline's default ``shard_rows``), Parquet; full shuffle, batch
256, warm (one untimed epoch first). Measured in rounds, each setting once a round, each for
about ``--seconds``; a ratio is taken against the limit of the same round, and the median over
rounds is printed:

- **limit**: ``np.take`` of NumPy memmaps of the same arrays (one ``.npy`` per column, maps
  kept open, as precache keeps its shards'), one call a column;
- ``read_batch(storage_order=True)``, ``make_loader(num_workers=0)``,
  ``make_loader(num_workers=2)`` (thread workers) over ``CachedDataset``;
- ``label`` alone and ``landmarks`` alone, ``read_batch`` and ``make_loader(num_workers=0)``,
  against the limit of that column alone.

Everything it wrote is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import precache
from precache.loading import CachedDataset, make_loader

PIPELINE = str(Path(__file__).with_name("synthetic_faces.py"))
ALL = ["image", "landmarks", "label"]
BATCH = 256


def build(work: Path, rows: int) -> Path:
    """A Parquet cache of ``rows`` face-shaped rows in 256-row shards (16 inputs of 16 rows)."""
    cache = work / "cache"
    if (cache / "manifest.json").exists():
        return cache
    inputs = work / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    for i in range(-(-rows // 16)):
        (inputs / f"{i:07d}.json").write_text(json.dumps({"seed": i, "rows": 16}))
    precache.run(PIPELINE, inputs, cache, shard_rows=16)
    return cache


def export(cache: Path, folder: Path) -> dict[str, np.ndarray]:
    """The columns as one ``.npy`` each in dataset order, opened as memmaps (the limit)."""
    folder.mkdir(parents=True, exist_ok=True)
    dataset = CachedDataset(cache, columns=ALL)
    try:
        for name in ALL:
            np.save(folder / f"{name}.npy", dataset.read_column(name))
    finally:
        dataset.close()
    return {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in ALL}


def epochs(rows: int, seed: int) -> Callable[[], list[np.ndarray]]:
    """Each call: the next epoch's shuffled batches of indices."""
    rng = np.random.default_rng(seed)

    def next_epoch() -> list[np.ndarray]:
        order = rng.permutation(rows)
        return [order[i:i + BATCH] for i in range(0, rows, BATCH)]
    return next_epoch


def timed(run_epoch: Callable[[], int], seconds: float) -> float:
    """Rows/s of whole epochs run for at least ``seconds`` (after one untimed epoch: warm)."""
    run_epoch()
    count, start = 0, time.perf_counter()
    while True:
        count += run_epoch()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count / elapsed


def limit_epoch(arrays: dict[str, np.ndarray], names: list[str],
                next_epoch: Callable[[], list[np.ndarray]]) -> Callable[[], int]:
    def run() -> int:
        count = 0
        for index in next_epoch():
            batch = {n: torch.from_numpy(np.take(arrays[n], index, axis=0)) for n in names}
            count += len(batch[names[0]])
        return count
    return run


def read_batch_epoch(dataset: CachedDataset, next_epoch: Callable[[], list[np.ndarray]],
                     ) -> Callable[[], int]:
    name = dataset.columns[0]

    def run() -> int:
        count = 0
        for index in next_epoch():  # (held until the next is read, as the limit's and a loop's)
            batch = dataset.read_batch(index, storage_order=True)
            count += len(batch[name])
        return count
    return run


def loader_epoch(loader: object, name: str) -> Callable[[], int]:
    def run() -> int:
        return sum(len(batch[name]) for batch in loader)  # type: ignore[attr-defined]
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=12000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=0.6, help="per setting and round")
    parser.add_argument("--only", default="", help="comma-separated setting names to run")
    parser.add_argument("--work", type=Path, default=Path("/tmp/precache-bench-gather"))
    parser.add_argument("--keep", action="store_true", help="keep the cache and .npy files")
    args = parser.parse_args()
    made = not args.work.exists()
    opened: list[CachedDataset] = []
    try:
        cache = build(args.work, args.rows)
        arrays = export(cache, args.work / "limit")
        rows = len(arrays["label"])

        def dataset(names: list[str]) -> CachedDataset:
            opened.append(CachedDataset(cache, columns=names))
            return opened[-1]
        full, label, points = dataset(ALL), dataset(["label"]), dataset(["landmarks"])
        label_loader = make_loader(label, BATCH, num_workers=0, seed=1)
        settings: dict[str, tuple[str, Callable[[], int]]] = {
            "limit": ("limit", limit_epoch(arrays, ALL, epochs(rows, 0))),
            "read_batch(storage_order=True)": ("limit", read_batch_epoch(full, epochs(rows, 0))),
            "make_loader(num_workers=0)": ("limit", loader_epoch(
                make_loader(dataset(ALL), BATCH, num_workers=0), "label")),
            "make_loader(num_workers=2) threads": ("limit", loader_epoch(
                make_loader(dataset(ALL), BATCH, num_workers=2, worker_kind="threads"), "label")),
            "label limit": ("label limit", limit_epoch(arrays, ["label"], epochs(rows, 0))),
            "label read_batch": ("label limit", read_batch_epoch(label, epochs(rows, 0))),
            "label make_loader(0)": ("label limit", loader_epoch(label_loader, "label")),
            "landmarks limit": ("landmarks limit",
                                limit_epoch(arrays, ["landmarks"], epochs(rows, 0))),
            "landmarks read_batch": ("landmarks limit", read_batch_epoch(points, epochs(rows, 0))),
        }
        only = [s for s in args.only.split(",") if s]
        rates: dict[str, list[float]] = {name: [] for name in settings}
        ratios: dict[str, list[float]] = {name: [] for name in settings}
        for _ in range(args.rounds):
            got = {}
            for name, (_, run) in settings.items():
                if not only or name in only or name.endswith("limit"):
                    got[name] = timed(run, args.seconds)
            for name, rate in got.items():
                rates[name].append(rate)
                ratios[name].append(rate / got[settings[name][0]])
        print(f"{rows:,} rows in {len(np.unique(full.shard_ids))} shards, "
              f"batch {BATCH}, full shuffle, warm, one process; median of {args.rounds} rounds")
        print("| reader | rows/s | vs limit |")
        print("|---|---:|---:|")
        for name in settings:
            if rates[name]:
                print(f"| {name} | {statistics.median(rates[name]):,.0f} "
                      f"| {statistics.median(ratios[name]):.2f} of {settings[name][0]} |")
    finally:
        for opened_dataset in opened:
            opened_dataset.close()
        if not args.keep and made:
            shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
