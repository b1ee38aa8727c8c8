"""Train a small CNN to find the 5 facial landmarks on cached face crops, the speed checklist
applied. It reads only the cache (no detector, no mesh), so every step is cheap to feed.

    torchrun --nproc_per_node=2 pipelines/faces/train.py --cache data/cache --epochs 3
    python pipelines/faces/train.py --cache data/cache --resume runs/faces/last.pt
    sbatch pipelines/slurm/faces_4nodes_x1gpu.sbatch     # Slurm: torchrun per node, or srun python

Task: regress ``landmarks5`` (crop pixels / size, so 0..1) from the augmented crop with
``precache.pipelines.faces.landmarks.LandmarkNet`` (smooth L1); every 10th crop is held out (``val_l1``).
``FaceAugment`` augments each batch where it lives after the loader (per uint8 crop with OpenCV on
a CPU, over the whole batch on a GPU), so the loader ships the cached columns whole; on a GPU,
JPEG crops travel as their bytes and are decoded there (nvJPEG). ``--decode-on loader`` has the
loader's workers decode them on every core instead (augmenting still on the GPU);
``--augment-on loader`` has them decode and augment (cheaper for small batches on a GPU).
The loop is ``precache.training.loop.fit``: strategies, precision, accumulation, clipping, the
OneCycle schedule by progress, the step timeline, and resume on another number of ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Subset

from precache.augment import FaceAugment
from precache.loading import CachedDataset, DevicePrefetcher, decode_images, make_loader
from precache.pipelines.faces.landmarks import (AUGMENT_COLUMNS, AUGMENT_ON, AUGMENT_ON_HELP,
                                                DECODE_ON, DECODE_ON_HELP, LandmarkNet,
                                                batch_to_inputs, decode_in_loader)
from precache.training.loop import Run, Step, Task, TrainData, fit
from precache.training.settings import Settings, check_cache, training_parser


class Landmarks(Task):
    """LandmarkNet on the augmented crops of a faces cache; every 10th crop validates.

    Args:
        augment_on: ``"device"`` or ``"loader"`` (``AUGMENT_ON_HELP``).
        decode_on: ``"device"`` or ``"loader"``: where JPEG crops are decoded on a GPU
            (``DECODE_ON_HELP``).
    """

    channels_last = True

    def __init__(self, augment_on: str = "device", decode_on: str = "device") -> None:
        if augment_on not in AUGMENT_ON:
            raise ValueError(f"augment_on must be one of {AUGMENT_ON}, not {augment_on!r}")
        if decode_on not in DECODE_ON:
            raise ValueError(f"decode_on must be one of {DECODE_ON}, not {decode_on!r}")
        self.augment_on, self.decode_on = augment_on, decode_on

    def data(self, run: Run) -> TrainData:
        s = run.settings
        self.full = CachedDataset(s.cache, columns=["image", "landmarks5"])
        train_idx = [i for i in range(len(self.full)) if i % 10]
        columns = AUGMENT_COLUMNS + ["key"] if s.log_keys else AUGMENT_COLUMNS
        in_loader = self.augment_on == "loader"
        # JPEG crops (stage 1's image_codec) travel encoded and nvJPEG decodes them on a GPU.
        # The generation the first opened: train_idx are positions of its rows.
        self.train_set = CachedDataset(s.cache, columns=columns, decode_images=decode_in_loader(
            run.device, self.decode_on, in_loader), generation=self.full.generation)
        self.augment = FaceAugment(seed=s.seed * 100_003 + run.rank)  # a stream per rank
        self.val_loader = make_loader(Subset(self.full, range(0, len(self.full), 10)),
                                      s.batch_size, shuffle=False, num_workers=0)
        loader = make_loader(Subset(self.train_set, train_idx), s.batch_size,
                             num_workers=s.workers, seed=s.seed, worker_kind=s.worker_kind,
                             batch_transform=self.augment if in_loader else None)
        return TrainData(loader, len(train_idx), columns, transform_in_loader=in_loader)

    def model(self, run: Run) -> nn.Module:
        return LandmarkNet()

    def inputs(self, batch: dict, run: Run) -> Any:
        if isinstance(batch["image"], list):  # JPEG bytes, decoded where the model is
            batch = {**batch, "image": decode_images(batch["image"], run.device)}
        if self.augment_on == "device":  # the batch is on the device already (DevicePrefetcher)
            batch = self.augment(batch)
        return batch_to_inputs(batch)

    def loss(self, net: nn.Module, inputs: Any, run: Run) -> Step:
        images, targets = inputs
        return Step(nn.functional.smooth_l1_loss(net(images).float(), targets, beta=0.02),
                    len(images))

    def validate(self, net: nn.Module, run: Run) -> dict[str, Any]:
        total = torch.zeros((), device=run.device)
        count = 0
        for batch in DevicePrefetcher(self.val_loader, run.device):  # each rank its share
            images, targets = batch_to_inputs(batch)
            with run.autocast():
                total += nn.functional.l1_loss(net(images).float(), targets, reduction="sum")
            count += targets.numel()
        error, numbers = run.all_sum([total.item(), count])
        return {"val_l1": error / max(1, numbers)}

    def close(self) -> None:
        for dataset in (self.full, self.train_set):
            dataset.close()


def main(argv: list[str] | None = None) -> None:
    p = training_parser(__doc__, out="runs/faces", lr=2e-3, items="crops",
                        cache_help="a cache of the faces pipeline")
    p.add_argument("--augment-on", choices=AUGMENT_ON, default="device", help=AUGMENT_ON_HELP)
    p.add_argument("--decode-on", choices=DECODE_ON, default="device", help=DECODE_ON_HELP)
    args = p.parse_args(argv)
    check_cache(p, args.cache, "faces", ["image", "landmarks5"])
    fit(Landmarks(args.augment_on, args.decode_on), Settings.from_args(args))


if __name__ == "__main__":
    main()
