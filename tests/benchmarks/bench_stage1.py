"""Stage-1 throughput benchmark: bare ops vs ``precache.run`` with 1 and 2 workers, and re-runs.

    .venv/bin/python tests/benchmarks/bench_stage1.py [--count N] [--repeat R]

What it measures, on a generated sample set (``data/make_samples.py``) in a temporary folder:

- ``bare_1``: the ``images`` pipeline's ops run in sequence in this process (read bytes, decode,
  resize/crop), with no runner at all: the ceiling for one process.
- ``bare_2`` (for information): the same ops in two already-started processes, each taking every
  other file: what this machine gives two processes with no runner and no start-up. On a shared
  VM it is often well under 2 x bare_1, which then caps the workers=2 ratio whatever the runner does.
- ``run workers=1`` / ``run workers=2``: ``precache.run`` into a fresh cache, wall time from the
  call (so it includes listing, worker start-up, hashing, shard writing and publishing).
  Goals: workers=1 >= 0.95 x bare_1; workers=2 >= 0.90 x 2 x bare_1.
- incremental re-runs: a full workers=2 run builds a cache, then the same command is re-run with no
  change, and again after 1% of the inputs were rewritten with other content (flipped and
  re-saved). Goal: the 1% re-run takes < 5% of the full run's time and computes only the changed
  inputs. The changed files are one per 1% slice of the key order (so they fall in different
  shards, like scattered edits), each the file of its slice whose op time is closest to the mean,
  so that their compute is about 1% of the total and the re-run measures the runner, not one huge
  picture. Their bare op time is reported as the floor.

Each measurement is repeated ``--repeat`` times, interleaved (bare, w1, w2, bare, w1, w2, ...), and
the best (shortest) time is kept, since a noisy machine only ever makes things slower. Compare the
ratios, which are measured within one run, rather than absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import multiprocessing
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # spawn-started workers inherit sys.path, so they find it too

import precache  # noqa: E402
from precache.processing import RunSummary  # noqa: E402
from precache.processing.sources import list_inputs  # noqa: E402
from precache.pipelines.images.pipeline import pipeline  # noqa: E402
from precache.threads import pin_threads  # noqa: E402

SHARD_ROWS: int | None = None  # None: precache's default (at least 32 shards for small runs)
GOAL_W1 = 0.95
GOAL_W2 = 0.90
GOAL_INCREMENTAL = 0.05
CHANGED_FRACTION = 0.01


def _quiet(*_: Any) -> None:
    pass


def load_make_samples() -> Callable[..., int]:
    """``make_samples`` from ``data/make_samples.py`` (``data/`` is not a package)."""
    path = ROOT / "data" / "make_samples.py"
    spec = importlib.util.spec_from_file_location("precache_bench_make_samples", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_samples


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


@dataclass
class Timing:
    wall_s: float
    computed: int
    bytes_written: int = 0

    @property
    def samples_per_s(self) -> float:
        return self.computed / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes_written / 1e6 / self.wall_s if self.wall_s > 0 else 0.0


class BareOps:
    """The pipeline's ops, set up once in this process, run over every input in sequence."""

    def __init__(self, paths: list[tuple[str, str]]) -> None:
        pin_threads()
        self.ops = pipeline.build_ops(pipeline.resolve_params())
        for op in self.ops:
            op.setup()
        self.paths = paths

    def run_one(self, key: str, path: str) -> None:
        with open(path, "rb") as f:
            data = f.read()
        sample: Any = {"key": key, "source_key": key, "source_hash": "", "locator": path,
                       "data": data}
        for op in self.ops:
            sample = op(sample)

    def measure(self, paths: list[tuple[str, str]] | None = None) -> Timing:
        paths = self.paths if paths is None else paths
        start = time.perf_counter()
        for key, path in paths:
            self.run_one(key, path)
        return Timing(time.perf_counter() - start, len(paths))

    def per_file(self) -> dict[str, float]:
        """Seconds of op time for each input (one pass)."""
        times = {}
        for key, path in self.paths:
            start = time.perf_counter()
            self.run_one(key, path)
            times[key] = time.perf_counter() - start
        return times


_pool_bare: BareOps | None = None


def _pool_init(paths: list[tuple[str, str]]) -> None:
    global _pool_bare
    _pool_bare = BareOps(paths)


def _pool_part(part: tuple[int, int]) -> float:
    """Run the ops over every ``n``-th input from ``k`` in this pool process; return its time."""
    assert _pool_bare is not None
    k, n = part
    return _pool_bare.measure(_pool_bare.paths[k::n]).wall_s


class BareOps2:
    """The ops in two already-started (spawn) processes, each taking every other input."""

    def __init__(self, paths: list[tuple[str, str]]) -> None:
        context = multiprocessing.get_context("spawn")
        self.pool = context.Pool(2, initializer=_pool_init, initargs=(paths,))
        self.count = len(paths)
        self.pool.map(_pool_part, [(0, 2), (1, 2)])  # start both, warm up

    def measure(self) -> Timing:
        start = time.perf_counter()
        self.pool.map(_pool_part, [(0, 2), (1, 2)], chunksize=1)
        return Timing(time.perf_counter() - start, self.count)

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


def measure_run(input_dir: Path, output: Path, workers: int) -> tuple[Timing, RunSummary]:
    start = time.perf_counter()
    summary = precache.run(pipeline, input_dir, output, workers=workers, progress=False,
                           shard_rows=SHARD_ROWS, log=_quiet)
    wall = time.perf_counter() - start
    if summary.failed:
        raise SystemExit(f"benchmark run had {summary.failed} failed inputs: "
                         f"{summary.failures[:3]}")
    return Timing(wall, summary.computed, summary.shard_bytes_written), summary


def choose_changed(keys: list[str], cost: dict[str, float], fraction: float) -> list[str]:
    """One key per ``fraction`` slice of the sorted keys (so they fall in different shards): the
    one whose op time is closest to the mean, so the changed files cost ~``fraction`` of the work."""
    n = max(1, round(len(keys) * fraction))
    mean = sum(cost.values()) / len(cost)
    bounds = [round(i * len(keys) / n) for i in range(n + 1)]
    return [min(keys[a:b], key=lambda k: abs(cost[k] - mean)) for a, b in zip(bounds, bounds[1:])]


def change_inputs(input_dir: Path, keys: list[str], salt: int) -> None:
    """Rewrite the inputs ``keys`` with other content: flipped left-right and re-saved in the
    same format (JPEG at another quality)."""
    from PIL import Image, ImageOps

    for key in keys:
        path = input_dir / key
        old = path.read_bytes()
        with Image.open(path) as image:
            image.load()
            fmt = image.format
            flipped = ImageOps.mirror(image.convert("RGB"))
        if fmt == "JPEG":
            flipped.save(path, format="JPEG", quality=60 + salt % 30)
        else:
            flipped.save(path, format=fmt)
        if hashlib.blake2b(path.read_bytes()).digest() == hashlib.blake2b(old).digest():
            raise SystemExit(f"rewriting {path} did not change its bytes")


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[list[str]], markdown: bool = False,
           left: tuple[int, ...] = (0,)) -> str:
    """A plain or Markdown table; columns not in ``left`` are right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    right = [i not in left for i in range(len(headers))]

    def fmt(cells: list[str]) -> str:
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return ("| " + " | ".join(parts) + " |") if markdown else "  ".join(parts)

    lines = [fmt(headers)]
    if markdown:
        lines.append("| " + " | ".join(("-" * (w - 1) + ":") if r else "-" * w
                                        for w, r in zip(widths, right)) + " |")
    else:
        lines.append("  ".join("-" * w for w in widths))
    lines.extend(fmt(r) for r in rows)
    return "\n".join(lines)


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=1600, help="sample images (default 1600)")
    parser.add_argument("--shard-rows", type=int, default=None,
                        help="inputs per shard (default: precache's own default)")
    parser.add_argument("--repeat", type=int, default=3, help="repeats per measurement (best kept)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="work in this folder and keep it (default: a temporary folder)")
    args = parser.parse_args()
    global SHARD_ROWS
    SHARD_ROWS = args.shard_rows
    if args.count < 2 or args.repeat < 1:
        parser.error("--count must be >= 2 and --repeat >= 1")

    tmp_ctx = tempfile.TemporaryDirectory(prefix="precache-bench-") if args.keep is None else None
    work = Path(tmp_ctx.name) if tmp_ctx is not None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _bench(work, args.count, args.repeat)
    finally:
        if tmp_ctx is not None:
            tmp_ctx.cleanup()


def _bench(work: Path, count: int, repeat: int) -> int:
    samples = work / "samples"
    t0 = time.perf_counter()
    shutil.rmtree(samples, ignore_errors=True)
    load_make_samples()(samples, count)
    inputs = list_inputs(samples, pipeline.extensions)
    input_bytes = sum(i.size for i in inputs)
    print(f"precache stage-1 benchmark: {len(inputs)} images ({input_bytes / 1e6:.1f} MB) made in "
          f"{time.perf_counter() - t0:.1f} s under {work}")
    print(f"python {sys.version.split()[0]}, cores available: {precache.processing.stage1_workers()}, "
          f"shard_rows={SHARD_ROWS or 'default'}, repeats={repeat} (best kept, interleaved)\n")

    paths = [(i.key, i.locator) for i in inputs]
    bare = BareOps(paths)
    cost = bare.per_file()  # also the warm-up: page cache, lazy library initialisation
    bare2 = BareOps2(paths)

    results: dict[str, list[Timing]] = {"bare_1": [], "bare_2": [], "w1": [], "w2": []}
    print("repeat  bare_1 s  bare_2 s     w1 s     w2 s")
    try:
        for r in range(repeat):
            results["bare_1"].append(bare.measure())
            results["bare_2"].append(bare2.measure())
            for workers in (1, 2):
                out = work / f"cache-w{workers}-{r}"
                timing, _ = measure_run(samples, out, workers)
                results[f"w{workers}"].append(timing)
                shutil.rmtree(out)
            print(f"{r + 1:>6}  " + " ".join(f"{results[k][-1].wall_s:8.2f}" for k in results),
                  flush=True)
    finally:
        bare2.close()

    best = {name: min(ts, key=lambda t: t.wall_s) for name, ts in results.items()}
    bare_rate = best["bare_1"].samples_per_s
    ratio_w1 = best["w1"].samples_per_s / bare_rate
    ratio_w2 = best["w2"].samples_per_s / (2 * bare_rate)
    ratio_bare2 = best["bare_2"].samples_per_s / (2 * bare_rate)
    ratio_w2_bare2 = best["w2"].samples_per_s / best["bare_2"].samples_per_s
    changed = choose_changed([i.key for i in inputs], cost, CHANGED_FRACTION)
    floor = min(bare.measure([(k, str(samples / k)) for k in changed]).wall_s
                for _ in range(repeat))

    # Incremental re-runs: full run, no-change re-run, 1%-changed re-run; fresh copy each repeat.
    # Per repeat: (full, no-change, 1%-changed, computed, changed, rewritten shards).
    inc: list[tuple[Timing, Timing, Timing, int, int, int]] = []
    print("\nrepeat  full w2 s  no-change s  1%-changed s  computed/changed  rewritten shards")
    for r in range(repeat):
        src = work / f"inc-samples-{r}"
        cache = work / f"inc-cache-{r}"
        shutil.copytree(samples, src)
        full, _ = measure_run(src, cache, 2)
        same, same_summary = measure_run(src, cache, 2)
        if same_summary.computed != 0:
            raise SystemExit(f"a no-change re-run computed {same_summary.computed} inputs")
        change_inputs(src, changed, salt=r)
        again, summary = measure_run(src, cache, 2)
        inc.append((full, same, again, summary.computed, len(changed), summary.rewritten_shards))
        print(f"{r + 1:>6}  {full.wall_s:9.2f}  {same.wall_s:11.3f}  {again.wall_s:12.3f}  "
              f"{summary.computed:>8}/{len(changed):<7}  {summary.rewritten_shards:>16}",
              flush=True)
        shutil.rmtree(src)
        shutil.rmtree(cache)

    # Fractions are per repeat (each re-run against its own full run), best kept.
    frac_change = min(a.wall_s / f.wall_s for f, _, a, *_ in inc)
    frac_same = min(s.wall_s / f.wall_s for f, s, *_ in inc)
    best_full = min((row[0] for row in inc), key=lambda t: t.wall_s)
    best_same = min((row[1] for row in inc), key=lambda t: t.wall_s)
    best_change = min((row[2] for row in inc), key=lambda t: t.wall_s)
    computed_ok = all(c == e for _, _, _, c, e, _ in inc)
    floor_frac = floor / best_full.wall_s
    n_changed = inc[0][4]

    print("\nDetail (best of each):")
    rows = [
        ["bare ops, 1 process", f"{best['bare_1'].wall_s:.2f}", f"{bare_rate:.1f}", "-", "-"],
        ["bare ops, 2 started processes", f"{best['bare_2'].wall_s:.2f}",
         f"{best['bare_2'].samples_per_s:.1f}", "-", f"{ratio_bare2:.3f} of 2 x bare_1"],
        ["precache.run workers=1", f"{best['w1'].wall_s:.2f}", f"{best['w1'].samples_per_s:.1f}",
         f"{best['w1'].mb_per_s:.1f}", f"{ratio_w1:.3f} of bare_1"],
        ["precache.run workers=2", f"{best['w2'].wall_s:.2f}", f"{best['w2'].samples_per_s:.1f}",
         f"{best['w2'].mb_per_s:.1f}",
         f"{ratio_w2:.3f} of 2 x bare_1, {ratio_w2_bare2:.3f} of bare_2"],
        ["full run for re-runs (w=2)", f"{best_full.wall_s:.2f}",
         f"{best_full.samples_per_s:.1f}", f"{best_full.mb_per_s:.1f}", "-"],
        ["re-run, no change", f"{best_same.wall_s:.3f}", "-", "-",
         f"{frac_same:.1%} of full run"],
        [f"re-run, {n_changed} changed ({CHANGED_FRACTION:.0%})", f"{best_change.wall_s:.3f}", "-",
         f"{best_change.mb_per_s:.1f}", f"{frac_change:.1%} of full run"],
        [f"  floor: bare ops on those {n_changed}", f"{floor:.3f}", "-", "-",
         f"{floor_frac:.1%} of full run"],
    ]
    print(_table(["measurement", "wall s", "samples/s", "MB/s written", "ratio"], rows,
                 left=(0, 4)))
    print(f"changed files: {', '.join(changed)}")
    print(f"1%-changed re-runs computed exactly the changed inputs: "
          f"{'yes' if computed_ok else 'NO'} ({', '.join(f'{c}/{e}' for *_, c, e, _ in inc)})")

    print(f"\nSummary ({len(inputs)} images, {precache.processing.stage1_workers()} cores, "
          f"best of {repeat}):\n")
    md = [
        ["bare ops, 1 process (bare_1)", f"{bare_rate:.1f}", "1.000", "reference"],
        ["bare ops, 2 started processes (bare_2)", f"{best['bare_2'].samples_per_s:.1f}",
         f"{ratio_bare2:.3f}", "none (this machine's 2-process ceiling)"],
        ["`precache.run`, workers=1", f"{best['w1'].samples_per_s:.1f}", f"{ratio_w1:.3f}",
         f">= {GOAL_W1:.2f} x bare_1 ({_verdict(ratio_w1 >= GOAL_W1)})"],
        ["`precache.run`, workers=2", f"{best['w2'].samples_per_s:.1f}", f"{ratio_w2:.3f}",
         f">= {GOAL_W2:.2f} x 2 x bare_1 ({_verdict(ratio_w2 >= GOAL_W2)})"],
        [f"re-run, {CHANGED_FRACTION:.0%} of inputs changed ({n_changed} computed)", "-",
         f"{frac_change:.1%}",
         f"< {GOAL_INCREMENTAL:.0%} of full run "
         f"({_verdict(frac_change < GOAL_INCREMENTAL and computed_ok)})"],
        ["re-run, no change", "-", f"{frac_same:.1%}", "(of full run)"],
    ]
    print(_table(["measurement", "samples/s", "ratio", "goal"], md, markdown=True, left=(0, 3)))
    met = ratio_w1 >= GOAL_W1 and ratio_w2 >= GOAL_W2 and frac_change < GOAL_INCREMENTAL \
        and computed_ok
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
