"""FaceAugment per sample against per batch, on one core, per step and in total.

    .venv/bin/python tests/benchmarks/bench_augment.py [--sizes 128 224] [--batch 256]
        [--repeats 5]

A batch of ``--batch`` copies of the astronaut's face (scikit-image, MediaPipe's mesh and the
cached region hulls, as the tests' ``face`` fixture; each copy's brightness shifted) at each size.
Per sample: ``augment(sample)`` on NumPy samples, as DataLoader workers call it. Batched:
``augment(batch)`` on the CPU tensors ``make_loader`` yields (the OpenCV form), and the same batch
in the torch form on the CPU (the form used on a GPU, for reference). Each row is one step alone
at probability 1 (the others off), then the defaults ("total"); samples/s is the best of
``--repeats`` passes over the batch, and the ratios are in the same run. With kornia installed,
its batched warp, colour jitter and blur on the same batch (float NCHW) are timed too, against
which the plain-torch form was chosen. Goal: batched >= 3x per sample at 128 px.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from precache.augment import FaceAugment  # noqa: E402
from precache.faces import topology  # noqa: E402

OFF = dict(flip_p=0.0, affine_p=0.0, color_p=0.0, blur_p=0.0, cutout_p=0.0,
           region_color_p=0.0, region_blur_p=0.0, occlude_p=0.0)
STEPS = {"flip": dict(flip_p=1.0), "affine": dict(affine_p=1.0), "colour": dict(color_p=1.0),
         "blur": dict(blur_p=1.0), "cutout": dict(cutout_p=1.0),
         "region colour": dict(region_color_p=1.0), "region blur": dict(region_blur_p=1.0),
         "occlusion": dict(occlude_p=1.0)}
GOAL = 3.0


def astronaut_face(size: int) -> dict[str, Any]:
    """The astronaut's face at ``size`` px as stage 1 caches it (MediaPipe mesh, hulls)."""
    import mediapipe as mp
    from skimage import data

    image = cv2.resize(np.ascontiguousarray(data.astronaut()[0:230, 100:330]), (size, size),
                       interpolation=cv2.INTER_AREA)
    with mp.solutions.face_mesh.FaceMesh(static_image_mode=True, max_num_faces=1) as mesher:
        found = mesher.process(image).multi_face_landmarks
    mesh = np.array([[p.x * size, p.y * size] for p in found[0].landmark[: topology.MESH_POINTS]],
                    dtype=np.float32)
    regions, sizes = topology.region_hulls(mesh)
    eye = {n: mesh[topology.MESH_REGIONS[n]].mean(axis=0) for n in ("left_eye", "right_eye")}
    landmarks5 = np.stack([eye["right_eye"], eye["left_eye"], mesh[1], mesh[61], mesh[291]])
    return {"image": image, "landmarks5": landmarks5.astype(np.float32), "mesh": mesh,
            "has_mesh": np.bool_(True), "regions": regions, "region_sizes": sizes}


def make_batch(face: dict[str, Any], n: int) -> dict[str, torch.Tensor]:
    shifts = np.random.default_rng(0).integers(-30, 31, (n, 1, 1, 3))
    batch = {k: np.repeat(np.asarray(v)[None], n, axis=0) for k, v in face.items()}
    batch["image"] = np.clip(batch["image"] + shifts, 0, 255).astype(np.uint8)
    return {k: torch.from_numpy(v) for k, v in batch.items()}


def rate(fn: Callable[[], Any], n: int, repeats: int) -> float:
    """Samples per second of ``fn`` (one pass over ``n`` samples), best of ``repeats``."""
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return n / best


def kornia_rows(batch: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    """kornia's batched forms of the warp, colour jitter and blur (float NCHW in 0..1)."""
    import kornia

    n, size = len(batch["image"]), batch["image"].shape[1]
    x = batch["image"].permute(0, 3, 1, 2).float().div(255)
    angle = torch.empty(n).uniform_(-15, 15)
    matrix = kornia.geometry.transform.get_rotation_matrix2d(
        torch.full((n, 2), (size - 1) / 2), angle, torch.ones(n, 2))
    jitter = kornia.augmentation.ColorJitter(0.2, 0.2, 0.2, 0.03, p=1.0)
    sigma = torch.empty(n, 2).uniform_(0.5, 1.5)
    steps = {
        "affine": lambda: kornia.geometry.transform.warp_affine(x, matrix, (size, size),
                                                                align_corners=True),
        "colour": lambda: jitter(x),
        "blur": lambda: kornia.filters.gaussian_blur2d(x, (9, 9), sigma),
    }
    return {name: rate(fn, n, repeats) for name, fn in steps.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 224])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    try:
        import kornia  # noqa: F401
        with_kornia = True
    except ImportError:
        with_kornia = False
    n = args.batch
    for size in args.sizes:
        face = astronaut_face(size)
        batch = make_batch(face, n)
        samples = [{k: v[i].numpy() for k, v in batch.items()} for i in range(n)]
        kornia_rates = kornia_rows(batch, args.repeats) if with_kornia else {}
        print(f"\n{size} px, batch {n}, one thread: samples/s")
        print(f"{'step':14s} {'per sample':>11s} {'batched':>9s} {'ratio':>6s} "
              f"{'torch form':>11s} {'kornia':>8s}")
        for name, params in [*STEPS.items(), ("total", {})]:
            augment = FaceAugment(**({**OFF, **params} if params else {}), seed=0)
            one = rate(lambda: [augment(s) for s in samples], n, args.repeats)
            batched = rate(lambda: augment(batch), n, args.repeats)
            grid = rate(lambda: augment.apply(batch, augment.draw(n), form="torch"), n,
                        max(1, args.repeats // 2))
            k = f"{kornia_rates[name]:8.0f}" if name in kornia_rates else f"{'':8s}"
            print(f"{name:14s} {one:11.0f} {batched:9.0f} {batched / one:5.1f}x {grid:11.0f} {k}",
                  flush=True)
            if name == "total" and size == 128:
                verdict = "met" if batched / one >= GOAL else "NOT met"
                print(f"goal batched >= {GOAL:.0f}x per sample at 128 px: {verdict}")


if __name__ == "__main__":
    main()
