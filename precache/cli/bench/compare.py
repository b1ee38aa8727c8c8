"""``bench_loader``: every setting of ``precache bench`` in one run, against the limit and the
per-file baseline measured in the same run, and the recommended number of workers."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from precache.cache import Cache
from precache.threads import threads_pinned

from precache.cli.bench.measure import (Rates, cores, default_worker_counts, measure_cached,
                                        measure_gather, measure_per_file)

__all__ = ["bench_loader", "BATCH_SIZES", "FILE_FORMATS"]

BATCH_SIZES = (64, 256, 1024)
"""Batch sizes tried at the recommended number of workers (those not above the row count)."""
FILE_FORMATS = {"jpeg": (".jpg", [cv2.IMWRITE_JPEG_QUALITY, 95]), "png": (".png", [])}
"""Per-file baseline formats: suffix and ``cv2.imwrite`` parameters (JPEG at quality 95; PNG at
OpenCV's default compression, lossless)."""


def _export(cache: Cache, fixed: list[str], file_format: str | None,
            folder: Path) -> tuple[dict[str, np.ndarray], list[str]]:
    """Write the ``fixed`` columns as memory-mapped ``.npy`` files and, with ``file_format``,
    every ``image`` as its own picture file; rows in ``CachedDataset`` order."""
    schema, shards = cache.manifest.schema, cache.manifest.shards
    rows = sum(len(s.live_indices()) for s in shards)
    arrays = {c: np.lib.format.open_memmap(folder / f"{c}.npy", mode="w+",
                                           dtype=np.dtype(schema[c].dtype),
                                           shape=(rows, *schema[c].shape)) for c in fixed}
    names = list(dict.fromkeys(fixed + (["image"] if file_format else [])))
    suffix, params = FILE_FORMATS[file_format] if file_format else ("", [])
    paths: list[str] = []
    position = 0
    for i, info in enumerate(shards):
        reader = cache.reader(i)
        try:
            part = reader.read(info.live_indices() if info.deleted else None, names)
        finally:
            reader.close()
        count = len(part[names[0]]) if names else len(info.live_indices())
        for c in fixed:
            arrays[c][position:position + count] = part[c]
        for image in part.get("image", []) if file_format else []:
            path = str(folder / f"{len(paths):07d}{suffix}")
            if image.ndim == 3:
                image = cv2.cvtColor(image, cv2.COLOR_RGB2BGR)
            if not cv2.imwrite(path, image, params):
                raise OSError(f"cannot write {path}")
            paths.append(path)
        position += count
    for array in arrays.values():
        array.flush()
    del arrays  # close the writable maps; read through fresh read-only ones
    return {c: np.load(folder / f"{c}.npy", mmap_mode="r") for c in fixed}, paths


def _image_problem(cache: Cache) -> str | None:
    spec = cache.manifest.schema.get("image")
    if spec is None:
        return "the cache has no 'image' column"
    if spec.kind != "ndarray" or spec.dtype != "uint8" or not (
            len(spec.shape) == 2 or (len(spec.shape) == 3 and spec.shape[2] == 3)):
        return f"'image' is {spec.dtype}{list(spec.shape)}, not an HxW or HxWx3 uint8 picture"
    return None


def _worker_rss(cached: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Worker memory per epoch of the fastest setting with workers (``None`` without one)."""
    with_workers = [r for r in cached if r["workers"] > 0 and r["rss_kb"]]
    if not with_workers:
        return None
    r = max(with_workers, key=lambda r: r["epoch2"])
    return {"workers": r["workers"], "epochs": len(r["rss_kb"]),
            "after_epoch1_kb": r["rss_kb"][0], "after_epoch2_kb": r["rss_kb"][1],
            "after_last_epoch_kb": r["rss_kb"][-1], "anon_after_epoch1_kb": r["anon_kb"][0],
            "anon_after_last_epoch_kb": r["anon_kb"][-1],
            "uss_after_epoch1_kb": r["uss_kb"][0], "uss_after_last_epoch_kb": r["uss_kb"][-1],
            "pss_after_epoch1_kb": r["pss_kb"][0], "pss_after_last_epoch_kb": r["pss_kb"][-1]}


def _memory_total() -> int:
    """This machine's RAM in bytes (``MemTotal``; 0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _notes(columns: list[str], fixed: list[str], image_problem: str | None) -> list[str]:
    """What the comparisons leave out."""
    notes = []
    if image_problem:
        notes.append(f"per-file loader skipped: {image_problem}")
    elif "image" not in columns:
        notes.append("the per-file loader reads 'image', which is not among the cached columns")
    elif set(columns) != {"image"}:
        notes.append("the per-file loader yields images only; the cached loader yields every "
                     "column asked for")
    if not fixed:
        notes.append("no limit: none of the columns has a fixed shape")
    elif len(fixed) < len(columns):
        notes.append("the limit gathers the fixed-shape columns only (not "
                     f"{', '.join(c for c in columns if c not in fixed)})")
    return notes


def bench_loader(cache: str | os.PathLike[str], *, batch_size: int = 256,
                 workers: Sequence[int] | None = None, columns: Sequence[str] | None = None,
                 seconds: float = 3.0, file_format: str = "jpeg",
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure stage-2 loading of ``cache``; see the module docstring for what exactly.

    Args:
        cache: the cache directory.
        batch_size: batch size of the main comparison (default 256).
        workers: DataLoader worker counts to try (default ``default_worker_counts()``).
        columns: columns to load (default: all).
        seconds: about how long each setting runs after its epoch 1 (default 3).
        file_format: ``jpeg`` (quality 95, default) or ``png``, for the per-file baseline.
        log: called with a line before each measurement (progress), if given.

    Returns:
        Plain data (JSON-serialisable): every rate in samples/s, ratios, RSS in kB, the
        recommendation and notes. ``format_report`` prints it.

    Raises:
        ManifestError: ``cache`` holds no finished cache.
        KeyError: a column is not in the cache.
        ValueError: an argument is out of range, or the cache has no rows.
    """
    say = log or (lambda line: None)
    path = os.fspath(cache)
    opened = Cache(path)
    schema = opened.manifest.schema
    columns = list(columns) if columns else list(schema)
    missing = [c for c in columns if c not in schema]
    if missing:
        raise KeyError(f"{path}: no column {missing} in this cache; it has {sorted(schema)}")
    counts = default_worker_counts() if workers is None else sorted(set(int(w) for w in workers))
    if (batch_size < 1 or seconds <= 0 or not counts or min(counts) < 0
            or file_format not in FILE_FORMATS):
        raise ValueError("batch size must be >= 1, seconds > 0, workers >= 0 (at least one), "
                         f"file format one of {sorted(FILE_FORMATS)}")
    rows = opened.manifest.rows
    if rows < 1:
        raise ValueError(f"{path}: the cache has no rows")
    fixed = [c for c in columns if schema[c].kind in ("ndarray", "scalar")]
    image_problem = _image_problem(opened)
    result: dict[str, Any] = {
        "cache": path, "format": opened.manifest.format, "rows": rows,
        "shards": len(opened.manifest.shards), "columns": columns, "limit_columns": fixed,
        "bytes_per_sample": int(sum(np.dtype(schema[c].dtype).itemsize
                                    * int(np.prod(schema[c].shape)) for c in fixed)),
        "batch_size": batch_size, "seconds": seconds, "workers": counts, "cores": cores(),
        "torch": torch.__version__, "ram_bytes": _memory_total(),
        "cache_bytes": sum(s.bytes for s in opened.manifest.shards),
    }
    result["decoded_bytes"] = result["bytes_per_sample"] * rows
    with threads_pinned(), tempfile.TemporaryDirectory(prefix="precache-bench-") as tmp:
        say(f"exporting {rows} rows for the baselines to {tmp} (untimed)")
        start = time.perf_counter()
        arrays, paths = _export(opened, fixed, None if image_problem else file_format, Path(tmp))
        result["export_s"] = time.perf_counter() - start
        limit_runs: list[Rates] = []
        if fixed:
            say("limit: NumPy gather (first half)")
            limit_runs.append(measure_gather(arrays, batch_size, seconds / 2))
        cached: list[dict[str, Any]] = []
        per_file: list[dict[str, Any]] = []
        for w in counts:
            say(f"cached loader, workers={w}")
            cached.append(dict(workers=w, batch_size=batch_size,
                               **asdict(measure_cached(path, columns, batch_size, w, seconds))))
            if not image_problem:
                say(f"per-file loader, workers={w}")
                rates = measure_per_file(paths, len(schema["image"].shape) == 3, batch_size, w,
                                         seconds)
                per_file.append(dict(workers=w, epoch1=rates.epoch1, epoch2=rates.epoch2,
                                     epoch_rates=rates.epoch_rates, cut_epochs=rates.cut_epochs))
        best = max(cached, key=lambda r: r["epoch2"])
        trials = [best]
        for b in sorted({b for b in BATCH_SIZES if b <= rows} - {batch_size}):
            say(f"cached loader, workers={best['workers']}, batch size {b}")
            trials.append(dict(workers=best["workers"], batch_size=b,
                               **asdict(measure_cached(path, columns, b, best["workers"],
                                                       seconds))))
        if fixed:
            say("limit: NumPy gather (second half)")
            limit_runs.append(measure_gather(arrays, batch_size, seconds / 2))
        del arrays
    limit = max((r.epoch2 for r in limit_runs), default=None)
    cold = max((r.epoch1 for r in limit_runs), default=None)
    result["limit"] = None if limit is None else {
        "samples_per_s": limit, "mb_per_s": limit * result["bytes_per_sample"] / 1e6,
        "runs": [r.epoch2 for r in limit_runs], "cold_samples_per_s": cold,
        "cold_runs": [r.epoch1 for r in limit_runs]}
    by_workers = {r["workers"]: r for r in per_file}
    for r in cached:
        base = by_workers.get(r["workers"])
        r["fraction_of_limit"] = r["epoch2"] / limit if limit else None
        r["epoch1_fraction_of_limit"] = r["epoch1"] / cold if cold else None  # both cold
        r["vs_per_file"] = r["epoch2"] / base["epoch2"] if base else None
        r["epoch1_vs_per_file"] = r["epoch1"] / base["epoch1"] if base else None
    result["cached"] = cached
    result["per_file"] = {"format": file_format, "quality": 95 if file_format == "jpeg" else None,
                          "skipped": image_problem, "results": per_file}
    trials.sort(key=lambda r: r["batch_size"])
    result["batch_sizes"] = [{k: r[k] for k in ("workers", "batch_size", "epoch1", "epoch2",
                                                "epoch_rates", "cut_epochs")} for r in trials]
    result["recommendation"] = {
        "num_workers": best["workers"],
        "batch_size": max(trials, key=lambda r: r["epoch2"])["batch_size"]}
    result["worker_rss"] = _worker_rss(cached)
    result["notes"] = _notes(columns, fixed, image_problem)
    return result
