"""pipelines/faces/train_lightning.py end to end: Lightning starts 2 CPU processes (gloo) itself,
and ``--strategy fsdp --precision bf16`` (FSDP2 through ModelParallelStrategy, bf16-mixed)
trains every training sample once per epoch across them, writing the epoch records of every
precache trainer; fp16 and DeepSpeed, GPU-only, are refused in one line. CacheDataModule's
resume under a Lightning DDP Trainer is tested in tests/precache/loading/test_lightning.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from precache.training.metrics_log import EPOCH_FIELDS
from tests.helpers import REPO, assert_each_sample_once_per_epoch, keys_per_epoch, load_script
from tests.helpers.training import clean_env, read_metrics, training_keys

pytest.importorskip("lightning")
SCRIPT = REPO / "pipelines" / "faces" / "train_lightning.py"


@pytest.mark.slow
def test_fsdp_with_bf16_on_two_cpu_processes_trains_on_every_sample_once(face_cache, tmp_path):
    out, keys = tmp_path / "run", tmp_path / "keys"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cache", str(face_cache), "--out", str(out),
         "--devices", "2", "--epochs", "2", "--batch-size", "4", "--workers", "0",
         "--strategy", "fsdp", "--precision", "bf16", "--log-keys", str(keys)],
        capture_output=True, text=True, timeout=400, env=clean_env(PYTHONPATH=str(REPO)),
        cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    records = read_metrics(out)
    assert [(r["epoch"], r["world_size"], r["strategy"], r["precision"]) for r in records] == [
        (0, 2, "fsdp", "bf16"), (1, 2, "fsdp", "bf16")]
    assert all(set(EPOCH_FIELDS) <= set(r) and r["train_loss"] > 0 and r["val_l1"] > 0
               for r in records)
    train = training_keys(face_cache)
    assert records[-1]["samples_seen"] == 2 * (len(train) + len(train) % 2)
    pad = len(train) % 2  # the sampler repeats one sample to even the ranks out
    assert_each_sample_once_per_epoch(keys_per_epoch(keys, 2), train, pads=[pad, pad])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU can run them")
@pytest.mark.parametrize("args, says", [
    (["--precision", "fp16"], "--precision fp16 (with a GradScaler) needs a CUDA GPU; use "
                              "--precision bf16 on CPU"),
    (["--strategy", "deepspeed_stage_2"], "--strategy deepspeed_stage_2 needs DeepSpeed and a "
                                          "CUDA GPU"),
])
def test_gpu_only_settings_are_refused_in_one_line(tmp_path, args, says):
    with pytest.raises(SystemExit, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_script(SCRIPT, "train_lightning").main(
            ["--cache", str(tmp_path / "none"), "--out", str(tmp_path / "run"), *args])
