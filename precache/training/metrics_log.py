"""The metrics log of a training run: one record schema for every trainer.

Rank 0 appends JSON lines to ``<out>/metrics.jsonl``:

- ``{"kind": "run", "config": {...}}`` once per launch (``timeline.run_record``);
- ``{"kind": "step", ...}`` for the batches the step timeline samples (``StepTimeline``);
- ``{"kind": "epoch", ...}`` once per epoch, with the fields of ``EPOCH_FIELDS`` (every trainer
  writes them) and the task's own (validation metrics such as ``val_accuracy``, throughput such
  as ``tokens_per_s``), which may not reuse a name of ``EPOCH_FIELDS``.

Rank 0 also prints one readable line per epoch to stdout (``epoch_line``): the record itself is
for programs (``precache doctor``, plots), the line for the person watching the run.

The other ranks hold a ``MetricLog`` that writes nothing, so the loop calls it on every rank.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

from precache.training.timeline import run_record

__all__ = ["EPOCH_FIELDS", "MetricLog", "epoch_line", "epoch_record"]

# What every epoch record holds: its place in the run, the training loss (mean over the rank's
# batches), samples/s (all ranks), the share of step time spent waiting for data (all ranks),
# the number of ranks, the learning rate after the epoch, the strategy and precision it ran
# with, and the schedule's progress (samples trained on so far, and planned for the run).
EPOCH_FIELDS = ("kind", "epoch", "step", "train_loss", "samples_per_s", "data_wait",
                "world_size", "lr", "strategy", "precision", "samples_seen", "samples_planned")


def epoch_record(*, epoch: int, step: int, train_loss: float, samples_per_s: float,
                 data_wait: float, world_size: int, lr: float, strategy: str, precision: str,
                 samples_seen: int, samples_planned: int, **task: Any) -> dict[str, Any]:
    """An epoch record: the fields of ``EPOCH_FIELDS`` and then the task's ``task`` fields (a
    ``timeline`` summary among them, where the trainer keeps one).

    Raises:
        ValueError: a task field reuses a name of ``EPOCH_FIELDS``, or a value is out of its
            range (a share outside 0..1, a negative rate).
    """
    if "kind" in task:
        raise ValueError("a task field may not be called 'kind' (one of EPOCH_FIELDS)")
    if not 0.0 <= data_wait <= 1.0:
        raise ValueError(f"data_wait is a share of step time, in [0, 1], not {data_wait}")
    if samples_per_s < 0 or world_size < 1:
        raise ValueError(f"samples_per_s must be >= 0 and world_size >= 1, not "
                         f"{samples_per_s} and {world_size}")
    return {"kind": "epoch", "epoch": int(epoch), "step": int(step),
            "train_loss": float(train_loss), "samples_per_s": float(samples_per_s),
            "data_wait": float(data_wait), "world_size": int(world_size), "lr": float(lr),
            "strategy": strategy, "precision": precision, "samples_seen": int(samples_seen),
            "samples_planned": int(samples_planned), **task}


def epoch_line(record: dict[str, Any], epochs: int | None = None,
               seconds: float | None = None) -> str:
    """One readable line for an epoch record, e.g. ``epoch 2/5: loss 0.4123, val_l1 0.03125,
    1,234 samples/s, data wait 3%, 12.3 s``: the training loss, the task's validation metrics
    (its ``val_`` fields), the rate, the data wait and the epoch's wall time (``seconds``,
    validation included). Epochs count from 1 here (the record's ``epoch`` from 0)."""
    of = f"/{epochs}" if epochs else ""
    parts = [f"loss {record['train_loss']:.4g}"]
    parts += [f"{name} {value:.4g}" for name, value in record.items()
              if name.startswith("val_") and isinstance(value, (int, float))]
    parts.append(f"{record['samples_per_s']:,.0f} samples/s")
    parts.append(f"data wait {100 * record['data_wait']:.0f}%")
    if seconds is not None:
        parts.append(f"{seconds:,.1f} s")
    return f"epoch {record['epoch'] + 1}{of}: " + ", ".join(parts)


class MetricLog:
    """``<out>/metrics.jsonl`` on rank 0, nothing on the other ranks.

    Args:
        out: the run's folder (made if missing).
        rank: this process's rank; only rank 0 writes.
        echo: also print each epoch's readable line (``epoch_line``) to stdout.
        epochs: the run's epochs, for ``epoch 2/5`` in that line.
    """

    def __init__(self, out: str | os.PathLike[str], rank: int, *, echo: bool = True,
                 epochs: int | None = None) -> None:
        self.echo, self.epochs = echo, epochs
        self.stream: IO[str] | None = None
        if rank == 0:
            Path(out).mkdir(parents=True, exist_ok=True)
            self.stream = (Path(out) / "metrics.jsonl").open("a", encoding="utf-8")

    def run(self, **config: Any) -> None:
        """Write the run's settings (the keys ``precache doctor`` reads: ``timeline``)."""
        self._write(run_record(**config))

    def epoch(self, *, seconds: float | None = None, **fields: Any) -> dict[str, Any]:
        """Write and return ``epoch_record(**fields)``; print its line (``seconds``: the
        epoch's wall time, for that line only)."""
        record = epoch_record(**fields)
        self._write(record)
        if self.stream is not None and self.echo:
            print(epoch_line(record, self.epochs, seconds), flush=True)
        return record

    def _write(self, record: dict[str, Any]) -> None:
        if self.stream is not None:
            self.stream.write(json.dumps(record) + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
