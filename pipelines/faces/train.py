"""Train a small CNN to find the 5 facial landmarks on cached face crops, the speed checklist
applied. It reads only the cache (no detector, no mesh), so every step is cheap to feed.

    torchrun --nproc_per_node=2 pipelines/faces/train.py --cache data/cache --epochs 3
    python pipelines/faces/train.py --cache data/cache --resume runs/faces/last.pt
    sbatch pipelines/slurm/faces_4nodes_x1gpu.sbatch     # Slurm: torchrun per node, or srun python

Task: regress ``landmarks5`` (crop pixels / size, so 0..1) from the augmented crop. FaceAugment
moves and re-indexes the points with the image, so a flip cannot teach the model to swap eyes.
Each epoch logs samples/s and the share of step time spent waiting for data; every optimizer
step logs its learning rate to ``<out>/lr.tsv``. The OneCycle schedule is a function of progress
(samples trained on / ``--epochs`` x training samples), so a run resumed with more epochs or on
another number of ranks continues on the curve of its new plan.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Subset

from precache.augment import FaceAugment
from precache.loading import CachedDataset, DevicePrefetcher, as_nchw, make_loader
from precache.training import (OneCycleSchedule, log_lr, mixed_precision, open_keys_log,
                               open_lr_log, optimizer_step)
from precache.training.checkpoint import CheckpointRefused
from precache.training.step import cpu_has_native_bf16
from precache.training.distributed import cleanup, init_distributed
from precache.training.strategy import STRATEGIES, StrategyMismatch, make_strategy
from precache.training.timeline import StepTimeline, run_record

COLUMNS = ["image", "landmarks5", "has_mesh", "regions", "region_sizes"]  # regions: for FaceAugment


class AugmentForTraining:
    """FaceAugment, then only what the step uses: every tensor a worker sends costs a transfer."""

    def __init__(self) -> None:
        self.augment = FaceAugment()

    def __call__(self, sample: dict) -> dict:
        out = self.augment(sample)
        keep = {"key": sample["key"]} if "key" in sample else {}  # read only for --log-keys
        return {"image": out["image"], "landmarks5": out["landmarks5"], **keep}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", required=True, help="a cache of the faces pipeline")
    p.add_argument("--out", default="runs/faces", help="checkpoints and the metrics log")
    p.add_argument("--epochs", type=int, default=3,
                   help="epochs of the whole run, which the learning rate schedule spans; resume "
                        "with more to extend a run")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (OneCycle)")
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: off)")
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers per rank")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16",
                   help="autocast dtype; fp16 (CUDA only) uses a GradScaler")
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp",
                   help="ddp: replicate the model; zero: ZeRO-1, shard the optimizer state; "
                        "fsdp: FSDP2, shard parameters, gradients and optimizer state")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--timeline-every", type=int, default=10,
                   help="time the phases of about one batch in N (the data wait: every batch)")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N optimizer steps")
    p.add_argument("--resume", default=None, help="checkpoint to continue from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-keys", default=None, metavar="DIR",
                   help="append 'epoch<TAB>key' of every sample trained on to DIR/keys-rank<R>.tsv "
                        "(to check that the ranks see each sample once per epoch)")
    return p.parse_args()


def conv_block(cin: int, cout: int) -> nn.Sequential:
    # No bias: the batch norm right after it has its own.
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class LandmarkNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(conv_block(3, 32), conv_block(32, 64), conv_block(64, 128),
                                      conv_block(128, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(128, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images)).view(-1, 5, 2)


def batch_to_inputs(batch: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 NHWC -> float NCHW (channels_last) in 0..1, and targets in 0..1 of the crop."""
    images = as_nchw(batch["image"]).float().div_(255)
    size = images.shape[-1]
    return images, batch["landmarks5"].float() / size


def main() -> None:
    args = parse_args()
    rank, world, _, device = init_distributed()  # torchrun's or srun's environment
    torch.manual_seed(args.seed)  # every rank starts from the same weights
    torch.backends.cudnn.benchmark = True  # fixed input shapes
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    full = CachedDataset(args.cache, columns=["image", "landmarks5"])
    val_idx = list(range(0, len(full), 10))
    train_idx = [i for i in range(len(full)) if i % 10]
    columns = COLUMNS + ["key"] if args.log_keys else COLUMNS
    train_set = CachedDataset(args.cache, columns=columns, transform=AugmentForTraining())
    loader = make_loader(Subset(train_set, train_idx), args.batch_size, num_workers=args.workers,
                         seed=args.seed)
    val_loader = make_loader(Subset(full, val_idx), args.batch_size, shuffle=False, num_workers=0)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks on this machine
    if device.type == "cpu":  # the cores left to this rank after its loader workers
        torch.set_num_threads(
            max(1, (os.cpu_count() or 1) // local_world - loader.loader.num_workers))

    strategy = make_strategy(args.strategy, rank=rank, world_size=world, device=device)
    model = strategy.wrap(LandmarkNet().to(device, memory_format=torch.channels_last))
    optimizer = strategy.make_optimizer(model, torch.optim.AdamW, lr=args.lr, weight_decay=1e-4)
    # Planned from this run's settings, also on resume: more --epochs stretch the curve.
    schedule = OneCycleSchedule(optimizer, args.lr, samples_planned=args.epochs * len(train_idx))
    amp_dtype, _ = mixed_precision(args.precision, device)
    scaler = strategy.grad_scaler(enabled=amp_dtype is torch.float16)

    epoch, step, position = 0, 0, 0  # position: samples this rank trained on in this epoch
    if args.resume:
        try:
            state = strategy.load(Path(args.resume), model, optimizer, map_location=device)
        except (CheckpointRefused, StrategyMismatch) as e:  # one line, naming the file
            raise SystemExit(str(e)) from None
        # After the optimizer's, which restores the saved rate. A checkpoint from before the
        # progress schedule has none: the start of its epoch is close enough.
        legacy = {"samples_seen": state["epoch"] * len(train_idx)}
        schedule.load_state_dict(state.get("schedule", legacy))
        scaler.load_state_dict(state["scaler"])
        loader.load_state_dict(state["loader"])  # mid-epoch: only the samples not yet seen
        epoch, step = state["epoch"], state["step"]
    net = torch.compile(model) if args.compile else model

    lr_log = open_lr_log(out, rank)

    def save(path: Path) -> None:  # every rank: a sharded strategy saves its shards
        strategy.save(path, model, optimizer, {
            "schedule": schedule.state_dict(), "scaler": scaler.state_dict(),
            "loader": loader.state_dict(consumed=position), "epoch": epoch, "step": step})
        if lr_log is not None:
            lr_log.flush()

    log = (out / "metrics.jsonl").open("a") if rank == 0 else None
    if log is not None:
        log.write(json.dumps(run_record(
            device=device.type, world_size=world, workers=loader.loader.num_workers,
            cpus=os.cpu_count(), batch_size=args.batch_size, accumulate=args.accumulate,
            precision=args.precision, cpu_bf16=cpu_has_native_bf16(), compile=args.compile,
            channels_last=True, input="images", columns=columns,
            columns_used=columns, transform_in_loader=True,
            pin_memory=device.type == "cuda", strategy=args.strategy)) + "\n")
    timeline = StepTimeline(device, every=args.timeline_every, seed=args.seed, log=log, rank=rank)
    keys_log = open_keys_log(args.log_keys, rank)
    while epoch < args.epochs:
        loader.set_epoch(epoch)
        net.train()
        wait = busy = 0.0
        seen, running, logged = 0, torch.zeros((), device=device), 0  # seen: this rank, this epoch
        pending = 0  # samples of this rank in the optimizer step being accumulated
        optimizer.zero_grad(set_to_none=True)
        timeline.begin_epoch(epoch)
        tick = time.perf_counter()
        for i, batch in enumerate(DevicePrefetcher(loader, device)):  # copies the next batch now
            got = time.perf_counter()
            timeline.data_ready()
            wait += got - tick
            if keys_log is not None:
                keys_log.write("".join(f"{epoch}\t{key}\n" for key in batch["key"]))
            with timeline.phase("h2d"):  # the copy overlaps (DevicePrefetcher): only uint8->float
                images, targets = batch_to_inputs(batch, device)
            with timeline.phase("forward"), torch.autocast(device.type, dtype=amp_dtype,
                                                          enabled=amp_dtype is not None):
                loss = nn.functional.smooth_l1_loss(net(images).float(), targets, beta=0.02)
            with timeline.phase("backward"):
                scaler.scale(loss / args.accumulate).backward()
            running += loss.detach()  # a tensor: no host sync, no graph kept
            logged += 1
            seen += len(images)
            pending += len(images)
            position = seen  # trained on: what a checkpoint must not replay
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
        if not done and epoch + 1 < args.epochs:
            loader.start_epoch(epoch + 1)  # workers fill the next epoch's first batches meanwhile
            position = 0
        net.eval()
        val_sum = torch.zeros((), device=device)
        val_n = 0
        with torch.no_grad():
            for batch in DevicePrefetcher(val_loader, device):
                images, targets = batch_to_inputs(batch, device)
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    val_sum += nn.functional.l1_loss(net(images).float(), targets, reduction="sum")
                val_n += targets.numel()
        if world > 1:
            totals = torch.tensor([val_sum.item(), val_n, seen, wait, wait + busy], device=device)
            dist.all_reduce(totals)
            val_error, seen_all = totals[0].item() / max(1, totals[1].item()), int(totals[2].item())
            wait_share = totals[3].item() / max(1e-9, totals[4].item())
        else:
            val_error, seen_all, wait_share = val_sum.item() / max(1, val_n), seen, wait / max(1e-9, wait + busy)
        record = {"kind": "epoch", "epoch": epoch, "step": step, "train_loss": train_loss, "val_l1": val_error,
                  "samples_per_s": seen_all / max(1e-9, wait + busy), "data_wait": wait_share,
                  "world_size": world, "lr": optimizer.param_groups[0]["lr"],
                  "strategy": args.strategy, **schedule.state_dict(),  # samples seen, planned
                  **timeline.epoch_summary()}
        if not done:
            epoch += 1
        save(out / "last.pt")
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(json.dumps(record), flush=True)
        if keys_log is not None:
            keys_log.flush()
        if done:
            break
    for dataset in (full, train_set):
        dataset.close()  # shard buffers go now, not during the interpreter's teardown
    cleanup()


if __name__ == "__main__":
    main()
