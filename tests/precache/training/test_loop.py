"""precache.training.loop.fit, the one loop of every trainer, on a tiny synthetic task
(``loop_job.Regression``): in this process for what one process shows (the record schema, the
timeline, accumulation and clipping, the precision choice, weights-only checkpoints), and under
torchrun with real gloo ranks for what needs several: a run stopped mid-epoch on 2 fsdp ranks
resumes on 3 zero ranks with more epochs, every sample once per epoch across the ranks of both
launches, every step's rate on the OneCycle curve of its run's plan.

The trainers in pipelines/ get one end-to-end test each (tests/pipelines/); what is proved here
is not proved again there."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from precache.training.checkpoint import load_checkpoint, save_checkpoint
from precache.training.loop import fit
from precache.training.metrics_log import EPOCH_FIELDS
from precache.training.settings import Settings
from precache.training.step import cpu_has_native_bf16, one_cycle
from tests.helpers import assert_each_sample_once_per_epoch, keys_per_epoch, run_torchrun
from tests.precache.training.loop_job import Regression

JOB = Path(__file__).with_name("loop_job.py")
PEAK = 1e-2


def settings(tmp_path: Path, **changes: object) -> Settings:
    base = dict(cache="unused", out=str(tmp_path / "run"), batch_size=2, lr=PEAK, workers=0,
                precision="fp32")
    return Settings(**{**base, **changes})  # type: ignore[arg-type]


def read_lr_log(out: Path) -> list[tuple[int, int, int, float]]:
    """``(step, samples_seen, samples_planned, lr)`` of every optimizer step, all launches."""
    rows = []
    for line in (out / "lr.tsv").read_text().splitlines():
        step, seen, planned, lr = line.split("\t")
        rows.append((int(step), int(seen), int(planned), float(lr)))
    return rows


def assert_on_the_curve(rows: list[tuple[int, int, int, float]], peak: float) -> None:
    """Each step once, across resumes; samples seen only grow; each rate is the curve (OneCycle
    defaults: start peak/25, end start/1e4) at that step's progress in its own run's plan."""
    assert [row[0] for row in rows] == list(range(len(rows)))
    assert rows[0][1] == 0 and all(a[1] < b[1] for a, b in zip(rows, rows[1:]))
    for step, seen, planned, lr in rows:
        expected = one_cycle(seen / planned, peak / 25, peak, peak / 25 / 1e4)
        assert lr == pytest.approx(expected, rel=1e-9), (step, seen, planned)


def records(out: Path) -> dict[str, list[dict]]:
    """The records of ``out/metrics.jsonl`` by kind."""
    kinds: dict[str, list[dict]] = {"run": [], "step": [], "epoch": []}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        kinds[record["kind"]].append(record)
    return kinds


def test_every_epoch_record_has_the_one_schema_and_a_timeline(tmp_path):
    fit(Regression(12), settings(tmp_path, epochs=2, timeline_every=1))
    out = tmp_path / "run"
    kinds = records(out)
    assert len(kinds["run"]) == 1
    config = kinds["run"][0]["config"]
    assert config["strategy"] == "ddp" and config["precision"] == "fp32"
    assert config["world_size"] == 1 and config["task"] == "regression"  # the task's extra
    for epoch, record in enumerate(kinds["epoch"]):
        assert list(record)[:len(EPOCH_FIELDS)] == list(EPOCH_FIELDS)
        assert set(record) - set(EPOCH_FIELDS) == {"val_mse", "bf16_batches", "timeline"}
        assert record["epoch"] == epoch and record["step"] == 6 * (epoch + 1)
        assert record["samples_seen"] == 12 * (epoch + 1) and record["samples_planned"] == 24
        assert 0 <= record["data_wait"] <= 1 and record["samples_per_s"] > 0
        shares = record["timeline"]
        assert shares["batches"] == shares["sampled"] == 6  # --timeline-every 1: all of them
        assert sum(shares[k] for k in ("data_wait", "h2d", "forward", "backward", "optimizer",
                                       "other")) == pytest.approx(1)
    steps = kinds["step"]
    assert len(steps) == 12 and all(s["forward_s"] > 0 and s["backward_s"] > 0 for s in steps)
    assert all(s["optimizer_s"] > 0 for s in steps)  # no accumulation: every batch steps
    assert_on_the_curve(read_lr_log(out), PEAK)
    checkpoint = load_checkpoint(out / "last.pt")  # weights only: tensors and plain data
    assert checkpoint["epoch"] == 2 and checkpoint["step"] == 12
    assert checkpoint["task"] == "regression" and checkpoint["strategy"] == "ddp"
    assert {"model", "optimizer", "scaler", "schedule", "loader"} <= checkpoint.keys()


def _grad_norm(optimizer: torch.optim.Optimizer) -> float:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None]
    return math.sqrt(sum(float(g.square().sum()) for g in grads))


@pytest.mark.parametrize("clip", [1e-3, 0.0])
def test_accumulation_steps_every_nth_batch_and_clip_bounds_the_gradient_norm(tmp_path, clip):
    norms: list[float] = []
    hook = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: norms.append(_grad_norm(optimizer)))
    try:
        fit(Regression(12), settings(tmp_path, epochs=1, accumulate=3, clip=clip))
    finally:
        hook.remove()
    assert len(norms) == 2  # 6 batches, one optimizer step per 3
    rows = read_lr_log(tmp_path / "run")
    assert [seen for _, seen, _, _ in rows] == [0, 6]  # 3 batches of 2 samples per step
    if clip:
        assert max(norms) <= clip * (1 + 1e-4)
    else:
        assert min(norms) > 1e-3  # the same steps, unclipped: what --clip bounded


@pytest.mark.parametrize("precision", ["bf16", "fp32", "auto"])
def test_the_precision_flag_picks_the_autocast_dtype(tmp_path, precision):
    fit(Regression(8), settings(tmp_path, epochs=1, precision=precision))
    expected = {"auto": "bf16" if cpu_has_native_bf16() else "fp32"}.get(precision, precision)
    kinds = records(tmp_path / "run")
    assert kinds["run"][0]["config"]["precision"] == expected
    record = kinds["epoch"][0]
    assert record["precision"] == expected
    assert record["bf16_batches"] == (4 if expected == "bf16" else 0)  # forward passes in bf16


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs fp16")
def test_fp16_without_cuda_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="--precision fp16 needs CUDA; on a CPU use auto"):
        fit(Regression(8), settings(tmp_path, precision="fp16"))


def test_a_checkpoint_that_would_run_code_is_refused_with_one_line_naming_it(tmp_path):
    class RunsCode:  # unpickled, it creates the marker file
        def __reduce__(self):
            return (open, (str(tmp_path / "marker"), "w"))

    evil = save_checkpoint({"step": 1, "payload": RunsCode()}, tmp_path / "last.pt")
    with pytest.raises(SystemExit) as refused:
        fit(Regression(8), settings(tmp_path, resume=str(evil)))
    message = str(refused.value)
    assert message.startswith(f"refusing to load checkpoint {evil}: it holds io.open, and "
                              "loading it could run code")
    assert "\n" not in message and not (tmp_path / "marker").exists()


@pytest.mark.slow
def test_a_run_stopped_on_two_fsdp_ranks_resumes_on_three_zero_ranks_with_each_sample_once(
        tmp_path):
    out, keys = tmp_path / "run", tmp_path / "keys"
    common = ["--cache", "unused", "--out", str(out), "--workers", "0", "--precision", "fp32",
              "--log-keys", str(keys), "--samples", "30"]
    first = run_torchrun(JOB, 2, *common, "--strategy", "fsdp", "--epochs", "1",
                         "--max-steps", "2")
    checkpoint = load_checkpoint(out / "last.pt")
    assert checkpoint["strategy"] == "fsdp" and "model" not in checkpoint  # the shards hold it
    assert (out / checkpoint["shards"] / ".metadata").is_file()
    assert first[-1]["step"] == checkpoint["step"] == 2 and checkpoint["epoch"] == 0
    assert checkpoint["loader"]["offset"] == 2 * 2 * 2 < checkpoint["loader"]["size"]  # samples
    assert checkpoint["schedule"] == {"samples_seen": 8, "samples_planned": 30}

    resumed = run_torchrun(JOB, 3, *common, "--strategy", "zero", "--epochs", "2",
                           "--resume", str(out / "last.pt"))
    assert [(r["epoch"], r["world_size"], r["strategy"]) for r in resumed] == [
        (0, 3, "zero"), (1, 3, "zero")]
    assert resumed[0]["step"] == 2 + 4  # 22 samples left: 4 rounds of 3 ranks x 2

    # Samples: the rest of epoch 0 on 3 ranks (2 repeated to even them out), then epoch 1.
    train = [f"s{i:03d}" for i in range(30)]
    merged = keys_per_epoch(keys, 3)
    assert_each_sample_once_per_epoch(merged, train, pads=[2, 0])
    assert resumed[-1]["samples_seen"] == sum(len(k) for k in merged.values()) == 8 + 24 + 30
    # Learning rate: 2 steps on the 1-epoch curve, then the 2-epoch curve from where they left.
    rows = read_lr_log(out)
    assert [planned for _, _, planned, _ in rows] == [30] * 2 + [60] * 9
    assert rows[2][1] == 8
    assert_on_the_curve(rows, PEAK)
    final = load_checkpoint(out / "last.pt")  # zero: the state gathered into one file
    assert final["strategy"] == "zero" and final["epoch"] == 2 and "model" in final
