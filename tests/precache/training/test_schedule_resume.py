"""The OneCycle schedule is a function of progress (samples seen / samples planned): it has
torch's OneCycleLR shape, and a run resumed with a larger plan or on other ranks continues on the
curve of its new plan instead of at the old curve's end (about 1e-4 of the peak)."""

from __future__ import annotations

import math

import pytest
import torch

from precache.training import OneCycleSchedule, one_cycle

PEAK = 2e-3
START, END = PEAK / 25, PEAK / 25 / 1e4  # OneCycleLR's div_factor and final_div_factor


def adamw() -> torch.optim.AdamW:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=PEAK)


def written_out(p: float) -> float:
    """The curve written out: cosine up to the peak over the first 30%, cosine down after."""
    if p <= 0.3:
        return START + (PEAK - START) * (1 - math.cos(math.pi * p / 0.3)) / 2
    return END + (PEAK - END) * (1 + math.cos(math.pi * (p - 0.3) / 0.7)) / 2


@pytest.mark.parametrize("p", [0.0, 0.05, 0.15, 0.3, 0.31, 0.5, 0.65, 0.9, 0.999, 1.0])
def test_the_rate_at_progress_p_is_the_one_cycle_formula(p):
    assert one_cycle(p, START, PEAK, END) == pytest.approx(written_out(p), rel=1e-12, abs=1e-15)


def test_the_curve_starts_peaks_and_ends_where_one_cycle_does_and_is_clamped():
    assert one_cycle(0.0, START, PEAK, END) == pytest.approx(START)
    assert one_cycle(0.15, START, PEAK, END) == pytest.approx((START + PEAK) / 2)  # half way up
    assert one_cycle(0.3, START, PEAK, END) == pytest.approx(PEAK)
    assert one_cycle(0.65, START, PEAK, END) == pytest.approx((PEAK + END) / 2)  # half way down
    assert one_cycle(1.0, START, PEAK, END) == pytest.approx(END)
    assert one_cycle(-0.5, START, PEAK, END) == one_cycle(0.0, START, PEAK, END)
    assert one_cycle(1.02, START, PEAK, END) == one_cycle(1.0, START, PEAK, END)  # padding
    with pytest.raises(ValueError, match=r"warmup must be in \[0, 1\), not 1"):
        one_cycle(0.5, START, PEAK, END, warmup=1)


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")  # no step
def test_it_follows_torchs_one_cycle_lr_rate_and_momentum_over_a_long_run():
    total = 2_001
    ours, theirs = adamw(), adamw()
    reference = torch.optim.lr_scheduler.OneCycleLR(theirs, max_lr=PEAK, total_steps=total)
    schedule = OneCycleSchedule(ours, PEAK, samples_planned=(total - 1) * 8)
    for step in range(total):
        if step % 100 == 0 or step == total - 1:
            for mine, torchs in zip(ours.param_groups, theirs.param_groups):
                assert mine["lr"] == pytest.approx(torchs["lr"], abs=3e-3 * PEAK), step
                assert mine["betas"][0] == pytest.approx(torchs["betas"][0], abs=1e-3), step
                assert mine["betas"][1] == torchs["betas"][1] == 0.999
        if step < total - 1:
            schedule.step(8)  # 8 samples a step, e.g. 2 ranks x 4
            reference.step()


def test_a_resume_with_more_epochs_continues_on_the_new_curve_not_at_the_old_end():
    first = adamw()
    schedule = OneCycleSchedule(first, PEAK, samples_planned=100 * 8)  # 1 epoch of 100 steps
    for _ in range(100):
        schedule.step(8)
    assert first.param_groups[0]["lr"] == pytest.approx(END)  # the run is over
    state = schedule.state_dict()
    assert state == {"samples_seen": 800, "samples_planned": 800}

    # Resubmitted with --epochs 2: the optimizer's own state restores the old, final rate; the
    # schedule, loaded after it, reads the curve of the 2-epoch plan at progress 1/2.
    second = adamw()
    second.load_state_dict(first.state_dict())
    assert second.param_groups[0]["lr"] == pytest.approx(END)
    resumed = OneCycleSchedule(second, PEAK, samples_planned=2 * 100 * 8)
    resumed.load_state_dict(state)
    assert resumed.progress == 0.5
    assert second.param_groups[0]["lr"] == pytest.approx(written_out(0.5))  # 0.81 of the peak
    rates = []
    for _ in range(100):  # the added epoch, on fewer ranks: 4 samples a step instead of 8
        rates.append(second.param_groups[0]["lr"])
        resumed.step(4)
        resumed.step(4)
    assert rates == pytest.approx([written_out(0.5 + k / 200) for k in range(100)])
    assert rates[0] > 0.8 * PEAK and sum(rates) / len(rates) > 0.3 * PEAK  # not ~1e-4 of it
    assert rates == sorted(rates, reverse=True)
    assert second.param_groups[0]["lr"] == pytest.approx(END)  # and it ends where it should


def test_the_rate_depends_on_samples_not_on_how_many_ranks_or_steps_brought_them():
    two, three = adamw(), adamw()
    on_two = OneCycleSchedule(two, PEAK, samples_planned=600)
    on_three = OneCycleSchedule(three, PEAK, samples_planned=600)
    for _ in range(30):
        on_two.step(2 * 4)  # 2 ranks x batch 4
    for _ in range(20):
        on_three.step(3 * 4)
    assert on_two.samples_seen == on_three.samples_seen == 240
    assert two.param_groups[0]["lr"] == three.param_groups[0]["lr"]
    assert two.param_groups[0]["lr"] == pytest.approx(written_out(0.4))


def test_sgd_momentum_cycles_and_a_plan_of_no_samples_is_refused():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK, momentum=0.9)
    schedule = OneCycleSchedule(sgd, PEAK, samples_planned=10)
    assert sgd.param_groups[0]["momentum"] == pytest.approx(0.95)
    schedule.step(3)  # progress 0.3: the peak rate, the lowest momentum
    assert sgd.param_groups[0]["lr"] == pytest.approx(PEAK)
    assert sgd.param_groups[0]["momentum"] == pytest.approx(0.85)
    with pytest.raises(ValueError, match="samples_planned must be at least 1, not 0"):
        OneCycleSchedule(sgd, PEAK, samples_planned=0)
