"""Fixed-shape columns of many small shards, warm, one process, against the NumPy limit.

    python tests/benchmarks/bench_gather.py                 # 12,000 rows, ~1-2 minutes on 2 cores
    python tests/benchmarks/bench_gather.py --rows 48000 --rounds 5
    python tests/benchmarks/bench_gather.py --ranks 2      # 2 ranks on this node
    python tests/benchmarks/bench_gather.py --format hdf5  # HDF5 shards instead of Parquet

The ``faces`` pipeline's shape (issue 37): raw 128 px crops (``image``, 49,152 bytes a row),
5 landmarks (``landmarks``, 40 bytes a row) and ``label`` (8 bytes) of ``synthetic_faces.py``,
in 256-row shards (the faces pipeline's default ``shard_rows``), Parquet (``--format hdf5``:
HDF5; each format's cache in its own folder under ``--work``); full shuffle, batch
256, warm (one untimed epoch first). Measured in rounds, each setting once a round, each for
about ``--seconds``; a ratio is taken against the limit of the same round, and the median over
rounds is printed:

- **limit**: ``np.take`` of NumPy memmaps of the same arrays (one ``.npy`` per column, maps
  kept open, as precache keeps its shards'), one call a column;
- **aligned limit**: the same ``np.take`` into arrays that start on a 64-byte boundary
  (``out=``). NumPy's own large arrays start 16 bytes past a page, where a copy of wide rows is
  ~20% slower, and precache copies rows of 16 KiB and more into 64-byte-aligned arrays: the
  table gives the image settings' ratio to both limits;
- ``read_batch(storage_order=True)``, ``make_loader(num_workers=0)``,
  ``make_loader(num_workers=2)`` (thread workers) over ``CachedDataset``;
- ``label`` alone and ``landmarks`` alone, ``read_batch`` and ``make_loader(num_workers=0)``,
  against the limit of that column alone;
- **mixed**: ``key`` (a string column, variable-length) with ``image`` + ``landmarks`` +
  ``label``, and ``key`` + ``label``, ``read_batch`` and ``make_loader(num_workers=0)``, against
  a limit that reads the same bytes: the fixed columns' memmap ``np.take`` plus each row's key
  sliced from a memmap of all keys' UTF-8 bytes and their offsets (as ``bench_varlen.py``'s
  limit) and made a ``str``, as precache hands it out.

``--cold``: instead, every measured epoch is cold: the cache's shard files and the limit's
``.npy`` files are dropped from the page cache (``posix_fadvise(DONTNEED)``, as
``bench_varlen.py``), then the reader is opened (a fresh ``CachedDataset``, fresh memmaps: a
page a live process maps cannot be dropped), reads one epoch and is closed; the epoch's time
includes the opening. The image + landmarks + label settings and their limit only (the goal:
cold >= 0.8 of the limit).

``--ranks R`` (R > 1) runs each ``make_loader`` setting and its limit as R forked processes
(ranks) on this node, each reading its share of every shuffled epoch: ``make_loader(...,
rank=r, world_size=R)``, and for the limit ``np.take`` of rank r's share (``order[r::R]``) of
the same-seed permutation. The ranks open their loaders, read one untimed epoch, then start
together (a barrier) and each times the same number of whole epochs (rank 0's choice, about
``--seconds``); the rate is all ranks' rows over the slowest rank's seconds, and the ratio is
to the limit with the same R in the same round. ``read_batch`` and ``landmarks`` are not run
then.

``--torch-threads N``: ``torch.set_num_threads(N)`` first. precache copies wide rows that are
not whole pages with ``torch.index_select`` while torch runs one thread (rows of whole pages,
as stage 1 writes 128 px crops, as pages whatever the count; ``loading/_engine/fixed_rows``).
The header says how many threads torch had.

Everything it wrote is deleted at the end unless ``--keep``. It runs against an older tree
too (``PYTHONPATH=/older/tree python tests/benchmarks/bench_gather.py``; the table names the
tree it read), for A/B runs: settings that need a name the tree lacks are skipped, saying so.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing
import re
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import precache
from precache.cli.bench.measure import drop_page_cache
from precache.loading import CachedDataset, make_loader

PIPELINE = str(Path(__file__).with_name("synthetic_faces.py"))
ALL = ["image", "landmarks", "label"]
MIXED = ["key", *ALL]
BATCH = 256

Keys = tuple[memoryview, np.ndarray]
"""Every row's key as UTF-8 bytes, one after another, and where each starts (and the last
ends): the limit's string column."""


def build(work: Path, rows: int, format: str = "parquet") -> Path:
    """A cache of ``rows`` face-shaped rows in 256-row shards (16 inputs of 16 rows) in
    ``format``, in a folder of its own (``cache`` for Parquet, ``cache-<format>`` else)."""
    cache = work / ("cache" if format == "parquet" else f"cache-{format}")
    if (cache / "manifest.json").exists():
        return cache
    inputs = work / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    for i in range(-(-rows // 16)):
        (inputs / f"{i:07d}.json").write_text(json.dumps({"seed": i, "rows": 16}))
    precache.run(PIPELINE, inputs, cache, shard_rows=16, format=format)
    return cache


def export(cache: Path, folder: Path) -> None:
    """The columns as one ``.npy`` each in dataset order (the limit's files); ``key`` as its
    UTF-8 bytes (``key.npy``) and offsets (``key_offsets.npy``)."""
    folder.mkdir(parents=True, exist_ok=True)
    dataset = CachedDataset(cache, columns=MIXED)
    try:
        for name in ALL:
            np.save(folder / f"{name}.npy", dataset.read_column(name))
        encoded = [key.encode() for key in dataset.read_column("key")]
    finally:
        dataset.close()
    np.save(folder / "key.npy", np.frombuffer(b"".join(encoded), np.uint8))
    np.save(folder / "key_offsets.npy", np.cumsum([0, *map(len, encoded)], dtype=np.int64))


def open_limit(folder: Path) -> tuple[dict[str, np.ndarray], Keys]:
    """The limit's files opened as memmaps (kept open, as precache keeps its shards')."""
    arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in ALL}
    keys = np.load(folder / "key.npy", mmap_mode="r")
    return arrays, (memoryview(keys), np.load(folder / "key_offsets.npy", mmap_mode="r"))


def epochs(rows: int, seed: int, rank: int = 0, world: int = 1,
           ) -> Callable[[], list[np.ndarray]]:
    """Each call: the next epoch's shuffled batches of indices (rank ``rank``'s share of
    ``world``: every ``world``-th index of the same permutation)."""
    rng = np.random.default_rng(seed)

    def next_epoch() -> list[np.ndarray]:
        order = rng.permutation(rows)[rank::world]
        return [order[i:i + BATCH] for i in range(0, len(order), BATCH)]
    return next_epoch


def timed_cold(factory: Factory, files: list[Path], seconds: float) -> float:
    """Rows/s of cold epochs (at least one) for at least ``seconds``: before each, ``files`` are
    dropped from the page cache, then the setting is opened (timed), reads one epoch and is
    closed."""
    count, elapsed = 0, 0.0
    while not count or elapsed < seconds:
        gc.collect()  # (maps of the last epoch's batches: a mapped page is not dropped)
        drop_page_cache(files)
        start = time.perf_counter()
        run, close = factory(0, 1)
        count += run()
        elapsed += time.perf_counter() - start
        close()
    return count / elapsed


def timed(run_epoch: Callable[[], int], seconds: float) -> float:
    """Rows/s of whole epochs run for at least ``seconds`` (after one untimed epoch: warm)."""
    run_epoch()
    count, start = 0, time.perf_counter()
    while True:
        count += run_epoch()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count / elapsed


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An array that starts on a 64-byte boundary (the aligned limit's; written here, not
    taken from precache, so that the baseline does not depend on the code it measures)."""
    nbytes = dtype.itemsize * math.prod(shape)
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def limit_epoch(arrays: dict[str, np.ndarray], names: list[str],
                next_epoch: Callable[[], list[np.ndarray]], keys: Keys | None = None,
                aligned: bool = False) -> Callable[[], int]:
    """The limit: ``np.take`` a fixed column (``aligned``: into a 64-byte-aligned array), and
    (``keys``) each row's key sliced from the memmapped bytes and made a ``str``."""
    fixed = [n for n in names if n != "key"]

    def take(array: np.ndarray, index: np.ndarray) -> np.ndarray:
        if not aligned:
            return np.take(array, index, axis=0)
        out = aligned_empty((len(index), *array.shape[1:]), array.dtype)
        return np.take(array, index, axis=0, out=out, mode="clip")  # (clip: no temporary)

    def run() -> int:
        count = 0
        for index in next_epoch():
            batch: dict[str, Any] = {n: torch.from_numpy(take(arrays[n], index)) for n in fixed}
            if keys is not None:
                values, offsets = keys
                starts, stops = offsets[index].tolist(), offsets[index + 1].tolist()
                batch["key"] = [str(values[a:b], "utf-8") for a, b in zip(starts, stops)]
            count += len(batch[fixed[0]])
        return count
    return run


def read_batch_epoch(dataset: CachedDataset, next_epoch: Callable[[], list[np.ndarray]],
                     ) -> Callable[[], int]:
    name = dataset.columns[-1]

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


Epoch = Callable[[], int]
Factory = Callable[[int, int], tuple[Epoch, Callable[[], None]]]
"""(rank, world) -> (one epoch's run, close): a setting opened in the process that reads it."""


def _rank(factory: Factory, rank: int, world: int, seconds: float, barrier: Any,
          epochs_to_run: Any, results: Any) -> None:
    """One rank of ``ranked`` (a forked process): open, one untimed epoch, then the agreed
    number of epochs from the barrier on; put (rank, rows, seconds) or (rank, None, error)."""
    try:
        run, close = factory(rank, world)
        start = time.perf_counter()
        run()
        if rank == 0:  # about ``seconds`` of whole epochs, the same count on every rank
            epochs_to_run.value = max(1, math.ceil(seconds / (time.perf_counter() - start)))
        barrier.wait(timeout=600)
        count, start = 0, time.perf_counter()
        for _ in range(epochs_to_run.value):
            count += run()
        elapsed = time.perf_counter() - start
        close()
        results.put((rank, count, elapsed))
    except BaseException:  # noqa: BLE001 - the parent reports it; the other ranks must not wait
        barrier.abort()
        results.put((rank, None, traceback.format_exc()))


def ranked(factory: Factory, world: int, seconds: float) -> float:
    """Rows/s of ``world`` forked ranks reading their shares together: all ranks' rows over
    the slowest rank's seconds."""
    context = multiprocessing.get_context("fork")
    barrier, epochs_to_run, results = context.Barrier(world), context.Value("i", 0), context.Queue()
    processes = [context.Process(target=_rank, args=(factory, r, world, seconds, barrier,
                                                     epochs_to_run, results))
                 for r in range(world)]
    for process in processes:
        process.start()
    got = [results.get(timeout=1200) for _ in processes]
    for process in processes:
        process.join()
    failed = [g for g in got if g[1] is None]
    if failed:
        raise RuntimeError(f"rank {failed[0][0]} failed:\n{failed[0][2]}")
    return sum(g[1] for g in got) / max(g[2] for g in got)


def settings_for(cache: Path, folder: Path, rows: int, cold: bool,
                 ) -> dict[str, tuple[str, Factory]]:
    """Each setting's name -> (the name of its limit, its factory); see the module docstring.
    The limit's memmaps are opened in the factory: a cold epoch opens them afresh."""
    def limit(names: list[str], aligned: bool = False) -> Factory:
        def make(rank: int, world: int) -> tuple[Epoch, Callable[[], None]]:
            arrays, keys = open_limit(folder)
            return (limit_epoch(arrays, names, epochs(rows, 0, rank, world),
                                keys if "key" in names else None, aligned), lambda: None)
        return make

    def loader(names: list[str], workers: int, **options: Any) -> Factory:
        def make(rank: int, world: int) -> tuple[Epoch, Callable[[], None]]:
            dataset = CachedDataset(cache, columns=names)
            given = dict(options, rank=rank, world_size=world) if world > 1 else options
            return (loader_epoch(make_loader(dataset, BATCH, num_workers=workers, **given),
                                 "label"), dataset.close)
        return make

    def read_batch(names: list[str]) -> Factory:
        def make(rank: int, world: int) -> tuple[Epoch, Callable[[], None]]:
            dataset = CachedDataset(cache, columns=names)
            return read_batch_epoch(dataset, epochs(rows, 0)), dataset.close
        return make

    fixed: dict[str, tuple[str, Factory]] = {
        "limit": ("limit", limit(ALL)),
        "aligned limit": ("limit", limit(ALL, aligned=True)),
        "read_batch(storage_order=True)": ("limit", read_batch(ALL)),
        "make_loader(num_workers=0)": ("limit", loader(ALL, 0)),
        "make_loader(num_workers=2) threads": ("limit", loader(ALL, 2, worker_kind="threads")),
    }
    if cold:
        return {f"cold {name}": (f"cold {limit_name}", factory)
                for name, (limit_name, factory) in fixed.items()}
    return {
        **fixed,
        "label limit": ("label limit", limit(["label"])),
        "label read_batch": ("label limit", read_batch(["label"])),
        "label make_loader(0)": ("label limit", loader(["label"], 0, seed=1)),
        "landmarks limit": ("landmarks limit", limit(["landmarks"])),
        "landmarks read_batch": ("landmarks limit", read_batch(["landmarks"])),
        "mixed limit": ("mixed limit", limit(MIXED)),
        "mixed read_batch": ("mixed limit", read_batch(MIXED)),
        "mixed make_loader(0)": ("mixed limit", loader(MIXED, 0)),
        "key+label limit": ("key+label limit", limit(["key", "label"])),
        "key+label read_batch": ("key+label limit", read_batch(["key", "label"])),
    }


def huge_page_share(folders: dict[str, Path]) -> str:
    """How much of each folder's files this process maps with 2 MB pages (``FilePmdMapped``
    of ``/proc/self/smaps``): the page cache's folio sizes decide it (a file read back through
    precache's cold path sits in 4 KB folios, one faulted in through a memmap in 2 MB ones),
    and a gather from 4 KB pages misses the TLB more (docs/performance.md). Linux only."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return "huge pages: unknown"
    totals = {name: [0, 0] for name in folders}
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        head = block.split("\n", 1)[0]
        for name, folder in folders.items():
            if f"{folder}/" in head:
                for k, field in enumerate(("Rss", "FilePmdMapped")):
                    found = re.search(rf"^{field}:\s+(\d+) kB", block, re.M)
                    totals[name][k] += int(found.group(1)) if found else 0
    return "; ".join(f"{name} {pmd >> 10} of {rss >> 10} MB mapped on 2 MB pages"
                     for name, (rss, pmd) in totals.items())


def measure(settings: dict[str, tuple[str, Factory]], args: argparse.Namespace,
            files: list[Path], closers: list[Callable[[], None]],
            ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each setting's rates and ratios to its limit, one a round."""
    if args.cold:
        runs: dict[str, Callable[[], float]] = {
            name: (lambda f=factory: timed_cold(f, files, args.seconds))
            for name, (_, factory) in settings.items()}
    elif args.ranks > 1:
        runs = {name: (lambda f=factory: ranked(f, args.ranks, args.seconds))
                for name, (_, factory) in settings.items()}
    else:  # opened once, in this process, in the order above
        runs = {}
        for name, (_, factory) in list(settings.items()):
            try:
                run, close = factory(0, 1)
            except (TypeError, AttributeError, ImportError) as error:  # an older tree
                print(f"skipped {name}: {error}", file=sys.stderr)
                del settings[name]
                continue
            closers.append(close)
            runs[name] = (lambda r=run: timed(r, args.seconds))
    only = [s for s in args.only.split(",") if s]
    rates: dict[str, list[float]] = {name: [] for name in settings}
    ratios: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        got = {}
        for name in settings:
            if not only or name in only or name.endswith("limit"):
                got[name] = runs[name]()
        for name, rate in got.items():
            rates[name].append(rate)
            ratios[name].append(rate / got[settings[name][0]])
            aligned = settings[name][0].replace("limit", "aligned limit")
            if aligned in got and name != aligned:
                ratios.setdefault(f"{name} / aligned", []).append(rate / got[aligned])
    if not args.cold and args.ranks == 1:  # (while this process maps the files)
        print("(after the last round: " + huge_page_share(
            {"cache": files[0].parent, "limit": files[-1].parent}) + ")")
    return rates, ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=12000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=0.6, help="per setting and round")
    parser.add_argument("--only", default="", help="comma-separated setting names to run")
    parser.add_argument("--work", type=Path, default=Path("/tmp/precache-bench-gather"))
    parser.add_argument("--format", choices=["parquet", "hdf5"], default="parquet",
                        help="the cache's shard format")
    parser.add_argument("--keep", action="store_true", help="keep the cache and .npy files")
    parser.add_argument("--ranks", type=int, default=1,
                        help="forked processes (ranks) reading their shares together")
    parser.add_argument("--cold", action="store_true",
                        help="cold epochs (files dropped from the page cache before each)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads first (1: precache's copies on one core, "
                             "as the limits'); default: torch's")
    args = parser.parse_args()
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    if args.cold and args.ranks > 1:
        parser.error("--cold runs in one process: leave out --ranks")
    made = not args.work.exists()
    closers: list[Callable[[], None]] = []
    try:
        cache = build(args.work, args.rows, args.format)
        export(cache, args.work / "limit")
        counted = CachedDataset(cache, columns=["label"])
        rows, shards = len(counted), len(np.unique(counted.shard_ids))
        counted.close()
        settings = settings_for(cache, args.work / "limit", rows, args.cold)
        if args.ranks > 1:  # the loaders and their limits only
            settings = {name: setting for name, setting in settings.items()
                        if "read_batch" not in name and not name.startswith("landmarks")}
        files = sorted((cache / "shards").iterdir()) + sorted((args.work / "limit").iterdir())
        rates, ratios = measure(settings, args, files, closers)
        where = (f"{args.ranks} ranks on this node (forked; all ranks' rows over the slowest "
                 "rank's time)" if args.ranks > 1 else "one process")
        print(f"{rows:,} rows in {shards} {args.format} shards, batch {BATCH}, full shuffle, "
              f"{'cold' if args.cold else 'warm'}, {where}; median of {args.rounds} rounds; "
              f"torch threads {torch.get_num_threads()}; "
              f"precache {precache.__file__.rsplit('/precache/', 1)[0]}")
        print("| reader | rows/s | vs limit | vs aligned limit |")
        print("|---|---:|---:|---:|")
        for name in settings:
            if rates[name]:
                aligned = ratios.get(f"{name} / aligned")
                print(f"| {name} | {statistics.median(rates[name]):,.0f} "
                      f"| {statistics.median(ratios[name]):.2f} of {settings[name][0]} "
                      f"| {f'{statistics.median(aligned):.2f}' if aligned else ''} |")
    finally:
        for close in closers:
            close()
        if not args.keep and made:
            shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
