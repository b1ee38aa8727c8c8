"""Stage-2 benchmark: what ``make_loader`` over a cache delivers, against a limit and a baseline.

``precache bench CACHE`` calls ``bench_loader`` and prints ``format_report``. Measured in one run,
with one thread per library per process (``threads_pinned``; workers pin themselves):

- **cached**: samples/s a training loop receives from ``make_loader(CachedDataset(cache,
  columns), batch_size, shuffle=True, num_workers=w)`` (default collate, persistent workers),
  for each ``w``. Epoch 1 (worker start, shards opened and decoded) and the later epochs
  ("ep2+": samples over seconds of epochs 2..n, i.e. their harmonic mean) are reported apart.
- **the limit**: a NumPy memmap gather of the same bytes, every column asked for. Exported
  once (untimed, ``export_columns``) to a temporary folder and memory-mapped: a fixed-shape
  column (``ndarray``, ``scalar``) as one ``.npy`` of ``(rows, *shape)``; a variable-length one
  (``ragged``, ``bytes``, ``str``) as a flat values ``.npy`` (ragged values at their own dtype,
  the raw bytes of bytes and str) and an int64 offsets ``.npy`` of ``rows + 1``, as the shard
  stores it. A ``DataLoader`` (no workers, shuffled, the same batch size) reads them through one
  dataset (``GatherRows``) whose ``__getitems__`` is one ``np.take`` per fixed-shape column and,
  per variable-length column, a list of one slice ``values[offsets[i]:offsets[i + 1]]`` per row
  (a 1-D view for ragged, ``bytes``, ``str(..., 'utf-8')`` for str), as ``CachedDataset``
  hands them out; an encoded image column (JPEG/WebP, stage 1's ``encode_image``) is decoded
  row by row with precache's own ``decode_image`` into one preallocated ``(n, h, w, 3)`` uint8
  array. Arrays become tensors, lists stay lists. Measured at the start and at the end, the
  faster kept (noise only slows).
- **cold epoch 1**: before epoch 1 of every cached and limit setting, the files it reads (the
  shards; the limit's ``.npy`` files, values and offsets included) are dropped from the page
  cache (``drop_page_cache``: ``posix_fadvise(DONTNEED)``), so epoch 1 reads from disk, as the
  first epoch of a job on a fresh node or any epoch of a cache larger than RAM does; the later
  epochs are warm.
- **per-file**: the classic loader. Every cached ``image`` is written once (untimed) as its own
  file (JPEG quality 95 by default, or PNG; an encoded ``image`` is decoded first), and a
  ``Dataset`` whose ``__getitem__`` is ``cv2.imread`` + ``cvtColor`` -> tensor is read by a
  ``DataLoader`` with the same batch size, workers, shuffle, persistent workers and default
  collate. It yields images only.
- **batch sizes**: 64, 256 and 1024 (those not above the row count) and the given batch size, at
  the recommended number of workers (the best cached ep2+ rate).
- **worker memory**: ``VmRSS`` and ``RssAnon`` from ``/proc/PID/status``, and USS and PSS from
  ``/proc/PID/smaps_rollup``, of each DataLoader worker after every epoch (pids from the
  loader's persistent iterator): memory stays flat, and PSS shows the mapped shards shared.
- **size**: the cache on disk and the columns asked for as the limit reads them (fixed-shape
  columns whole, variable-length ones as stored: their values, encoded images encoded), against
  ``MemTotal``.

Every setting runs epoch 1, then more epochs for about ``seconds``. A long epoch is cut (its rate
is then over the batches it delivered): a baseline's after ``seconds`` (its rate is steady from
the first batches on), a cached loader's only after ``CACHED_CUT`` x ``seconds``, since its epoch
1 starts cold (see above) and opens the shards.

On 2 cores, workers can be slower than the main process for cached data: every batch is copied
through shared memory and the processes share the cores. Measure, don't assume. ``VmRSS`` counts
the pages of the memory-mapped shards a worker has touched, which the page cache shares among
processes; ``RssAnon`` is the worker's own memory (decoded string and ragged columns among it).
USS counts the mapped pages only this worker has touched, so it falls as the workers' epochs
overlap; PSS divides shared pages among the processes that map them.

Parts: ``measure`` (timing epochs of one loader setting: the cached loader, the per-file
baseline, the NumPy gather limit: ``GatherRows`` over arrays and ``FlatColumn`` s),
``compare`` (``bench_loader``: export the baselines' data once with ``export_columns``, run every
setting, pick the recommendation) and ``report`` (``format_report``).
"""

from precache.cli.bench.compare import BATCH_SIZES, FILE_FORMATS, bench_loader, export_columns
from precache.cli.bench.measure import (CACHED_CUT, FlatColumn, GatherRows, Rates,
                                        default_worker_counts, drop_page_cache, measure_cached,
                                        measure_gather, measure_per_file)
from precache.cli.bench.report import format_report

__all__ = ["bench_loader", "format_report", "default_worker_counts", "drop_page_cache",
           "measure_cached",
           "measure_per_file", "measure_gather", "Rates", "BATCH_SIZES", "FILE_FORMATS",
           "CACHED_CUT", "export_columns", "FlatColumn", "GatherRows"]
