"""MTCNN on this CPU: today's OpenCV path against the torch engine, on photos and video frames,
and the faces pipeline with 2 workers on each engine.

    .venv/bin/python tests/benchmarks/bench_mtcnn.py [--photos 32] [--frames 32] [--repeat 3]
        [--baseline df506cf] [--pipeline 0] [--cuda]

Baseline ("today"): ``precache/faces/mtcnn.py`` as of commit ``--baseline`` (the last commit
before the torch engine; read with ``git show`` and imported as a module of its own), i.e.
the cascade on OpenCV's DNN module, one image a call (``MTCNN.detect``). Measured in the same
run, interleaved with the other forms (baseline, form, baseline, form, ...), best of
``--repeat`` kept for each, since a busy machine only ever slows. One thread for torch and
OpenCV, as in stage-1 workers. CPU time of this thread is printed beside wall time: on a shared
machine it is the steadier of the two (it still grows when another process shares the core's
caches).

Forms:
- ``opencv``: the OpenCV engine of this commit (``MTCNN``), one image a call.
- ``torch bN``: ``TorchMTCNN(device="cpu").detect_batch`` over N images at a time.

Inputs: the first ``--photos`` pictures of ``data/make_samples.py`` (made in memory: faces,
groups, no face) resized to 640x480; ``--frames`` frames of ``data/make_videos.py``'s first
scene (a face gliding over a background) rendered at 640x480 (not encoded). Every form must find
as many faces as the baseline (printed; a mismatch is flagged).

``--cuda``: also ``TorchMTCNN(device="cuda")`` at batch 1, 8, 32 and 128 (photos/s, wall), when
torch sees a GPU; else the rows say "not lent".

``--pipeline N``: also ``precache.run`` of the ``faces`` pipeline with 2 workers over N of the
pictures (their own sizes, written as JPEG to a temporary folder), once per CPU engine
(``PRECACHE_MTCNN_CPU_ENGINE=opencv`` and ``torch``, which the workers read), inputs/s.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from precache.faces.mtcnn import MTCNN  # noqa: E402
from precache.faces.mtcnn_torch import TorchMTCNN  # noqa: E402
from tests.face_photos import sample_pictures  # noqa: E402
from tests.helpers import load_script  # noqa: E402

BASELINE = "df506cf"
SIZE = (640, 480)


def load_baseline(commit: str) -> ModuleType:
    """``precache/faces/mtcnn.py`` as of ``commit``, as a module named ``mtcnn_baseline``."""
    source = subprocess.run(["git", "show", f"{commit}:precache/faces/mtcnn.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="bench-mtcnn-")) / "mtcnn_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("mtcnn_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pictures(count: int) -> list[np.ndarray]:
    """The first ``count`` pictures of ``data/make_samples.py``, at their own sizes."""
    return list(sample_pictures(count).values())


def frames(count: int) -> list[np.ndarray]:
    """``count`` frames of ``data/make_videos.py``'s first scene at 640x480."""
    videos = load_script(ROOT / "data" / "make_videos.py", "make_videos")
    faces, backgrounds = videos.samples.load_photos()
    rng = np.random.default_rng([videos.SEED, 0])
    shots = videos.make_scene(videos.scene_kind(0), faces, backgrounds, rng, SIZE,
                              count / 15 + 1, 15)
    return [videos.render(shots, t, rng, None)[0] for t in np.arange(count) / 15]


def batched(detect: Callable[[list[np.ndarray]], list], size: int
            ) -> Callable[[list[np.ndarray]], list]:
    def run(images: list[np.ndarray]) -> list:
        out = []
        for i in range(0, len(images), size):
            out += detect(images[i:i + size])
        return out
    return run


def measure(forms: dict[str, Callable[[list[np.ndarray]], list]], images: list[np.ndarray],
            repeat: int) -> dict[str, tuple[float, float, int]]:
    """Best (wall s, thread CPU s) of each form over ``images``, forms interleaved; faces."""
    best = {name: (float("inf"), float("inf"), 0) for name in forms}
    for name, run in forms.items():  # warm-up: shapes, primitives, caches
        run(images[:2])
    for _ in range(repeat):
        for name, run in forms.items():
            wall, cpu = time.perf_counter(), time.thread_time()
            found = run(images)
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            faces = sum(len(f[0]) for f in found)
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu), faces)
    return best


def report(title: str, best: dict[str, tuple[float, float, int]], count: int) -> None:
    base_wall, base_cpu, base_faces = best["baseline"]
    print(f"\n{title} ({count} images; baseline: OpenCV path of commit {BASELINE}, 1 thread)")
    print(f"  {'form':<12} {'per s (wall)':>12} {'per s (cpu)':>12} {'x wall':>8} {'x cpu':>8}  faces")
    for name, (wall, cpu, faces) in best.items():
        flag = "" if faces == base_faces else f"  (baseline found {base_faces})"
        print(f"  {name:<12} {count / wall:>12.1f} {count / cpu:>12.1f} "
              f"{base_wall / wall:>8.2f} {base_cpu / cpu:>8.2f}  {faces}{flag}")


def pipeline_rates(images: list[np.ndarray], repeat: int) -> None:
    """The faces pipeline, 2 workers, per CPU engine: inputs/s (wall of ``precache.run``)."""
    import precache

    with tempfile.TemporaryDirectory(prefix="bench-mtcnn-") as tmp:
        folder = Path(tmp) / "photos"
        folder.mkdir()
        for k, image in enumerate(images):
            cv2.imwrite(str(folder / f"p{k:04d}.jpg"), cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
        best: dict[str, float] = {}
        for r in range(repeat):
            for engine in ("opencv", "torch"):
                os.environ["PRECACHE_MTCNN_CPU_ENGINE"] = engine
                out = Path(tmp) / f"cache-{engine}-{r}"
                start = time.perf_counter()
                precache.run("faces", folder, out, workers=2, params={"size": 128}, progress=False,
                             log=lambda *a, **k: None)
                best[engine] = min(best.get(engine, float("inf")), time.perf_counter() - start)
        os.environ.pop("PRECACHE_MTCNN_CPU_ENGINE", None)
    print(f"\nfaces pipeline, 2 workers, {len(images)} pictures (own sizes), device=cpu")
    for engine, wall in best.items():
        print(f"  {engine:<12} {len(images) / wall:>8.2f} inputs/s  "
              f"x{best['opencv'] / wall:.2f} against opencv")


def cuda_rates(photos: list[np.ndarray], video: list[np.ndarray], baseline: object,
               repeat: int) -> None:
    """Torch on the GPU against the baseline on one CPU thread, same images."""
    if not torch.cuda.is_available():
        print("\ncuda: not lent (torch sees no CUDA GPU)")
        return
    gpu = TorchMTCNN(device="cuda")

    def synced(run: Callable[[list[np.ndarray]], list]) -> Callable[[list[np.ndarray]], list]:
        def timed(images: list[np.ndarray]) -> list:
            out = run(images)
            torch.cuda.synchronize()
            return out
        return timed

    forms = {"baseline": lambda images: [baseline.detect(i) for i in images],  # type: ignore[attr-defined]
             **{f"cuda b{n}": synced(batched(gpu.detect_batch, n)) for n in (1, 8, 32, 128)}}
    print(f"\ncuda: {torch.cuda.get_device_name()}")
    report("photos 640x480 on cuda", measure(forms, photos, repeat), len(photos))
    report("video frames 640x480 on cuda", measure(forms, video, repeat), len(video))


def main() -> None:
    global BASELINE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--photos", type=int, default=32)
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument("--pipeline", type=int, default=0)
    parser.add_argument("--cuda", action="store_true")
    args = parser.parse_args()
    BASELINE = args.baseline
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    print(f"load: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs; torch {torch.__version__}")
    baseline = load_baseline(args.baseline).MTCNN()
    opencv, torch_cpu = MTCNN(), TorchMTCNN(device="cpu")
    one = lambda detector: (lambda images: [detector.detect(i) for i in images])  # noqa: E731
    forms = {"baseline": one(baseline), "opencv": one(opencv),
             **{f"torch b{n}": batched(torch_cpu.detect_batch, n) for n in (1, 8, 32)}}
    photos = [cv2.resize(p, SIZE, interpolation=cv2.INTER_AREA) for p in pictures(args.photos)]
    report("photos 640x480", measure(forms, photos, args.repeat), len(photos))
    video = frames(args.frames)
    report("video frames 640x480", measure(forms, video, args.repeat), len(video))
    if args.cuda:
        cuda_rates(photos, video, baseline, args.repeat)
    if args.pipeline:
        pipeline_rates(pictures(args.pipeline), args.repeat)
    print(f"\nload after: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
