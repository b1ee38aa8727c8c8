"""Lightning runs over a cache, for test_lightning.py: each rank logs the keys it trains on.

    python lightning_job.py CACHE OUT --stops 2,7,13                       # 1 rank
    torchrun --nproc_per_node=2 lightning_job.py CACHE OUT --stops 2,4,7   # 2 gloo ranks

One launch runs every scenario (a Python with Lightning takes seconds to start): 2 epochs
uninterrupted, and for each stop and each way of handing Lightning the loader (a
``CacheDataModule``; a ``make_loader`` loader passed to ``fit``), a run stopped after that many
steps with a checkpoint there, then ``fit(ckpt_path=...)`` to the end of epoch 1. Each fit's
rank r appends ``epoch<TAB>key`` lines to ``OUT/<scenario>/<phase>-rank<r>.tsv``. Under torchrun
Lightning finds its ranks in the environment, so every fit of the launch shares one gloo group.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning as L
import torch
from torch import nn

from precache.loading import CachedDataset, make_loader
from precache.loading.interop.lightning import CacheDataModule

BATCH = 4


class Tiny(L.LightningModule):
    def __init__(self, log: Path) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.log_path = log

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        path = self.log_path.with_name(f"{self.log_path.name}-rank{self.global_rank}.tsv")
        with path.open("a") as f:
            f.write("".join(f"{self.current_epoch}\t{key}\n" for key in batch["key"]))
        means = batch["image"].float().mean(dim=(1, 2)) / 255
        return self.layer(means).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(cache: str, way: str, log: Path, *, max_steps: int = -1, ckpt_path: str | None = None,
        checkpoints: Path | None = None) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    callbacks = [] if checkpoints is None else [L.pytorch.callbacks.ModelCheckpoint(
        dirpath=checkpoints, save_last=True, every_n_train_steps=max_steps, save_top_k=0)]
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                        precision="bf16-mixed", max_epochs=2, max_steps=max_steps,
                        callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        enable_checkpointing=checkpoints is not None)
    torch.manual_seed(0)
    if way == "datamodule":
        data = CacheDataModule(cache, batch_size=BATCH, columns=["key", "image"], num_workers=1)
        trainer.fit(Tiny(log), datamodule=data, ckpt_path=ckpt_path)
    else:  # the loader made before fit: its ranks from torchrun's environment
        loader = make_loader(CachedDataset(cache, columns=["key", "image"]), BATCH, seed=0,
                             num_workers=1, rank=int(os.environ.get("RANK", "0")),
                             world_size=world)
        trainer.fit(Tiny(log), train_dataloaders=loader, ckpt_path=ckpt_path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache")
    parser.add_argument("out")
    parser.add_argument("--stops", default="", help="steps after which a run stops, e.g. 2,7,13")
    args = parser.parse_args()
    out = Path(args.out)
    fit(args.cache, "datamodule", out / "full" / "run")
    for stop in [int(s) for s in args.stops.split(",") if s]:
        for way in ("datamodule", "loader"):
            scenario = out / f"{way}-{stop}"
            fit(args.cache, way, scenario / "first", max_steps=stop, checkpoints=scenario)
            fit(args.cache, way, scenario / "resumed", ckpt_path=str(scenario / "last.ckpt"))


if __name__ == "__main__":
    main()
