"""The parts of a training step that every entry point in ``pipelines/`` does the same way:
mixed precision set-up, the optimizer step of the speed checklist, and the per-rank key log."""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

__all__ = ["mixed_precision", "optimizer_step", "open_keys_log"]

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def mixed_precision(precision: str, device: torch.device) -> tuple[Any, torch.amp.GradScaler]:
    """``(autocast dtype or None, GradScaler)`` for ``bf16``, ``fp16`` or ``fp32``. The scaler
    is enabled only for fp16, whose small range needs it.

    Raises:
        SystemExit: fp16 without CUDA.
    """
    dtype = PRECISIONS[precision]
    if dtype is torch.float16 and device.type != "cuda":
        raise SystemExit("--precision fp16 needs CUDA; use bf16 on CPU")
    return dtype, torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler, scheduler: Any, clip: float) -> None:
    """Unscale and clip the gradients (``clip`` > 0), step, advance the schedule, and free the
    gradients (``set_to_none``: no memset, and the next backward writes instead of adding).
    The schedule stops at its last step: a resume on more ranks makes epochs longer."""
    if clip:
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(optimizer)
    scaler.update()
    if scheduler.last_epoch < scheduler.total_steps:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def open_keys_log(folder: str | os.PathLike[str] | None, rank: int) -> IO[str] | None:
    """``folder/keys-rank<R>.tsv`` for appending ``epoch<TAB>key`` lines (``--log-keys``), or
    None without a folder."""
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return (Path(folder) / f"keys-rank{rank}.tsv").open("a")
