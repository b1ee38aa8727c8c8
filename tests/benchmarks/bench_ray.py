"""Stage 1 on Ray vs the local executor: the same faces run with 2 workers each.

    .venv/bin/python tests/benchmarks/bench_ray.py [--count 300] [--repeat 2] [--keep DIR]

What it measures, on the first ``--count`` pictures of the generated face sample set
(``data/make_samples.py``, in a temporary folder), with the ``faces`` pipeline at ``size=128``
(MTCNN and MediaPipe per picture, so the per-input work is real):

- ``local``: ``precache.run(..., workers=2)`` into a fresh cache, wall time of the call (listing,
  starting the second worker process, loading the models, the work, writing shards, publishing).
- ``ray start-up``: ``ray.init`` of a local Ray with 2 CPUs (as ``--executor ray`` without
  ``--address`` does), timed on its own, since a cluster is usually started once for many runs.
- ``ray``: ``precache.run(..., executor="ray", workers=2)`` on that Ray into a fresh cache, wall
  time of the call: like ``local``, it includes starting the two actors and loading their models.
  Ray's own processes (GCS, raylet, agents) share the 2 cores with the actors.

Goal: ``ray`` at most 15% slower than ``local`` (inputs/s ratio >= 0.85). Per repeat: a local run
with no Ray running, then Ray is started, a Ray run, and Ray is stopped; the best (shortest) of
``--repeat`` is kept for each, since a noisy machine only ever slows. Both caches must hold the
same shards (checksums), which the script checks.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the actors get this process's import path

import precache  # noqa: E402
from precache.processing import RunSummary  # noqa: E402
from precache import Cache  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_stage1 import _table, load_make_samples  # noqa: E402  (a sibling script)

PARAMS = {"size": 128}
WORKERS = 2
GOAL_RATIO = 0.85


def _quiet(*_: object) -> None:
    pass


def timed_run(samples: Path, output: Path, executor: str) -> tuple[float, RunSummary]:
    shutil.rmtree(output, ignore_errors=True)
    start = time.perf_counter()
    summary = precache.run("faces", samples, output, params=PARAMS, workers=WORKERS,
                           executor=executor, progress=False, log=_quiet)
    return time.perf_counter() - start, summary


def shards(cache: Path) -> list[tuple[str, int, str]]:
    return [(s.path, s.rows, s.checksum) for s in Cache(cache).manifest.shards]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=300,
                        help="face sample pictures (default 300, the quick start's set)")
    parser.add_argument("--repeat", type=int, default=2, help="repeats (best kept, default 2)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="work in this folder and keep it (default: a temporary folder)")
    args = parser.parse_args()
    if args.count < 2 or args.repeat < 1:
        parser.error("--count must be >= 2 and --repeat >= 1")
    import ray

    tmp = tempfile.TemporaryDirectory(prefix="precache-bench-ray-") if args.keep is None else None
    work = Path(tmp.name) if tmp is not None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    ray_temp = tempfile.mkdtemp(prefix="pcray-")  # Ray's session files; a short path for sockets
    try:
        samples = work / "samples"
        shutil.rmtree(samples, ignore_errors=True)
        load_make_samples()(samples, args.count)
        print(f"precache Ray benchmark: faces pipeline ({PARAMS}), {args.count} pictures, "
              f"{WORKERS} workers, {precache.processing.stage1_workers()} cores, ray "
              f"{ray.__version__}, best of {args.repeat}\n")
        print("repeat  local s  ray start s  ray s  ray stop s")
        local_s, start_s, ray_s, stop_s = [], [], [], []
        for r in range(args.repeat):
            t_local, local = timed_run(samples, work / "cache-local", "local")
            t0 = time.perf_counter()
            ray.init(address="local", num_cpus=WORKERS, include_dashboard=False,
                     logging_level=logging.WARNING, _temp_dir=ray_temp)
            t_start = time.perf_counter() - t0
            t_ray, on_ray = timed_run(samples, work / "cache-ray", "ray")
            t0 = time.perf_counter()
            ray.shutdown()
            t_stop = time.perf_counter() - t0
            if shards(work / "cache-local") != shards(work / "cache-ray"):
                raise SystemExit("the local and Ray caches differ")
            counts = [(s.ok, s.skipped, s.failed) for s in (local, on_ray)]
            if counts[0] != counts[1]:
                raise SystemExit(f"counts (ok, skipped, failed) differ: local {counts[0]}, "
                                 f"ray {counts[1]}")
            for values, value in ((local_s, t_local), (start_s, t_start), (ray_s, t_ray),
                                  (stop_s, t_stop)):
                values.append(value)
            print(f"{r + 1:>6}  {t_local:7.2f}  {t_start:11.2f}  {t_ray:5.2f}  {t_stop:10.2f}",
                  flush=True)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(ray_temp, ignore_errors=True)
        if tmp is not None:
            tmp.cleanup()

    best_local, best_ray = min(local_s), min(ray_s)
    ratio = best_local / best_ray  # Ray's inputs/s over the local executor's
    one_shot = best_ray + min(start_s) + min(stop_s)
    verdict = "met" if ratio >= GOAL_RATIO else "MISSED"
    print(f"\nboth caches hold the same shards (checksums) in every repeat: {local.ok} ok, "
          f"{local.skipped} skipped (no face), {local.failed} failed")
    rows = [
        ["local executor, 2 workers", f"{best_local:.2f}", f"{args.count / best_local:.2f}",
         "1.000", "reference"],
        ["Ray executor, 2 actors", f"{best_ray:.2f}", f"{args.count / best_ray:.2f}",
         f"{ratio:.3f}", f">= {GOAL_RATIO:.2f} x local ({verdict})"],
        ["Ray start-up (local, 2 CPUs)", f"{min(start_s):.2f}", "-", "-", "once per cluster"],
        ["Ray shutdown", f"{min(stop_s):.2f}", "-", "-", "-"],
        ["Ray incl. start-up and shutdown", f"{one_shot:.2f}", f"{args.count / one_shot:.2f}",
         f"{best_local / one_shot:.3f}", "one `--executor ray` run without --address"],
    ]
    print()
    print(_table(["measurement", "wall s", "inputs/s", "ratio", "goal"], rows, markdown=True,
                 left=(0, 4)))
    return 0 if ratio >= GOAL_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
