"""Issue 40's stage-1 goals through ``precache.run``: each face detector in the whole pipeline,
photos and video, with the workers of a real run, against MTCNN in the same run.

    .venv/bin/python tests/benchmarks/bench_detectors_run.py [--count 300] [--videos 8]
        [--workers 2] [--repeat 2] [--no-variants]

1. ``faces`` on ``--count`` photos of ``data/make_samples.py`` (640 px and smaller: real faces
   from scikit-image and matplotlib, groups, face-less photos), ``--workers`` processes, into a
   fresh cache each time: inputs/s from the call's wall time (worker start-up, shard writing and
   publishing included), for ``detector=mtcnn`` (the baseline: today's default) and
   ``detector=blazeface``, and the rows each found.
2. ``video-faces`` on ``--videos`` generated videos (``data/make_videos.py``: 320 x 240, 15 fps,
   moving and crossing faces) the same way: sampled frames/s (``frames=32`` a video).

With ``--variants`` (default), BlazeFace also runs with the pipelines' opt-in speed settings:
``mesh_roi=landmarks`` (``FaceMesh(roi="landmarks")``: the mesh placed by the detector's points,
without MediaPipe's face detector) and, for photos, ``tile=0`` as well (one BlazeFace pass a
photo, no tiles).

Runs alternate (mtcnn, blazeface, ..., mtcnn, ...) and the best of ``--repeat`` is kept: a busy
machine only makes a run slower. Each line also gives where a worker's time went
(``RunSummary.stages``). The ratios are the goal's: each row's rate over MTCNN's, same run.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import precache  # noqa: E402

DETECTORS = ("mtcnn", "blazeface")
VARIANTS = {  # row label -> the pipeline's opt-in parameters, with detector=blazeface
    "faces": {"blazeface, mesh_roi=landmarks": {"mesh_roi": "landmarks"},
              "blazeface, mesh_roi=landmarks, tile=0": {"mesh_roi": "landmarks", "tile": 0}},
    "video-faces": {"blazeface, mesh_roi=landmarks": {"mesh_roi": "landmarks"}},
}


def best_runs(pipeline: str, inputs: Path, work: Path, workers: int, repeat: int,
              params: dict, variants: bool) -> dict[str, precache.processing.RunSummary]:
    """The fastest of ``repeat`` fresh runs of each detector (and variant), alternating."""
    rows: dict[str, dict] = {d: {"detector": d} for d in DETECTORS}
    for label, extra in (VARIANTS[pipeline] if variants else {}).items():
        rows[label] = {"detector": "blazeface", **extra}
    best: dict[str, precache.processing.RunSummary] = {}
    for _ in range(repeat):
        for k, (label, extra) in enumerate(rows.items()):
            out = work / f"{pipeline}-{k}"
            shutil.rmtree(out, ignore_errors=True)
            summary = precache.run(pipeline, inputs, out, workers=workers, progress=False,
                                   log=lambda *_: None, params={**params, **extra})
            if label not in best or summary.wall_s < best[label].wall_s:
                best[label] = summary
    return best


def report(title: str, unit: str, best: dict, per_input: float = 1.0) -> None:
    base = best["mtcnn"].computed * per_input / best["mtcnn"].wall_s
    print(f"\n{title}")
    print(f"| detector | {unit}/s | vs mtcnn | rows | time per input in a worker |")
    print("|---|--:|--:|--:|---|")
    for detector, summary in best.items():
        rate = summary.computed * per_input / summary.wall_s
        print(f"| {detector} | {rate:,.1f} | {rate / base:.2f}x | {summary.rows} | "
              f"{summary.stages.describe()} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=300, help="sample photos")
    parser.add_argument("--videos", type=int, default=8, help="generated videos (even)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--no-variants", dest="variants", action="store_false",
                        help="only the built-in pipelines (mtcnn, blazeface)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pc-detectors-") as temp:
        work = Path(temp)
        subprocess.run([sys.executable, str(ROOT / "data" / "make_samples.py"), "--count",
                        str(args.count), "--output", str(work / "photos")], check=True,
                       capture_output=True)
        subprocess.run([sys.executable, str(ROOT / "data" / "make_videos.py"), "--output",
                        str(work / "videos"), "--per-label", str(max(1, args.videos // 2))],
                       check=True, capture_output=True)
        photos = best_runs("faces", work / "photos", work, args.workers, args.repeat,
                           {"size": 128, "labels": "none"}, args.variants)
        report(f"faces, {args.count} photos, {args.workers} workers, best of {args.repeat}",
               "inputs", photos)
        videos = best_runs("video-faces", work / "videos", work, args.workers, args.repeat,
                           {"size": 128, "frames": 32, "labels": "none"}, args.variants)
        report(f"video-faces, {args.videos} videos x 32 sampled frames, {args.workers} workers, "
               f"best of {args.repeat}", "frames", videos, per_input=32)


if __name__ == "__main__":
    main()
