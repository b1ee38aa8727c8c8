"""Feeding a GPU from JPEG face crops (issue 25): decode + FaceAugment on the CPU against decode
(nvJPEG) + FaceAugment on the GPU, in one run.

    python tests/benchmarks/bench_gpu.py                        # 20,480 crops of 224 px, CUDA
    python tests/benchmarks/bench_gpu.py --device cpu --rows 2048 --size 64   # the code path here

The cache is ``bench_feed.py``'s face-shaped rows (smooth crops with noise, 5 landmarks, a mesh
and its region hulls) as JPEG q95, written by stage 1. Readers, each full shuffle, batch 256,
warm (one untimed epoch first), epochs interleaved, medians; every batch ends as normalised
float NCHW on ``--device`` and the clock stops after a device synchronize:

1. **cpu**: loader threads read and decode the crops (libjpeg-turbo) and augment the batch
   (``FaceAugment``, OpenCV form), the loop copies it to the device and normalises it there
   (the path without GPU decoding);
2. **gpu decode**: loader threads hand out each batch's JPEG bytes
   (``CachedDataset(decode_images=False)``); the loop decodes them on the device
   (``decode_images``: nvJPEG) and normalises;
3. **gpu decode + augment**: as 2, then ``FaceAugment`` on the device (torch form, one warp per
   batch) before normalising: what the face trainers do on a GPU;
4. **gpu decode in the loader threads, augment in the loop**: each thread decodes on a CUDA
   stream of its own (TorchCodec keeps a pool of decoders, so threads may decode at once);
5. **cpu decode + gpu augment**: loader threads decode (libjpeg-turbo, every core at once), the
   loop copies the pixels over and augments them on the device (the trainers' ``--decode-on
   loader``): nvJPEG's host side serves one batch at a time, the threads do not.

Rates are samples/s; ratios to reader 1 in the same run. The issue's goal: decode + augment on
the GPU machine (3, 4 or 5) at >= 20,000/s on one H100 at 224 px.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_feed import build  # noqa: E402

from precache.augment import FaceAugment  # noqa: E402
from precache.loading import CachedDataset, as_nchw, decode_images, make_loader  # noqa: E402
from precache.loading.loaders.device import to_device  # noqa: E402
from precache.threads import pin_threads  # noqa: E402

BATCH = 256
COLUMNS = ["image", "landmarks5", "mesh", "has_mesh", "regions", "region_sizes", "label"]


def normalised(images: torch.Tensor) -> torch.Tensor:
    """uint8 NHWC -> float NCHW in 0..1 (channels_last), as the trainers feed a model."""
    return as_nchw(images).float().div_(255)


def readers(cache: Path, device: torch.device, threads: int) -> dict[str, Callable[[int], Any]]:
    """name -> (epoch -> iterator of normalised batches on ``device``)."""
    cpu_augment, gpu_augment = FaceAugment(seed=1), FaceAugment(seed=1)
    decoded = make_loader(CachedDataset(cache, columns=COLUMNS), BATCH, num_workers=threads,
                          worker_kind="threads", batch_transform=cpu_augment)
    pixels = make_loader(CachedDataset(cache, columns=COLUMNS), BATCH, num_workers=threads,
                         worker_kind="threads")
    encoded_set = CachedDataset(cache, columns=COLUMNS, decode_images=False)
    encoded = make_loader(encoded_set, BATCH, num_workers=threads, worker_kind="threads")

    def on_device(augment: FaceAugment | None) -> Callable[[dict], dict]:
        def transform(batch: dict) -> dict:
            batch = to_device(batch, device)
            batch["image"] = decode_images(batch["image"], device)
            return augment(batch) if augment is not None else batch
        return transform

    in_threads = make_loader(encoded_set, BATCH, num_workers=threads, worker_kind="threads",
                             batch_transform=on_device(FaceAugment(seed=1)))
    decoded_in_threads = make_loader(encoded_set, BATCH, num_workers=threads,
                                     worker_kind="threads", batch_transform=on_device(None))

    def read_only(epoch: int):
        encoded.set_epoch(epoch)
        for batch in encoded:
            yield batch["label"]

    def threads_on_device(epoch: int):
        in_threads.set_epoch(epoch)
        for batch in in_threads:
            yield normalised(batch["image"])

    def cpu(epoch: int):
        decoded.set_epoch(epoch)
        for batch in decoded:
            yield normalised(batch["image"].to(device, non_blocking=True))

    def threads_decode_loop_augments(epoch: int):
        decoded_in_threads.set_epoch(epoch)
        for batch in decoded_in_threads:
            yield normalised(gpu_augment(batch)["image"])

    def cpu_decode_gpu_augment(epoch: int):
        pixels.set_epoch(epoch)
        for batch in pixels:
            yield normalised(gpu_augment(to_device(batch, device))["image"])

    def gpu(epoch: int, augment: FaceAugment | None):
        encoded.set_epoch(epoch)
        for batch in encoded:
            batch = to_device(batch, device)
            batch["image"] = decode_images(batch["image"], device)
            if augment is not None:
                batch = augment(batch)
            yield normalised(batch["image"])

    return {f"cpu: {threads} threads decode + augment (OpenCV), then copy": cpu,
            f"gpu decode ({threads} threads read the bytes)": lambda e: gpu(e, None),
            "gpu decode + augment (torch form)": lambda e: gpu(e, gpu_augment),
            f"gpu decode + augment, in the {threads} loader threads": threads_on_device,
            f"gpu decode in the {threads} loader threads, augment in the loop":
                threads_decode_loop_augments,
            f"cpu decode ({threads} threads) + gpu augment": cpu_decode_gpu_augment,
            f"read the bytes only ({threads} threads, no decode)": read_only}


def parts(cache: Path, device: torch.device, profile: bool) -> None:
    """Decode alone and augment alone, on batches already in memory (no loader), and a
    profile of the augmentation's operations."""
    dataset = CachedDataset(cache, columns=COLUMNS, decode_images=False)
    batches = [dataset.read_batch(list(range(i, len(dataset), 37))[:BATCH]) for i in range(8)]
    for batch in batches:
        batch["image"] = list(batch["image"])
    augment = FaceAugment(seed=1)

    def timed(name: str, work: Callable[[dict], Any], inputs: list[dict]) -> None:
        for batch in inputs[:2]:
            work(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(3):
            for batch in inputs:
                work(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rate = 3 * len(inputs) * BATCH / (time.perf_counter() - start)
        print(f"part: {name}: {rate:,.0f}/s", flush=True)

    timed("decode only (decode_images, batches in memory)",
          lambda b: decode_images(b["image"], device), batches)
    for name, decode in gpu_libraries(device).items():  # each installed library's decoder
        timed(f"decode only, {name}", lambda b, d=decode: d(b["image"]), batches)
    on_device = []
    for batch in batches:
        moved = {k: torch.as_tensor(np.asarray(v)).to(device) for k, v in batch.items()
                 if k != "image"}
        moved["image"] = decode_images(batch["image"], device)
        on_device.append(moved)
    timed("augment only (FaceAugment on decoded batches)", augment, on_device)
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                               if device.type == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            for batch in on_device:
                augment(batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=14), flush=True)
        with torch_profile(activities=activities) as prof:
            for batch in batches:
                decode_images(batch["image"], device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8), flush=True)


def gpu_libraries(device: torch.device) -> dict[str, Callable[[list], Any]]:
    """Each installed library's batched JPEG decoder on ``device`` (name with version -> decode
    a list of byte arrays), to compare them in one run: ``decode_images`` uses the first."""
    found: dict[str, Callable[[list], Any]] = {}
    if device.type != "cuda":
        return found
    as_tensors = lambda rows: [torch.from_numpy(np.asarray(r)) for r in rows]  # noqa: E731
    try:
        import torchcodec
        from torchcodec.decoders import decode_jpeg as codec_decode
        found[f"torchcodec {torchcodec.__version__}"] = lambda rows: codec_decode(
            as_tensors(rows), device=device)
    except (ImportError, OSError, RuntimeError) as error:
        print(f"torchcodec: not usable here ({type(error).__name__}: {error})", flush=True)
    try:
        import torchvision
        from torchvision.io import decode_jpeg as vision_decode
        found[f"torchvision {torchvision.__version__}"] = lambda rows: vision_decode(
            as_tensors(rows), device=device)
    except (ImportError, OSError, RuntimeError) as error:
        print(f"torchvision: not usable here ({type(error).__name__}: {error})", flush=True)
    return found


def run_reader(epochs: Callable[[int], Any], rows: int, number: int, device: torch.device) -> float:
    """Samples/s of one epoch, every batch finished on the device; checks the row count."""
    seen = 0
    start = time.perf_counter()
    for images in epochs(number):
        seen += len(images)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    assert seen == rows, f"read {seen} rows, not {rows}"
    return rows / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_480)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="loader threads (default: the cores less one, at most 16)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="also time decode and augment alone, and profile their operations")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="write the cache into DIR and keep it (e.g. to train on it)")
    args = parser.parse_args()
    device = torch.device(args.device)
    threads = args.threads or max(1, min(16, (os.cpu_count() or 2) - 1))
    pin_threads()
    work = args.keep or Path(tempfile.mkdtemp(dir=args.dir, prefix="bench_gpu-"))
    try:
        start = time.perf_counter()
        cache = build(work, args.rows, args.size, "jpeg", workers=os.cpu_count() or 2)
        print(f"stage 1: {args.rows:,} JPEG crops of {args.size} px in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        if args.profile:
            parts(cache, device, profile=True)
        named = readers(cache, device, threads)
        rates: dict[str, list[float]] = {name: [] for name in named}
        for name, epochs in named.items():  # warm: page cache, threads, nvJPEG handles
            run_reader(epochs, args.rows, 0, device)
        for number in range(1, args.epochs + 1):
            for name, epochs in named.items():
                rates[name].append(run_reader(epochs, args.rows, number, device))
                print(f"epoch {number} {name}: {rates[name][-1]:,.0f}/s", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{args.size} px JPEG q95 crops, batch {BATCH}, full shuffle, warm, {where}, "
          f"{os.cpu_count()} CPUs; median of {args.epochs} interleaved epochs")
    base = statistics.median(next(iter(rates.values())))
    print(f"{'reader':<60} {'samples/s':>10} {'/cpu':>6}")
    for name, values in rates.items():
        print(f"{name:<60} {statistics.median(values):>10,.0f} "
              f"{statistics.median(values) / base:>6.2f}")


if __name__ == "__main__":
    main()
