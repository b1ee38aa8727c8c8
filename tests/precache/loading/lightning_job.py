"""A Lightning run over a cache, for test_lightning.py: each rank logs the keys it trains on.

    python lightning_job.py CACHE OUT --devices 2 --max-steps 3          # stops mid-epoch
    python lightning_job.py CACHE OUT --devices 2 --resume OUT/last.ckpt  # finishes the epoch

Lightning's DDP on CPU re-runs this script for the other ranks, so it must be a script.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning as L
import torch
from torch import nn

from precache.loading.lightning import CacheDataModule


class Tiny(L.LightningModule):
    def __init__(self, log_dir: str) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.log_dir = log_dir

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        with open(os.path.join(self.log_dir, f"keys-rank{self.global_rank}.txt"), "a") as f:
            f.write("".join(f"{key}\n" for key in batch["key"]))
        means = batch["image"].float().mean(dim=(1, 2)) / 255
        return self.layer(means).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache")
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    data = CacheDataModule(args.cache, batch_size=4, columns=["key", "image"], num_workers=1)
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=args.out, save_last=True,
                                                     every_n_train_steps=1, save_top_k=0)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp",
                        precision="bf16-mixed", max_epochs=1, max_steps=args.max_steps,
                        callbacks=[checkpoint], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Tiny(args.out), datamodule=data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
