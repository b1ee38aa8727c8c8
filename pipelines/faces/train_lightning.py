"""The faces landmark model (``precache.pipelines.faces.landmarks``) as a LightningModule over precache's
``CacheDataModule``, with the strategy and precision switches of the face thesis's recipe
(which ended with DeepSpeed ZeRO stage 2 and fp16 through Lightning):

    python pipelines/faces/train_lightning.py --cache data/cache --devices 1
    python pipelines/faces/train_lightning.py --cache data/cache --devices 2 --strategy fsdp
    python pipelines/faces/train_lightning.py --cache data/cache --devices 8 --strategy deepspeed_stage_2 --precision fp16
    srun python pipelines/faces/train_lightning.py --cache data/cache --devices 4 --num-nodes 2

The flags are the other trainers' where they mean the same (``training_parser``); ``--precision
bf16|fp16|fp32|auto`` maps to Lightning's ``bf16-mixed|16-mixed|32``. ``--strategy fsdp`` is
FSDP2 through ``ModelParallelStrategy`` (Lightning's ``FSDPStrategy`` refuses the CPU); FSDP2
shards contiguous weights only, so the weights stay NCHW there. ``fp16`` and
``deepspeed_stage_2`` need CUDA: on CPU the script says so in one line. Each epoch appends the
record of every precache trainer (``precache.training.metrics_log``) to ``<out>/metrics.jsonl``;
``--resume`` continues from a Lightning checkpoint, mid-epoch included. ``FaceAugment`` augments
each training batch after it reaches its device (``on_after_batch_transfer``): per uint8 crop
with OpenCV on a CPU, over the whole batch on a GPU.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import lightning as L
import torch
from torch import nn

from precache.augment import FaceAugment
from precache.loading.interop.lightning import CacheDataModule
from precache.pipelines.faces.landmarks import AUGMENT_COLUMNS, LandmarkNet, batch_to_inputs
from precache.training.metrics_log import MetricLog
from precache.training.settings import check_cache, training_parser
from precache.training.step import auto_precision, open_keys_log

LIGHTNING_PRECISION = {"fp32": "32", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def check_hardware(strategy: str, precision: str) -> None:
    """One clear line for the combinations that cannot run here, before Lightning starts."""
    cuda = torch.cuda.is_available()
    if precision == "fp16" and not cuda:
        raise SystemExit("--precision fp16 (with a GradScaler) needs a CUDA GPU; use "
                         "--precision bf16 on CPU")
    if strategy == "deepspeed_stage_2" and not (cuda and importlib.util.find_spec("deepspeed")):
        raise SystemExit("--strategy deepspeed_stage_2 needs DeepSpeed and a CUDA GPU: pip "
                         "install deepspeed on a machine with CUDA; on CPU use ddp or fsdp")


class LandmarkModule(L.LightningModule):
    """LandmarkNet, smooth-L1 on the augmented crops' landmarks, AdamW."""

    def __init__(self, lr: float, keys_dir: str | None = None, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = LandmarkNet()
        self._keys: Any = None
        self.augment: FaceAugment | None = None

    def setup(self, stage: str) -> None:
        self.augment = FaceAugment(seed=self.hparams.seed * 100_003 + self.global_rank)

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        """Training batches are augmented whole, on the device they were moved to."""
        if self.trainer.training and self.augment is not None:
            return self.augment(batch)
        return batch

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
            self._keys = self._keys or open_keys_log(self.hparams.keys_dir, self.global_rank)
            self._keys.write("".join(f"{self.current_epoch}\t{k}\n" for k in batch["key"]))
            self._keys.flush()
        images, targets = batch_to_inputs(batch)
        loss = nn.functional.smooth_l1_loss(self.net(images).float(), targets, beta=0.02)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True,
                 batch_size=len(images))
        return loss

    def validation_step(self, batch: dict, index: int) -> None:
        images, targets = batch_to_inputs(batch)
        self.log("val_l1", nn.functional.l1_loss(self.net(images).float(), targets),
                 sync_dist=True, batch_size=len(images))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=1e-4)


class EpochRecords(L.Callback):
    """Each epoch's record, in the schema of every precache trainer (the data wait: the time
    between one batch's end and the next one's start)."""

    def __init__(self, out: str, strategy: str, precision: str, epochs: int) -> None:
        self.out, self.strategy, self.precision, self.epochs, self.seen = (
            out, strategy, precision, epochs, 0)

    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        self.log = MetricLog(self.out, trainer.global_rank, epochs=self.epochs)

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.started = self.ready = time.perf_counter()
        self.samples, self.wait = 0, 0.0

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, i: int) -> None:
        self.wait += time.perf_counter() - self.ready

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, out: Any, batch: Any,
                           i: int) -> None:
        self.samples += len(batch["image"]) * trainer.world_size
        self.ready = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        elapsed = time.perf_counter() - self.started
        self.seen += self.samples
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        self.log.epoch(seconds=elapsed, epoch=trainer.current_epoch, step=trainer.global_step,
                       train_loss=metrics.pop("train_loss", float("nan")),
                       samples_per_s=self.samples / elapsed, data_wait=self.wait / elapsed,
                       world_size=trainer.world_size, strategy=self.strategy,
                       precision=self.precision, lr=trainer.optimizers[0].param_groups[0]["lr"],
                       samples_seen=self.seen, samples_planned=self.epochs * len(
                           trainer.datamodule.train_set), **metrics)


def main(argv: list[str] | None = None) -> None:
    p = training_parser(__doc__, out="runs/faces-lightning", lr=2e-3, precision="fp32",
                        items="crops", cache_help="a cache of the faces pipeline", loop=False,
                        strategies=("ddp", "fsdp", "deepspeed_stage_2"))
    p.add_argument("--devices", type=int, default=1, help="processes (GPUs) per node")
    p.add_argument("--num-nodes", type=int, default=1)
    args = p.parse_args(argv)
    precision = args.precision if args.precision != "auto" else auto_precision(
        torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    check_hardware(args.strategy, precision)
    check_cache(p, args.cache, "faces", ["image", "landmarks5"])
    L.seed_everything(args.seed, workers=True)
    data = CacheDataModule(args.cache, args.batch_size,
                           columns=AUGMENT_COLUMNS + (["key"] if args.log_keys else []),
                           val_every=10,
                           num_workers=args.workers, seed=args.seed)
    strategy: Any = args.strategy
    if args.strategy == "fsdp":  # FSDP2 (configure_model shards); FSDPStrategy refuses the CPU
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=args.devices * args.num_nodes,
                                         tensor_parallel_size=1)
    trainer = L.Trainer(
        accelerator="auto", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
        precision=LIGHTNING_PRECISION[precision], max_epochs=args.epochs,
        max_steps=args.max_steps or -1, accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip or None, default_root_dir=args.out,
        callbacks=[EpochRecords(args.out, args.strategy, precision, args.epochs)],
        enable_progress_bar=False, logger=False, use_distributed_sampler=False)
    trainer.fit(LandmarkModule(args.lr, args.log_keys, args.seed), datamodule=data,
                ckpt_path=args.resume)


if __name__ == "__main__":
    main()
