"""Train a ResNet3D-18 to classify cached 3D volumes (whole, or random patches), the speed
checklist applied. It reads only the cache: reorientation, resampling and normalisation were
done once by stage 1 (``precache run volumes``).

    precache run volumes --input data/volumes.npz --output data/volcache --set shape=28
    python pipelines/volumes/train.py --cache data/volcache --epochs 8
    torchrun --nproc_per_node=2 pipelines/volumes/train.py --cache data/volcache --strategy zero
    python pipelines/volumes/train.py --cache data/ctcache --patch 64 --patches-per-volume 4
    python pipelines/volumes/train.py --cache data/volcache --resume runs/volumes/last.pt

Items are VOLUMES (each on exactly one rank once per epoch). With ``--patch 0`` (default for
volumes of at most 64^3) the whole volume is the input (``CachedDataset``); with ``--patch P``
each volume gives ``--patches-per-volume`` random P^3 patches read from the mapped shard
(``precache.loading.datasets.volume_patches.PatchDataset``), each labelled with its volume's label. Batches are
augmented on the device, whole (``precache.augment.volume.VolumeAugment``: flips, 90-degree
turns, intensity, gamma, optionally a small affine). A ``.npz`` cache trains on ``train`` and
validates on ``val``; any other validates on every 10th volume. Validation scores whole volumes
(the network pools globally, so any size fits). The loop is ``precache.training.loop.fit``:
``--strategy ddp|zero|fsdp``, ``--precision``, ``--accumulate``, ``--clip``, ``set_to_none``,
the OneCycle rate by progress, ``cudnn.benchmark``, the timeline, resume on any world size.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Subset

from precache.augment import VolumeAugment
from precache.loading import (CachedDataset, DevicePrefetcher, PatchDataset, class_targets,
                              make_loader)
from precache.training.loop import Run, Step, Task, TrainData, fit
from precache.training.settings import Settings, check_cache, training_parser


class BasicBlock3d(nn.Module):
    """Two 3x3x3 convolutions with a residual; no conv bias (the batch norm after has one)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv3d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm3d(cout)
        self.conv2 = nn.Conv3d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm3d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv3d(cin, cout, 1, stride, bias=False), nn.BatchNorm3d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.down is None else self.down(x)))


class ResNet3d(nn.Module):
    """ResNet3D-18: a stride-2 3x3x3 stem, four stages of two basic blocks (widths w, 2w, 4w,
    8w), global average pooling, a linear head. ``width=64`` is the classic network."""

    def __init__(self, classes: int, width: int = 32, in_channels: int = 1,
                 blocks: tuple[int, ...] = (2, 2, 2, 2)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(in_channels, width, 3, 2, 1, bias=False),
                                  nn.BatchNorm3d(width), nn.ReLU(inplace=True))
        layers, cin = [], width
        for stage, count in enumerate(blocks):
            cout = width * 2 ** stage
            for b in range(count):
                layers.append(BasicBlock3d(cin, cout, 2 if b == 0 and stage > 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean(dim=(2, 3, 4)))


class VolumeClassification(Task):
    """ResNet3d on whole volumes or random patches of a volumes cache (see the docstring)."""

    input = "volumes"

    def __init__(self, args: Any) -> None:
        self.args = args  # the flags of main()

    def data(self, run: Run) -> TrainData:
        a, s = self.args, run.settings
        self.full = CachedDataset(s.cache, columns=["volume", "label"])
        meta = CachedDataset(s.cache, columns=["label", "split"], generation=self.full.generation)
        rows = meta.read_batch(range(len(meta)))
        meta.close()
        labels, splits = np.asarray(rows["label"]), np.array(rows["split"], dtype=str)
        self.classes = class_targets(labels)[0]  # sorted; a .npz cache's integers stay integers
        self.index = {str(name): i for i, name in enumerate(self.classes)}
        every = np.arange(len(labels))
        if (splits == "train").any():
            train_idx, val_idx = every[splits == "train"], every[splits == "val"]
        else:
            train_idx, val_idx = every[every % 10 != 0], every[every % 10 == 0]
        shape = self.full.read_batch([0])["volume"].shape[1:]
        self.patches = a.patch if a.patch is not None else (0 if max(shape) <= 64 else 64)
        if self.patches:
            self.train_set: Any = PatchDataset(s.cache, patch=self.patches,
                                               per_volume=a.patches_per_volume,
                                               classes=self.classes, seed=s.seed,
                                               generation=self.full.generation)
            columns = ["volume", "label"]
        else:
            columns = ["volume", "label", "key"] if s.log_keys else ["volume", "label"]
            self.train_set = CachedDataset(s.cache, columns=columns,
                                           generation=self.full.generation)
        self.augment = None if a.no_augment else VolumeAugment(affine_p=a.affine_p)
        self.val_loader = make_loader(Subset(self.full, val_idx.tolist()), a.val_batch_size,
                                      shuffle=False, num_workers=0)
        loader = make_loader(Subset(self.train_set, train_idx.tolist()), s.batch_size,
                             num_workers=s.workers, seed=s.seed,
                             worker_kind=s.worker_kind)
        if run.rank == 0:
            what = f"{a.patches_per_volume} patches of {self.patches}^3" if self.patches else \
                "whole"
            print(f"{len(train_idx)} volumes {tuple(shape)} to train on ({what}), "
                  f"{len(val_idx)} to validate; classes {self.classes}", flush=True)
        return TrainData(loader, len(train_idx), columns)

    def model(self, run: Run) -> nn.Module:
        net = ResNet3d(len(self.classes), width=self.args.width)
        # channels_last_3d: the fast layout for 3D convolutions on GPUs (cuDNN) and oneDNN
        return net.to(memory_format=torch.channels_last_3d) if self.args.channels_last else net

    def _prepare(self, volumes: torch.Tensor, train: bool) -> torch.Tensor:
        """uint8 (N, D, H, W) on the device -> float (N, 1, D, H, W) in 0..1, augmented."""
        x = volumes.float().div_(255).unsqueeze(1)
        if train and self.augment is not None:
            x = self.augment(x)
        if self.args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last_3d)
        return x

    def _targets(self, labels: Any, device: torch.device) -> torch.Tensor:
        # strings, or an int64 tensor where stage 1 stored integer labels (a MedMNIST .npz)
        names = labels.tolist() if isinstance(labels, torch.Tensor) else labels
        return torch.as_tensor([self.index[str(name)] for name in names]).to(device,
                                                                             non_blocking=True)

    def inputs(self, batch: dict, run: Run) -> Any:
        if self.patches:
            k = batch["patch"].shape[1]
            return (self._prepare(batch["patch"].flatten(0, 1), True),
                    batch["target"].repeat_interleave(k), len(batch["target"]))
        return (self._prepare(batch["volume"], True), self._targets(batch["label"], run.device),
                len(batch["label"]))

    def keys(self, batch: dict) -> list[str]:
        return list(batch["key"])

    def loss(self, net: nn.Module, inputs: Any, run: Run) -> Step:
        x, targets, volumes = inputs
        logits = net(x).float()
        correct = (logits.argmax(1) == targets).sum()  # a tensor: summed without a host sync
        return Step(nn.functional.cross_entropy(logits, targets), volumes,
                    {"train_correct": correct, "train_inputs": len(targets)})

    def validate(self, net: nn.Module, run: Run) -> dict[str, Any]:
        correct = torch.zeros((), device=run.device)
        count = 0
        for batch in DevicePrefetcher(self.val_loader, run.device):  # each rank its share
            targets = self._targets(batch["label"], run.device)
            with run.autocast():
                logits = net(self._prepare(batch["volume"], False)).float()
            correct += (logits.argmax(1) == targets).sum()
            count += len(targets)
        right, total = run.all_sum([correct.item(), count])
        return {"val_acc": right / max(1, total), "val_volumes": total}

    def report(self, sums: dict[str, float], seconds: float) -> dict[str, Any]:
        inputs = sums.get("train_inputs", 0.0)
        return {"train_acc": sums.get("train_correct", 0.0) / max(1.0, inputs),
                "inputs_per_s": inputs / max(1e-9, seconds)}

    def extra(self) -> dict[str, Any]:
        return {"classes": self.classes, "width": self.args.width, "patch": self.patches}

    def check(self, state: dict[str, Any], path: str) -> None:
        # as text: checkpoints from before integer labels saved "0", "1", ... for the same classes
        saved = [str(c) for c in state.get("classes") or []]
        if saved != [str(c) for c in self.classes] or state.get("width") != self.args.width:
            raise SystemExit(f"{path} was trained on labels {state.get('classes')} with width "
                             f"{state.get('width')}; this run has {self.classes}, "
                             f"width {self.args.width}")

    def close(self) -> None:
        for dataset in (self.full, self.train_set):
            dataset.close()


def main(argv: list[str] | None = None) -> None:
    p = training_parser(__doc__, out="runs/volumes", lr=3e-3, epochs=8, batch_size=16,
                        precision="auto", items="volumes",
                        cache_help="a cache of the volumes pipeline")
    p.add_argument("--width", type=int, default=32,
                   help="channels of the first stage (64: the classic ResNet3D-18)")
    p.add_argument("--patch", type=int, default=None,
                   help="train on random P^3 patches (0: whole volumes; default: whole up to "
                        "64^3, else 64)")
    p.add_argument("--patches-per-volume", type=int, default=4, help="with --patch: per epoch")
    p.add_argument("--val-batch-size", type=int, default=16, help="volumes per validation batch")
    p.add_argument("--affine-p", type=float, default=0.0,
                   help="share of inputs given a small random affine (resampled)")
    p.add_argument("--no-augment", action="store_true", help="train on the cached volumes as is")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="channels_last_3d weights and inputs (default: on CUDA)")
    args = p.parse_args(argv)
    check_cache(p, args.cache, "volumes", ["volume", "label", "split"])
    if args.channels_last is None:
        args.channels_last = torch.cuda.is_available()
    if args.precision == "auto" and not torch.cuda.is_available():
        # bf16 autocast of Conv3d on this CPU (oneDNN, torch 2.13, native bf16) gave NaN weight
        # gradients in the last stage (2^3 voxels) within the first steps; fp32 trains.
        args.precision = "fp32"
    fit(VolumeClassification(args), Settings.from_args(args))


if __name__ == "__main__":
    main()
