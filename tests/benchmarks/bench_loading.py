"""Stage-2 loading at any size: ``make_loader`` over a face-shaped cache against the NumPy memmap
limit, cold (page cache dropped) and warm, in one run.

    python tests/benchmarks/bench_loading.py --rows 20000              # 1.06 GB
    python tests/benchmarks/bench_loading.py --rows 576000 --max-batches 100   # 30.5 GB

It writes inputs for ``synthetic_faces.py`` (16 rows each), runs stage 1 into a Parquet (or
``--format hdf5``) cache, exports the same columns as one ``.npy`` per column (the limit's
data), then measures, full-random shuffle, batch 256, columns image/landmarks/mesh/box/label:

- **limit**: a DataLoader (no workers) over a dataset whose ``__getitems__`` is one
  ``np.take`` per memory-mapped column;
- **precache**: ``make_loader(CachedDataset(...), 256, num_workers=w)`` for each ``--workers``.

Each setting's epoch 1 starts with its files dropped from the page cache (cold); epoch 2 is
warm where the data fits in RAM. ``--max-batches`` cuts an epoch (for caches larger than RAM:
every epoch is then cold). Worker USS/PSS are read after the warm epoch. Everything it wrote
is deleted at the end unless ``--keep`` (the cache and the .npy files are as large as the data).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

import precache
from precache.cli.bench.measure import (_MemmapRows, _as_tensors, _smaps_kb, drop_page_cache,
                                        shard_paths)
from precache.loading import CachedDataset, make_loader

COLUMNS = ["image", "landmarks", "mesh", "box", "label"]
PIPELINE = str(Path(__file__).with_name("synthetic_faces.py"))


def build(work: Path, rows: int, fmt: str) -> Path:
    cache = work / f"cache-{fmt}"
    if (cache / "manifest.json").exists():
        return cache
    inputs = work / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    for i in tqdm(range(rows // 16), desc="inputs", unit="file"):
        (inputs / f"{i:07d}.json").write_text(json.dumps({"seed": i, "rows": 16}))
    precache.run(PIPELINE, inputs, cache, format=fmt, shard_rows=16)
    return cache


def export(cache: Path, folder: Path) -> dict[str, str]:
    """The columns as one ``.npy`` each, rows in dataset order (the limit's data)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {c: str(folder / f"{c}.npy") for c in COLUMNS}
    if all(os.path.exists(f) for f in files.values()):
        return files
    dataset = CachedDataset(cache, columns=COLUMNS)
    first = dataset.read_batch([0])
    arrays = {c: np.lib.format.open_memmap(files[c], mode="w+", dtype=first[c].dtype,
                                           shape=(len(dataset), *first[c].shape[1:]))
              for c in COLUMNS}
    for start in tqdm(range(0, len(dataset), 4096), desc="export .npy", unit="chunk"):
        part = dataset.read_batch(np.arange(start, min(len(dataset), start + 4096)))
        for c in COLUMNS:
            arrays[c][start:start + len(part[c])] = part[c]
        dataset.close()  # unmap what was read: past RAM, mapped pages crowd the page cache
        dataset = CachedDataset(cache, columns=COLUMNS)
    for array in arrays.values():
        array.flush()
    dataset.close()
    return files


def epoch_rate(loader, epoch: int, max_batches: int | None) -> tuple[float, float]:
    """(samples/s, seconds to the first batch) of one epoch, cut after ``max_batches``."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    count, first, start = 0, None, time.perf_counter()
    for i, batch in enumerate(loader):
        count += len(batch["label"])
        if first is None:
            first = time.perf_counter() - start
        if max_batches and i + 1 >= max_batches:
            break
    return count / (time.perf_counter() - start), first or 0.0


def measure_limit(files: dict[str, str], max_batches: int | None) -> dict[str, float]:
    drop_page_cache(list(files.values()))
    arrays = {c: np.load(f, mmap_mode="r") for c, f in files.items()}
    generator = torch.Generator()
    generator.manual_seed(0)
    loader = DataLoader(_MemmapRows(arrays), batch_size=256, shuffle=True, generator=generator,
                        collate_fn=_as_tensors)
    cold, first = epoch_rate(loader, 0, max_batches)
    warm, _ = epoch_rate(loader, 1, max_batches)
    return {"cold": cold, "warm": warm, "first_batch_s": first}


def measure_precache(cache: Path, workers: int, max_batches: int | None) -> dict[str, float]:
    drop_page_cache(shard_paths(str(cache)))
    dataset = CachedDataset(cache, columns=COLUMNS)
    loader = make_loader(dataset, 256, num_workers=workers, seed=0)
    try:
        cold, first = epoch_rate(loader, 0, max_batches)
        warm, _ = epoch_rate(loader, 1, max_batches)
        iterator = getattr(loader.loader, "_iterator", None)  # (thread workers have none)
        pids = [p.pid for p in getattr(iterator, "_workers", [])] if workers else []
        smaps = [_smaps_kb(pid) for pid in pids]
        uss = sum(m.get("Private_Clean", 0) + m.get("Private_Dirty", 0) for m in smaps) * 1024
        pss = sum(m.get("Pss", 0) for m in smaps) * 1024
    finally:
        iterator = getattr(loader.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        dataset.close()
    return {"cold": cold, "warm": warm, "first_batch_s": first, "uss": uss, "pss": pss}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--format", default="parquet", choices=["parquet", "hdf5"])
    parser.add_argument("--workers", default="0,2", help="comma-separated worker counts")
    parser.add_argument("--max-batches", type=int, default=None,
                        help="cut each epoch after this many batches (for caches past RAM)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/precache-bench-loading"))
    parser.add_argument("--cache", type=Path, default=None, help="use this cache (not built)")
    parser.add_argument("--keep", action="store_true", help="keep the cache and .npy files")
    args = parser.parse_args()
    made = not args.work.exists()
    try:
        cache = args.cache or build(args.work, args.rows, args.format)
        files = export(cache, args.work / "limit")
        opened = precache.Cache(cache)
        decoded = sum(os.path.getsize(f) for f in files.values())
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        print(f"cache {cache}: {len(opened):,} rows, {opened.manifest.format}, "
              f"{sum(s.bytes for s in opened.manifest.shards) / 1e9:.2f} GB on disk, "
              f"{decoded / 1e9:.2f} GB of columns = {decoded / ram:.2f}x RAM "
              f"({ram / 2**30:.1f} GiB); batch 256, full shuffle"
              + (f"; epochs cut after {args.max_batches} batches" if args.max_batches else ""))
        limit = measure_limit(files, args.max_batches)
        rows = [("NumPy memmap `__getitems__` (the limit)", "0", limit)]
        for w in (int(x) for x in args.workers.split(",")):
            rows.append((f"precache, {opened.manifest.format}", str(w),
                         measure_precache(cache, w, args.max_batches)))
        print("| reader | workers | epoch 1 (cold) | vs limit cold | epoch 2 | vs limit warm "
              "| first batch | workers' USS / PSS |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, workers, r in rows:
            memory = (f"{r['uss'] / 1e6:,.0f} / {r['pss'] / 1e6:,.0f} MB "
                      f"({r['uss'] / decoded:.1%} USS)" if r.get("uss") else "-")
            print(f"| {name} | {workers} | {r['cold']:,.0f}/s | {r['cold'] / limit['cold']:.2f} "
                  f"| {r['warm']:,.0f}/s | {r['warm'] / limit['warm']:.2f} "
                  f"| {r['first_batch_s'] * 1000:,.0f} ms | {memory} |")
    finally:
        if not args.keep and made:
            shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
