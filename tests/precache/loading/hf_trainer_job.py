"""One process of the Trainer tests (run directly, or by torchrun as one of several ranks):
``PrecacheTrainer`` trains a model over a text cache and logs, per rank and epoch, the keys of
every sample it trained on to ``<out>/keys-rank<R>.tsv``; rank 0 writes ``<out>/result.json``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import (BertConfig, BertForSequenceClassification, TrainerCallback,
                          TrainingArguments)

from precache.loading import CachedDataset
from precache.loading.hf import HFTokenCollate, PrecacheTrainer


class KeysLogged(HFTokenCollate):
    """The collator, also writing ``epoch<TAB>key`` of every sample it batches."""

    def __init__(self, label_ids: dict, path: Path) -> None:
        super().__init__(label_ids)
        self.log, self.epoch = path.open("a"), 0

    def __call__(self, samples: list[dict]) -> dict:
        self.log.write("".join(f"{self.epoch}\t{s['key']}\n" for s in samples))
        self.log.flush()
        return super().__call__(samples)


class Epochs(TrainerCallback):
    def __init__(self, collate: KeysLogged) -> None:
        self.collate = collate

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.collate.epoch = int(round(state.epoch or 0))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="a pretrained folder; default a tiny random BERT")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=-1)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", 0))
    train = CachedDataset(args.cache, columns=["ids", "label", "key"])
    labels = sorted(set(CachedDataset(args.cache, columns=["label"]).read_batch(
        range(len(train)))["label"]))
    torch.manual_seed(0)
    if args.model:
        model = BertForSequenceClassification.from_pretrained(args.model, num_labels=len(labels))
    else:
        model = BertForSequenceClassification(BertConfig(
            vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, num_labels=len(labels)))
    before = [p.detach().clone() for p in model.parameters()]
    collate = KeysLogged({name: i for i, name in enumerate(labels)}, out / f"keys-rank{rank}.tsv")
    trainer = PrecacheTrainer(
        model=model, train_dataset=train, data_collator=collate, callbacks=[Epochs(collate)],
        args=TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=4,
                               num_train_epochs=args.epochs, max_steps=args.max_steps,
                               learning_rate=5e-4, report_to=[], save_strategy="no",
                               logging_steps=1, use_cpu=True, seed=0,
                               dataloader_num_workers=0, disable_tqdm=True))
    result = trainer.train()
    changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    if rank == 0:
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        (out / "result.json").write_text(json.dumps({
            "steps": result.global_step, "losses": losses, "changed": changed,
            "world_size": trainer.args.world_size}))


if __name__ == "__main__":
    main()
