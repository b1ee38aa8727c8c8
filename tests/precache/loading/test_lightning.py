"""The Lightning DataModule with a real Trainer: 2 CPU processes, DDP (gloo), bf16-mixed; a run
stopped mid-epoch resumes from its checkpoint with exactly the samples not yet trained on."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import precache
from tests.helpers import build_cache, write_photos

pytest.importorskip("lightning")
JOB = Path(__file__).with_name("lightning_job.py")


def run_job(*args: str) -> None:
    done = subprocess.run([sys.executable, str(JOB), *args], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


def keys_per_rank(out: Path) -> list[list[str]]:
    return [p.read_text().split() for p in sorted(out.glob("keys-rank*.txt"))]


@pytest.mark.slow
def test_a_ddp_trainer_resumes_mid_epoch_without_repeating_or_skipping(tmp_path):
    write_photos(tmp_path / "photos", 21)
    cache = tmp_path / "cache"
    build_cache(tmp_path / "photos", cache, pipeline="images", params={"size": 8}, workers=1,
                shard_rows=8)
    first, second = tmp_path / "first", tmp_path / "second"
    run_job(str(cache), str(first), "--max-steps", "2")
    before = keys_per_rank(first)
    assert [len(k) for k in before] == [8, 8]  # 2 steps x batch 4 on each of 2 ranks
    run_job(str(cache), str(second), "--resume", str(first / "last.ckpt"))
    after = keys_per_rank(second)
    assert len(after) == 2 and len(after[0]) == len(after[1])  # equal batches: no DDP hang
    seen = Counter(k for keys in before + after for k in keys)
    everything = precache.Cache(cache).read_all(["key"])["key"]
    assert set(seen) == set(everything)
    # 21 rows: 16 seen before the stop, the 5 left are padded to 6 for 2 ranks.
    assert sum(seen.values()) == 22 and max(seen.values()) == 2
    repeated = {k for k, n in seen.items() if n == 2}  # the padding, from the resumed part only
    assert len(repeated) == 1 and not repeated & set(before[0] + before[1])


def test_shard_window_applies_to_the_training_rows_when_validation_is_held_out(tmp_path):
    from precache.loading.lightning import CacheDataModule

    write_photos(tmp_path / "in", 40)
    build_cache(tmp_path / "in", tmp_path / "cache", pipeline="images", params={"size": 16},
                shard_rows=8, workers=1)
    module = CacheDataModule(tmp_path / "cache", batch_size=4, val_every=5, num_workers=0,
                             shard_window=2)
    module.setup("fit")
    loader = module.train_dataloader()
    assert loader.sampler.shard_window == 2
    loader.set_epoch(0)
    order = list(loader.sampler)
    assert sorted(order) == list(range(32))  # the 32 training rows, each once
    # Shuffled within windows of 2 shards: at no point are more than 2 shards started and not
    # finished (a plain shuffle has all 5 open almost at once).
    left = Counter(module.train_set.shard_ids.tolist())
    open_most = 0
    for shard in module.train_set.shard_ids[order].tolist():
        left[shard] -= 1
        started = {s for s in left if left[s] < Counter(module.train_set.shard_ids.tolist())[s]}
        open_most = max(open_most, sum(1 for s in started if left[s] > 0))
    assert open_most <= 2
    assert [len(b["key"]) for b in module.val_dataloader()] == [4, 4]
