"""The Lightning DataModule with a real Trainer: 2 CPU processes, DDP (gloo), bf16-mixed; a run
stopped mid-epoch resumes from its checkpoint with exactly the samples not yet trained on."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import precache
from tests.conftest import write_photos

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
    precache.run("images", tmp_path / "photos", cache, params={"size": 8}, workers=1,
                 shard_rows=8, progress=False, log=lambda *a, **k: None)
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
