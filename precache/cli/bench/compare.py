"""``bench_loader``: every setting of ``precache bench`` in one run, against the limit and the
per-file baseline measured in the same run, and the recommended number of workers."""

from __future__ import annotations

import os
import shutil
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
from precache.cache.formats.variable import VARIABLE_KINDS
from precache.cache.image_codec import decode_image, encoded_columns
from precache.cache.schema import ColumnSpec
from precache.threads import threads_pinned

from precache.cli.bench.measure import (FlatColumn, Rates, cores, default_worker_counts,
                                        measure_cached, measure_gather, measure_per_file)

__all__ = ["bench_loader", "export_columns", "BATCH_SIZES", "FILE_FORMATS", "FIXED_KINDS"]

FIXED_KINDS = ("ndarray", "scalar")
"""Column kinds the limit reads with one ``np.take`` (every other it reads as per-row slices of
flat values, ``VARIABLE_KINDS``)."""

BATCH_SIZES = (64, 256, 1024)
"""Batch sizes tried at the recommended number of workers (those not above the row count)."""
FILE_FORMATS = {"jpeg": (".jpg", [cv2.IMWRITE_JPEG_QUALITY, 95]), "png": (".png", [])}
"""Per-file baseline formats: suffix and ``cv2.imwrite`` parameters (JPEG at quality 95; PNG at
OpenCV's default compression, lossless)."""


def _flat_rows(values: list[Any], spec: ColumnSpec) -> tuple[bytes, list[int]]:
    """One shard's rows of a variable-length column as one run of raw bytes, and each row's
    length in values (elements for ``ragged``, bytes for ``bytes`` and ``str``)."""
    if spec.kind == "ragged":
        arrays = [np.ascontiguousarray(v, dtype=spec.dtype) for v in values]
        return b"".join(a.tobytes() for a in arrays), [len(a) for a in arrays]
    raw = [v.encode("utf-8") if spec.kind == "str" else bytes(v) for v in values]
    return b"".join(raw), [len(r) for r in raw]


def _save_flat(raw: Path, count: int, dtype: np.dtype, out: Path) -> None:
    """``raw`` (``count`` values of ``dtype``, written as they came) as a 1-D ``.npy`` at ``out``;
    ``raw`` is removed. (The length is known only at the end, and a ``.npy`` header holds it.)"""
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": (count,)}
    with open(out, "wb") as target, open(raw, "rb") as source:
        np.lib.format.write_array_header_1_0(target, header)
        shutil.copyfileobj(source, target, 1 << 24)
    raw.unlink()


def export_columns(cache: Cache, columns: Sequence[str], file_format: str | None,
                   folder: Path) -> tuple[dict[str, np.ndarray | FlatColumn], list[str]]:
    """The limit's data and the per-file baseline's files, rows in ``CachedDataset`` order.

    Each fixed-shape column becomes one memory-mapped ``.npy`` of ``(rows, *shape)``; each
    variable-length one a ``FlatColumn``: a flat values ``.npy`` (ragged values at their own
    dtype, the raw bytes of ``bytes`` and ``str``) and an int64 offsets ``.npy`` of ``rows + 1``
    (encoded image columns as kind ``image``: decoded per row when read). With ``file_format``,
    every ``image`` is also written as its own picture file (an encoded one decoded first).
    Columns of any other kind are left out.
    """
    schema, shards = cache.manifest.schema, cache.manifest.shards
    encoded = encoded_columns(cache.manifest.ops)
    fixed = [c for c in columns if schema[c].kind in FIXED_KINDS]
    variable = [c for c in columns if schema[c].kind in VARIABLE_KINDS]
    rows = sum(len(s.live_indices()) for s in shards)
    arrays = {c: np.lib.format.open_memmap(folder / f"{c}.npy", mode="w+",
                                           dtype=np.dtype(schema[c].dtype),
                                           shape=(rows, *schema[c].shape)) for c in fixed}
    raw = {c: open(folder / f"{c}.values.raw", "wb") for c in variable}
    lengths: dict[str, list[int]] = {c: [] for c in variable}
    names = list(dict.fromkeys(fixed + variable + (["image"] if file_format else [])))
    suffix, params = FILE_FORMATS[file_format] if file_format else ("", [])
    paths: list[str] = []
    position = 0
    try:
        for i, info in enumerate(shards):
            reader = cache.reader(i)
            try:
                part = reader.read(info.live_indices() if info.deleted else None, names)
            finally:
                reader.close()
            count = len(part[names[0]]) if names else len(info.live_indices())
            for c in fixed:
                arrays[c][position:position + count] = part[c]
            for c in variable:
                data, sizes = _flat_rows(part[c], schema[c])
                raw[c].write(data)
                lengths[c] += sizes
            for image in part.get("image", []) if file_format else []:
                path = str(folder / f"{len(paths):07d}{suffix}")
                if "image" in encoded:
                    image = decode_image(image)
                if image.ndim == 3:
                    image = cv2.cvtColor(image, cv2.COLOR_RGB2BGR)
                if not cv2.imwrite(path, image, params):
                    raise OSError(f"cannot write {path}")
                paths.append(path)
            position += count
    finally:
        for file in raw.values():
            file.close()
    for array in arrays.values():
        array.flush()
    del arrays  # close the writable maps; read through fresh read-only ones
    out: dict[str, np.ndarray | FlatColumn] = {
        c: np.load(folder / f"{c}.npy", mmap_mode="r") for c in fixed}
    for c in variable:
        dtype = np.dtype(schema[c].dtype if schema[c].kind == "ragged" else np.uint8)
        offsets = np.concatenate([[0], np.cumsum(lengths[c], dtype=np.int64)]).astype(np.int64)
        _save_flat(folder / f"{c}.values.raw", int(offsets[-1]), dtype,
                   folder / f"{c}.values.npy")
        np.save(folder / f"{c}.offsets.npy", offsets)
        out[c] = FlatColumn(folder / f"{c}.values.npy", folder / f"{c}.offsets.npy",
                            "image" if c in encoded else schema[c].kind)
    return {c: out[c] for c in columns if c in out}, paths


def _limit_reads(cache: Cache, columns: list[str]) -> dict[str, str]:
    """How the limit reads each column: ``take`` (fixed shape), ``ragged <dtype>``, ``bytes``,
    ``str``, or the codec of an encoded image column (``jpeg``, ``webp``)."""
    schema, encoded = cache.manifest.schema, encoded_columns(cache.manifest.ops)
    return {c: "take" if schema[c].kind in FIXED_KINDS else encoded.get(c) or
            (f"ragged {schema[c].dtype}" if schema[c].kind == "ragged" else schema[c].kind)
            for c in columns}


def _column_bytes(column: np.ndarray | FlatColumn) -> int:
    """Bytes the limit reads of a column over every row (offsets not counted)."""
    return int(column.values.nbytes if isinstance(column, FlatColumn) else column.nbytes)


def _image_problem(cache: Cache) -> str | None:
    spec = cache.manifest.schema.get("image")
    if spec is None:
        return "the cache has no 'image' column"
    if spec.kind == "bytes" and "image" in encoded_columns(cache.manifest.ops):
        return None  # JPEG/WebP: decoded when the files are written
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


def _notes(columns: list[str], limited: list[str], image_problem: str | None) -> list[str]:
    """What the comparisons leave out."""
    notes = []
    if image_problem:
        notes.append(f"per-file loader skipped: {image_problem}")
    elif "image" not in columns:
        notes.append("the per-file loader reads 'image', which is not among the cached columns")
    elif set(columns) != {"image"}:
        notes.append("the per-file loader yields images only; the cached loader yields every "
                     "column asked for")
    if not limited:
        notes.append("no limit: none of the columns is of a kind the limit reads")
    elif len(limited) < len(columns):
        notes.append("the limit leaves out columns of other kinds than ndarray, scalar, ragged, "
                     f"bytes and str ({', '.join(c for c in columns if c not in limited)})")
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
    limited = [c for c in columns if schema[c].kind in FIXED_KINDS + VARIABLE_KINDS]
    image_problem = _image_problem(opened)
    result: dict[str, Any] = {
        "cache": path, "format": opened.manifest.format, "rows": rows,
        "shards": len(opened.manifest.shards), "columns": columns, "limit_columns": limited,
        "limit_reads": _limit_reads(opened, limited), "batch_size": batch_size,
        "seconds": seconds, "workers": counts, "cores": cores(), "torch": torch.__version__,
        "ram_bytes": _memory_total(),
        "cache_bytes": sum(s.bytes for s in opened.manifest.shards),
    }
    with threads_pinned(), tempfile.TemporaryDirectory(prefix="precache-bench-") as tmp:
        say(f"exporting {rows} rows for the baselines to {tmp} (untimed)")
        start = time.perf_counter()
        arrays, paths = export_columns(opened, limited, None if image_problem else file_format,
                                       Path(tmp))
        result["export_s"] = time.perf_counter() - start
        # as the limit reads them: fixed-shape columns whole, variable-length ones as stored
        result["decoded_bytes"] = sum(_column_bytes(a) for a in arrays.values())
        result["bytes_per_sample"] = round(result["decoded_bytes"] / rows)
        limit_runs: list[Rates] = []
        if arrays:
            say("limit: NumPy gather (first half)")
            limit_runs.append(measure_gather(arrays, batch_size, seconds / 2))
        cached: list[dict[str, Any]] = []
        per_file: list[dict[str, Any]] = []
        for w in counts:
            for kind in ("threads", "processes") if w else ("none",):
                say(f"cached loader, workers={w}" + (f" ({kind})" if w else ""))
                cached.append(dict(workers=w, worker_kind=kind, batch_size=batch_size,
                                   **asdict(measure_cached(path, columns, batch_size, w, seconds,
                                                           _asked_kind(w, kind)))))
            if not image_problem:
                say(f"per-file loader, workers={w}")
                color = len(schema["image"].shape) == 3 or schema["image"].kind == "bytes"
                rates = measure_per_file(paths, color, batch_size, w, seconds)
                per_file.append(dict(workers=w, epoch1=rates.epoch1, epoch2=rates.epoch2,
                                     epoch_rates=rates.epoch_rates, cut_epochs=rates.cut_epochs))
        best = max(cached, key=lambda r: r["epoch2"])
        trials = [best]
        for b in sorted({b for b in BATCH_SIZES if b <= rows} - {batch_size}):
            say(f"cached loader, workers={best['workers']} ({best['worker_kind']}), "
                f"batch size {b}")
            trials.append(dict(workers=best["workers"], worker_kind=best["worker_kind"],
                               batch_size=b,
                               **asdict(measure_cached(path, columns, b, best["workers"],
                                                       seconds, _asked_kind(best["workers"],
                                                                            best["worker_kind"])))))
        if arrays:
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
    result["batch_sizes"] = [{k: r[k] for k in ("workers", "worker_kind", "batch_size",
                                                "epoch1", "epoch2",
                                                "epoch_rates", "cut_epochs")} for r in trials]
    result["recommendation"] = {
        "num_workers": best["workers"], "worker_kind": best["worker_kind"],
        "batch_size": max(trials, key=lambda r: r["epoch2"])["batch_size"]}
    result["worker_rss"] = _worker_rss(cached)
    result["notes"] = _notes(columns, limited, image_problem)
    return result


def _asked_kind(workers: int, kind: str) -> str:
    """``make_loader``'s ``worker_kind`` for a row of the report (``"none"`` without workers)."""
    return kind if workers else "auto"
