"""One process of the Trainer tests (run directly, or by torchrun as one of several ranks):
``PrecacheTrainer`` trains a model over a text cache and logs every batch it trained on, per
rank, as ``epoch<TAB>key,key,...`` lines in ``<out>/batches-rank<R>.tsv``; then evaluates on the
cache with ``remove_unused_columns`` on (the default); rank 0 writes ``<out>/result.json``."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
from transformers import (BertConfig, BertForSequenceClassification, TrainerCallback,
                          TrainingArguments)

from precache.loading import CachedDataset
from precache.loading.interop.hf import HFTokenCollate, PrecacheTrainer


class BatchesLogged(HFTokenCollate):
    """The collator, also writing the epoch and the keys of every batch it makes."""

    def __init__(self, label_ids: dict, path: Path) -> None:
        super().__init__(label_ids)
        self.log, self.epoch = path.open("a"), -1  # -1: not training (evaluation)

    def __call__(self, samples: list[dict]) -> dict:
        if self.epoch >= 0:
            self.log.write(f"{self.epoch}\t{','.join(s['key'] for s in samples)}\n")
            self.log.flush()
        return super().__call__(samples)


class Epochs(TrainerCallback):
    """Tells the collator the epoch (``state.epoch`` is fractional on a mid-epoch resume)."""

    def __init__(self, collate: BatchesLogged) -> None:
        self.collate = collate

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.collate.epoch = math.floor(state.epoch or 0)

    def on_train_end(self, args, state, control, **kwargs):
        self.collate.epoch = -1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="a pretrained folder; default a tiny random BERT")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--save-at", default="", help="steps to save a checkpoint after, e.g. 1,4,7")
    p.add_argument("--resume", default="",
                   help="checkpoint folders to resume from, one after another in this launch "
                        "(comma-separated); each resumed run logs under OUT/<folder's name>/")
    args = p.parse_args()
    out = Path(args.out)
    train = CachedDataset(args.cache, columns=["ids", "label", "key"])
    labels = sorted(set(CachedDataset(args.cache, columns=["label"]).read_batch(
        range(len(train)))["label"]))
    save_at = {int(s) for s in args.save_at.split(",") if s}
    resumes = [r for r in args.resume.split(",") if r]
    for resume in resumes or [None]:
        run(args, out / Path(resume).name if resume else out, train, labels, save_at, resume)


class SaveAt(TrainerCallback):
    """Saves a checkpoint after the chosen steps only."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        control.should_save = state.global_step in self.steps


def run(args: argparse.Namespace, out: Path, train: CachedDataset, labels: list[str],
        save_at: set[int], resume: str | None) -> None:
    """One training run (a resumed one if ``resume``), logged under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", 0))
    torch.manual_seed(0)
    if args.model:
        model = BertForSequenceClassification.from_pretrained(args.model, num_labels=len(labels))
    else:
        model = BertForSequenceClassification(BertConfig(
            vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, num_labels=len(labels)))
    before = [p.detach().clone() for p in model.parameters()]
    collate = BatchesLogged({name: i for i, name in enumerate(labels)},
                            out / f"batches-rank{rank}.tsv")
    trainer = PrecacheTrainer(
        model=model, train_dataset=train, data_collator=collate,
        callbacks=[Epochs(collate), SaveAt(save_at)],
        args=TrainingArguments(
            output_dir=str(out / "trainer"), per_device_train_batch_size=4,
            per_device_eval_batch_size=16, num_train_epochs=args.epochs, max_steps=args.max_steps,
            learning_rate=5e-4, report_to=[], logging_steps=1, use_cpu=True, seed=0,
            save_strategy="steps" if save_at else "no", save_steps=10**9,
            dataloader_num_workers=0, disable_tqdm=True))
    result = trainer.train(resume_from_checkpoint=resume)
    changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    evaluation = trainer.evaluate(eval_dataset=train)
    if rank == 0:
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        (out / "result.json").write_text(json.dumps({
            "steps": result.global_step, "losses": losses, "changed": changed,
            "world_size": trainer.args.world_size, "eval_loss": evaluation["eval_loss"]}))


if __name__ == "__main__":
    main()
