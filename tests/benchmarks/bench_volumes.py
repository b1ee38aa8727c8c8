"""Volumes benchmark: patch reads, the input pipeline against MONAI, and the speed checklist.

    .venv/bin/python tests/benchmarks/bench_volumes.py [--part patches|monai|checklist|all]

In a temporary folder, every number a same-run ratio on this machine:

1. ``patches``: 6 volumes of 256^3 (uint8) through ``precache run volumes``; random 64^3
   patches read through ``PatchDataset.read_patches`` against reading the whole volume from the
   same mapped shard and cropping it, cold (the shard dropped from the page cache with
   ``posix_fadvise(DONTNEED)`` before every read) and warm.
2. ``monai``: 96 NIfTI volumes (48^3 int16, 1 x 1 x 1.5 mm, half of them LAS) from
   data/make_volumes.py; the same deterministic steps (RAS, 1.5 mm, percentiles 0.5-99.5 to
   0..1, pad/crop to 32^3) and random steps (flips, 90-degree turns, intensity scale and shift,
   gamma) as MONAI ``PersistentDataset`` and ``CacheDataset`` (each rank caches its partition),
   against precache (stage 1 once; ``CachedDataset`` + ``make_loader`` + ``VolumeAugment`` on
   the batch). Two rank processes, batch 16, no loader workers; the second epoch is timed
   (the first builds MONAI's caches). Volumes/s of both ranks, the caches' bytes, and the
   ranks' USS at the end.
3. ``checklist``: the ResNet3D-18 (width 16) on 28^3 volumes, one checklist step added per
   row, training samples/s of the same loop measured in this run.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_volumes = _load(REPO / "data" / "make_volumes.py", "make_volumes")


def _run(pipeline_input: Path, out: Path, **params) -> float:
    import precache

    start = time.perf_counter()
    precache.run("volumes", pipeline_input, out, params=params, progress=False, log=lambda *a: None,
                 workers=1)
    return time.perf_counter() - start


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def bench_patches(tmp: Path, count: int = 6, size: int = 256, patch: int = 64,
                  reads: int = 24) -> dict:
    from precache.cli.bench.measure import drop_page_cache
    from precache.loading.datasets.volume_patches import PatchDataset, patch_corners

    rng = np.random.default_rng(0)
    stack = np.stack([np.clip(make_volumes.make_volume(i, size)[0] / 4, 0, 255).astype(np.uint8)
                      for i in range(count)])
    np.save(tmp / "big.npy", stack)
    del stack
    seconds = _run(tmp / "big.npy", tmp / "big", shape=(size,))
    shards = glob.glob(str(tmp / "big" / "shards" / "*.parquet"))
    dataset = PatchDataset(tmp / "big", patch=patch, per_volume=1)
    plan = [(int(rng.integers(count)), patch_corners((size,) * 3, (patch,) * 3, 1, rng))
            for _ in range(reads)]

    def close_readers() -> None:
        for reader in dataset._readers.values():
            reader.close()
        dataset._readers = {}

    def whole(index: int, corner: np.ndarray) -> np.ndarray:
        volume = np.array(dataset._volumes(int(dataset._shard[index]))[int(dataset._row[index])])
        z, y, x = corner[0]
        return volume[z:z + patch, y:y + patch, x:x + patch].copy()

    result = {"stage1_s": round(seconds, 1), "cache_bytes": _bytes(tmp / "big")}
    for name, read in (("patch", dataset.read_patches), ("whole", whole)):
        cold = 0.0
        for index, corner in plan:
            close_readers()
            drop_page_cache(shards)
            start = time.perf_counter()
            read(index, corner)
            cold += time.perf_counter() - start
        for index, corner in plan:  # warm every page first
            read(index, corner)
        start = time.perf_counter()
        for index, corner in plan * 4:
            read(index, corner)
        warm = time.perf_counter() - start
        result[f"{name}_cold_per_s"] = reads / cold
        result[f"{name}_warm_per_s"] = 4 * reads / warm
    result["cold_ratio"] = result["patch_cold_per_s"] / result["whole_cold_per_s"]
    result["warm_ratio"] = result["patch_warm_per_s"] / result["whole_warm_per_s"]
    dataset.close()
    return result


def _monai_transforms(cache_dir: Path | None):
    from monai import transforms as T

    deterministic = [
        T.LoadImaged(keys="image", image_only=True), T.EnsureChannelFirstd(keys="image"),
        T.Orientationd(keys="image", axcodes="RAS"),
        T.Spacingd(keys="image", pixdim=(1.5, 1.5, 1.5), mode="bilinear"),
        T.ScaleIntensityRangePercentilesd(keys="image", lower=0.5, upper=99.5, b_min=0.0,
                                          b_max=1.0, clip=True),
        T.ResizeWithPadOrCropd(keys="image", spatial_size=(32, 32, 32))]
    random = [T.RandFlipd(keys="image", prob=0.5, spatial_axis=0),
              T.RandFlipd(keys="image", prob=0.5, spatial_axis=1),
              T.RandFlipd(keys="image", prob=0.5, spatial_axis=2),
              T.RandRotate90d(keys="image", prob=0.5, spatial_axes=(0, 1)),
              T.RandAdjustContrastd(keys="image", prob=1.0, gamma=(0.82, 1.22)),
              T.RandScaleIntensityd(keys="image", factors=0.1, prob=1.0),
              T.RandShiftIntensityd(keys="image", offsets=0.1, prob=1.0)]
    return T.Compose(deterministic + random)


def _rank(kind: str, rank: int, files: list, cache: str, work: str, queue: mp.Queue) -> None:
    import psutil

    torch.set_num_threads(1)
    mine = files[rank::2]
    if kind == "precache":
        from precache.augment.volume import VolumeAugment
        from precache.loading import CachedDataset, make_loader

        dataset = CachedDataset(cache, columns=["volume", "label"])
        loader = make_loader(dataset, 16, num_workers=0, seed=0, rank=rank, world_size=2)
        augment = VolumeAugment()

        def epoch(e: int) -> int:
            loader.set_epoch(e)
            seen = 0
            for batch in loader:
                x = augment(batch["volume"].float().div_(255).unsqueeze(1))
                seen += len(x)
            return seen
    else:
        from monai.data import CacheDataset, DataLoader, PersistentDataset

        data = [{"image": f, "label": label} for f, label in mine]
        transform = _monai_transforms(None)
        if kind == "persistent":
            dataset = PersistentDataset(data, transform, cache_dir=work)
        else:
            dataset = CacheDataset(data, transform, cache_rate=1.0, num_workers=0,
                                   progress=False)
        loader = DataLoader(dataset, batch_size=16, shuffle=True, num_workers=0)

        def epoch(e: int) -> int:
            return sum(len(batch["image"]) for batch in loader)
    epoch(0)
    start = time.perf_counter()
    seen = epoch(1)
    seconds = time.perf_counter() - start
    queue.put({"rank": rank, "per_s": seen / seconds,
               "uss": psutil.Process().memory_full_info().uss})


def _two_ranks(kind: str, files: list, cache: str, work: str) -> dict:
    context = mp.get_context("spawn")
    queue = context.Queue()
    ranks = [context.Process(target=_rank, args=(kind, r, files, cache, work, queue))
             for r in range(2)]
    for p in ranks:
        p.start()
    results = [queue.get(timeout=900) for _ in ranks]
    for p in ranks:
        p.join()
    return {"volumes_per_s": sum(r["per_s"] for r in results),
            "uss_mb": sum(r["uss"] for r in results) / 2**20}


def bench_monai(tmp: Path, count: int = 96) -> dict:
    make_volumes.main(["--output", str(tmp / "nifti"), "--count", str(count), "--size", "48"])
    files = sorted((str(p), p.parent.name) for p in (tmp / "nifti").rglob("*.nii.gz"))
    stage1 = _run(tmp / "nifti", tmp / "cache", spacing=(1.5,), shape=(32,))
    persistent = tmp / "monai_persistent"
    persistent.mkdir()
    result = {"inputs": count, "originals_bytes": _bytes(tmp / "nifti"),
              "precache_bytes": _bytes(tmp / "cache"), "precache_stage1_s": round(stage1, 1)}
    for kind in ("precache", "persistent", "cache"):
        result[kind] = _two_ranks(kind, files, str(tmp / "cache"), str(persistent))
    result["persistent_bytes"] = _bytes(persistent)
    result["vs_persistent"] = (result["precache"]["volumes_per_s"]
                               / result["persistent"]["volumes_per_s"])
    result["vs_cache"] = result["precache"]["volumes_per_s"] / result["cache"]["volumes_per_s"]
    return result


def bench_checklist(tmp: Path, steps: int = 8, rounds: int = 3) -> list[dict]:
    """Training samples/s of the checklist's steps, each added to the ones before, the median
    of ``rounds`` rounds taken in turn over all rows (one run)."""
    from torch import nn

    train = _load(REPO / "pipelines" / "volumes" / "train.py", "volumes_train")
    make_volumes.make_npz(tmp / "set.npz", count=128, size=28)
    volumes = np.load(tmp / "set.npz")["train_images"]
    labels = np.load(tmp / "set.npz")["train_labels"][:, 0].astype(np.int64)
    from precache.augment.volume import VolumeAugment

    augment = VolumeAugment()

    def with_bias(net: nn.Module) -> nn.Module:  # the anti-pattern: conv bias before BN
        for module in list(net.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Conv3d) and child.bias is None:
                    setattr(module, name, nn.Conv3d(child.in_channels, child.out_channels,
                                                    child.kernel_size, child.stride,
                                                    child.padding, bias=True))
        return net

    def measure(batch: int, bias: bool, as_tensor: bool, set_to_none: bool, channels_last: bool,
                bf16: bool) -> float:
        torch.manual_seed(0)
        net = train.ResNet3d(3, width=16)
        net = with_bias(net) if bias else net
        if channels_last:
            net = net.to(memory_format=torch.channels_last_3d)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        rng = np.random.default_rng(0)
        seconds, seen = 0.0, 0
        for step in range(steps + 2):
            pick = rng.choice(len(volumes), batch, replace=False)
            start = time.perf_counter()
            raw = volumes[pick]
            x = torch.as_tensor(raw) if as_tensor else torch.tensor(raw.tolist(), dtype=torch.uint8)
            x = augment(x.float().div_(255).unsqueeze(1))
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last_3d)
            y = torch.as_tensor(labels[pick])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = nn.functional.cross_entropy(net(x).float(), y)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            if step >= 2:
                seconds += time.perf_counter() - start
                seen += batch
        return seen / seconds

    steps_on = [("baseline: batch 8, torch.tensor copy, conv bias, zero_grad to zeros", {}),
                ("+ torch.as_tensor", {"as_tensor": True}),
                ("+ no conv bias before batch norm", {"bias": False}),
                ("+ zero_grad(set_to_none=True)", {"set_to_none": True}),
                ("+ batch 32", {"batch": 32}),
                ("+ channels_last_3d", {"channels_last": True}),
                ("+ bf16 autocast", {"bf16": True})]
    settings = dict(batch=8, bias=True, as_tensor=False, set_to_none=False, channels_last=False,
                    bf16=False)
    configs = []
    for _, change in steps_on:
        settings.update(change)
        configs.append(dict(settings))
    rates: list[list[float]] = [[] for _ in configs]
    for _ in range(rounds):  # every row once per round: a slower minute hits all rows alike
        for k, config in enumerate(configs):
            rates[k].append(measure(**config))
    rows, base = [], None
    for (name, _), row_rates in zip(steps_on, rates):
        rate = float(np.median(row_rates))
        base = base or rate
        rows.append({"step": name, "samples_per_s": round(rate, 1),
                     "vs_baseline": round(rate / base, 2),
                     "rounds": [round(r, 1) for r in row_rates]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["patches", "monai", "checklist", "all"], default="all")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-volumes-") as folder:
        tmp = Path(folder)
        if args.part in ("patches", "all"):
            print(json.dumps({"patches": bench_patches(tmp)}, default=float), flush=True)
        if args.part in ("monai", "all"):
            print(json.dumps({"monai": bench_monai(tmp)}, default=float), flush=True)
        if args.part in ("checklist", "all"):
            bench_checklist(tmp)


if __name__ == "__main__":
    main()
