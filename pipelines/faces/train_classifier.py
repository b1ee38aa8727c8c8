"""Train a face-video classifier (e.g. real vs fake) on a video-faces cache, scored per video.

    precache run video-faces --input data/videos --output data/video_cache --set size=128
    python pipelines/faces/train_classifier.py --cache data/video_cache --epochs 6
    torchrun --nproc_per_node=2 pipelines/faces/train_classifier.py --cache data/video_cache
    python pipelines/faces/train_classifier.py --cache data/video_cache --mode clips --clip-frames 8
    sbatch pipelines/slurm/classifier_1node.sbatch

It reads only the cache (no decoder, no detector). Each training item is a VIDEO, so the DDP
sampler gives every video to exactly one rank once per epoch:

* ``--mode frames``: ``--frames-per-video`` random face frames of each video per epoch (a long
  video counts as much as a short one); the model scores each frame;
* ``--mode clips``: ``--clip-frames`` consecutive frames of one track; the frame features are
  averaged over time before the head.

FaceAugment draws once per clip (every frame of a clip gets the same flip, warp and colour).
Validation is per video, like the DFDC and FaceForensics++ evaluations: every cached frame of a
held-out video is scored, the scores are averaged (``mean``) or averaged over the most confident
half (``confident``), and log-loss and ROC AUC are computed over videos; a held-out video in
which stage 1 found no face scores 0.5. The split is by video (fakes with their ``original``,
where the cache has one), stratified by label, and the same on every rank and every run.

The speed checklist of ``train.py`` holds: DDP (gloo on CPU, NCCL on GPU), autocast (bf16, or
fp16 with a GradScaler), gradient accumulation, clipping, ``zero_grad(set_to_none=True)``,
checkpoints with the loader's mid-epoch position (resume on another number of ranks), and the
share of step time spent waiting for data, per epoch in ``<out>/metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import zlib
from pathlib import Path, PurePosixPath

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Subset

from precache.augment import FaceAugment
from precache.cache import Cache
from precache.loading import CachedDataset, DevicePrefetcher, as_nchw, make_loader
from precache.loading.clips import ClipDataset, VideoFrameDataset
from precache.processing.ops.labels import Labels
from precache.training import (OneCycleSchedule, log_lr, mixed_precision, open_keys_log,
                               open_lr_log, optimizer_step)
from precache.training.checkpoint import CheckpointRefused, load_checkpoint, save_checkpoint
from precache.training.distributed import cleanup, init_distributed

AUGMENT_COLUMNS = ["image", "landmarks5", "has_mesh", "regions", "region_sizes"]


class AugmentForTraining:
    """FaceAugment, then only the image: every array a worker sends costs a transfer.

    Flip, colour, cutout and region colour/occlusion, but nothing that resamples or smooths the
    crop: a blur (whole or per region) makes a real face look like the smoothed faces many
    manipulations leave, and an affine warp's bilinear resampling is itself a low-pass filter.
    With either, on the sample videos (whose fakes are a smoothed inner face) the loss barely
    moved in 8 epochs; without, validation AUC reached 1.0 by epoch 5."""

    def __init__(self) -> None:
        self.augment = FaceAugment(affine_p=0.0, blur_p=0.0, region_blur_p=0.0)

    def same(self, samples: list[dict]) -> list[dict]:
        """One draw for all frames of a clip."""
        return [{"image": s["image"]} for s in self.augment.same(samples)]

    def __call__(self, sample: dict) -> dict:
        return {"image": self.augment(sample)["image"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", required=True, help="a cache of the video-faces pipeline")
    p.add_argument("--out", default="runs/classifier", help="checkpoints and the metrics log")
    p.add_argument("--mode", choices=["frames", "clips"], default="frames",
                   help="train on random frames of each video, or on clips of one track")
    p.add_argument("--frames-per-video", type=int, default=8, help="--mode frames: per epoch")
    p.add_argument("--clip-frames", type=int, default=8, help="--mode clips: frames per clip")
    p.add_argument("--stride", type=int, default=1, help="--mode clips: sampled frames apart")
    p.add_argument("--positive", default=None,
                   help="the label scored as positive (default: 'fake' in any case if present, "
                        "else the last label in sorted order)")
    p.add_argument("--val-fraction", type=float, default=0.25, help="videos held out, per label")
    p.add_argument("--epochs", type=int, default=8,
                   help="epochs of the whole run, which the learning rate schedule spans")
    p.add_argument("--batch-size", type=int, default=4, help="videos per batch, per rank")
    p.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (OneCycle)")
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: off)")
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers per rank")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16",
                   help="autocast dtype; fp16 (CUDA only) uses a GradScaler")
    p.add_argument("--no-augment", action="store_true", help="train on the cached crops as they are")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N optimizer steps")
    p.add_argument("--resume", default=None, help="checkpoint to continue from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-keys", default=None, metavar="DIR",
                   help="append 'epoch<TAB>video' of every video trained on to "
                        "DIR/keys-rank<R>.tsv (to check exact-once per epoch across ranks)")
    return p.parse_args(argv)


def conv_block(cin: int, cout: int) -> nn.Sequential:
    # Per-sample normalisation (a group per channel): a batch holds a few videos' frames, and
    # batch norm's running statistics then left evaluation at chance (50% on the held-out videos
    # while batch statistics gave 99%); GroupNorm(8) learned several times slower here.
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                         nn.GroupNorm(cout, cout), nn.ReLU(inplace=True))


class FrameClassifier(nn.Module):
    """A small CNN per frame; a clip's frame features are averaged before the head."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(conv_block(3, 32), conv_block(32, 64), conv_block(64, 96),
                                      conv_block(96, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(128, classes)

    def forward(self, images: torch.Tensor, frames_per_item: int = 1) -> torch.Tensor:
        features = self.features(images)
        if frames_per_item > 1:
            features = features.view(-1, frames_per_item, features.shape[-1]).mean(dim=1)
        return self.head(features)


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (the Mann-Whitney U statistic, ties counted half); NaN without
    both classes."""
    labels, scores = np.asarray(labels, bool), np.asarray(scores, np.float64)
    positives, negatives = scores[labels], scores[~labels]
    if not len(positives) or not len(negatives):
        return float("nan")
    greater = (positives[:, None] > negatives[None, :]).sum()
    ties = (positives[:, None] == negatives[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(positives) * len(negatives)))


def log_loss(labels: np.ndarray, scores: np.ndarray, eps: float = 1e-6) -> float:
    p = np.clip(np.asarray(scores, np.float64), eps, 1 - eps)
    y = np.asarray(labels, np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def aggregate(scores: np.ndarray, how: str) -> float:
    """One video score from its frame scores: ``mean``, or ``confident``: the mean of the half
    of the frames farthest from 0.5 (a few confident fake frames are not averaged away)."""
    if not len(scores):
        return 0.5
    if how == "mean":
        return float(np.mean(scores))
    far = np.argsort(-np.abs(scores - 0.5))[: max(1, math.ceil(len(scores) / 2))]
    return float(np.mean(scores[far]))


def split_videos(videos: list[str], labels: list[str], groups: list[str],
                 fraction: float) -> set[str]:
    """Held-out videos: whole groups (a fake with its original: a scene must not be on both
    sides, or the model learns scenes instead of fakes), taken in the order of a hash of the
    group name until they hold ``fraction`` of the videos and every label that has more than
    one group."""
    order = sorted(set(groups), key=lambda g: (zlib.crc32(g.encode()), g))
    members: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    groups_of = {label: {g for g, lab in zip(groups, labels) if lab == label} for label in set(labels)}
    wanted = {label for label, found in groups_of.items() if len(found) > 1}
    held: set[int] = set()
    for group in order:
        covered = {labels[i] for i in held}
        if len(held) >= fraction * len(videos) and wanted <= covered:
            break
        if len(held) + len(members[group]) > max(1, fraction * len(videos)) and (
                {labels[i] for i in members[group]} <= covered):
            continue  # would overshoot and adds no missing label
        held.update(members[group])
    return {videos[i] for i in held}


def no_face_videos(cache: str, generation: int) -> list[tuple[str, str]]:
    """(video, folder label) of the inputs stage 1 skipped for having no face; they score 0.5.
    Only a folder-labelled cache names their label (a metadata file's labels are not kept for
    skipped inputs); it is the label stage 1's ``Labels`` op would have given."""
    opened = Cache(cache, generation=generation)
    labels_source = next((op["params"].get("labels") for op in opened.manifest.ops
                          if op["name"] == "labels"), "none")
    if labels_source != "folder":
        return []
    by_folder = Labels(labels="folder")
    index = opened.read_index().to_pydict()
    return [(str(key), by_folder({"source_key": str(key)})["label"])
            for key, status, message in zip(index["key"], index["status"], index["message"])
            if status == "skipped" and message == "no_face"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world, _, device = init_distributed()
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    transform = None if args.no_augment else AugmentForTraining()
    columns = ["image"] if args.no_augment else AUGMENT_COLUMNS
    if args.mode == "frames":
        train_set = VideoFrameDataset(args.cache, frames_per_video=args.frames_per_video,
                                      columns=columns, transform=transform, seed=args.seed)
        per_item = args.frames_per_video
    else:
        train_set = ClipDataset(args.cache, frames=args.clip_frames, stride=args.stride,
                                start="random", columns=columns, transform=transform,
                                seed=args.seed)
        per_item = args.clip_frames
    if train_set.labels is None:
        raise SystemExit(f"{args.cache} has no label column; run stage 1 with labels=folder or "
                         "a metadata file (precache run video-faces --help)")
    classes = list(train_set.classes)
    positive = args.positive or next((c for c in classes if c.lower() == "fake"), classes[-1])
    if positive not in classes:
        raise SystemExit(f"--positive {positive!r} is not a label of {args.cache}: {classes}")
    positive_index = classes.index(positive)

    # Split by video (a fake with its original), stratified by label; same on every rank. The
    # videos, their labels and rows come from the training set's index; only each video's first
    # row is read for its original, and the same generation is read throughout.
    index, videos = train_set.index, train_set.videos
    frames = CachedDataset(args.cache, columns=["image"], generation=train_set.generation)
    originals = [""] * len(videos)
    if "original" in Cache(args.cache, generation=train_set.generation).manifest.schema:
        meta = CachedDataset(args.cache, columns=["original"], generation=train_set.generation)
        originals = meta.read_batch(index.rows[index.group_start[index.video_group_start[:-1]]]
                                    )["original"]
        meta.close()
    # a fake's group is its original's video (metadata files name it by bare file name)
    by_name = {PurePosixPath(v).name: v for v in videos}
    video_group = {v: by_name.get(o, o) if o else v for v, o in zip(videos, originals)}
    skipped = no_face_videos(args.cache, train_set.generation)
    names = videos + [v for v, _ in skipped]
    labels = train_set.labels + [lab for _, lab in skipped]
    held = split_videos(names, labels, [video_group.get(v, v) for v in names], args.val_fraction)
    held_rows = {i: index.rows[slice(*index.video_rows(i))] for i, v in enumerate(videos)
                 if v in held}  # every cached frame of each held-out video
    val_rows = np.concatenate([np.empty(0, np.int64), *held_rows.values()])
    val_owner = np.concatenate([np.empty(0, np.int64),
                                *(np.full(len(r), i) for i, r in held_rows.items())])
    train_items = [i for i, v in enumerate(videos) if v not in held]
    if rank == 0:
        print(f"{len(names)} videos ({len(skipped)} without faces): {len(names) - len(held)} "
              f"train, {len(held)} validation; classes {classes}, positive {positive!r}", flush=True)

    loader = make_loader(Subset(train_set, train_items), args.batch_size, num_workers=args.workers,
                         seed=args.seed)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world - loader.loader.num_workers))

    model = FrameClassifier(len(classes)).to(device)  # GroupNorm is slow in channels_last on CPU
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    schedule = OneCycleSchedule(optimizer, args.lr, samples_planned=args.epochs * len(train_items))
    amp_dtype, scaler = mixed_precision(args.precision, device)

    epoch, step, position = 0, 0, 0
    if args.resume:
        try:
            state = load_checkpoint(args.resume, map_location=device)
        except CheckpointRefused as e:
            raise SystemExit(str(e)) from None
        if state.get("classes") != classes:
            raise SystemExit(f"{args.resume} was trained on labels {state.get('classes')}, this "
                             f"cache has {classes}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        scaler.load_state_dict(state["scaler"])
        loader.load_state_dict(state["loader"])
        epoch, step = state["epoch"], state["step"]
    if world > 1:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    bare = model.module if isinstance(model, DistributedDataParallel) else model

    lr_log = open_lr_log(out, rank)

    def save(path: Path) -> None:
        if rank == 0:
            save_checkpoint({"model": bare.state_dict(), "optimizer": optimizer.state_dict(),
                             "schedule": schedule.state_dict(), "scaler": scaler.state_dict(),
                             "loader": loader.state_dict(consumed=position), "epoch": epoch,
                             "step": step, "classes": classes}, path)
            lr_log.flush()

    def validate() -> dict:
        """Every frame of every held-out video scored; this rank scores every world-th row."""
        bare.eval()
        mine, owners = val_rows[rank::world], val_owner[rank::world]
        scores: list[tuple[int, float]] = []  # (video item, frame score)
        with torch.no_grad():
            for start in range(0, len(mine), 64):
                rows = mine[start:start + 64]
                images = as_nchw(torch.from_numpy(frames.read_batch(rows)["image"])).to(device)
                images = images.float().div_(255)
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    logits = bare(images).float()
                p = torch.softmax(logits, dim=1)[:, positive_index].cpu().numpy()
                scores.extend(zip(owners[start:start + 64].tolist(), p.tolist()))
        if world > 1:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, scores)
            scores = [s for part in gathered for s in part]
        per_video: dict[str, list[float]] = {}
        for item, score in scores:
            per_video.setdefault(videos[item], []).append(score)
        result = {}
        truth = [(v, lab) for v, lab in zip(names, labels) if v in held]
        y = np.array([lab == positive for _, lab in truth])
        for how in ("mean", "confident"):
            s = np.array([aggregate(np.array(per_video.get(v, [])), how) for v, _ in truth])
            result[f"val_auc_{how}"] = roc_auc(y, s)
            result[f"val_logloss_{how}"] = log_loss(y, s)
        result["val_videos"] = len(truth)
        return result

    log = (out / "metrics.jsonl").open("a") if rank == 0 else None
    keys_log = open_keys_log(args.log_keys, rank)
    loss_fn = nn.CrossEntropyLoss()
    while epoch < args.epochs:
        loader.set_epoch(epoch)
        model.train()
        wait = busy = 0.0
        seen, running, logged, pending = 0, torch.zeros((), device=device), 0, 0
        optimizer.zero_grad(set_to_none=True)
        tick = time.perf_counter()
        for i, batch in enumerate(DevicePrefetcher(loader, device)):
            got = time.perf_counter()
            wait += got - tick
            if keys_log is not None:
                keys_log.write("".join(f"{epoch}\t{video}\n" for video in batch["video"]))
            images = batch["image"]  # (B, T, H, W, 3) uint8
            count = images.shape[0]
            images = as_nchw(images.flatten(0, 1)).float().div_(255)
            targets = batch["target"].to(device)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                if args.mode == "clips":
                    logits = model(images, per_item).float()
                else:  # every frame scored, each with its video's label
                    logits = model(images).float()
                    targets = targets.repeat_interleave(per_item)
                loss = loss_fn(logits, targets)
            scaler.scale(loss / args.accumulate).backward()
            running += loss.detach()
            logged += 1
            seen += count
            pending += count
            position = seen
            if (i + 1) % args.accumulate == 0:
                log_lr(lr_log, step, schedule)
                optimizer_step(model, optimizer, scaler, schedule, args.clip, samples=pending * world)
                pending = 0
                step += 1
                if step % args.save_every == 0:
                    save(out / "last.pt")
            tick = time.perf_counter()
            busy += tick - got
            if args.max_steps and step >= args.max_steps:
                break
        train_loss = (running / max(1, logged)).item()
        done = bool(args.max_steps and step >= args.max_steps)
        if not done and epoch + 1 < args.epochs:
            loader.start_epoch(epoch + 1)
            position = 0
        metrics = validate()
        if world > 1:
            totals = torch.tensor([seen, wait, wait + busy], dtype=torch.float64, device=device)
            dist.all_reduce(totals)
            seen_all, wait_share = int(totals[0].item()), totals[1].item() / max(1e-9, totals[2].item())
        else:
            seen_all, wait_share = seen, wait / max(1e-9, wait + busy)
        record = {"epoch": epoch, "step": step, "train_loss": train_loss, **metrics,
                  "videos_per_s": seen_all / max(1e-9, wait + busy),
                  "frames_per_s": seen_all * per_item / max(1e-9, wait + busy),
                  "data_wait": wait_share, "world_size": world,
                  "lr": optimizer.param_groups[0]["lr"], **schedule.state_dict()}
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
    for dataset in (frames, train_set):
        dataset.close()
    cleanup()


if __name__ == "__main__":
    main()
