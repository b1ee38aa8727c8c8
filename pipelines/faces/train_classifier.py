"""Train a face-video classifier (e.g. real vs fake) on a video-faces cache, scored per video.

    precache run video-faces --input data/videos --output data/video_cache --set size=128
    python pipelines/faces/train_classifier.py --cache data/video_cache --epochs 6
    torchrun --nproc_per_node=2 pipelines/faces/train_classifier.py --cache data/video_cache --strategy fsdp
    python pipelines/faces/train_classifier.py --cache data/video_cache --mode clips --clip-frames 8
    sbatch pipelines/slurm/classifier_2nodes_x1gpu.sbatch

It reads only the cache. Each training item is a VIDEO (every video on exactly one rank once per
epoch): ``--mode frames`` scores ``--frames-per-video`` random face frames of it, ``--mode clips``
averages the frame features of ``--clip-frames`` consecutive frames of one track (FaceAugment
augments each batch after the loader, one draw per clip). Validation is per video (``precache.pipelines.faces.video_eval``): every cached
frame of a held-out video is scored, the scores averaged (``mean``) or averaged over the most
confident half (``confident``), then log-loss and ROC AUC over videos; a held-out video without
faces scores 0.5. The split keeps a fake with its ``original``, is stratified by label, and is
the same on every rank and run. The loop is ``precache.training.loop.fit`` (strategies,
precision, ``--compile``, the timeline, resume on another number of ranks).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Subset

from precache.augment import FaceAugment
from precache.cache import Cache
from precache.loading import (CachedDataset, ClipDataset, VideoFrameDataset, as_nchw,
                              collate_clips, decode_images, make_loader)
from precache.pipelines.faces.landmarks import (AUGMENT_COLUMNS, AUGMENT_ON, AUGMENT_ON_HELP,
                                                DECODE_ON, DECODE_ON_HELP, decode_in_loader)
from precache.pipelines.faces.video_eval import aggregate, held_out, log_loss, roc_auc
from precache.processing.ops import Labels
from precache.training.loop import Run, Step, Task, TrainData, fit
from precache.training.settings import Settings, check_cache, training_parser


def frame_augment(seed: int) -> FaceAugment:
    """Flip, colour, cutout and region colour/occlusion, but nothing that resamples or smooths the
    crop: a blur (whole or per region) makes a real face look like the smoothed faces many
    manipulations leave, and an affine warp's bilinear resampling is itself a low-pass filter.
    With either, on the sample videos (whose fakes are a smoothed inner face) the loss barely
    moved in 8 epochs; without, validation AUC reached 1.0 by epoch 5."""
    return FaceAugment(affine_p=0.0, blur_p=0.0, region_blur_p=0.0, seed=seed)


def augment_frames(augment: FaceAugment, batch: dict, clips: bool) -> torch.Tensor:
    """The batch's (B, T, H, W, 3) frames augmented as one batch of B * T crops, where the batch
    lives: one draw per clip (``clips``, so its frames move and change alike), else per frame."""
    images = batch["image"]
    frames = {key: batch[key].flatten(0, 1) for key in AUGMENT_COLUMNS}
    groups = torch.arange(len(images)).repeat_interleave(images.shape[1]) if clips else None
    return augment(frames, groups=groups)["image"].unflatten(0, tuple(images.shape[:2]))


class AugmentFrames:
    """``augment_frames`` as ``make_loader``'s ``batch_transform`` (``--augment-on loader``): a
    class, so that worker processes can receive it."""

    def __init__(self, augment: FaceAugment, clips: bool) -> None:
        self.augment, self.clips = augment, clips

    def __call__(self, batch: dict) -> dict:
        return {**batch, "image": augment_frames(self.augment, batch, self.clips)}


class FrameClassifier(nn.Module):
    """A small CNN per frame; a clip's frame features are averaged before the head. Per-sample
    normalisation (a group per channel): a batch holds a few videos' frames, and batch norm's
    running statistics left evaluation at chance (50% on held-out videos while batch statistics
    gave 99%); GroupNorm(8) learned several times slower here."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        blocks = [nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                                nn.GroupNorm(cout, cout), nn.ReLU(inplace=True))
                  for cin, cout in ((3, 32), (32, 64), (64, 96), (96, 128))]
        self.features = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(128, classes)

    def forward(self, images: torch.Tensor, frames_per_item: int = 1) -> torch.Tensor:
        features = self.features(images)
        if frames_per_item > 1:
            features = features.view(-1, frames_per_item, features.shape[-1]).mean(dim=1)
        return self.head(features)


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


class VideoClassification(Task):
    """Train on videos' frames or clips; validate per held-out video (see the docstring)."""

    def __init__(self, args: Any) -> None:
        self.args = args  # the flags of main()

    def data(self, run: Run) -> TrainData:
        a, s = self.args, run.settings
        columns = ["image"] if a.no_augment else AUGMENT_COLUMNS
        self.augment = None if a.no_augment else frame_augment(s.seed * 100_003 + run.rank)
        in_loader = a.augment_on == "loader" and self.augment is not None
        # JPEG frames (stage 1's image_codec) travel encoded and nvJPEG decodes them on a GPU
        decode = decode_in_loader(run.device, a.decode_on, in_loader)
        self.train_set = VideoFrameDataset(
            s.cache, frames_per_video=a.frames_per_video, columns=columns,
            seed=s.seed, decode_images=decode) if a.mode == "frames" else ClipDataset(
            s.cache, frames=a.clip_frames, stride=a.stride, start="random", columns=columns,
            seed=s.seed, decode_images=decode)
        self.per_item = a.frames_per_video if a.mode == "frames" else a.clip_frames
        if self.train_set.labels is None:
            raise SystemExit(f"{s.cache} has no label column; run stage 1 with labels=folder or "
                             "a metadata file (precache run video-faces --help)")
        self.classes = list(self.train_set.classes)
        positive = a.positive or next((c for c in self.classes if c.lower() == "fake"),
                                      self.classes[-1])
        if positive not in self.classes:
            raise SystemExit(f"--positive {positive!r} is not a label of {s.cache}: "
                             f"{self.classes}")
        self.positive = self.classes.index(positive)
        self.frames = CachedDataset(s.cache, columns=["image"],
                                    generation=self.train_set.generation)
        skipped = no_face_videos(s.cache, self.train_set.generation)
        self.truth, self.val_rows, train_items = held_out(self.train_set, skipped,
                                                          a.val_fraction, positive)
        total = len(self.train_set.videos) + len(skipped)
        if run.rank == 0:
            print(f"{total} videos ({len(skipped)} without faces): {total - len(self.truth)} "
                  f"train, {len(self.truth)} validation; classes {self.classes}, positive "
                  f"{positive!r}", flush=True)
        # collate_clips: a clip's frames of JPEG bytes stay one list per clip
        loader = make_loader(Subset(self.train_set, train_items), s.batch_size,
                             num_workers=s.workers, seed=s.seed, collate_fn=collate_clips,
                             worker_kind=s.worker_kind, batch_transform=AugmentFrames(
                                 self.augment, a.mode == "clips") if in_loader else None)
        return TrainData(loader, len(train_items), columns, transform_in_loader=in_loader)

    def model(self, run: Run) -> nn.Module:
        return FrameClassifier(len(self.classes))  # GroupNorm is slow in channels_last on CPU

    def keys(self, batch: dict) -> list[str]:
        return list(batch["video"])

    def inputs(self, batch: dict, run: Run) -> Any:
        if isinstance(batch["image"], list):  # JPEG bytes of B clips, decoded on the device
            batch = {**batch, "image": decode_images(batch["image"], run.device)}
        images = batch["image"]  # (B, T, H, W, 3) uint8, on the device (DevicePrefetcher)
        if self.augment is not None and self.args.augment_on == "device":
            images = augment_frames(self.augment, batch, clips=self.args.mode == "clips")
        return as_nchw(images.flatten(0, 1)).float().div_(255), batch["target"].to(run.device)

    def loss(self, net: nn.Module, inputs: Any, run: Run) -> Step:
        images, targets = inputs
        if self.args.mode == "clips":
            logits = net(images, self.per_item).float()
        else:  # every frame scored, each with its video's label
            logits = net(images).float()
            targets = targets.repeat_interleave(self.per_item)
        count = len(images) // self.per_item
        return Step(nn.functional.cross_entropy(logits, targets), count,
                    {"frames": count * self.per_item})

    def validate(self, net: nn.Module, run: Run) -> dict[str, Any]:
        """Every frame of every held-out video scored; this rank scores every world-th row,
        in as many forward passes as every other rank (fsdp gathers in each)."""
        share = -(-len(self.val_rows) // run.world_size)
        mine = self.val_rows[run.rank::run.world_size]
        if len(mine) < share:  # padding, not scored
            mine += [("", self.val_rows[0][1])] * (share - len(mine))
        scores: list[tuple[str, float]] = []
        for start in range(0, len(mine), 64):
            part = mine[start:start + 64]
            images = torch.from_numpy(self.frames.read_batch([r for _, r in part])["image"])
            with run.autocast():
                logits = net(as_nchw(images.to(run.device)).float().div_(255)).float()
            p = torch.softmax(logits, dim=1)[:, self.positive].cpu().tolist()
            scores.extend((v, score) for (v, _), score in zip(part, p) if v)
        if run.world_size > 1:
            gathered: list[Any] = [None] * run.world_size
            dist.all_gather_object(gathered, scores)
            scores = [s for part in gathered for s in part]
        per_video: dict[str, list[float]] = {}
        for video, score in scores:
            per_video.setdefault(video, []).append(score)
        y = np.array([fake for _, fake in self.truth])
        result: dict[str, Any] = {}
        for how in ("mean", "confident"):
            s = np.array([aggregate(np.array(per_video.get(v, [])), how) for v, _ in self.truth])
            result[f"val_auc_{how}"], result[f"val_logloss_{how}"] = roc_auc(y, s), log_loss(y, s)
        return {**result, "val_videos": len(self.truth)}

    def report(self, sums: dict[str, float], seconds: float) -> dict[str, Any]:
        return {"frames_per_s": sums.get("frames", 0.0) / max(1e-9, seconds)}

    def extra(self) -> dict[str, Any]:
        return {"classes": self.classes}

    def check(self, state: dict[str, Any], path: str) -> None:
        if state.get("classes") != self.classes:
            raise SystemExit(f"{path} was trained on labels {state.get('classes')}, this cache "
                             f"has {self.classes}")

    def close(self) -> None:
        for dataset in (self.frames, self.train_set):
            dataset.close()


def main(argv: list[str] | None = None) -> None:
    p = training_parser(__doc__, out="runs/classifier", lr=3e-3, epochs=8, batch_size=4,
                        items="videos", cache_help="a cache of the video-faces pipeline")
    p.add_argument("--mode", choices=["frames", "clips"], default="frames",
                   help="train on random frames of each video, or on clips of one track")
    p.add_argument("--frames-per-video", type=int, default=8, help="--mode frames: per epoch")
    p.add_argument("--clip-frames", type=int, default=8, help="--mode clips: frames per clip")
    p.add_argument("--stride", type=int, default=1, help="--mode clips: sampled frames apart")
    p.add_argument("--positive", default=None,
                   help="the label scored as positive (default: 'fake' in any case if present, "
                        "else the last label in sorted order)")
    p.add_argument("--val-fraction", type=float, default=0.25, help="videos held out, per label")
    p.add_argument("--no-augment", action="store_true",
                   help="train on the cached crops as they are")
    p.add_argument("--augment-on", choices=AUGMENT_ON, default="device", help=AUGMENT_ON_HELP)
    p.add_argument("--decode-on", choices=DECODE_ON, default="device", help=DECODE_ON_HELP)
    args = p.parse_args(argv)
    check_cache(p, args.cache, "video-faces", ["image"])
    fit(VideoClassification(args), Settings.from_args(args))


if __name__ == "__main__":
    main()
