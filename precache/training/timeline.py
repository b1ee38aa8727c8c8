"""Where a training step's time goes: data wait, host-to-device copy, forward, backward, optimizer.

The data wait is timed on every batch with the host clock: it is what the loader costs the step,
and reading a clock is free. The other phases are timed on a sample of batches only, drawn at
random with probability ``1/every`` (seeded), so that under gradient accumulation the batches
that step the optimizer are sampled in their share; on the batches not drawn ``phase()`` does
nothing at all.

- **CPU:** phase boundaries are host clock readings (CPU ops run synchronously).
- **CUDA:** phase boundaries are CUDA events recorded on the current stream, so nothing in the
  measured step waits for the GPU. A sampled batch's events are read once they have completed:
  when the next sampled batch starts (by then they have, as a rule) or at the end of the epoch,
  which synchronizes at most once.

Rank 0 writes each sampled batch as a ``{"kind": "step", ...}`` line to the run's
``metrics.jsonl``; ``epoch_summary()`` gives the epoch's shares for its epoch record, and
``run_record(**config)`` the run's settings, which ``precache doctor`` reads with them.

Config keys that ``precache doctor`` reads (all optional): ``device`` (cpu/cuda), ``world_size``,
``workers`` (loader workers per rank), ``cpus`` (of the node), ``batch_size``, ``accumulate``,
``precision`` (fp32/bf16/fp16), ``cpu_bf16`` (the CPU computes bf16 natively), ``compile``,
``channels_last`` (None where it does not apply), ``input`` (images/tokens), ``columns`` (read
from the cache), ``columns_used`` (used by the step), ``transform_in_loader``, ``pin_memory``,
``strategy``.
"""

from __future__ import annotations

import json
import random
import time
from contextlib import contextmanager, nullcontext
from typing import IO, Any, ContextManager, Iterator

import torch

__all__ = ["PHASES", "StepTimeline", "run_record"]

PHASES = ("data_wait", "h2d", "forward", "backward", "optimizer")
TIMED = PHASES[1:]  # the phases timed on sampled batches
_NOTHING = nullcontext()


def run_record(**config: Any) -> dict[str, Any]:
    """The run's settings as a ``metrics.jsonl`` record (see the module docstring for keys)."""
    return {"kind": "run", "config": config}


class _Sample:
    """The boundaries of one sampled batch: (phase, start mark, end mark)."""

    def __init__(self, epoch: int, data_wait: float, started: float) -> None:
        self.epoch, self.data_wait, self.started = epoch, data_wait, started
        self.step = 0
        self.host_s = 0.0
        self.begin: Any = None  # CUDA: events around the whole batch
        self.end: Any = None
        self.marks: list[tuple[str, Any, Any]] = []


class StepTimeline:
    """Times the phases of training batches; see the module docstring.

    Args:
        device: the training device; CUDA events time the phases there.
        every: about one batch in ``every`` has its phases timed (1: all).
        seed: seed of the draw, so that reruns sample the same batches.
        log: where sampled batches are written as JSON lines (rank 0's metrics.jsonl), or None.
        rank: this process's rank, written into the lines.
    """

    def __init__(self, device: torch.device, *, every: int = 10, seed: int = 0,
                 log: IO[str] | None = None, rank: int = 0) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, not {every}")
        self.cuda = device.type == "cuda"
        self.every, self.log, self.rank = every, log, rank
        self._draw = random.Random(seed)
        self._current: _Sample | None = None
        self._pending: list[_Sample] = []  # sampled, events not read yet (CUDA)
        self._reset(0)

    def _reset(self, epoch: int) -> None:
        self.epoch = epoch
        self._batches, self._wait, self._wall = 0, 0.0, 0.0
        self._sums = dict.fromkeys(TIMED, 0.0)
        self._sampled, self._sampled_s = 0, 0.0
        self._tick = time.perf_counter()

    def begin_epoch(self, epoch: int) -> None:
        """Start the epoch's clocks; the first batch's data wait starts now."""
        self._resolve(wait=True)
        self._reset(epoch)

    def data_ready(self) -> None:
        """The loader gave a batch: its data wait ends, its work starts."""
        now = time.perf_counter()
        wait = now - self._tick
        self._wait += wait
        self._started = now
        self._current = None
        if self.every == 1 or self._draw.random() * self.every < 1:
            self._resolve(wait=False)
            self._current = _Sample(self.epoch, wait, now)
            if self.cuda:
                self._current.begin = self._mark()

    def phase(self, name: str) -> ContextManager[None]:
        """Time ``name`` (one of h2d, forward, backward, optimizer) if this batch is sampled."""
        if self._current is None:
            return _NOTHING
        if name not in TIMED:
            raise ValueError(f"unknown phase {name!r}; one of {', '.join(TIMED)}")
        return self._timed(name)

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        start = self._mark()
        try:
            yield
        finally:
            if self._current is not None:
                self._current.marks.append((name, start, self._mark()))

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def end_step(self, step: int) -> None:
        """This batch's work is queued; the next batch's data wait starts now."""
        now = time.perf_counter()
        self._batches += 1
        self._wall += now - self._started  # the work part; the wait is counted apart
        if self._current is not None:
            self._current.step = step
            self._current.host_s = now - self._current.started
            if self.cuda:
                self._current.end = self._mark()
            self._pending.append(self._current)
            self._current = None
            if not self.cuda:
                self._resolve(wait=True)
        self._tick = time.perf_counter()

    def _resolve(self, wait: bool) -> None:
        """Read the pending samples whose timings are complete (all of them if ``wait``)."""
        while self._pending:
            sample = self._pending[0]
            if self.cuda and not sample.end.query():
                if not wait:
                    return
                sample.end.synchronize()
            self._pending.pop(0)
            self._add(sample)

    def _add(self, sample: _Sample) -> None:
        phases = dict.fromkeys(TIMED, 0.0)
        busy = sample.host_s  # on CUDA, the longer of host and device time of the batch
        if self.cuda:
            busy = max(busy, sample.begin.elapsed_time(sample.end) / 1e3)
        for name, start, end in sample.marks:
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            phases[name] += seconds
        for name in TIMED:
            self._sums[name] += phases[name]
        self._sampled += 1
        self._sampled_s += busy
        if self.log is not None:
            self.log.write(json.dumps({
                "kind": "step", "epoch": sample.epoch, "step": sample.step, "rank": self.rank,
                "data_wait_s": sample.data_wait, **{f"{n}_s": phases[n] for n in TIMED},
                "step_s": sample.data_wait + busy}) + "\n")

    def epoch_summary(self) -> dict[str, Any]:
        """``{"timeline": {...}}``: the epoch's batches, sampled batches, mean seconds per batch,
        and the share of the epoch's time in each phase (they sum to 1).

        The data wait share is measured on every batch. The other phases' shares are estimated
        from the sampled batches: each phase's mean time over the mean sampled batch time, times
        the share not spent waiting; ``other`` is what the phases do not cover (logging,
        bookkeeping, and on CUDA the time the host ran ahead of the device)."""
        self._resolve(wait=True)
        total = self._wait + self._wall
        wait_share = self._wait / total if total > 0 else 0.0
        busy = 1.0 - wait_share
        shares = {name: (busy * self._sums[name] / self._sampled_s if self._sampled_s > 0 else 0.0)
                  for name in TIMED}
        covered = sum(shares.values())
        if covered > busy:  # device time beyond the host's: scale into the busy share
            shares = {n: s * busy / covered for n, s in shares.items()}
            covered = busy
        summary = {"batches": self._batches, "sampled": self._sampled,
                   "step_s": total / self._batches if self._batches else 0.0,
                   "data_wait": wait_share, **shares, "other": max(0.0, busy - covered)}
        if self.log is not None:
            self.log.flush()
        self._reset(self.epoch)
        return {"timeline": summary}
