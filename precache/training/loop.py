"""The one training loop of precache's trainers: ``fit(task, settings)``.

A ``Task`` (a recipe in ``pipelines/`` writes one) supplies the data, the model, the step from a
batch to a loss, a validation hook and what its checkpoints carry besides the states; ``fit``
does the rest, the same way for every trainer:

- the process group from torchrun's or Slurm's environment (``distributed``), and the CPU
  threads left to each rank after its loader workers;
- ``--strategy ddp|zero|fsdp`` (``strategy``); autocast with ``--precision bf16|fp16|fp32|auto``
  (fp16 with a GradScaler, CUDA only); gradient accumulation, clipping and ``set_to_none``
  (``step.optimizer_step``); ``--compile``;
- the OneCycle schedule as a function of progress, samples trained on / ``epochs`` x training
  samples (``step.OneCycleSchedule``), each step's rate in ``<out>/lr.tsv``;
- the step timeline (``timeline``: the data wait of every batch, the phases of a sample; of every
  batch where an epoch has few, ``timeline_every``) and one epoch record schema in
  ``<out>/metrics.jsonl`` (``metrics_log``);
- on rank 0, a progress bar per epoch (on a terminal) and one readable line per epoch;
- ``<out>/last.pt`` every ``save_every`` optimizer steps and at every epoch's end: model,
  optimizer, scaler, schedule, and the loader's position in samples, so that ``resume``
  continues mid-epoch on any number of ranks and under any strategy; loaded weights-only
  (``checkpoint``): a checkpoint that would run code is refused in one line.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from precache.loading.loaders.device import DevicePrefetcher
from precache.training.checkpoint import CheckpointRefused
from precache.training.distributed import cleanup, init_distributed
from precache.training.metrics_log import MetricLog
from precache.training.settings import Settings
from precache.training.step import (OneCycleSchedule, auto_precision, cpu_has_native_bf16,
                                    log_lr, mixed_precision, open_keys_log, open_lr_log,
                                    optimizer_step)
from precache.training.strategy import StrategyMismatch, make_strategy
from precache.training.timeline import StepTimeline

__all__ = ["Loader", "Run", "Step", "Task", "TrainData", "fit", "timeline_every"]

SAMPLED_PER_EPOCH = 10
"""Batches an epoch should time in detail: with fewer than ``SAMPLED_PER_EPOCH`` x
``--timeline-every`` batches, every batch is timed (``timeline_every``)."""


class Loader(Protocol):
    """What ``fit`` asks of a training loader (``CacheLoader`` has it all, over a
    ``DistributedShardSampler`` or a batch sampler). ``consumed`` counts samples this rank
    trained on in the epoch since it started or was resumed."""

    num_workers: int  # loader threads or processes (the run record, the CPU threads left)
    worker_kind: str  # "threads", "processes" or "none"

    def set_epoch(self, epoch: int) -> None: ...
    def start_epoch(self, epoch: int) -> None: ...
    def state_dict(self, consumed: int) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def cached_dataset(self) -> Any: ...
    def __iter__(self) -> Iterator[Any]: ...
    def close(self) -> None: ...


@dataclass
class TrainData:
    """A task's training data.

    Attributes:
        loader: the training loader, split over the ranks.
        samples: training samples in one epoch (the schedule plans ``epochs`` x this many).
        columns: the cache columns read (the run record).
        transform_in_loader: the loader's workers run a transform (the run record).
    """

    loader: Loader
    samples: int
    columns: list[str]
    transform_in_loader: bool = False


class Step(NamedTuple):
    """What a task's ``loss`` returns: the batch's mean loss, its number of samples, and sums
    the task wants over the epoch and all ranks (given to ``Task.report``)."""

    loss: torch.Tensor
    samples: int
    sums: dict[str, Any] = {}


@dataclass
class Run:
    """Where a task runs: the settings, this process's rank among ``world_size``, its device,
    and the precision resolved from ``settings.precision`` (``auto`` decided)."""

    settings: Settings
    rank: int
    world_size: int
    device: torch.device
    precision: str
    amp_dtype: torch.dtype | None = field(default=None)

    def autocast(self) -> AbstractContextManager[Any]:
        """Autocast to the run's precision on its device (a no-op for fp32)."""
        return torch.autocast(self.device.type, dtype=self.amp_dtype,
                              enabled=self.amp_dtype is not None)

    def all_sum(self, values: Iterable[float]) -> list[float]:
        """``values`` summed over all ranks (float64; one all-reduce)."""
        totals = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(totals)
        return totals.tolist()


class Task:
    """A training task: a recipe subclasses it and overrides ``data``, ``model``, ``loss`` and,
    as needed, the rest.

    Attributes:
        input: ``images`` or ``tokens`` (the run record, for ``precache doctor``).
        channels_last: the model's weights in channels_last (None: the question does not apply).
        weight_decay: AdamW's.
        compile_dynamic: ``torch.compile(dynamic=...)`` (input shapes vary per batch).
        prefetch: copy each next batch to the device during the step (``DevicePrefetcher``);
            off, ``inputs`` receives the batch on the host and copies it itself.
    """

    input = "images"
    channels_last: bool | None = None
    weight_decay = 1e-4
    compile_dynamic = False
    prefetch = True

    def data(self, run: Run) -> TrainData:
        """Open the cache: the training loader (and whatever ``validate`` reads)."""
        raise NotImplementedError

    def model(self, run: Run) -> nn.Module:
        """The model, on the CPU (called after ``data``)."""
        raise NotImplementedError

    def inputs(self, batch: Any, run: Run) -> Any:
        """The batch as the model's inputs on ``run.device`` (timed as the h2d phase)."""
        return batch

    def loss(self, net: nn.Module, inputs: Any, run: Run) -> Step:
        """The forward pass and the loss, under autocast (timed as the forward phase)."""
        raise NotImplementedError

    def keys(self, batch: Any) -> list[str]:
        """The keys of the batch's samples, for ``--log-keys``."""
        return list(batch["key"])

    def validate(self, net: nn.Module, run: Run) -> dict[str, Any]:
        """Metrics of the epoch's model (every rank calls it, under ``torch.no_grad``, in eval
        mode); the same on every rank."""
        return {}

    def report(self, sums: dict[str, float], seconds: float) -> dict[str, Any]:
        """The task's fields of an epoch record, from its ``Step.sums`` (all ranks) and the
        epoch's seconds on this rank."""
        return {}

    def extra(self) -> dict[str, Any]:
        """Plain data added to every checkpoint and to the run record (e.g. the classes)."""
        return {}

    def check(self, state: dict[str, Any], path: str) -> None:
        """Refuse (``SystemExit``) a checkpoint ``state`` this task cannot continue."""

    def close(self) -> None:
        """Close what ``data`` opened."""


def timeline_every(every: int, batches: int | None) -> int:
    """The timeline's sampling interval for an epoch of ``batches`` (None: unknown): ``every``,
    or 1 (time every batch) when sampling one batch in ``every`` would time fewer than
    ``SAMPLED_PER_EPOCH``. A short run (the sample caches: a few batches an epoch) otherwise
    timed none, and ``precache doctor`` could not judge its phases; timing a batch costs a few
    clock readings (CUDA events on a GPU)."""
    if batches is not None and batches < SAMPLED_PER_EPOCH * every:
        return 1
    return every


def _batches(loader: Loader) -> int | None:
    """Batches of a whole epoch on this rank, where the loader knows (``CacheLoader`` does)."""
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def _progress(batches: Any, epoch: int, settings: Settings, total: int | None,
              show: bool) -> Any:
    """``batches`` with a progress bar on stderr when ``show`` (rank 0 on a terminal); as they
    are otherwise, so that a log file gets no bar."""
    if not show:
        return batches
    return tqdm(batches, total=total, desc=f"epoch {epoch + 1}/{settings.epochs}", unit="batch",
                leave=False, dynamic_ncols=True, file=sys.stderr)


def fit(task: Task, settings: Settings) -> None:
    """Train ``task`` with ``settings``; see the module docstring."""
    rank, world, _, device = init_distributed()  # torchrun's or srun's environment
    torch.manual_seed(settings.seed)  # every rank starts from the same weights
    torch.backends.cudnn.benchmark = True
    precision = auto_precision(device) if settings.precision == "auto" else settings.precision
    amp_dtype, _ = mixed_precision(precision, device)
    run = Run(settings, rank, world, device, precision, amp_dtype)
    out = Path(settings.out)
    data = task.data(run)
    loader, workers = data.loader, data.loader.num_workers
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks on this machine
    if device.type == "cpu":  # the cores left to this rank after its loader workers
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world - workers))

    strategy = make_strategy(settings.strategy, rank=rank, world_size=world, device=device)
    layout = torch.channels_last if task.channels_last else torch.preserve_format
    model = strategy.wrap(task.model(run).to(device, memory_format=layout))
    optimizer = strategy.make_optimizer(model, torch.optim.AdamW, lr=settings.lr,
                                        weight_decay=task.weight_decay)
    # Planned from this run's settings, also on resume: more epochs stretch the curve.
    schedule = OneCycleSchedule(optimizer, settings.lr,
                                samples_planned=settings.epochs * data.samples)
    scaler = strategy.grad_scaler(enabled=amp_dtype is torch.float16)
    epoch, step = 0, 0
    if settings.resume:
        try:
            state = strategy.load(Path(settings.resume), model, optimizer, map_location=device)
        except (CheckpointRefused, StrategyMismatch) as e:  # one line, naming the file
            raise SystemExit(str(e)) from None
        task.check(state, settings.resume)
        # After the optimizer's, which restores the saved rate. A checkpoint from before the
        # progress schedule has none: the start of its epoch is close enough.
        schedule.load_state_dict(state.get("schedule",
                                           {"samples_seen": state["epoch"] * data.samples}))
        scaler.load_state_dict(state["scaler"])
        loader.load_state_dict(state.get("loader", state.get("sampler")))  # older text: sampler
        epoch, step = state["epoch"], state["step"]
    net = torch.compile(model, dynamic=task.compile_dynamic) if settings.compile else model

    log = MetricLog(out, rank, epochs=settings.epochs)
    batches_per_epoch = _batches(loader)
    every = timeline_every(settings.timeline_every, batches_per_epoch)
    cached = loader.cached_dataset()  # a CacheBacked dataset, or None
    encoded = cached is not None and bool(cached.encoded_columns)  # JPEG/WebP columns (CacheBacked)
    decoded_on = None if not encoded else "cpu" if cached.decode_images else "device"
    log.run(device=device.type, world_size=world, workers=workers,
            worker_kind=loader.worker_kind,
            images_decoded_on=decoded_on, cpus=os.cpu_count(),
            batch_size=settings.batch_size, accumulate=settings.accumulate, precision=precision,
            precision_flag=settings.precision, cpu_bf16=cpu_has_native_bf16(),
            compile=settings.compile, timeline_every=every,
            channels_last=task.channels_last, input=task.input, columns=data.columns,
            columns_used=data.columns, transform_in_loader=data.transform_in_loader,
            pin_memory=device.type == "cuda", strategy=settings.strategy, **task.extra())
    if rank == 0:  # the first thing printed; each epoch then prints one line
        print(f"training on {world} {device.type} rank{'s' if world > 1 else ''}, precision "
              f"{precision}" + (" (auto)" if settings.precision == "auto" else "") +
              f"; records in {out / 'metrics.jsonl'} (precache doctor {out})", flush=True)
    lr_log, keys_log = open_lr_log(out, rank), open_keys_log(settings.log_keys, rank)
    timeline = StepTimeline(device, every=every, seed=settings.seed, log=log.stream, rank=rank)
    show_progress = rank == 0 and sys.stderr.isatty()
    position = 0  # samples this rank trained on in this epoch: what a checkpoint must not replay

    def save() -> None:  # every rank: a sharded strategy saves its shards
        strategy.save(out / "last.pt", model, optimizer, {
            "schedule": schedule.state_dict(), "scaler": scaler.state_dict(),
            "loader": loader.state_dict(consumed=position), "epoch": epoch, "step": step,
            **task.extra()})
        if lr_log is not None:
            lr_log.flush()

    while epoch < settings.epochs:
        loader.set_epoch(epoch)  # right after a resume: the rest of the checkpoint's epoch
        net.train()
        running, sums = torch.zeros((), device=device), {}
        batches = position = pending = 0  # pending: samples of the step being accumulated
        optimizer.zero_grad(set_to_none=True)
        started = time.perf_counter()
        timeline.begin_epoch(epoch)
        source = DevicePrefetcher(loader, device) if task.prefetch else loader
        bar = _progress(source, epoch, settings, batches_per_epoch, show_progress)
        for batch in bar:
            timeline.data_ready()
            if keys_log is not None:
                keys_log.write("".join(f"{epoch}\t{key}\n" for key in task.keys(batch)))
            with timeline.phase("h2d"):
                inputs = task.inputs(batch, run)
            with timeline.phase("forward"), run.autocast():
                result = task.loss(net, inputs, run)
            with timeline.phase("backward"):
                scaler.scale(result.loss / settings.accumulate).backward()
            running += result.loss.detach()  # a tensor: no host sync, no graph kept
            for name, value in result.sums.items():
                sums[name] = sums.get(name, 0) + value
            batches += 1
            position += result.samples
            pending += result.samples
            if batches % settings.accumulate == 0:
                log_lr(lr_log, step, schedule)  # the rate this step uses
                with timeline.phase("optimizer"):
                    # every rank's batches hold as many samples (lock-step): no all_reduce needed
                    optimizer_step(net, optimizer, scaler, schedule, settings.clip,
                                   samples=pending * world)
                pending, step = 0, step + 1
                if step % settings.save_every == 0:
                    save()
            timeline.end_step(step)
            if settings.max_steps and step >= settings.max_steps:
                break
        if bar is not source:
            bar.close()  # before the epoch's line (also after --max-steps stopped it)
        train_loss = (running / max(1, batches)).item()  # one sync per epoch
        done = bool(settings.max_steps and step >= settings.max_steps)
        trained = position
        if not done and epoch + 1 < settings.epochs:
            loader.start_epoch(epoch + 1)  # workers fill its first batches during validation
            position = 0
        net.eval()
        with torch.no_grad():
            metrics = task.validate(net, run)
        summary = timeline.epoch_summary()
        seconds = summary["timeline"]["step_s"] * summary["timeline"]["batches"]
        names = sorted(sums)
        seen, wait, total, *summed = run.all_sum(
            [trained, summary["timeline"]["data_wait"] * seconds, seconds,
             *(float(sums[n]) for n in names)])
        record = dict(epoch=epoch, step=step, train_loss=train_loss,
                      samples_per_s=seen / max(1e-9, seconds),  # lock-step: this rank's time
                      data_wait=wait / max(1e-9, total), world_size=world,
                      lr=optimizer.param_groups[0]["lr"], strategy=settings.strategy,
                      precision=precision, **schedule.state_dict(), **metrics,
                      **task.report(dict(zip(names, summed)), seconds), **summary)
        if not done:
            epoch += 1
        save()
        log.epoch(seconds=time.perf_counter() - started, **record)
        if keys_log is not None:
            keys_log.flush()
        if done:
            break
    loader.close()  # its reading threads, before the datasets they read close
    task.close()  # shard buffers go now, not during the interpreter's teardown
    log.close()
    # What holds the process group (the wrapped model, a sharded optimizer, the reference cycles
    # of their hooks) goes now, while the interpreter is whole: collected during its teardown
    # at exit instead, a gloo rank sometimes aborted ("terminate called without an active
    # exception") after its work was done.
    net = model = optimizer = schedule = scaler = save = None  # (not del: save() names them)
    gc.collect()
    cleanup()
