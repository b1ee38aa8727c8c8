"""``cache_dataset`` over a Dataset whose ``__getitem__`` costs >= 20 ms: epoch 1 of the plain
``DataLoader`` against epochs read back from the cache through ``make_loader`` (issue 39's goal:
>= 100x the samples/s, the same samples).

    python tests/benchmarks/bench_cache_dataset.py              # 320 samples, ~30 s on 2 cores
    python tests/benchmarks/bench_cache_dataset.py --samples 1000 --workers 2

The dataset (``FilteredImages``) does real work per sample: a 256x256 float32 image drawn from a
seeded generator, a Gaussian blur, a 5x5 median filter and a Sobel magnitude (SciPy), pooled to
128x128; it returns ``{"image": float32 tensor (1, 128, 128), "label": int, "mean": float}``.

1. **plain**: ``DataLoader(dataset, batch_size, shuffle=False, num_workers=W)``, one epoch (the
   epoch 1 a run without a cache pays every epoch), timed; its batches kept.
2. **stage 1**: ``cache_dataset(dataset, out, workers=W)``, timed (for reference).
3. **same samples**: ``make_loader(cached, shuffle=False)`` gives the very batches of 1
   (``torch.equal`` on every tensor), and ``cached[i]`` equals ``dataset[i]`` for a few ``i``.
4. **cached epochs**: ``make_loader(cached, batch_size, shuffle=True, num_workers=w)`` for
   ``w`` in 0 and W, one untimed epoch, then whole epochs for about ``--seconds``: samples/s.

The ratios printed are cached samples/s over plain epoch-1 samples/s. Everything written is
deleted at the end.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import ndimage
from torch.utils.data import DataLoader

from precache.bring_your_own import cache_dataset
from precache.loading import make_loader


class FilteredImages:
    """A map-style dataset whose samples cost real CPU work (see the module's docstring)."""

    def __init__(self, n: int, size: int = 256) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        rng = np.random.default_rng(i)
        image = rng.random((self.size, self.size), dtype=np.float32)
        image = ndimage.gaussian_filter(image, sigma=3)
        image = ndimage.median_filter(image, size=5)
        edges = np.hypot(ndimage.sobel(image, 0), ndimage.sobel(image, 1))
        pooled = edges.reshape(self.size // 2, 2, self.size // 2, 2).mean(axis=(1, 3))
        return {"image": torch.from_numpy(pooled[None].astype(np.float32)),
                "label": i % 10, "mean": float(pooled.mean())}


def _epoch(loader: Any) -> tuple[int, float]:
    start, count = time.perf_counter(), 0
    for batch in loader:
        count += len(batch["label"])
    return count, time.perf_counter() - start


def _same_batches(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if sorted(x) != sorted(y):
            return False
        for name in x:
            if not torch.equal(torch.as_tensor(x[name]), torch.as_tensor(y[name])):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=320)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dataset = FilteredImages(args.samples)
    start = time.perf_counter()
    for i in range(5):
        dataset[i]
    cost_ms = (time.perf_counter() - start) / 5 * 1e3
    print(f"__getitem__: {cost_ms:.1f} ms a sample (one process)")

    plain = DataLoader(dataset, batch_size=args.batch_size, shuffle=False,
                       num_workers=args.workers)
    start = time.perf_counter()
    plain_batches = list(plain)
    plain_s = time.perf_counter() - start
    plain_rate = args.samples / plain_s
    print(f"plain DataLoader epoch 1 (num_workers={args.workers}): {plain_rate:,.1f} samples/s "
          f"({plain_s:.1f} s)")

    tmp = Path(tempfile.mkdtemp(prefix="bench-cache-dataset-"))
    try:
        start = time.perf_counter()
        cached = cache_dataset(dataset, tmp / "cache", workers=args.workers, progress=False,
                               log=lambda _: None)
        stage1_s = time.perf_counter() - start
        print(f"cache_dataset (workers={args.workers}): {args.samples / stage1_s:,.1f} "
              f"samples/s ({stage1_s:.1f} s)")

        ordered = make_loader(cached, batch_size=args.batch_size, shuffle=False, num_workers=0)
        same = _same_batches(plain_batches, list(ordered))
        for i in (0, args.samples // 2, args.samples - 1):
            got, want = cached[i], dataset[i]
            same = same and torch.equal(got["image"], want["image"]) and got["label"] == want[
                "label"] and got["mean"] == want["mean"]
        print(f"same samples as the dataset: {'yes' if same else 'NO'}")

        for workers in sorted({0, args.workers}):
            loader = make_loader(cached, batch_size=args.batch_size, shuffle=True,
                                 num_workers=workers)
            _epoch(loader)  # untimed: workers start, pages warm
            count, seconds = 0, 0.0
            while seconds < args.seconds:
                n, s = _epoch(loader)
                count, seconds = count + n, seconds + s
            rate = count / seconds
            print(f"cached epochs, make_loader(num_workers={workers}, {loader.worker_kind}): "
                  f"{rate:,.0f} samples/s = {rate / plain_rate:,.0f}x plain epoch 1")
        cached.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
