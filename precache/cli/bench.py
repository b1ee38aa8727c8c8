"""Stage-2 benchmark: what ``make_loader`` over a cache delivers, against a limit and a baseline.

``precache bench CACHE`` calls ``bench_loader`` and prints ``format_report``. Measured in one run,
with one thread per library per process (``threads_pinned``; workers pin themselves):

- **cached**: samples/s a training loop receives from ``make_loader(CachedDataset(cache,
  columns), batch_size, shuffle=True, num_workers=w)`` (default collate, persistent workers),
  for each ``w``. Epoch 1 (worker start, shards opened and decoded) and the later epochs
  ("ep2+": samples over seconds of epochs 2..n, i.e. their harmonic mean) are reported apart.
- **the limit**: a NumPy gather of the same bytes. The fixed-shape columns asked for (``ndarray``
  and ``scalar``; strings and bytes have no fixed shape) are written once to one ``.npy`` per
  column in a temporary folder and memory-mapped; each batch is ``np.take(column, indices,
  axis=0, out=batch, mode="clip")`` per column into preallocated arrays, over a fresh
  permutation per epoch. Measured at the start and at the end, the faster kept (noise only slows).
- **per-file**: the classic loader. Every cached ``image`` is written once (untimed) as its own
  file (JPEG quality 95 by default, or PNG), and a ``Dataset`` whose ``__getitem__`` is
  ``cv2.imread`` + ``cvtColor`` -> tensor is read by a ``DataLoader`` with the same batch size,
  workers, shuffle, persistent workers and default collate. It yields images only.
- **batch sizes**: 64, 256 and 1024 (those not above the row count) and the given batch size, at
  the recommended number of workers (the best cached ep2+ rate).
- **worker RSS**: ``VmRSS`` and ``RssAnon`` from ``/proc/PID/status`` of each DataLoader worker
  after every epoch (pids from the loader's persistent iterator), to show memory stays flat.

Every setting runs epoch 1, then more epochs for about ``seconds``. A long epoch is cut (its rate
is then over the batches it delivered): a baseline's after ``seconds`` (its rate is steady from
the first batches on), a cached loader's only after ``CACHED_CUT`` x ``seconds``, since its epoch
1 front-loads opening (and, for Parquet, decoding) the shards.

On 2 cores, workers can be slower than the main process for cached data: every batch is copied
through shared memory and the processes share the cores. Measure, don't assume. ``VmRSS`` counts
the pages of memory-mapped (HDF5) shards a worker has touched, which the page cache shares among
processes; ``RssAnon`` is the worker's own memory (decoded Parquet columns among it).
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from precache.cache import Cache
from precache.loading.dataset import CachedDataset
from precache.loading.loader import make_loader
from precache.threads import pin_threads, threads_pinned

__all__ = ["bench_loader", "format_report", "default_worker_counts", "measure_cached",
           "measure_per_file", "measure_gather", "Rates", "BATCH_SIZES", "FILE_FORMATS",
           "CACHED_CUT"]

BATCH_SIZES = (64, 256, 1024)
"""Batch sizes tried at the recommended number of workers (those not above the row count)."""
CACHED_CUT = 10
"""A cached-loader epoch is cut after this many times ``seconds`` (a baseline's: ``seconds``)."""
FILE_FORMATS = {"jpeg": (".jpg", [cv2.IMWRITE_JPEG_QUALITY, 95]), "png": (".png", [])}
"""Per-file baseline formats: suffix and ``cv2.imwrite`` parameters (JPEG at quality 95; PNG at
OpenCV's default compression, lossless)."""


@dataclass
class Rates:
    """Samples/s of one loader setting, epoch 1 apart from the later epochs.

    Args:
        epoch1: samples/s of epoch 1.
        epoch2: samples/s over epochs 2..n together (their harmonic mean for equal epochs).
        epoch_rates: samples/s of every epoch.
        rss_kb: per epoch, ``VmRSS`` of each worker process after it (empty without workers).
        anon_kb: per epoch, ``RssAnon`` of each worker process (memory not shared with files).
        cut_epochs: how many epochs were cut before their end.
    """

    epoch1: float
    epoch2: float
    epoch_rates: list[float]
    cut_epochs: int = 0
    rss_kb: list[list[int]] = field(default_factory=list)
    anon_kb: list[list[int]] = field(default_factory=list)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_worker_counts() -> list[int]:
    """0, 1, 2, then powers of two up to the usable cores, and the cores themselves."""
    cores = _cores()
    counts, n = [0, 1, 2], 4
    while n <= cores:
        counts.append(n)
        n *= 2
    return counts + ([cores] if cores > 2 and cores not in counts else [])


def _run_epochs(epoch: Callable[[int], Iterator[int]], seconds: float,
                after_epoch: Callable[[], None] | None = None, cut: float | None = None) -> Rates:
    """Time ``epoch(e)`` (yielding batch lengths) for e = 0, 1, ... until the epochs after the
    first have run for ``seconds`` (so at least two epochs); an epoch is cut after ``cut`` seconds
    (default ``seconds``)."""
    cut = seconds if cut is None else cut
    rates, later_n, later_s, cuts = [], 0, 0.0, 0
    while len(rates) < 2 or later_s < seconds:
        count, start = 0, time.perf_counter()
        batches, stopped = epoch(len(rates)), False
        for n in batches:
            count += n
            if time.perf_counter() - start >= cut:
                stopped = True
                break
        elapsed = time.perf_counter() - start
        cuts += stopped and next(batches, None) is not None  # cut if batches were left (untimed)
        rates.append(count / elapsed)
        if len(rates) > 1:
            later_n, later_s = later_n + count, later_s + elapsed
        if after_epoch is not None:
            after_epoch()
    return Rates(rates[0], later_n / later_s, rates, cuts)


def _batch_len(batch: Any) -> int:
    return len(next(iter(batch.values())) if isinstance(batch, dict) else batch)


def _worker_pids(loader: DataLoader) -> list[int]:
    workers = getattr(getattr(loader, "_iterator", None), "_workers", None)
    return [p.pid for p in (workers or multiprocessing.active_children())]


def _proc_status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _shutdown(loader: DataLoader) -> None:
    """Stop a loader's persistent workers now rather than at garbage collection."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None


def measure_cached(cache: str, columns: Sequence[str], batch_size: int, workers: int,
                   seconds: float) -> Rates:
    """Samples/s a training loop receives from ``make_loader`` over ``CachedDataset``."""
    dataset = CachedDataset(cache, columns)
    loader = make_loader(dataset, batch_size, shuffle=True, num_workers=workers)
    rss: list[list[int]] = []
    anon: list[list[int]] = []

    def epoch(e: int) -> Iterator[int]:
        loader.set_epoch(e)
        return (_batch_len(b) for b in loader)

    def after_epoch() -> None:
        if workers:
            pids = _worker_pids(loader.loader)
            rss.append([_proc_status_kb(p, "VmRSS") for p in pids])
            anon.append([_proc_status_kb(p, "RssAnon") for p in pids])

    try:
        rates = _run_epochs(epoch, seconds, after_epoch, cut=CACHED_CUT * seconds)
    finally:
        _shutdown(loader.loader)
        dataset.close()
    rates.rss_kb, rates.anon_kb = rss, anon
    return rates


class _ImageFiles(Dataset):
    """One picture file per sample, read and decoded with OpenCV in ``__getitem__``."""

    def __init__(self, paths: list[str], color: bool) -> None:
        self.paths = paths
        self.color = color

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        if not self.color:
            return torch.from_numpy(cv2.imread(self.paths[index], cv2.IMREAD_GRAYSCALE))
        image = cv2.imread(self.paths[index], cv2.IMREAD_COLOR)
        return torch.from_numpy(cv2.cvtColor(image, cv2.COLOR_BGR2RGB))


def _pin_worker(_: int) -> None:
    pin_threads()


def measure_per_file(paths: list[str], color: bool, batch_size: int, workers: int,
                     seconds: float) -> Rates:
    """Samples/s of a plain ``DataLoader`` over one picture file per sample."""
    generator = torch.Generator()
    generator.manual_seed(0)
    options: dict[str, Any] = (dict(persistent_workers=True, worker_init_fn=_pin_worker)
                               if workers else {})
    loader = DataLoader(_ImageFiles(paths, color), batch_size=batch_size, shuffle=True,
                        num_workers=workers, pin_memory=torch.cuda.is_available(),
                        generator=generator, **options)
    try:
        return _run_epochs(lambda e: (len(b) for b in loader), seconds)
    finally:
        _shutdown(loader)


def measure_gather(arrays: dict[str, np.ndarray], batch_size: int, seconds: float) -> Rates:
    """Samples/s of ``np.take`` of shuffled rows into preallocated batches, per column."""
    n = len(next(iter(arrays.values())))
    out = {k: np.empty((batch_size, *a.shape[1:]), dtype=a.dtype) for k, a in arrays.items()}

    def epoch(e: int) -> Iterator[int]:
        order = np.random.default_rng(e).permutation(n)
        for start in range(0, n, batch_size):
            indices = order[start:start + batch_size]
            for name, array in arrays.items():
                np.take(array, indices, axis=0, out=out[name][:len(indices)], mode="clip")
            yield len(indices)

    return _run_epochs(epoch, seconds)


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
            "anon_after_last_epoch_kb": r["anon_kb"][-1]}


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
        "batch_size": batch_size, "seconds": seconds, "workers": counts, "cores": _cores(),
        "torch": torch.__version__,
    }
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
    result["limit"] = None if limit is None else {
        "samples_per_s": limit, "mb_per_s": limit * result["bytes_per_sample"] / 1e6,
        "runs": [r.epoch2 for r in limit_runs]}
    by_workers = {r["workers"]: r for r in per_file}
    for r in cached:
        base = by_workers.get(r["workers"])
        r["fraction_of_limit"] = r["epoch2"] / limit if limit else None
        r["epoch1_fraction_of_limit"] = r["epoch1"] / limit if limit else None
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


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _ratio(x: float | None, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{suffix}"


def _mb(kbs: list[int]) -> str:
    return ", ".join(f"{k / 1024:,.0f}" for k in kbs)


def _epochs(entry: dict[str, Any]) -> str:
    """Epoch count, with ``*`` when some were cut before their end."""
    return f"{len(entry['epoch_rates'])}{'*' if entry.get('cut_epochs') else ''}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = [[c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
             for cells in [headers, ["-" * w for w in widths], *rows]]
    return "\n".join("  ".join(cells).rstrip() for cells in lines)


def format_report(result: dict[str, Any]) -> str:
    """The human-readable report of a ``bench_loader`` result."""
    r = result
    limit, per_file = r["limit"], r["per_file"]
    out = [f"precache bench {r['cache']}: {r['rows']:,} rows in {r['shards']} {r['format']} "
           f"shards; columns {', '.join(r['columns'])}",
           f"batch {r['batch_size']}, shuffle, default collate, persistent workers; epoch 1, then "
           f"{r['seconds']:g} s of epochs per setting; {r['cores']} cores; torch {r['torch']}; "
           "one thread per library per process", ""]
    if limit:
        out.append(f"limit (np.take of {', '.join(r['limit_columns'])}, {r['bytes_per_sample']:,} "
                   f"B/sample, from memory-mapped .npy into preallocated batches): "
                   f"{_rate(limit['samples_per_s'])} samples/s ({limit['mb_per_s']:,.0f} MB/s; "
                   f"runs {' / '.join(_rate(x) for x in limit['runs'])}, faster kept)")
    if per_file["skipped"]:
        out.append(f"per-file loader: skipped ({per_file['skipped']})")
    else:
        kind = (f"JPEG q={per_file['quality']}" if per_file["format"] == "jpeg"
                else "PNG (lossless)")
        out.append(f"per-file loader: one {kind} file per row, cv2.imread + cvtColor -> tensor "
                   f"(images only; files written in {r['export_s']:.1f} s, untimed)")
    files = {p["workers"]: p for p in per_file["results"]}
    rows = []
    for c in r["cached"]:
        p = files.get(c["workers"], {})
        rows.append([str(c["workers"]), _rate(c["epoch1"]), _rate(c["epoch2"]),
                     _epochs(c), _ratio(c["fraction_of_limit"]),
                     _rate(p.get("epoch1")), _rate(p.get("epoch2")),
                     _epochs(p) if p else "-", _ratio(c["vs_per_file"], "x")])
    out += ["", "samples/s (ep2+: epochs 2..n together; epoch 1 includes worker start and first "
            f"reads; *: epochs cut, cached after {CACHED_CUT * r['seconds']:g} s, per-file after "
            f"{r['seconds']:g} s)", "",
            _table(["workers", "cached ep1", "ep2+", "epochs", "of limit", "per-file ep1", "ep2+",
                    "epochs", "cached/per-file"], rows)]
    rec = r["recommendation"]
    out += ["", f"batch sizes at workers={rec['num_workers']} (samples/s)", "",
            _table(["batch", "ep1", "ep2+", "epochs"],
                   [[str(b["batch_size"]), _rate(b["epoch1"]), _rate(b["epoch2"]),
                     _epochs(b)] for b in r["batch_sizes"]])]
    rss = r["worker_rss"]
    if rss:
        out += ["", f"worker RSS, workers={rss['workers']} (VmRSS MB per worker; RssAnon, not "
                "shared with files, in brackets):",
                f"  after epoch 1: {_mb(rss['after_epoch1_kb'])} "
                f"[{_mb(rss['anon_after_epoch1_kb'])}]; after epoch 2: "
                f"{_mb(rss['after_epoch2_kb'])}; after epoch {rss['epochs']} (last): "
                f"{_mb(rss['after_last_epoch_kb'])} [{_mb(rss['anon_after_last_epoch_kb'])}]"]
    best = max(r["batch_sizes"], key=lambda b: b["epoch2"])
    out += ["", f"recommended: num_workers={rec['num_workers']} (most samples/s in epochs 2+), "
            f"batch_size={rec['batch_size']} ({_rate(best['epoch2'])} samples/s, the most of "
            f"{', '.join(str(b['batch_size']) for b in r['batch_sizes'])}); differences of a few "
            "percent are noise", "",
            "notes:", "- on few cores, worker processes can be slower than the main process for "
            "cached data (every batch is copied through shared memory and the processes share "
            "the cores); workers pay off when a transform does per-sample work"]
    out += [f"- {n}" for n in r["notes"]]
    return "\n".join(out)
