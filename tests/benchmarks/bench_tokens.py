"""Token ids of real documents in stage 2, cold and warm, against the NumPy memmap limit.

    .venv/bin/python tests/benchmarks/bench_tokens.py                  # 60,000 docs, ~1-2 minutes
    .venv/bin/python tests/benchmarks/bench_tokens.py --docs 6000 --rounds 1 --workers 0
    PYTHONPATH=/tmp/before .venv/bin/python tests/benchmarks/bench_tokens.py   # an older tree

Issue 37's token goal. The documents are the fortunes corpus (``data/make_corpus.py``; Debian's
``fortunes`` must be installed), repeated in order as one JSON Lines file of ``--docs`` records
(as ``bench_text.py``'s ``--copies`` file), and stage 1 is the ``text`` pipeline with its
defaults (the ``minilm`` tokenizer, ``max_length`` 512; ``ids`` a ragged uint16 column), its
``shard_rows`` 4096 passed explicitly (``--shard-rows``; 0 lets ``precache.run`` choose: for a
run this small it cuts at least 32 shards). The ``ids`` column is then exported once, untimed,
in dataset order as ``values.npy`` (all ids end to end) + ``offsets.npy`` (int64, rows + 1):
the limit's data. Stage 1 and the export are not timed; with ``--work DIR --keep`` a later run
reuses them.

Readers, full shuffle, batch 256, at each ``--workers``, both consumed by the same loop, which
copies the batch's rows once into one array (``np.concatenate``, as a collate would) and sums
them (so every id is read, and each epoch's sums must equal the other reader's):

- **limit**: a torch ``DataLoader`` (``shuffle=True``, persistent worker processes when
  ``--workers`` > 0) over a dataset whose ``__getitems__`` returns each row as a plain
  ndarray view of the memmapped values (no copy, no per-row checks: the least work a reader of
  these bytes can do); a worker hands its batch over as one array and its row ends (as
  precache's ``RaggedRows`` does), not one pickle a row;
- **precache**: ``make_loader(CachedDataset(cache, columns=["ids"]), 256, shuffle=True,
  num_workers=w)`` (its own choice of worker kind: threads, for a ``CachedDataset``).

Each round measures, for each ``--workers``, the limit and then precache: the reader's files are
dropped from the page cache (``posix_fadvise`` DONTNEED), the loader is opened, epoch 1 is
cold (worker start-up included), then ``--warm-epochs`` warm epochs (their total rate).
``--rounds`` rounds are interleaved; a ratio is precache over the limit of the same round and
workers, and the medians over rounds are printed. Compare ratios, not rates, across runs: the
machine's load moves the limit itself.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

import precache
from precache.cli.bench.measure import drop_page_cache
from precache.loading import CachedDataset, make_loader

ROOT = Path(__file__).resolve().parents[2]
COLUMN = "ids"
BATCH = 256


# --- the data -----------------------------------------------------------------------------------


def corpus_records(work: Path, docs: int) -> Path:
    """The fortunes corpus as one JSON Lines file of ``docs`` records (the corpus repeated)."""
    spec = importlib.util.spec_from_file_location("make_corpus", ROOT / "data" / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    folder = work / "corpus"
    module.make_corpus(folder)
    texts = [json.dumps({"text": f.read_text(encoding="utf-8"), "label": f.parent.name})
             for f in sorted(folder.rglob("*.txt"))]
    shutil.rmtree(folder)
    records = work / "corpus.jsonl"
    records.write_text("".join(texts[i % len(texts)] + "\n" for i in range(docs)),
                       encoding="utf-8")
    return records


def build(work: Path, docs: int, shard_rows: int) -> Path:
    """The ``text`` pipeline's cache of ``docs`` fortunes (kept and reused if already there)."""
    cache = work / "cache"
    if (cache / "manifest.json").exists():
        return cache
    records = corpus_records(work, docs)
    start = time.perf_counter()
    summary = precache.run("text", records, cache, shard_rows=shard_rows or None,
                           progress=False, log=lambda *a, **k: None)
    if summary.failed:
        raise RuntimeError(f"stage 1 failed on {summary.failed} records")
    print(f"stage 1 (text, untimed for the ratios): {docs:,} docs in "
          f"{time.perf_counter() - start:.1f}s", flush=True)
    records.unlink()
    return cache


def export(cache: Path, folder: Path) -> tuple[Path, Path]:
    """The ``ids`` column in dataset order as ``values.npy`` + int64 ``offsets.npy``."""
    values_file, offsets_file = folder / "values.npy", folder / "offsets.npy"
    if offsets_file.exists():
        return values_file, offsets_file
    folder.mkdir(parents=True, exist_ok=True)
    dataset = CachedDataset(cache, columns=[COLUMN])
    try:
        parts: list[np.ndarray] = []
        for start in range(0, len(dataset), 8192):
            rows = dataset.read_batch(range(start, min(len(dataset), start + 8192)))[COLUMN]
            parts += [np.array(row) for row in rows]
    finally:
        dataset.close()
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(row) for row in parts], out=offsets[1:])
    np.save(values_file, np.concatenate(parts))
    np.save(offsets_file, offsets)
    return values_file, offsets_file


# --- the limit ----------------------------------------------------------------------------------


def _rows(flat: np.ndarray, ends: np.ndarray) -> Rows:
    starts = [0, *ends[:-1].tolist()]
    return Rows(flat[a:b] for a, b in zip(starts, ends.tolist()))


class Rows(list):
    """A batch's rows (ndarray views); crosses to another process as one array + row ends."""

    def __reduce__(self) -> Any:
        if not self:
            return (Rows, ())
        return (_rows, (np.concatenate(self), np.cumsum([len(row) for row in self])))


class MemmapRows:
    """The limit's dataset: each row a plain view of the memmapped values."""

    def __init__(self, values: Path, offsets: Path) -> None:
        self.values = np.load(values, mmap_mode="r").view(np.ndarray)
        self.offsets = np.load(offsets, mmap_mode="r").view(np.ndarray)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitems__(self, indices: list[int]) -> dict[str, Rows]:
        index = np.asarray(indices, dtype=np.int64)
        starts, stops = self.offsets[index].tolist(), self.offsets[index + 1].tolist()
        values = self.values
        return {COLUMN: Rows(values[a:b] for a, b in zip(starts, stops))}


def as_batch(batch: Any) -> Any:
    """The DataLoader's collate: ``__getitems__`` already made the batch."""
    return batch


def limit_loader(values: Path, offsets: Path, workers: int, seed: int) -> DataLoader:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(MemmapRows(values, offsets), batch_size=BATCH, shuffle=True,
                      generator=generator, num_workers=workers, collate_fn=as_batch,
                      persistent_workers=workers > 0)


# --- timing -------------------------------------------------------------------------------------


def consume(batch: dict[str, Any]) -> tuple[int, int, int]:
    """What the training loop does with a batch: its rows copied once into one array (as a
    collate does), then every id read; (rows, ids, sum of ids)."""
    rows = batch[COLUMN]
    flat = np.concatenate(rows)
    return len(rows), len(flat), int(flat.sum(dtype=np.int64))


def run_epoch(loader: Iterable[Any]) -> tuple[float, tuple[int, int, int]]:
    """(seconds, (rows, ids, sum)) of one pass."""
    rows = ids = total = 0
    start = time.perf_counter()
    for batch in loader:
        n, t, s = consume(batch)
        rows, ids, total = rows + n, ids + t, total + s
    return time.perf_counter() - start, (rows, ids, total)


def shutdown(loader: Any) -> None:
    """Stop a DataLoader's persistent workers now, not at garbage collection."""
    inner = getattr(loader, "loader", loader)  # a CacheLoader wraps its DataLoader
    iterator = getattr(inner, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    if hasattr(inner, "_iterator"):
        inner._iterator = None


def measure(files: list[Path], open_loader: Callable[[], tuple[Any, Callable[[], None]]],
            warm_epochs: int) -> dict[str, Any]:
    """Drop ``files`` from the page cache, open the loader, time a cold and the warm epochs."""
    gc.collect()  # earlier readers' maps would keep their pages cached
    drop_page_cache(files)
    loader, close = open_loader()
    try:
        cold_s, cold_sums = run_epoch(loader)
        warm = [run_epoch(loader) for _ in range(warm_epochs)]
    finally:
        shutdown(loader)
        close()
        del loader
        gc.collect()
    return {"cold": cold_sums[0] / cold_s,
            "warm": sum(s[0] for _, s in warm) / sum(t for t, _ in warm),
            "sums": [cold_sums] + [s for _, s in warm]}


# --- the run ------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=60_000, help="documents (records)")
    parser.add_argument("--shard-rows", type=int, default=4096,
                        help="stage 1's shard_rows (the text pipeline's 4096; 0: precache.run's "
                        "own choice)")
    parser.add_argument("--workers", default="0,2", help="comma-separated num_workers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm-epochs", type=int, default=10, help="warm epochs after the cold")
    parser.add_argument("--work", type=Path, default=Path("/tmp/precache-bench-tokens"))
    parser.add_argument("--keep", action="store_true", help="keep the cache and .npy files")
    args = parser.parse_args()
    workers_list = [int(w) for w in args.workers.split(",") if w]
    made = not args.work.exists()
    args.work.mkdir(parents=True, exist_ok=True)
    try:
        cache = build(args.work, args.docs, args.shard_rows)
        values, offsets = export(cache, args.work / "limit")
        shard_files = sorted((cache / "shards").rglob("*.*"))
        lengths = np.diff(np.load(offsets))
        rows = len(lengths)
        print(f"{rows:,} docs, {lengths.sum():,} ids (uint16; {lengths.mean():.0f} a doc, "
              f"max {lengths.max()}), {len(shard_files)} shards; precache "
              f"{precache.__file__.rsplit('/precache/', 1)[0]}; load {os.getloadavg()[0]:.2f}",
              flush=True)
        results: dict[tuple[str, int], list[dict]] = {}
        for round_ in range(args.rounds):
            for workers in workers_list:
                def open_limit(w: int = workers) -> tuple[Any, Callable[[], None]]:
                    return limit_loader(values, offsets, w, seed=round_), lambda: None

                def open_precache(w: int = workers) -> tuple[Any, Callable[[], None]]:
                    dataset = CachedDataset(cache, columns=[COLUMN])
                    return (make_loader(dataset, BATCH, shuffle=True, num_workers=w,
                                        seed=round_), dataset.close)

                got = {"limit": measure([values, offsets], open_limit, args.warm_epochs),
                       "precache": measure(shard_files, open_precache, args.warm_epochs)}
                for name, result in got.items():
                    results.setdefault((name, workers), []).append(result)
                    if result["sums"] != got["limit"]["sums"] or any(
                            s[0] != rows for s in result["sums"]):
                        raise RuntimeError(f"round {round_ + 1}, workers={workers}: {name}'s "
                                           f"sums {result['sums']} differ from the limit's "
                                           f"{got['limit']['sums']}")
                print(f"round {round_ + 1}, workers={workers}: limit cold "
                      f"{got['limit']['cold']:,.0f}/s warm {got['limit']['warm']:,.0f}/s; "
                      f"precache cold {got['precache']['cold']:,.0f}/s warm "
                      f"{got['precache']['warm']:,.0f}/s", flush=True)
        print(f"\nbatch {BATCH}, full shuffle, samples/s, medians of {args.rounds} interleaved "
              f"rounds; ratio: precache / the limit (a memmap of values + offsets, row views, "
              f"torch DataLoader) of the same round and workers; epoch 1 cold, then "
              f"{args.warm_epochs} warm; every epoch's sums equal the limit's")
        print("| reader | workers | epoch 1, cold | of the limit | warm | of the limit |")
        print("|---|--:|--:|--:|--:|--:|")
        for workers in workers_list:
            limit = results[("limit", workers)]
            for name in ("limit", "precache"):
                runs = results[(name, workers)]
                ratio = {key: statistics.median(r[key] / base[key] for r, base in zip(runs, limit))
                         for key in ("cold", "warm")}
                print(f"| {name} | {workers} | {statistics.median(r['cold'] for r in runs):,.0f} "
                      f"| {ratio['cold']:.2f} | {statistics.median(r['warm'] for r in runs):,.0f} "
                      f"| {ratio['warm']:.2f} |")
    finally:
        if made and not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
