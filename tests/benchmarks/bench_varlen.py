"""Variable-length columns in stage 2 (issue 23): precache against the NumPy memmap limit,
LitData and Hugging Face ``datasets``, over the same rows, cold and warm, in one run.

    .venv/bin/python tests/benchmarks/bench_varlen.py                        # full size
    .venv/bin/python tests/benchmarks/bench_varlen.py --docs 5000 --images 1000   # seconds
    .venv/bin/python tests/benchmarks/bench_varlen.py --workload tokens --docs 30000000 \\
        --rows-per-record 4096 --shard-rows 8192 --readers limit,precache --workers 0,2 \\
        --max-batches 200 --dir /big/disk  # 31 GB, past RAM
    .venv/bin/python tests/benchmarks/bench_varlen.py --workload jpeg --images 3200000 \
        --shard-rows 8192 --readers limit,precache --workers 0,2 --max-batches 200 \
        --dir /big/disk  # 28 GB of JPEG crops, past RAM

Workloads (fixed seeds, so every reader and every run sees the same data):

- **tokens**: ``--docs`` documents of 16..1,024 uint16 ids (uniform lengths, ids < 30522);
  precache stores them as a ``ragged`` column, read in place from the mapped shard.
- **jpeg**: ``--images`` 128x128 RGB crops (smooth gradients, soft blobs, one hard edge and
  noise) as JPEG quality 95, 4:4:4 (simplejpeg, as ``precache.cache.image_codec``); every
  reader decodes them with simplejpeg into one preallocated (n, 128, 128, 3) uint8 batch.
  Past ``POOL_IMAGES`` rows, row i is crop ``i % POOL_IMAGES`` again (the page cache holds a
  file's pages, not their contents, so a repeated crop costs what a new one does; drawing a
  crop takes ~1.5 ms, 70 minutes for the 3 million of a cache past RAM), and stage 1 stores the
  source's bytes, which are what ``EncodeImage`` writes (``StoredJPEG``), 4,096 rows a record.

The source data is written once (untimed) as two ``.npy`` files, all values and int64 offsets;
that is also the limit's data. Stage 1 builds the precache cache of each ``--shard-rows``
itself (``precache.run`` over a JSON Lines file of row numbers, with the pipeline defined in
this file: one op reading row i, plus precache's own ``EncodeImage`` for jpeg), timed.

Readers, each full shuffle, batch 256, through a torch DataLoader at each ``--workers``:

1. **limit**: the memmapped ``.npy`` values + offsets; ``__getitems__`` slices each row (jpeg:
   decodes each into the batch): the least work any reader of these bytes can do.
2. **precache**: ``make_loader(CachedDataset(cache, columns=[...]), 256, shuffle=True,
   num_workers=w)``; **budget**: the same with ``max_decoded_bytes`` = cache bytes / 20.
3. **litdata**: ``litdata.optimize`` (64 MB chunks) read by ``StreamingDataset(shuffle=True)``
   + ``StreamingDataLoader`` (LitData's shuffle: chunks, then rows within a window; not a
   full shuffle). Skipped, saying why, if ``litdata`` cannot be imported or used.
4. **hf**: a ``datasets.Dataset`` of the same arrays, ``save_to_disk``, ``load_from_disk``
   (memory-mapped Arrow), ``with_format("numpy")``; ``__getitems__`` is ``ds[indices]``.

Epoch 1 is cold: the reader's files are dropped from the page cache (``posix_fadvise``
DONTNEED, as ``precache.cli.bench.measure.drop_page_cache``) and only then opened; it includes
starting the workers. Epoch 2 is warm (where the data fits in RAM). The training loop touches
every byte of a token batch (it concatenates the rows and sums the ids; every reader hands out
rows that may be views of its file) and a pixel of every image; those sums, per epoch, must
match the limit's (``check``), so every reader read every row once. Workers' USS
(smaps_rollup Private_Clean + Private_Dirty) is read after epoch 2 and shown as a % of the
precache cache's bytes. Rates are samples/s, with ratios to the limit measured in the same run:
compare ratios, not absolute numbers, across machines.

``--ranks R`` runs each of the limit and precache as R processes on this node (ranks, forked;
each with its ``--workers``), each reading its share of every epoch (``make_loader(rank=,
world_size=)``; the limit: ``DistributedSampler``), started together: the rate is all ranks'
rows over the slowest rank's time, and USS is the ranks' and their workers' together. LitData
and HF are not run then.

``--max-batches K`` cuts every epoch after K batches (caches larger than RAM: every epoch is
then cold and no check is made). Everything is built under ``--dir`` (default: a temporary
folder); what this run built is deleted at the end unless ``--keep``; ``--reuse`` keeps and
uses what an earlier ``--keep`` run left there.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

from precache.cache.schema import ragged
from precache.processing.ops import FunctionOp
from precache.processing.ops.image import EncodeImage
from precache.processing.pipeline import Pipeline

SEED = 23
POOL_IMAGES = 100_000
VOCAB = 30522
MIN_LEN, MAX_LEN = 16, 1024
SIDE = 128
QUALITY = 95
BATCH = 256
COLUMN = {"tokens": "ids", "jpeg": "image"}

# ---------------------------------------------------------------------------------------------
# Source data (the limit's files) and the stage-1 pipeline. precache's workers load this file
# as a pipeline (``pipeline`` below), so nothing here may run on import.
# ---------------------------------------------------------------------------------------------


def synthetic_image(i: int) -> np.ndarray:
    """Image ``i``: a smooth field with structure JPEG must spend bytes on (not pure noise)."""
    import cv2

    rng = np.random.default_rng([SEED, 2, i])
    coarse = rng.uniform(30, 225, (4, 4, 3)).astype(np.float32)  # smooth colour field
    image = cv2.resize(coarse, (SIDE, SIDE), interpolation=cv2.INTER_CUBIC)
    y, x = np.mgrid[0:SIDE, 0:SIDE].astype(np.float32) / SIDE
    for _ in range(3):  # soft blobs
        cx, cy, r = rng.uniform(0.1, 0.9), rng.uniform(0.1, 0.9), rng.uniform(0.06, 0.25)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))
        image += blob[..., None] * rng.uniform(-70, 70, 3).astype(np.float32)
    x0, y0 = rng.integers(0, SIDE - 24, 2)  # one hard-edged rectangle
    image[y0:y0 + rng.integers(12, 40), x0:x0 + rng.integers(12, 40)] += rng.uniform(-60, 60, 3)
    image += rng.standard_normal(image.shape, dtype=np.float32) * 3.0  # sensor noise
    return np.clip(image, 0, 255).astype(np.uint8)


def encode(image: np.ndarray) -> bytes:
    import simplejpeg

    return simplejpeg.encode_jpeg(image, quality=QUALITY, colorspace="RGB",
                                  colorsubsampling="444")


def _encode_range(bounds: tuple[int, int]) -> list[bytes]:
    return [encode(synthetic_image(i)) for i in range(*bounds)]


def write_source(workload: str, rows: int, folder: Path) -> dict[str, Path]:
    """``values.npy`` (uint16 ids or uint8 JPEG bytes, all rows end to end) and ``offsets.npy``
    (int64, rows + 1): the limit's data and every other reader's source. Written in chunks,
    so it works past RAM."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"values": folder / "values.npy", "offsets": folder / "offsets.npy"}
    offsets = np.zeros(rows + 1, dtype=np.int64)
    if workload == "tokens":
        lengths = np.random.default_rng([SEED, 0]).integers(MIN_LEN, MAX_LEN + 1, rows)
        np.cumsum(lengths, out=offsets[1:])
        values = np.lib.format.open_memmap(files["values"], "w+", np.uint16, (int(offsets[-1]),))
        step = 1 << 26
        for k, start in enumerate(range(0, len(values), step)):
            stop = min(len(values), start + step)
            values[start:stop] = np.random.default_rng([SEED, 1, k]).integers(
                0, VOCAB, stop - start, dtype=np.uint16)
        values.flush()
        del values
    else:  # encode the pool in parallel, then write it (repeated past POOL_IMAGES) as a .npy
        distinct = min(rows, POOL_IMAGES)
        step = 1000
        bounds = [(s, min(distinct, s + step)) for s in range(0, distinct, step)]
        with multiprocessing.get_context("fork").Pool(max(1, min(os.cpu_count() or 1, 8))) as pool:
            encoded = [data for part in pool.imap(_encode_range, bounds) for data in part]
        lengths = np.array([len(data) for data in encoded], dtype=np.int64)
        pool_bytes = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        del encoded
        np.cumsum(lengths[np.arange(rows) % distinct], out=offsets[1:])
        values = np.lib.format.open_memmap(files["values"], "w+", np.uint8, (int(offsets[-1]),))
        for start in range(0, len(values), len(pool_bytes)):  # whole pools, then the rest
            stop = min(len(values), start + len(pool_bytes))
            values[start:stop] = pool_bytes[:stop - start]
            values.flush()
        del values
    np.save(files["offsets"], offsets)
    return files


_SOURCES: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # per process: folder -> memmaps
RECORD_ROWS = [1]  # rows per stage-1 record of this run's token workload
WARM_EPOCHS = [1]  # warm epochs after each cold one (--warm-epochs; their median is reported)


def _source(folder: str) -> tuple[np.ndarray, np.ndarray]:
    if folder not in _SOURCES:
        _SOURCES[folder] = (np.load(os.path.join(folder, "values.npy"), mmap_mode="r"),
                            np.load(os.path.join(folder, "offsets.npy"), mmap_mode="r"))
    return _SOURCES[folder]


def token_row(sample: dict, source: str) -> dict | list[dict]:
    """Stage 1, tokens: the record ``{"i": n}`` becomes document n's ids (a ragged column);
    ``{"i": n, "n": k}`` documents n..n+k-1, one row each (``--rows-per-record``)."""
    record = json.loads(sample["data"])
    values, offsets = _source(source)
    if "n" not in record:
        i = record["i"]
        sample["ids"] = ragged(np.array(values[offsets[i]:offsets[i + 1]]), np.uint16)
        return sample
    first, count = record["i"], record["n"]
    del sample["data"]
    block = np.array(values[offsets[first]:offsets[first + count]])
    cuts = (offsets[first + 1:first + count] - offsets[first]).tolist()
    return [dict(sample, ids=ragged(part, np.uint16)) for part in np.split(block, cuts)]


def image_row(sample: dict) -> dict:
    """Stage 1, jpeg: the record ``{"i": n}`` becomes image n (``EncodeImage`` encodes it)."""
    i = json.loads(sample["data"])["i"]
    sample["image"] = synthetic_image(i)
    return sample


def stored_jpeg_rows(sample: dict, source: str) -> list[dict]:
    """Stage 1, jpeg past ``POOL_IMAGES``: the record ``{"i": n, "n": k}`` becomes rows
    n..n+k-1, each the source's JPEG bytes of its crop (``StoredJPEG`` keeps them)."""
    record = json.loads(sample["data"])
    values, offsets = _source(source)
    first, count = record["i"], record["n"]
    del sample["data"]
    block = np.array(values[offsets[first]:offsets[first + count]])
    cuts = (offsets[first:first + count + 1] - offsets[first]).tolist()
    return [dict(sample, image=block[a:b].tobytes()) for a, b in zip(cuts[:-1], cuts[1:])]


class StoredJPEG(EncodeImage):
    """``EncodeImage(codec="jpeg", quality=QUALITY)`` over rows that already hold its output
    (the source was encoded by the same simplejpeg call), so stage 2 reads an encoded image
    column exactly as it would have; a benchmark's shortcut, not a pipeline's."""

    def __call__(self, sample: dict) -> dict:
        return sample


def make_ops(workload: str = "tokens", source: str = "", stored: bool = False) -> list:
    if workload == "tokens":
        return [FunctionOp(token_row, params={"source": source})]
    if stored:
        return [FunctionOp(stored_jpeg_rows, params={"source": source}),
                StoredJPEG(codec="jpeg", quality=QUALITY, column="image")]
    return [FunctionOp(image_row), EncodeImage(codec="jpeg", quality=QUALITY, column="image")]


pipeline = Pipeline(name="bench_varlen", make_ops=make_ops, extensions=(".jsonl",),
                    description="issue 23's benchmark: token ids (ragged) or JPEG crops")

# ---------------------------------------------------------------------------------------------
# The benchmark proper
# ---------------------------------------------------------------------------------------------

T0 = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {message}", flush=True)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def folder_files(path: Path) -> list[Path]:
    return [p for p in Path(path).rglob("*") if p.is_file()]


def build_precache(workload: str, source: Path, records: Path, cache: Path, shard_rows: int,
                   workers: int) -> float:
    """Stage 1 into ``cache``; its wall seconds."""
    import precache

    params = {"workload": workload, "source": str(source)}
    if workload == "jpeg" and RECORD_ROWS[0] > 1:
        params["stored"] = True
    summary = precache.run(str(Path(__file__).resolve()), records, cache, params=params,
                           workers=workers, shard_rows=shard_rows,
                           progress=sys.stderr.isatty(), log=lambda line: say(f"  {line}"))
    if summary.failed:
        raise RuntimeError(f"stage 1 failed on {summary.failed} inputs: {summary.failures[:3]}")
    return summary.wall_s


def _hf_batches(workload: str, source: Path, step: int = 1 << 16) -> Any:
    """The source as Arrow record batches (int32 offsets per batch: any size fits)."""
    import pyarrow as pa

    values, offsets = _source(str(source))
    for start in range(0, len(offsets) - 1, step):
        stop = min(len(offsets) - 1, start + step)
        local = (offsets[start:stop + 1] - offsets[start]).astype(np.int32)
        data = np.asarray(values[offsets[start]:offsets[stop]])
        if workload == "tokens":
            array = pa.ListArray.from_arrays(pa.array(local), pa.array(data))
        else:
            array = pa.Array.from_buffers(pa.binary(), stop - start,
                                          [None, pa.py_buffer(local), pa.py_buffer(data)])
        yield pa.RecordBatch.from_arrays([array], names=[COLUMN[workload]])


def build_hf(workload: str, source: Path, out: Path) -> float:
    """A ``datasets.Dataset`` of the source arrays, ``save_to_disk``; its wall seconds."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    datasets.disable_progress_bars()
    start = time.perf_counter()
    table = pa.Table.from_batches(list(_hf_batches(workload, source)))
    datasets.Dataset(InMemoryTable(table)).save_to_disk(str(out), max_shard_size="500MB")
    _SOURCES.clear()
    return time.perf_counter() - start


def _litdata_rows(bounds: tuple[int, int, str, str]) -> Any:
    """``litdata.optimize``'s fn: the rows of one block of the source."""
    start, stop, folder, workload = bounds
    values, offsets = _source(folder)
    for i in range(start, stop):
        row = np.array(values[offsets[i]:offsets[i + 1]])
        yield {COLUMN[workload]: row if workload == "tokens" else row.tobytes()}


def build_litdata(workload: str, source: Path, out: Path, rows: int, log: Path) -> float:
    """``litdata.optimize`` of the source (its output to ``log``); its wall seconds."""
    import litdata

    start = time.perf_counter()
    blocks = [(s, min(rows, s + 2048), str(source), workload) for s in range(0, rows, 2048)]
    saved, environ = (os.dup(1), os.dup(2)), dict(os.environ)
    with open(log, "w") as sink:  # its workers print per-item progress; keep it off the report
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            litdata.optimize(fn=_litdata_rows, inputs=blocks, output_dir=str(out),
                             chunk_bytes="64MB", num_workers=min(2, len(blocks)),
                             start_method="fork", mode="overwrite", verbose=False)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    multiprocessing.set_start_method("fork", force=True)  # optimize sets both globally
    os.environ.clear()
    os.environ.update(environ)
    return time.perf_counter() - start


# --- datasets of the readers that precache does not provide --------------------------------


def decode_into(buffers: list[Any]) -> Any:
    """JPEGs decoded by simplejpeg straight into one (n, h, w, 3) uint8 batch, as a tensor (as
    precache's collate returns it: a worker hands it over in shared memory, not pickled)."""
    import simplejpeg
    import torch

    batch = np.empty((len(buffers), SIDE, SIDE, 3), dtype=np.uint8)
    for k, data in enumerate(buffers):
        simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=batch[k])
    return torch.from_numpy(batch)


class MemmapRows:
    """The limit: a slice of the memmapped values per row (no copy); jpeg rows decoded."""

    def __init__(self, source: Path, workload: str) -> None:
        self.values = np.load(source / "values.npy", mmap_mode="r").view(np.ndarray)
        self.offsets = np.load(source / "offsets.npy", mmap_mode="r").view(np.ndarray)
        self.workload = workload

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitems__(self, indices: list[int]) -> dict[str, Any]:
        index = np.asarray(indices, dtype=np.int64)
        starts, stops = self.offsets[index].tolist(), self.offsets[index + 1].tolist()
        values = self.values
        rows = [values[a:b] for a, b in zip(starts, stops)]
        if self.workload == "tokens":
            return {"ids": rows}
        return {"image": decode_into(rows)}


class HFRows:
    """Hugging Face: ``ds[indices]`` of a memory-mapped, numpy-formatted ``Dataset``."""

    def __init__(self, path: Path, workload: str) -> None:
        import datasets

        self.column = COLUMN[workload]
        self.ds = datasets.load_from_disk(str(path)).with_format("numpy")
        self.workload = workload

    def __len__(self) -> int:
        return len(self.ds)

    def __getitems__(self, indices: list[int]) -> dict[str, Any]:
        values = self.ds[list(indices)][self.column]
        if self.workload == "tokens":
            return {"ids": list(values)}
        return {"image": decode_into(list(values))}


def as_batch(batch: Any) -> Any:
    """DataLoader collate for datasets whose ``__getitems__`` already made the batch."""
    return batch


def litdata_collate_tokens(items: list[dict]) -> dict[str, Any]:
    return {"ids": [item["ids"] for item in items]}


def litdata_collate_jpeg(items: list[dict]) -> dict[str, Any]:
    return {"image": decode_into([item["image"] for item in items])}


def _pin(_: int) -> None:
    from precache.threads import pin_threads

    pin_threads()


def torch_loader(dataset: Any, workers: int, rank: int = 0, world: int = 1) -> Any:
    """What ``make_loader`` sets, for a plain dataset: shuffle, batch 256, persistent workers
    with pinned threads; rank ``rank`` of ``world`` reads its share (``DistributedSampler``)."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    generator = torch.Generator()
    generator.manual_seed(0)
    options: dict[str, Any] = dict(persistent_workers=True, worker_init_fn=_pin) if workers else {}
    if world > 1:
        options["sampler"] = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0)
    else:
        options.update(shuffle=True, generator=generator)
    return DataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=as_batch,
                      **options)


# --- timing -----------------------------------------------------------------------------------


def touch(batch: dict[str, Any], workload: str) -> tuple[int, int, int]:
    """(rows, tokens or 0, checksum): reads every id of a token batch (rows may be views of a
    file that were never read) and one pixel per image."""
    if workload == "tokens":
        flat = np.concatenate([np.asarray(row) for row in batch["ids"]])
        return len(batch["ids"]), len(flat), int(flat.sum(dtype=np.int64))
    images = np.asarray(batch["image"])
    return len(images), 0, int(images[:, 0, 0, :].sum(dtype=np.int64))


def run_epoch(loader: Any, epoch: int, workload: str, max_batches: int | None,
              opened: float | None = None) -> tuple[float, tuple[int, int, int], float]:
    """(samples/s, (rows, tokens, checksum), seconds to the first batch) of one epoch, cut
    after ``max_batches``; ``opened``: when the loader was opened (the first batch counts
    from then)."""
    from precache.loading import CacheLoader

    if isinstance(loader, CacheLoader):  # the others reshuffle on each iteration themselves
        loader.set_epoch(epoch)
    elif hasattr(getattr(loader, "sampler", None), "set_epoch"):  # a DistributedSampler
        loader.sampler.set_epoch(epoch)
    rows = tokens = total = 0
    start = shown = time.perf_counter()
    first = 0.0
    for i, batch in enumerate(loader):
        if i == 0:
            first = time.perf_counter() - (start if opened is None else opened)
        n, t, s = touch(batch, workload)
        rows, tokens, total = rows + n, tokens + t, total + s
        if max_batches and i + 1 >= max_batches:
            break
        if time.perf_counter() - shown > 30:  # a long epoch shows where it is
            shown = time.perf_counter()
            say(f"    epoch {epoch + 1}: {rows:,} rows, {rows / (shown - start):,.0f}/s")
    return rows / (time.perf_counter() - start), (rows, tokens, total), first


def torch_of(loader: Any) -> Any:
    return getattr(loader, "loader", loader)  # a CacheLoader wraps a DataLoader


def workers_uss(loader: Any) -> tuple[int, int]:
    """Bytes of the loader's live workers' USS (Private_Clean + Private_Dirty), and of its
    Private_Clean part alone (pages of mapped files only that worker maps: the read data)."""
    from precache.cli.bench.measure import _smaps_kb

    iterator = getattr(torch_of(loader), "_iterator", None)
    pids = [p.pid for p in getattr(iterator, "_workers", None) or []]
    maps = [_smaps_kb(pid) for pid in pids]
    clean = sum(m.get("Private_Clean", 0) for m in maps) * 1024
    return clean + sum(m.get("Private_Dirty", 0) for m in maps) * 1024, clean


def shutdown(loader: Any) -> None:
    """Stop persistent workers now, not at garbage collection (their maps pin the page cache)."""
    inner = torch_of(loader)
    iterator = getattr(inner, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    inner._iterator = None


def _rank(rank: int, ranks: int, open_loader: Callable[..., tuple[Any, Callable[[], None]]],
          workload: str, workers: int, max_batches: int | None, barrier: Any,
          results: Any) -> None:
    """One rank of ``measure_ranks`` (a forked process): open its loader, then two epochs, each
    started with the other ranks; put (rank, [(rows, seconds, sums, first)] per epoch, USS)."""
    from precache.cli.bench.measure import _smaps_kb

    opened = time.perf_counter()
    loader, close = open_loader(rank, ranks)
    epochs = []
    for epoch in (0, 1):
        barrier.wait()
        start = time.perf_counter()
        _, sums, first = run_epoch(loader, epoch, workload, max_batches,
                                   opened if epoch == 0 else None)
        epochs.append((sums[0], time.perf_counter() - start, sums, first))
    pids = [os.getpid()] + [p.pid for p in getattr(getattr(torch_of(loader), "_iterator", None),
                                                   "_workers", None) or []]
    maps = [_smaps_kb(pid) for pid in pids]
    uss = sum(m.get("Private_Clean", 0) + m.get("Private_Dirty", 0) for m in maps) * 1024
    results.put((rank, epochs, uss, sum(m.get("Private_Clean", 0) for m in maps) * 1024))
    shutdown(loader)
    close()


def measure_ranks(files: list[Path], open_loader: Callable[..., tuple[Any, Callable[[], None]]],
                  workload: str, workers: int, max_batches: int | None,
                  ranks: int) -> dict[str, Any]:
    """``measure`` with ``ranks`` processes, each reading its share (see the module docstring):
    all rows over the slowest rank's seconds, per epoch."""
    from precache.cli.bench.measure import drop_page_cache

    gc.collect()
    drop_page_cache(files)
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(ranks), context.Queue()
    processes = [context.Process(target=_rank, args=(r, ranks, open_loader, workload, workers,
                                                     max_batches, barrier, results))
                 for r in range(ranks)]
    for process in processes:
        process.start()
    got = [results.get(timeout=3600) for _ in processes]
    for process in processes:
        process.join()
        if process.exitcode:
            raise RuntimeError(f"a rank exited with {process.exitcode}")
    rates = [sum(g[1][e][0] for g in got) / max(g[1][e][1] for g in got) for e in (0, 1)]
    sums = [tuple(map(sum, zip(*(g[1][e][2] for g in got)))) for e in (0, 1)]
    return {"cold": rates[0], "warm": rates[1], "uss": sum(g[2] for g in got),
            "uss_files": sum(g[3] for g in got), "sums": sums,
            "first": max(g[1][0][3] for g in got), "ranks": ranks}


def measure(files: list[Path], open_loader: Callable[..., tuple[Any, Callable[[], None]]],
            workload: str, workers: int, max_batches: int | None,
            ranks: int = 1) -> dict[str, Any]:
    """Drop ``files`` from the page cache, then open the loader and time two epochs
    (``ranks`` > 1: ``measure_ranks``)."""
    from precache.cli.bench.measure import drop_page_cache

    if ranks > 1:
        return measure_ranks(files, open_loader, workload, workers, max_batches, ranks)
    gc.collect()  # maps of earlier readers would keep their pages in the page cache
    drop_page_cache(files)
    opened = time.perf_counter()
    loader, close = open_loader()
    try:
        cold, sums1, first = run_epoch(loader, 0, workload, max_batches, opened)
        warms = [run_epoch(loader, 1 + k, workload, max_batches) for k in range(WARM_EPOCHS[0])]
        warm, sums2 = float(np.median([w[0] for w in warms])), warms[-1][1]
        uss, uss_files = workers_uss(loader) if workers else (0, 0)
    finally:
        shutdown(loader)
        close()
        del loader
        gc.collect()
    return {"cold": cold, "warm": warm, "uss": uss, "uss_files": uss_files,
            "sums": [sums1, sums2], "first": first}


# --- one workload -----------------------------------------------------------------------------


def verify_cache(cache: Path, source: Path, workload: str) -> None:
    """A few rows of the cache equal the source's (the key ``records.jsonl:n`` is row n - 1)."""
    from precache.loading import CachedDataset

    dataset = CachedDataset(cache, columns=["key", COLUMN[workload]])
    try:
        rows = np.random.default_rng(0).choice(len(dataset), min(64, len(dataset)), replace=False)
        got = dataset.read_batch(rows)
        per = RECORD_ROWS[0]  # records.jsonl:n is row n - 1, or with blocks :n#j row per*(n-1)+j
        index = [(int(key.rsplit(":", 1)[1].split("#")[0]) - 1) * per
                 + (int(key.split("#")[1]) if "#" in key else 0) for key in got["key"]]
        want = MemmapRows(source, workload).__getitems__(index)
        column = COLUMN[workload]
        same = (all(np.array_equal(a, b) for a, b in zip(got[column], want[column]))
                if workload == "tokens" else np.array_equal(got[column], want[column].numpy()))
        if not same:
            raise RuntimeError(f"{cache}: its rows differ from the source's")
    finally:
        dataset.close()
        _SOURCES.clear()


def run_workload(workload: str, rows: int, args: argparse.Namespace, work: Path,
                 built: list[Path]) -> tuple[list[dict], dict]:
    """Build every reader's files for ``workload`` and measure them; (table rows, sizes)."""
    column = COLUMN[workload]
    root = work / f"{workload}-{rows}"
    source = root / "source"
    readers = args.readers

    def fresh(path: Path, done: Callable[[Path], bool]) -> bool:
        """Whether ``path`` must be (re)built; marks it as this run's to delete."""
        if args.reuse and done(path):
            return False
        shutil.rmtree(path, ignore_errors=True)
        built.append(path)
        return True

    if not root.exists():
        built.append(root)  # all of it is this run's
    root.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"workload": workload, "rows": rows, "write_s": {}, "bytes": {}}
    if fresh(source, lambda p: (p / "offsets.npy").exists()):
        say(f"{workload}: writing the source ({rows:,} rows) as values.npy + offsets.npy")
        start = time.perf_counter()
        write_source(workload, rows, source)
        info["write_s"]["limit (.npy)"] = time.perf_counter() - start
    values = np.load(source / "values.npy", mmap_mode="r")
    info["raw_bytes"] = int(values.nbytes)
    info["bytes"]["limit (.npy)"] = folder_bytes(source)
    del values
    records = root / "records.jsonl"
    per = RECORD_ROWS[0] = (args.rows_per_record if workload == "tokens" else
                            4096 if rows > POOL_IMAGES else 1)
    if not records.exists() or not args.reuse:  # stage 1's input: one record per row (block)
        with open(records, "w") as out:
            if per > 1:
                out.write("".join(f'{{"i": {i}, "n": {min(per, rows - i)}}}\n'
                                  for i in range(0, rows, per)))
            for start in range(0, rows if per == 1 else 0, 1 << 20):
                stop = min(rows, start + (1 << 20))
                out.write("".join(f'{{"i": {i}}}\n' for i in range(start, stop)))

    caches: dict[int, Path] = {}
    for shard_rows in args.shard_rows:
        cache = root / f"precache-{shard_rows}"
        caches[shard_rows] = cache
        name = f"precache shard_rows={shard_rows}"
        if fresh(cache, lambda p: (p / "manifest.json").exists()):
            say(f"{workload}: stage 1 -> {cache.name} ({args.stage1_workers} workers)")
            info["write_s"][name] = build_precache(workload, source, records, cache,
                                                   max(1, shard_rows // per),
                                                   args.stage1_workers)
            say(f"{workload}: stage 1 took {info['write_s'][name]:.1f}s")
        info["bytes"][name] = folder_bytes(cache)
        verify_cache(cache, source, workload)
    info["cache_bytes"] = info["bytes"][f"precache shard_rows={args.shard_rows[0]}"]

    hf_dir, lit_dir = root / "hf", root / "litdata"
    if "hf" in readers:
        if fresh(hf_dir, lambda p: (p / "dataset_info.json").exists()):
            say(f"{workload}: datasets save_to_disk -> {hf_dir.name}")
            info["write_s"]["hf (save_to_disk)"] = build_hf(workload, source, hf_dir)
        info["bytes"]["hf (save_to_disk)"] = folder_bytes(hf_dir)
    litdata_skip = None
    if "litdata" in readers:
        try:
            if fresh(lit_dir, lambda p: (p / "index.json").exists()):
                say(f"{workload}: litdata.optimize -> {lit_dir.name}")
                info["write_s"]["litdata (optimize)"] = build_litdata(
                    workload, source, lit_dir, rows, root / "litdata-optimize.log")
            info["bytes"]["litdata (optimize)"] = folder_bytes(lit_dir)
        except Exception as error:  # noqa: BLE001 - reported, and the rest still runs
            litdata_skip = f"{type(error).__name__}: {error}".splitlines()[0]
            if isinstance(error, ImportError):
                litdata_skip += " (pip install litdata; --no-deps if it would replace torch)"
            say(f"{workload}: LitData skipped: {litdata_skip}")
        _SOURCES.clear()

    table: list[dict] = []

    def record(reader: str, shard_rows: Any, workers: int, run: Callable[[], dict],
               uss_base: int) -> None:
        say(f"{workload}: {reader}" + (f" shard_rows={shard_rows}" if shard_rows else "")
            + f", workers={workers}" + (f", round {round_ + 1}" if args.rounds > 1 else ""))
        try:
            result = run()
        except Exception as error:  # noqa: BLE001 - one reader failing must not hide the rest
            traceback.print_exc()
            table.append({"workload": workload, "reader": reader, "shard_rows": shard_rows,
                          "workers": workers, "skipped": f"{type(error).__name__}: {error}"})
            return
        result.update(workload=workload, reader=reader, shard_rows=shard_rows, workers=workers,
                      uss_of=uss_base, round=round_)
        table.append(result)
        say(f"{workload}:   epoch 1 {result['cold']:,.0f}/s, epoch 2 {result['warm']:,.0f}/s"
            + (f", USS {result['uss'] / 1e6:,.0f} MB" if workers or ranks > 1 else ""))

    ranks = args.ranks
    for round_ in range(args.rounds):  # interleaved: every reader once a round
        for workers in args.workers:
            if "limit" in readers:
                def open_limit(rank: int = 0, world: int = 1) -> tuple[Any, Callable[[], None]]:
                    return (torch_loader(MemmapRows(source, workload), workers, rank, world),
                            lambda: None)
                record("limit", "", workers, lambda: measure(
                    [source / "values.npy", source / "offsets.npy"], open_limit, workload, workers,
                    args.max_batches, ranks), info["cache_bytes"])
            for shard_rows, cache in caches.items():
                cache_bytes = info["bytes"][f"precache shard_rows={shard_rows}"]
                for reader in ("precache", "budget"):
                    if reader not in readers:
                        continue
                    budget = cache_bytes // 20 if reader == "budget" else 1 << 30

                    def open_precache(rank: int = 0, world: int = 1, cache: Path = cache,
                                      budget: int = budget) -> tuple[Any, Any]:
                        from precache.loading import CachedDataset, make_loader

                        dataset = CachedDataset(cache, columns=[column], max_decoded_bytes=budget)
                        return (make_loader(dataset, BATCH, shuffle=True, num_workers=workers,
                                            rank=rank, world_size=world), dataset.close)

                    from precache.cli.bench.measure import shard_paths

                    record(reader, shard_rows, workers, lambda: measure(
                        shard_paths(str(cache)), open_precache, workload, workers,
                        args.max_batches, ranks), cache_bytes)
            if ranks > 1 and ("litdata" in readers or "hf" in readers):
                say(f"{workload}: LitData and HF are not run with --ranks")
                continue
            if "litdata" in readers:
                if litdata_skip is not None:
                    table.append({"workload": workload, "reader": "litdata", "shard_rows": "",
                                  "workers": workers, "skipped": litdata_skip})
                else:
                    def open_litdata() -> tuple[Any, Callable[[], None]]:
                        from litdata import StreamingDataLoader, StreamingDataset

                        dataset = StreamingDataset(str(lit_dir), shuffle=True, seed=0)
                        collate = (litdata_collate_tokens if workload == "tokens"
                                   else litdata_collate_jpeg)
                        options = (dict(persistent_workers=True, worker_init_fn=_pin)
                                   if workers else {})
                        return StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers,
                                                   collate_fn=collate, **options), lambda: None
                    record("litdata", "", workers, lambda: measure(
                        folder_files(lit_dir), open_litdata, workload, workers, args.max_batches),
                        info["cache_bytes"])
            if "hf" in readers:
                def open_hf() -> tuple[Any, Callable[[], None]]:
                    return torch_loader(HFRows(hf_dir, workload), workers), lambda: None
                record("hf", "", workers, lambda: measure(
                    folder_files(hf_dir), open_hf, workload, workers, args.max_batches),
                    info["cache_bytes"])
    return combine(table, args.rounds), info


# --- report -----------------------------------------------------------------------------------


def combine(table: list[dict], rounds: int) -> list[dict]:
    """With ``--rounds`` > 1, one row per reader: the median of each measure over the rounds,
    and ``cold_ratio`` / ``warm_ratio``, the median of each round's ratio to that round's limit
    (the machine's load changes between rounds, not within one). A reader that failed in
    any round shows its first failure."""
    if rounds <= 1:
        return table
    limits = {(r["workload"], r["workers"], r["round"]): r for r in table
              if r["reader"] == "limit" and "skipped" not in r}
    out: dict[tuple, list[dict]] = {}
    for r in table:
        out.setdefault((r["workload"], r["reader"], r["shard_rows"], r["workers"]), []).append(r)
    merged = []
    for runs in out.values():
        failed = [r for r in runs if "skipped" in r]
        if failed:
            merged.append(failed[0])
            continue
        row = dict(runs[0])
        for key in ("cold", "warm", "first", "uss", "uss_files"):
            if key in row:
                row[key] = float(np.median([r[key] for r in runs]))
        for key in ("cold", "warm"):
            ratios = [r[key] / limits[(r["workload"], r["workers"], r["round"])][key]
                      for r in runs if (r["workload"], r["workers"], r["round"]) in limits]
            if ratios:
                row[f"{key}_ratio"] = float(np.median(ratios))
                row[f"{key}_ratios"] = [round(x, 3) for x in ratios]
        row["sums"] = [s for r in runs for s in r["sums"]]
        merged.append(row)
    return merged



def check(row: dict, limit: dict | None, rows: int, cut: bool) -> str:
    """Whether both epochs read every row once, with the limit's sums."""
    if cut:
        return "-"
    for sums in row["sums"]:
        if sums[0] != rows or (limit is not None and sums != limit["sums"][0]):
            return f"MISMATCH {sums}"
    return "ok"


def report(table: list[dict], infos: list[dict], args: argparse.Namespace) -> str:
    lines = []
    for info in infos:
        w = info["workload"]
        lines.append(f"{w}: {info['rows']:,} rows, {info['raw_bytes'] / 1e6:,.1f} MB of "
                     + ("ids at uint16" if w == "tokens" else "JPEG bytes (q95, 4:4:4)")
                     + f" ({info['raw_bytes'] / info['rows']:,.0f} B/row)")
        for name, size in info["bytes"].items():
            made = info["write_s"].get(name)
            lines.append(f"  {name:<28} {size / 1e6:10,.1f} MB on disk = "
                         f"{size / info['raw_bytes']:.3f}x the raw "
                         + ("ids" if w == "tokens" else "JPEGs")
                         + (f"; written in {made:,.1f}s" if made is not None else "; reused"))
    lines.append("")
    lines.append(f"batch {BATCH}, full shuffle (LitData: its own chunk-wise shuffle), samples/s; "
                 "ratios to the limit with the same workers in this run"
                 + (f"; {args.ranks} ranks on this node, all ranks' samples/s, USS of the ranks "
                    "and their workers" if args.ranks > 1 else "")
                 + (f"; epochs cut after {args.max_batches} batches" if args.max_batches else "")
                 + (f"; medians of {args.rounds} interleaved rounds (ratios: the median of each "
                    "round's ratio)" if args.rounds > 1 else ""))
    header = (f"{'workload':<8} {'reader':<9} {'shards':>6} {'wk':>2} {'epoch 1 cold':>13} "
              f"{'/limit':>6} {'epoch 2 warm':>13} {'/limit':>6} {'workers USS (files)':>26} "
              f"{'1st batch':>9} check")
    lines += [header, "-" * len(header)]
    limits = {(r["workload"], r["workers"]): r for r in table
              if r["reader"] == "limit" and "skipped" not in r}
    rows_of = {info["workload"]: info["rows"] for info in infos}
    for r in table:
        lead = (f"{r['workload']:<8} {r['reader']:<9} {str(r['shard_rows']):>6} "
                f"{r['workers']:>2} ")
        if "skipped" in r:
            lines.append(lead + f"skipped: {r['skipped']}")
            continue
        limit = limits.get((r["workload"], r["workers"]))
        cold_ratio = f"{r.get('cold_ratio', r['cold'] / limit['cold']):.2f}" if limit else "-"
        warm_ratio = f"{r.get('warm_ratio', r['warm'] / limit['warm']):.2f}" if limit else "-"
        uss = (f"{r['uss'] / 1e6:,.0f} MB {r['uss'] / r['uss_of']:4.0%} "
               f"({r['uss_files'] / r['uss_of']:4.0%})" if r["workers"] or r.get("ranks")
               else "-")
        lines.append(lead + f"{r['cold']:>11,.0f}/s {cold_ratio:>6} {r['warm']:>11,.0f}/s "
                     f"{warm_ratio:>6} {uss:>26} {r['first'] * 1e3:>7,.0f}ms "
                     + check(r, limit, rows_of[r["workload"]], bool(args.max_batches)))
    lines.append("workers USS: all workers' Private_Clean + Private_Dirty after epoch 2 (their "
                 "own heap and interpreter included, and any page of a mapped file that only one "
                 "worker touched), as a % of the bytes of the precache cache (in brackets: the "
                 "Private_Clean part alone, file pages only that worker maps; its own shard_rows; "
                 "other readers: the first); 1st batch: from opening the loader (cold: files "
                 "out of the page cache) to its first batch, worker start included")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    def names(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
        def parse(text: str) -> list[str]:
            got = [x for x in text.split(",") if x]
            wrong = [x for x in got if x not in choices]
            if wrong:
                raise argparse.ArgumentTypeError(f"{wrong}: choose from {','.join(choices)}")
            return got
        return parse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=names(("tokens", "jpeg")), default=["tokens", "jpeg"])
    parser.add_argument("--docs", type=int, default=200_000, help="token documents")
    parser.add_argument("--images", type=int, default=20_000, help="JPEG crops")
    parser.add_argument("--shard-rows", type=ints, default=[256, 8192],
                        help="stage-1 shard_rows, one cache each (comma-separated)")
    parser.add_argument("--workers", type=ints, default=[0, 2], help="DataLoader workers")
    parser.add_argument("--readers", default=["limit", "precache", "budget", "litdata", "hf"],
                        type=names(("limit", "precache", "budget", "litdata", "hf")))
    parser.add_argument("--stage1-workers", type=int, default=min(os.cpu_count() or 1, 8),
                        help="stage-1 worker processes (default: the cores)")
    parser.add_argument("--ranks", type=int, default=1,
                        help="processes (ranks) on this node, each reading its share")
    parser.add_argument("--max-batches", type=int, default=None,
                        help="cut each epoch after this many batches (caches past RAM)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to build (default: a temporary folder)")
    parser.add_argument("--rows-per-record", type=int, default=1,
                        help="tokens: documents per stage-1 input record (one row each); "
                        "--shard-rows stays in rows. Stage 1 of tens of millions of one-row "
                        "records pays its per-input costs that many times: for caches past RAM")
    parser.add_argument("--keep", action="store_true", help="keep what this run built")
    parser.add_argument("--reuse", action="store_true",
                        help="use files an earlier --keep run left in --dir")
    parser.add_argument("--warm-epochs", type=int, default=1,
                        help="warm epochs after each cold one, their median reported (one "
                        "process, torch DataLoader or make_loader: --ranks runs one)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every reader this many times, in turn, and report medians "
                        "(each round: a cold and a warm epoch of each reader)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    WARM_EPOCHS[0] = max(1, args.warm_epochs)
    multiprocessing.set_start_method("fork", force=True)  # the DataLoaders' workers
    temporary = args.dir is None or not args.dir.exists()  # then all of it is this run's
    work = Path(tempfile.mkdtemp(prefix="bench-varlen-")) if args.dir is None else args.dir
    work.mkdir(parents=True, exist_ok=True)
    built: list[Path] = []
    table: list[dict] = []
    infos: list[dict] = []
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    say(f"building under {work}; RAM {ram / 2**30:.1f} GiB, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.2f}; readers {','.join(args.readers)}, workers {args.workers}, "
        f"shard_rows {args.shard_rows}")
    try:
        for workload in args.workload:
            rows = args.docs if workload == "tokens" else args.images
            part, info = run_workload(workload, rows, args, work, built)
            table += part
            infos.append(info)
        say(f"done; load average {os.getloadavg()[0]:.2f} (other processes skew the rates)")
        text = report(table, infos, args)
        print("\n" + text, flush=True)
        if args.json:
            args.json.write_text(json.dumps({"args": vars(args), "sizes": infos,
                                             "results": table}, indent=1, default=str))
    finally:
        if not args.keep:
            if temporary:
                shutil.rmtree(work, ignore_errors=True)
            else:
                for path in built:
                    shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
