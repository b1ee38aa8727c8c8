"""accelerate's loop over a ``make_loader`` loader: ``prepare`` leaves it as it is,
``register_for_checkpointing`` + ``save_state``/``load_state`` resume it exactly, and epochs
advance without ``set_epoch``, as with accelerate's own stateful DataLoader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import precache
from tests.helpers import build_cache, write_photos

pytest.importorskip("accelerate")
JOB = Path(__file__).with_name("accelerate_job.py")
REPO = Path(__file__).parents[3]


@pytest.mark.slow
def test_a_loop_resumed_from_save_state_trains_the_rest_of_the_epoch_then_the_next(tmp_path):
    write_photos(tmp_path / "photos", 30)
    build_cache(tmp_path / "photos", tmp_path / "cache", pipeline="images", params={"size": 8},
                workers=1, shard_rows=8)
    stops = (1, 4, 7)  # of 8 batches an epoch: early, in the middle, the last but one
    done = subprocess.run([sys.executable, str(JOB), str(tmp_path / "cache"), str(tmp_path),
                           "--stops", ",".join(map(str, stops))], capture_output=True,
                          text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads((tmp_path / "result.json").read_text())
    everything = sorted(precache.Cache(tmp_path / "cache").read_all(["key"])["key"])
    full = runs["full"]
    assert [epoch for epoch, _ in full] == [0] * 8 + [1] * 8
    for epoch in (0, 1):
        assert sorted(k for e, keys in full if e == epoch for k in keys) == everything
    assert full[:8] != [[0, keys] for _, keys in full[8:]]  # reshuffled without set_epoch
    for stop in stops:
        assert runs[f"first-{stop}"] == full[:stop]
        assert runs[f"resumed-{stop}"] == full[stop:], stop
