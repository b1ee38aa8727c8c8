"""The faces landmark model: a small CNN that finds the 5 facial landmarks on cached face crops,
its inputs, and the face trainers' shared flags (``--augment-on``, ``--decode-on``: their
choices, help strings and where crops are decoded). ``pipelines/faces/train.py`` trains it with
``precache.training.loop.fit``, ``pipelines/faces/train_lightning.py`` as a LightningModule;
``pipelines/faces/train_classifier.py`` shares the flags.

Targets are ``landmarks5`` in crop pixels / crop size (0..1). ``FaceAugment`` moves and
re-indexes the points with the image, so a flip cannot teach the model to swap eyes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from precache.loading import as_nchw, decodes_on

__all__ = ["AUGMENT_COLUMNS", "AUGMENT_ON", "AUGMENT_ON_HELP", "DECODE_ON", "DECODE_ON_HELP",
           "LandmarkNet", "batch_to_inputs", "decode_in_loader"]

AUGMENT_COLUMNS = ["image", "landmarks5", "has_mesh", "regions", "region_sizes"]  # FaceAugment's
AUGMENT_ON = ("device", "loader")  # the face trainers' --augment-on
AUGMENT_ON_HELP = (
    "where FaceAugment runs. device: on each batch after the loader, where the model is (on a "
    "GPU, JPEG crops are decoded there too, by nvJPEG); its cost there is mostly per batch (on "
    "an H100 ~37 ms for 256 crops of 224 px, ~12 ms for 32 of 128 px), so it suits large "
    "batches. loader: in the loader's workers, on the CPU (OpenCV), the crops decoded there; "
    "with worker threads the draws are shared by the threads, so which batch gets which draw "
    "varies from run to run (--worker-kind processes, or --augment-on device, repeat exactly)")


DECODE_ON = ("device", "loader")  # the face trainers' --decode-on
DECODE_ON_HELP = (
    "where JPEG crops (stage 1's image_codec=jpeg) are decoded when the model is on a GPU. "
    "device: nvJPEG there, one call per batch; the crops travel as their bytes (5-10x smaller), "
    "but the decoder's host side serves one batch at a time (~14,500 crops of 224 px/s on an "
    "H100 through torchvision). loader: libjpeg-turbo in the loader's workers, on every core at "
    "once (~3,800 such crops/s per core), then the pixels travel; FaceAugment still runs where "
    "--augment-on says. On a CPU, or with --augment-on loader, crops are decoded in the loader")


def decode_in_loader(device: torch.device | str, decode_on: str, augment_in_loader: bool) -> bool:
    """Whether the face trainers' loader decodes JPEG crops (``CachedDataset(decode_images=...)``):
    when asked to (``--decode-on loader``), when the loader augments them, or when the device
    cannot (a CPU, or a GPU without a GPU decoder installed)."""
    if decode_on not in DECODE_ON:
        raise ValueError(f"decode_on must be one of {DECODE_ON}, not {decode_on!r}")
    return augment_in_loader or decode_on == "loader" or not decodes_on(device)


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    # No bias: the batch norm right after it has its own.
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class LandmarkNet(nn.Module):
    """Four stride-2 conv blocks, average pooling, a linear head: (N, 3, H, W) -> (N, 5, 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(_conv_block(3, 32), _conv_block(32, 64),
                                      _conv_block(64, 128), _conv_block(128, 128),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(128, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images)).view(-1, 5, 2)


def batch_to_inputs(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 NHWC -> float NCHW (channels_last) in 0..1, and the targets in 0..1 of the crop."""
    images = as_nchw(batch["image"]).float().div_(255)
    return images, batch["landmarks5"].float() / images.shape[-1]
