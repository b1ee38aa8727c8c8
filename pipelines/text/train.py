"""Train a small transformer encoder to classify cached documents by ``label``, the speed
checklist applied. It reads only the token ids of a ``text`` cache (no tokenizer at train time).

    torchrun --nproc_per_node=2 pipelines/text/train.py --cache data/textcache --epochs 3
    python pipelines/text/train.py --cache data/textcache --resume runs/text/last.pt
    srun python pipelines/text/train.py --cache data/textcache   # Slurm: one task per GPU

Batches come from a LengthBucketSampler (documents of similar length together) and are padded
only to their own longest document, so little of each step is spent on padding. The sampler's
state makes a checkpoint resumable mid-epoch, on any number of ranks. Each epoch logs samples/s,
real tokens/s, the padded share of the batches and the share of step time spent waiting for data;
every optimizer step logs its learning rate to ``<out>/lr.tsv``. The OneCycle schedule is a
function of progress (samples trained on / ``--epochs`` x training samples), so a run resumed with
more epochs or on another number of ranks continues on the curve of its new plan.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Subset

from precache.loading import CachedDataset
from precache.loading.buckets import LengthBucketSampler
from precache.loading.text import TokenCollate
from precache.training import (OneCycleSchedule, log_lr, mixed_precision, open_keys_log,
                               open_lr_log, optimizer_step)
from precache.training.step import auto_precision, cpu_has_native_bf16
from precache.training.checkpoint import CheckpointRefused
from precache.training.distributed import cleanup, init_distributed
from precache.training.strategy import STRATEGIES, StrategyMismatch, make_strategy
from precache.training.timeline import StepTimeline, run_record

VOCAB = 30522  # BERT WordPiece (the text pipeline's default tokenizer); pad id 0


def add_loop_args(p: argparse.ArgumentParser, *, out: str, lr: float,
                  precisions: tuple[str, ...] = ("bf16", "fp16", "fp32"),
                  precision: str = "bf16") -> None:
    """The options of ``fit``'s loop, shared with ``finetune.py``."""
    p.add_argument("--out", default=out, help="checkpoints and the metrics log")
    p.add_argument("--epochs", type=int, default=3,
                   help="epochs of the whole run, which the learning rate schedule spans; resume "
                        "with more to extend a run")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate (OneCycle)")
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: off)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    p.add_argument("--precision", choices=precisions, default=precision,
                   help="autocast dtype; fp16 (CUDA only) uses a GradScaler" + (
                       ". auto: bf16 on a GPU that has it (else fp16), fp32 on a CPU without "
                       "native bf16 (AVX512-BF16, AMX), where bf16 is emulated (measured 23x "
                       "slower on an AVX2 CPU)" if "auto" in precisions else ""))
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp",
                   help="ddp: replicate the model; zero: ZeRO-1, shard the optimizer state; "
                        "fsdp: FSDP2, shard parameters, gradients and optimizer state")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--timeline-every", type=int, default=10,
                   help="time the phases of about one batch in N (the data wait: every batch)")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N optimizer steps")
    p.add_argument("--resume", default=None, help="checkpoint to continue from (any world size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-keys", default=None, metavar="DIR",
                   help="append 'epoch<TAB>key' of every sample trained on to DIR/keys-rank<R>.tsv "
                        "(to check that the ranks see each sample once per epoch)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", required=True, help="a cache of the text pipeline")
    add_loop_args(p, out="runs/text", lr=1e-3)
    p.add_argument("--vocab-size", type=int, default=VOCAB,
                   help="the tokenizer's vocabulary size (default: BERT WordPiece's, the text "
                   "pipeline's default tokenizer; for your own, what `precache tokenizer train` "
                   "printed)")
    return p.parse_args(argv)


class TextClassifier(nn.Module):
    """Token + learned position embeddings, a 2-layer encoder, mean over real tokens, a linear head."""

    def __init__(self, classes: int, max_length: int, vocab_size: int = VOCAB, d_model: int = 128,
                 heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model, padding_idx=0)
        self.positions = nn.Embedding(max_length, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.1,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions.weight[: ids.shape[1]]
        x = self.encoder(x, src_key_padding_mask=mask == 0)
        m = mask.unsqueeze(-1).to(x.dtype)
        return self.head((x * m).sum(1) / m.sum(1).clamp_min(1))


@dataclass
class TextModel:
    """What ``fit`` trains, from the classes and the cached lengths.

    Attributes:
        module: on the CPU; ``fit`` moves and wraps it.
        logits: (module, ids, mask) -> (batch, classes) logits.
        vocab_size: a cached id at or beyond it stops the run with ``vocab_advice``.
        pad_id: the id ``TokenCollate`` pads with.
        extra: added to every checkpoint and to the run record.
    """

    module: nn.Module
    logits: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    vocab_size: int
    vocab_advice: str
    pad_id: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    def build(classes: list[str], lengths: np.ndarray) -> TextModel:
        max_length = -(-int(lengths.max()) // 8) * 8  # TokenCollate pads to multiples of 8
        return TextModel(TextClassifier(len(classes), max_length, args.vocab_size),
                         lambda net, ids, mask: net(ids, mask), args.vocab_size,
                         f"beyond --vocab-size {args.vocab_size}: pass the vocabulary size of "
                         "the tokenizer that built the cache", extra={"max_length": max_length})

    fit(args, build)


def fit(args: argparse.Namespace, build: Callable[[list[str], np.ndarray], TextModel]) -> None:
    """Train ``build(classes, lengths)``'s model on ``args.cache`` (every 10th row held out)
    with the options of ``add_loop_args``: the loop of this trainer and of ``finetune.py``."""
    rank, world, _, device = init_distributed()  # torchrun's or srun's environment
    torch.manual_seed(args.seed)  # every rank starts from the same weights
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    meta_set = CachedDataset(args.cache, columns=["length", "label"])
    meta = meta_set.read_batch(range(len(meta_set)))  # whole columns, read once
    lengths, labels = meta["length"], list(meta["label"])
    classes = sorted(set(labels))  # label string -> int, fixed for the run (and its checkpoint)
    label_id = {name: i for i, name in enumerate(classes)}
    val_idx = list(range(0, len(labels), 10))
    train_idx = [i for i in range(len(labels)) if i % 10]
    columns = ["ids", "label", "key"] if args.log_keys else ["ids", "label"]
    data = CachedDataset(args.cache, columns=columns, generation=meta_set.generation)
    built = build(classes, lengths)
    collate = TokenCollate(column="ids", pad_id=built.pad_id, multiple_of=8)
    sampler = LengthBucketSampler(lengths[train_idx], args.batch_size, seed=args.seed)  # Subset positions
    loader = DataLoader(Subset(data, train_idx), batch_sampler=sampler, collate_fn=collate,
                        num_workers=args.workers, pin_memory=device.type == "cuda",
                        persistent_workers=args.workers > 0)
    val_loader = DataLoader(Subset(data, val_idx[rank::world]), batch_size=args.batch_size,
                            collate_fn=collate, num_workers=0)  # each rank scores its share
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks on this machine
    if device.type == "cpu":  # the cores left to this rank after its loader workers
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world - args.workers))

    strategy = make_strategy(args.strategy, rank=rank, world_size=world, device=device)
    model = strategy.wrap(built.module.to(device))
    optimizer = strategy.make_optimizer(model, torch.optim.AdamW, lr=args.lr, weight_decay=1e-2)
    # Planned from this run's settings, also on resume: more --epochs stretch the curve.
    schedule = OneCycleSchedule(optimizer, args.lr, samples_planned=args.epochs * len(train_idx))
    precision = auto_precision(device) if args.precision == "auto" else args.precision
    amp_dtype, _ = mixed_precision(precision, device)
    scaler = strategy.grad_scaler(enabled=amp_dtype is torch.float16)

    epoch, step, position = 0, 0, 0  # position: batches this rank trained on in this epoch
    if args.resume:
        try:
            state = strategy.load(Path(args.resume), model, optimizer, map_location=device)
        except (CheckpointRefused, StrategyMismatch) as e:  # one line, naming the file
            raise SystemExit(str(e)) from None
        if state["classes"] != classes:
            raise SystemExit(f"{args.resume} was trained on labels {state['classes']}, not {classes}")
        # After the optimizer's, which restores the saved rate. A checkpoint from before the
        # progress schedule has none: the start of its epoch is close enough.
        legacy = {"samples_seen": state["epoch"] * len(train_idx)}
        schedule.load_state_dict(state.get("schedule", legacy))
        scaler.load_state_dict(state["scaler"])
        sampler.load_state_dict(state["sampler"])  # mid-epoch: only the batches not yet trained on
        epoch, step = state["epoch"], state["step"]
    net = torch.compile(model, dynamic=True) if args.compile else model  # lengths vary per batch

    lr_log = open_lr_log(out, rank)

    def save(path: Path) -> None:  # every rank: a sharded strategy saves its shards
        strategy.save(path, model, optimizer, {
            "schedule": schedule.state_dict(), "scaler": scaler.state_dict(),
            "sampler": sampler.state_dict(batches=position), "classes": classes,
            "epoch": epoch, "step": step, **built.extra})
        if lr_log is not None:
            lr_log.flush()

    def to_device(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        targets = torch.tensor([label_id[name] for name in batch["label"]])
        if int(batch["input_ids"].max()) >= built.vocab_size:  # the CPU copy: no device sync
            raise SystemExit(f"{args.cache} holds token id {int(batch['input_ids'].max())}, "
                             f"{built.vocab_advice}")
        return (batch["input_ids"].to(device, non_blocking=True),
                batch["attention_mask"].to(device, non_blocking=True), targets.to(device, non_blocking=True))

    log = (out / "metrics.jsonl").open("a") if rank == 0 else None
    if log is not None:
        log.write(json.dumps(run_record(
            device=device.type, world_size=world, workers=args.workers, cpus=os.cpu_count(),
            batch_size=args.batch_size, accumulate=args.accumulate, precision=precision,
            cpu_bf16=cpu_has_native_bf16(), compile=args.compile, channels_last=None,
            input="tokens", columns=columns, columns_used=columns, transform_in_loader=False,
            pin_memory=device.type == "cuda", strategy=args.strategy, **built.extra)) + "\n")
    timeline = StepTimeline(device, every=args.timeline_every, seed=args.seed, log=log, rank=rank)
    keys_log = open_keys_log(args.log_keys, rank)
    while epoch < args.epochs:
        sampler.set_epoch(epoch)  # right after a resume: the rest of the checkpoint's epoch
        net.train()
        wait = busy = 0.0
        seen, running, logged = 0, torch.zeros((), device=device), 0  # seen: this rank, this epoch
        tokens, slots = torch.zeros((), device=device), torch.zeros((), device=device)
        pending = 0  # samples of this rank in the optimizer step being accumulated
        optimizer.zero_grad(set_to_none=True)
        timeline.begin_epoch(epoch)
        tick = time.perf_counter()
        for i, batch in enumerate(loader):
            got = time.perf_counter()
            timeline.data_ready()
            wait += got - tick
            if keys_log is not None:
                keys_log.write("".join(f"{epoch}\t{key}\n" for key in batch["key"]))
            with timeline.phase("h2d"):
                ids, mask, targets = to_device(batch)
            with timeline.phase("forward"), torch.autocast(device.type, dtype=amp_dtype,
                                                          enabled=amp_dtype is not None):
                loss = nn.functional.cross_entropy(built.logits(net, ids, mask).float(), targets)
            with timeline.phase("backward"):
                scaler.scale(loss / args.accumulate).backward()
            running += loss.detach()  # a tensor: no host sync, no graph kept
            tokens += mask.sum()
            slots += mask.numel()
            logged += 1
            seen += len(ids)
            pending += len(ids)
            position = i + 1  # trained on: what a checkpoint must not replay
            if (i + 1) % args.accumulate == 0:
                log_lr(lr_log, step, schedule)  # the rate this step uses
                with timeline.phase("optimizer"):
                    # every rank's batches hold as many samples (lock-step): no all_reduce needed
                    optimizer_step(net, optimizer, scaler, schedule, args.clip,
                                   samples=pending * world)
                pending = 0
                step += 1
            timeline.end_step(step)
            if (i + 1) % args.accumulate == 0 and step % args.save_every == 0:
                save(out / "last.pt")
            tick = time.perf_counter()
            busy += tick - got
            if args.max_steps and step >= args.max_steps:
                break
        train_loss = (running / max(1, logged)).item()  # one sync per epoch
        done = bool(args.max_steps and step >= args.max_steps)
        net.eval()
        correct = torch.zeros((), device=device)
        val_n = 0
        with torch.no_grad():
            for batch in val_loader:
                ids, mask, targets = to_device(batch)
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    correct += (built.logits(net, ids, mask).argmax(-1) == targets).sum()
                val_n += len(targets)
        totals = torch.tensor([correct.item(), val_n, seen, tokens.item(), slots.item(), wait,
                               wait + busy], dtype=torch.float64, device=device)
        if world > 1:
            dist.all_reduce(totals)
        c, n, seen_all, tok, slot, wait_all, time_all = totals.tolist()
        elapsed = wait + busy  # ranks run in lock-step: this rank's time is the epoch's
        record = {"kind": "epoch", "epoch": epoch, "step": step, "train_loss": train_loss,
                  "val_accuracy": c / max(1, n), "samples_per_s": seen_all / max(1e-9, elapsed),
                  "tokens_per_s": tok / max(1e-9, elapsed), "padding": 1 - tok / max(1, slot),
                  "data_wait": wait_all / max(1e-9, time_all), "world_size": world,
                  "lr": optimizer.param_groups[0]["lr"],
                  "strategy": args.strategy, **schedule.state_dict(),  # samples seen, planned
                  **timeline.epoch_summary()}
        if not done:
            epoch += 1
            position = 0  # the next epoch starts from its beginning
        save(out / "last.pt")
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(json.dumps(record), flush=True)
        if keys_log is not None:
            keys_log.flush()
        if done:
            break
    for dataset in (meta_set, data):
        dataset.close()  # shard buffers go now, not during the interpreter's teardown
    cleanup()


if __name__ == "__main__":
    main()
