"""The faces landmark model of ``pipelines/faces/train.py`` as a LightningModule over precache's
``CacheDataModule``, with the strategy and precision switches of the face thesis's recipe
(which ended with DeepSpeed ZeRO stage 2 and fp16 through Lightning):

    python pipelines/faces/train_lightning.py --cache data/cache --devices 1
    python pipelines/faces/train_lightning.py --cache data/cache --devices 2 --strategy fsdp
    python pipelines/faces/train_lightning.py --cache data/cache --devices 8 --strategy deepspeed_stage_2 --precision 16-mixed
    srun python pipelines/faces/train_lightning.py --cache data/cache --devices 4 --num-nodes 2

``--strategy fsdp`` is FSDP2 through Lightning's ``ModelParallelStrategy`` (``configure_model``
shards each conv block, then the model): Lightning's ``FSDPStrategy`` (FSDP1) refuses the CPU
("The strategy `fsdp` requires a GPU accelerator"). FSDP2 shards contiguous weights only, so the
weights stay NCHW there (the activations are still channels_last).

What was tested on CPU (gloo, 2 processes that Lightning starts itself): ``--strategy ddp`` (fp32)
and ``fsdp`` (bf16-mixed); every training sample once per epoch across
the ranks (``CacheDataModule``'s loaders keep precache's sampler). GPU-only: ``16-mixed`` (fp16
needs CUDA; on CPU use ``bf16-mixed``) and ``deepspeed_stage_2`` (DeepSpeed needs CUDA and
``pip install deepspeed``, which this project does not install); the script says so in one line
instead of failing inside Lightning.

Each epoch appends ``{"kind": "epoch", "epoch", "train_loss", "samples_per_s", ...}`` to
``<out>/metrics.jsonl`` on rank 0; ``--resume`` continues from a Lightning checkpoint, mid-epoch
included (the loader's position is in it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from precache.loading.lightning import CacheDataModule
from precache.pipelines.faces.train import AugmentForTraining, LandmarkNet, batch_to_inputs

STRATEGIES = ("ddp", "fsdp", "deepspeed_stage_2")
PRECISIONS = ("32", "bf16-mixed", "16-mixed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", required=True, help="a cache of the faces pipeline")
    p.add_argument("--out", default="runs/faces-lightning", help="checkpoints and metrics")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per device")
    p.add_argument("--workers", type=int, default=None, help="loader workers per device")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--devices", type=int, default=1, help="processes (GPUs) per node")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    p.add_argument("--precision", choices=PRECISIONS, default="32",
                   help="16-mixed (fp16, GradScaler) needs CUDA; bf16-mixed runs on CPU too")
    p.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: off)")
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--resume", default=None, help="a Lightning checkpoint to continue from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-keys", default=None, metavar="DIR",
                   help="append 'epoch<TAB>key' of every sample trained on to DIR/keys-rank<R>.tsv")
    return p.parse_args(argv)


def check_hardware(strategy: str, precision: str) -> None:
    """One clear line for the combinations that cannot run here, before Lightning starts."""
    cuda = torch.cuda.is_available()
    if precision == "16-mixed" and not cuda:
        raise SystemExit("--precision 16-mixed (fp16 with a GradScaler) needs a CUDA GPU; "
                         "use --precision bf16-mixed on CPU")
    if strategy == "deepspeed_stage_2":
        if importlib.util.find_spec("deepspeed") is None:
            raise SystemExit("--strategy deepspeed_stage_2 needs DeepSpeed and a CUDA GPU: "
                             "pip install deepspeed (on a machine with CUDA)")
        if not cuda:
            raise SystemExit("--strategy deepspeed_stage_2 needs a CUDA GPU; on CPU use "
                             "--strategy ddp or fsdp")


class LandmarkModule(L.LightningModule):
    """LandmarkNet, smooth-L1 on the augmented crops' landmarks, AdamW."""

    def __init__(self, lr: float, keys_dir: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = LandmarkNet()
        self._keys = None

    def configure_model(self) -> None:
        mesh = self.device_mesh  # set by ModelParallelStrategy (--strategy fsdp) only
        if mesh is None:
            self.net = self.net.to(memory_format=torch.channels_last)
        else:  # FSDP2 (contiguous weights only): each conv block its own unit, then the rest
            from torch.distributed.fsdp import fully_shard

            for block in self.net.features:
                if any(True for _ in block.parameters()):
                    fully_shard(block, mesh=mesh["data_parallel"])
            fully_shard(self.net, mesh=mesh["data_parallel"])

    def training_step(self, batch: dict, index: int) -> torch.Tensor:
        if self.hparams.keys_dir:
            if self._keys is None:
                Path(self.hparams.keys_dir).mkdir(parents=True, exist_ok=True)
                self._keys = open(Path(self.hparams.keys_dir) / f"keys-rank{self.global_rank}.tsv",
                                  "a")
            self._keys.write("".join(f"{self.current_epoch}\t{k}\n" for k in batch["key"]))
            self._keys.flush()
        images, targets = batch_to_inputs(batch, self.device)
        loss = nn.functional.smooth_l1_loss(self.net(images).float(), targets, beta=0.02)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True,
                 batch_size=len(images))
        return loss

    def validation_step(self, batch: dict, index: int) -> None:
        images, targets = batch_to_inputs(batch, self.device)
        self.log("val_l1", nn.functional.l1_loss(self.net(images).float(), targets),
                 sync_dist=True, batch_size=len(images))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=1e-4)


class EpochMetrics(L.Callback):
    """Rank 0 appends each epoch's loss and samples/s to ``metrics.jsonl``."""

    def __init__(self, path: Path, batch_size: int) -> None:
        self.path, self.batch_size = path, batch_size

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.started, self.batches = time.perf_counter(), 0

    def on_train_batch_end(self, trainer, module, outputs, batch, index) -> None:
        self.batches += 1

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        elapsed = time.perf_counter() - self.started
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        record = {"kind": "epoch", "epoch": trainer.current_epoch, "step": trainer.global_step,
                  "samples_per_s": self.batches * self.batch_size * trainer.world_size / elapsed,
                  "world_size": trainer.world_size, "strategy": type(trainer.strategy).__name__,
                  "precision": trainer.precision, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_hardware(args.strategy, args.precision)
    L.seed_everything(args.seed, workers=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    columns = ["image", "landmarks5", "has_mesh", "regions", "region_sizes"]
    data = CacheDataModule(args.cache, args.batch_size,
                           columns=columns + (["key"] if args.log_keys else []),
                           train_transform=AugmentForTraining(), val_every=10,
                           num_workers=args.workers, seed=args.seed)
    strategy: Any = args.strategy
    if args.strategy == "fsdp":
        # FSDP2 through ModelParallelStrategy (configure_model shards): Lightning's FSDPStrategy
        # (FSDP1) refuses the CPU ("The strategy `fsdp` requires a GPU accelerator").
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=args.devices * args.num_nodes,
                                         tensor_parallel_size=1)
    trainer = L.Trainer(
        accelerator="auto", devices=args.devices, num_nodes=args.num_nodes,
        strategy=strategy, precision=args.precision, max_epochs=args.epochs,
        max_steps=args.max_steps, accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip or None, default_root_dir=str(out),
        callbacks=[EpochMetrics(out / "metrics.jsonl", args.batch_size)],
        enable_progress_bar=False, logger=False, use_distributed_sampler=False)
    trainer.fit(LandmarkModule(args.lr, args.log_keys), datamodule=data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
