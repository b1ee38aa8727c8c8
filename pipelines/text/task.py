"""Text classification from a token cache: the task of ``pipelines/text/train.py`` (an encoder
trained from scratch) and ``pipelines/text/finetune.py`` (a pretrained transformer).

Batches come from ``make_loader`` over a ``LengthBucketSampler`` (documents of similar length
together; it resumes mid-epoch on any number of ranks), padded by ``TokenCollate`` to their own
longest document, so little of each step is spent on padding; every 10th document is held out,
and validation is accuracy over them (each rank scores its share).
Epoch records add ``val_accuracy``, ``tokens_per_s`` (real tokens, all ranks) and ``padding``
(the padded share of the batches).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from precache.loading import CachedDataset, LengthBucketSampler, TokenCollate, make_loader
from precache.training.loop import Run, Step, Task, TrainData

__all__ = ["TextClassification", "TextModel"]


@dataclass
class TextModel:
    """What ``TextClassification`` trains, built from the classes and the cached lengths.

    Attributes:
        module: on the CPU; ``fit`` moves and wraps it.
        logits: (module, ids, mask) -> (batch, classes) logits.
        vocab_size: a cached id at or beyond it stops the run with ``vocab_advice``.
        vocab_advice: the end of that message: what to do.
        pad_id: the id ``TokenCollate`` pads with.
        extra: added to every checkpoint and to the run record.
    """

    module: nn.Module
    logits: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    vocab_size: int
    vocab_advice: str
    pad_id: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class TextClassification(Task):
    """Classify the documents of a ``text`` cache by ``label``.

    Args:
        build: ``(classes, lengths) -> TextModel``, called once the cache is open.
    """

    input = "tokens"
    weight_decay = 1e-2
    compile_dynamic = True  # lengths vary per batch
    prefetch = False  # ``inputs`` checks the ids on the host copy, then copies

    def __init__(self, build: Callable[[list[str], np.ndarray], TextModel]) -> None:
        self.build = build

    def data(self, run: Run) -> TrainData:
        s = run.settings
        self.meta = CachedDataset(s.cache, columns=["length", "label"])
        meta = self.meta.read_batch(range(len(self.meta)))  # whole columns, read once
        lengths, labels = meta["length"], list(meta["label"])
        self.classes = sorted(set(labels))  # label -> int, fixed for the run and its checkpoints
        self.label_id = {name: i for i, name in enumerate(self.classes)}
        val_idx = list(range(0, len(labels), 10))
        train_idx = [i for i in range(len(labels)) if i % 10]
        columns = ["ids", "label", "key"] if s.log_keys else ["ids", "label"]
        self.docs = CachedDataset(s.cache, columns=columns, generation=self.meta.generation)
        self.built = self.build(self.classes, lengths)
        collate = TokenCollate(column="ids", pad_id=self.built.pad_id, multiple_of=8)
        sampler = LengthBucketSampler(lengths[train_idx], s.batch_size, seed=s.seed)
        # auto: threads (a cached batch is one read per shard, TokenCollate pads it with a few
        # NumPy calls: the GIL is held briefly and no batch is copied through shared memory)
        loader = make_loader(Subset(self.docs, train_idx), batch_sampler=sampler, seed=s.seed,
                             collate_fn=collate, num_workers=s.workers,
                             pin_memory=run.device.type == "cuda", worker_kind=s.worker_kind)
        # every rank scores every world-th held-out document, in as many forward passes as every
        # other rank (fsdp gathers the parameters in each): short shares are padded, not scored
        share = -(-len(val_idx) // run.world_size)
        mine = val_idx[run.rank::run.world_size]
        self.val_scored = len(mine)
        mine += val_idx[:1] * (share - len(mine))
        self.val_loader = DataLoader(Subset(self.docs, mine), batch_size=s.batch_size,
                                     collate_fn=collate, num_workers=0)
        return TrainData(loader, len(train_idx), columns)

    def model(self, run: Run) -> nn.Module:
        return self.built.module

    def inputs(self, batch: dict, run: Run) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if int(batch["input_ids"].max()) >= self.built.vocab_size:  # the host copy: no sync
            raise SystemExit(f"{run.settings.cache} holds token id "
                             f"{int(batch['input_ids'].max())}, {self.built.vocab_advice}")
        targets = torch.tensor([self.label_id[name] for name in batch["label"]])
        return tuple(t.to(run.device, non_blocking=True)  # type: ignore[return-value]
                     for t in (batch["input_ids"], batch["attention_mask"], targets))

    def loss(self, net: nn.Module, inputs: Any, run: Run) -> Step:
        ids, mask, targets = inputs
        loss = nn.functional.cross_entropy(self.built.logits(net, ids, mask).float(), targets)
        return Step(loss, len(ids), {"tokens": mask.sum(), "slots": mask.numel()})

    def validate(self, net: nn.Module, run: Run) -> dict[str, Any]:
        correct = torch.zeros((), device=run.device)
        seen = 0
        for batch in self.val_loader:
            ids, mask, targets = self.inputs(batch, run)
            with run.autocast():
                right_ones = self.built.logits(net, ids, mask).argmax(-1) == targets
            correct += right_ones[:max(0, self.val_scored - seen)].sum()  # not the padding
            seen += len(targets)
        right, total = run.all_sum([correct.item(), self.val_scored])
        return {"val_accuracy": right / max(1, total)}

    def report(self, sums: dict[str, float], seconds: float) -> dict[str, Any]:
        tokens = sums.get("tokens", 0.0)
        return {"tokens_per_s": tokens / max(1e-9, seconds),
                "padding": 1 - tokens / max(1, sums.get("slots", 0.0))}

    def extra(self) -> dict[str, Any]:
        return {"classes": self.classes, **self.built.extra}

    def check(self, state: dict[str, Any], path: str) -> None:
        if state.get("classes") != self.classes:
            raise SystemExit(f"{path} was trained on labels {state.get('classes')}, not "
                             f"{self.classes}")

    def close(self) -> None:
        for dataset in (self.meta, self.docs):
            dataset.close()
