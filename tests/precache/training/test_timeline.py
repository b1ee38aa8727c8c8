"""StepTimeline on CPU with a real DataLoader and a real model: the data wait is timed on every
batch, the phases on a seeded sample that under gradient accumulation includes optimizer steps,
and the epoch's shares say which part dominated."""

from __future__ import annotations

import pytest
import torch

from precache.training.timeline import PHASES, StepTimeline, run_record
from tests.precache.training.timeline_runs import train


def test_a_slow_loader_shows_as_data_wait_and_a_big_model_as_compute():
    loader_bound, _ = train(delay=0.01, width=8, every=1)
    compute_bound, _ = train(delay=0.0, width=4096, every=1)
    for summary in (loader_bound, compute_bound):
        assert summary["batches"] == summary["sampled"] == 24
        assert sum(summary[p] for p in (*PHASES, "other")) == pytest.approx(1.0)
        assert summary["step_s"] > 0
    compute = lambda s: s["forward"] + s["backward"]  # noqa: E731
    assert loader_bound["data_wait"] > compute(loader_bound)
    assert compute(compute_bound) > compute_bound["data_wait"]
    assert compute_bound["data_wait"] < loader_bound["data_wait"]


def test_phases_are_timed_on_a_seeded_sample_that_includes_optimizer_steps():
    summary, steps = train(delay=0.0, width=256, every=4, accumulate=4, batches=200)
    assert summary["batches"] == 200 and 20 < summary["sampled"] < 100
    assert len(steps) == summary["sampled"]
    with_optimizer = [s for s in steps if s["optimizer_s"] > 0]
    assert with_optimizer and len(with_optimizer) < len(steps)  # accumulation: some batches only
    assert all((s["step"] + 1) % 4 == 0 for s in with_optimizer)
    for s in steps:
        assert s["kind"] == "step" and s["forward_s"] > 0 and s["backward_s"] > 0
        assert s["h2d_s"] + s["forward_s"] + s["backward_s"] + s["optimizer_s"] <= s["step_s"]
    again, steps_again = train(delay=0.0, width=256, every=4, accumulate=4, batches=200)
    assert [s["step"] for s in steps_again] == [s["step"] for s in steps]  # the same draw


def test_an_unsampled_batch_records_nothing_and_the_summary_resets():
    timeline = StepTimeline(torch.device("cpu"), every=10**9, seed=1)
    timeline.begin_epoch(3)
    timeline.data_ready()
    assert timeline.phase("forward") is timeline.phase("backward")  # the shared no-op
    with timeline.phase("forward"):
        pass
    timeline.end_step(0)
    first = timeline.epoch_summary()["timeline"]
    assert first["batches"] == 1 and first["sampled"] == 0 and first["forward"] == 0
    assert timeline.epoch_summary()["timeline"]["batches"] == 0
    with pytest.raises(ValueError, match="every must be at least 1"):
        StepTimeline(torch.device("cpu"), every=0)
    assert run_record(device="cpu", workers=2) == {"kind": "run",
                                                   "config": {"device": "cpu", "workers": 2}}
