"""pipelines/faces/train_lightning.py: the landmark model as a LightningModule over
CacheDataModule. Lightning starts 2 CPU processes (gloo) itself: ddp sees every training sample
once per epoch across them, fsdp (FSDP2 through ModelParallelStrategy: Lightning's FSDPStrategy
refuses the CPU) with bf16-mixed trains; fp16 and DeepSpeed, GPU-only, are refused in one
line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import make_face_cache
from tests.pipelines.coverage import clean_env, training_keys
from tests.pipelines.resume_checks import assert_each_sample_once_per_epoch, keys_per_epoch

pytest.importorskip("lightning")
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "pipelines" / "faces" / "train_lightning.py"


@pytest.fixture(scope="module")
def face_cache(tmp_path_factory) -> Path:
    return make_face_cache(tmp_path_factory.mktemp("lightning"), count=30, size=48, workers=2)


def train(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    env = clean_env(PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def epochs_in(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_trains_on_every_sample_once_per_epoch(face_cache, tmp_path):
    out, keys = tmp_path / "run", tmp_path / "keys"
    done = train("--cache", str(face_cache), "--out", str(out), "--devices", "2", "--epochs", "2",
                 "--batch-size", "4", "--workers", "0", "--log-keys", str(keys))
    assert done.returncode == 0, done.stderr[-4000:]
    records = epochs_in(out)
    assert [(r["epoch"], r["world_size"], r["strategy"]) for r in records] == [
        (0, 2, "DDPStrategy"), (1, 2, "DDPStrategy")]
    assert all(r["samples_per_s"] > 0 and r["train_loss"] > 0 for r in records)
    train_keys = training_keys(face_cache)
    pad = -len(train_keys) % 2  # the sampler repeats one sample to even the ranks out
    assert_each_sample_once_per_epoch(keys_per_epoch(keys, 2), train_keys, pads=[pad, pad])


@pytest.mark.slow
def test_fsdp_with_bf16_on_two_cpu_processes_trains(face_cache, tmp_path):
    out = tmp_path / "run"
    done = train("--cache", str(face_cache), "--out", str(out), "--devices", "2", "--epochs", "2",
                 "--batch-size", "4", "--workers", "0", "--strategy", "fsdp",
                 "--precision", "bf16-mixed")
    assert done.returncode == 0, done.stderr[-4000:]
    records = epochs_in(out)
    assert [(r["epoch"], r["strategy"], r["precision"]) for r in records] == [
        (0, "ModelParallelStrategy", "bf16-mixed"), (1, "ModelParallelStrategy", "bf16-mixed")]
    assert all(r["train_loss"] > 0 and r["val_l1"] > 0 for r in records)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU can run them")
@pytest.mark.parametrize("args, says", [
    (["--precision", "16-mixed"], "--precision 16-mixed (fp16 with a GradScaler) needs a CUDA "
                                  "GPU; use --precision bf16-mixed on CPU"),
    (["--strategy", "deepspeed_stage_2"], "--strategy deepspeed_stage_2 needs"),
])
def test_gpu_only_settings_are_refused_in_one_line(face_cache, tmp_path, args, says):
    done = train("--cache", str(face_cache), "--out", str(tmp_path / "run"), *args, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(says)
    assert "Traceback" not in done.stderr
