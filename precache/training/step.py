"""The parts of a training step that every entry point in ``pipelines/`` does the same way:
mixed precision set-up, the OneCycle schedule driven by progress, the optimizer step of the speed
checklist, and the per-rank key and learning-rate logs."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

__all__ = ["OneCycleSchedule", "auto_precision", "cpu_has_native_bf16", "log_lr", "mixed_precision", "one_cycle", "open_keys_log",
           "open_lr_log", "optimizer_step"]

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
WARMUP = 0.3  # share of the run spent rising to the peak (torch's OneCycleLR pct_start default)


def mixed_precision(precision: str, device: torch.device) -> tuple[Any, torch.amp.GradScaler]:
    """``(autocast dtype or None, GradScaler)`` for ``bf16``, ``fp16`` or ``fp32``. The scaler
    is enabled only for fp16, whose small range needs it.

    Raises:
        SystemExit: fp16 without CUDA.
    """
    dtype = PRECISIONS[precision]
    if dtype is torch.float16 and device.type != "cuda":
        raise SystemExit("--precision fp16 needs CUDA; on a CPU use auto (the default) "
                         "or fp32")
    return dtype, torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)


def auto_precision(device: torch.device, cpu_bf16: bool | None = None) -> str:
    """``--precision auto`` (the trainers' default): bf16 where the hardware computes in it, fp16
    (with a GradScaler) on GPUs without bf16, fp32 on CPUs without native bf16 (AVX512-BF16,
    AMX), where torch emulates it (measured 23x slower than fp32 for MiniLM fine-tuning on an AVX2
    CPU). ``cpu_bf16``: whether the CPU has native bf16 (default: ``cpu_has_native_bf16()``)."""
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    native = cpu_has_native_bf16() if cpu_bf16 is None else cpu_bf16
    return "bf16" if native else "fp32"


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """True where the CPU computes bf16 in hardware (AVX512-BF16 or AMX); elsewhere torch
    emulates it, and bf16 autocast is slower than fp32. ``cpuinfo``: the text of
    ``/proc/cpuinfo`` (default: read it; without it, e.g. on macOS, False)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    return bool({"avx512_bf16", "amx_bf16"} & set(cpuinfo.split()))


def one_cycle(progress: float, start: float, peak: float, end: float,
              warmup: float = WARMUP) -> float:
    """The OneCycle curve at ``progress`` (clamped to 0..1): a half cosine from ``start`` to
    ``peak`` over the first ``warmup`` share of the run, then one from ``peak`` to ``end``.

    The shape of torch's ``OneCycleLR`` (cosine annealing), but of progress instead of a step
    count, so that a run resumed with another plan simply reads the curve at its new progress.
    """
    if not 0 <= warmup < 1:
        raise ValueError(f"warmup must be in [0, 1), not {warmup}")
    p = min(max(progress, 0.0), 1.0)
    if p < warmup:
        a, b, t = start, peak, p / warmup
    else:
        a, b, t = peak, end, (p - warmup) / (1 - warmup)
    return b + (a - b) * (1 + math.cos(math.pi * t)) / 2


class OneCycleSchedule:
    """OneCycle learning rate, with Adam's beta1 (or SGD's momentum) cycled the other way, as a
    function of progress: samples trained on so far (all ranks) / samples the run plans to see.

    Why not ``OneCycleLR``: it counts steps towards a total fixed when it is built, and its
    state carries that total into a resumed run. A run resumed with more ``--epochs``, or on
    fewer ranks (longer epochs, more steps), found its schedule at the end and trained every
    added step near the end rate (1e-4 to 2e-2 of the peak, measured). Here the state is only
    ``samples_seen``; the plan comes from the resumed run's own settings, so the curve is
    recomputed from the new plan.

    The optimizer's rate is always the curve at ``samples_seen / samples_planned``: set when
    built and by ``load_state_dict`` (call it after the optimizer's, which restores the old
    rate), then after every optimizer step by ``step(samples)``. Padding samples that a sampler
    repeats to even the ranks count as seen, so progress may pass 1 by a few samples per epoch;
    the curve stays at its end there.

    Args:
        optimizer: its param groups get ``lr`` (and ``betas[0]`` or a nonzero ``momentum``).
        peak_lr: the rate at the end of the warm-up.
        samples_planned: samples of the whole run, e.g. epochs x training samples.
        div_factor: the rate starts at ``peak_lr / div_factor`` (OneCycleLR's default 25).
        final_div_factor: and ends at the start rate / ``final_div_factor`` (default 1e4).
        momentum: (at the peak rate, at the start and end rates), OneCycleLR's (0.85, 0.95).
        warmup: share of the run spent rising to the peak (OneCycleLR's pct_start, 0.3).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, peak_lr: float, samples_planned: int, *,
                 div_factor: float = 25.0, final_div_factor: float = 1e4,
                 momentum: tuple[float, float] = (0.85, 0.95), warmup: float = WARMUP) -> None:
        if samples_planned < 1:
            raise ValueError(f"samples_planned must be at least 1, not {samples_planned}")
        self.optimizer, self.samples_planned, self.warmup = optimizer, int(samples_planned), warmup
        self.peak_lr, self.start_lr = peak_lr, peak_lr / div_factor
        self.end_lr = self.start_lr / final_div_factor
        self.momentum = momentum
        self.samples_seen = 0
        self._apply()

    @property
    def progress(self) -> float:
        return self.samples_seen / self.samples_planned

    def lr(self) -> float:
        """The rate at the current progress."""
        return one_cycle(self.progress, self.start_lr, self.peak_lr, self.end_lr, self.warmup)

    def _apply(self) -> None:
        lr = self.lr()
        low, high = self.momentum
        beta = one_cycle(self.progress, high, low, high, self.warmup)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            if "betas" in group:
                group["betas"] = (beta, *group["betas"][1:])
            elif group.get("momentum"):
                group["momentum"] = beta

    def step(self, samples: int) -> None:
        """Count an optimizer step's ``samples`` (all ranks) and set the next step's rate."""
        self.samples_seen += int(samples)
        self._apply()

    def state_dict(self) -> dict[str, int]:
        """``samples_seen``, and ``samples_planned`` for information: a resume plans anew."""
        return {"samples_seen": self.samples_seen, "samples_planned": self.samples_planned}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.samples_seen = int(state["samples_seen"])
        self._apply()


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler, schedule: OneCycleSchedule, clip: float,
                   samples: int) -> None:
    """Unscale and clip the gradients (``clip`` > 0), step, count the step's ``samples`` (all
    ranks) in the schedule, and free the gradients (``set_to_none``: no memset, and the next
    backward writes instead of adding)."""
    if clip:
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(optimizer)
    scaler.update()
    schedule.step(samples)
    optimizer.zero_grad(set_to_none=True)


def open_keys_log(folder: str | os.PathLike[str] | None, rank: int) -> IO[str] | None:
    """``folder/keys-rank<R>.tsv`` for appending ``epoch<TAB>key`` lines (``--log-keys``), or
    None without a folder."""
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return (Path(folder) / f"keys-rank{rank}.tsv").open("a")


def log_lr(lr_log: IO[str] | None, step: int, schedule: OneCycleSchedule) -> None:
    """Append the rate of optimizer step ``step`` and the progress it was read at to
    ``lr_log`` (``open_lr_log``; None on ranks other than 0)."""
    if lr_log is not None:
        lr = schedule.optimizer.param_groups[0]["lr"]
        lr_log.write(f"{step}\t{schedule.samples_seen}\t{schedule.samples_planned}\t{lr!r}\n")


def open_lr_log(folder: str | os.PathLike[str], rank: int) -> IO[str] | None:
    """On rank 0, ``folder/lr.tsv`` for appending ``step<TAB>samples_seen<TAB>samples_planned
    <TAB>lr`` before every optimizer step: the schedule a run followed, across its resumes.
    None on the other ranks."""
    if rank != 0:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return (Path(folder) / "lr.tsv").open("a")
