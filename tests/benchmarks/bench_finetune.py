"""Fine-tuning benchmark in the style of the DistilBERT-on-IMDB recipe: minutes per epoch of
MiniLM-L6 fine-tuning, one speed step added per row, every row measured in the same run.

    .venv/bin/python tests/benchmarks/bench_finetune.py [--batches 24] [--padded-batches 8]
    .venv/bin/python tests/benchmarks/bench_finetune.py --accuracy     # + the accuracy comparison

On the fortunes corpus (``data/make_corpus.py``, ~3,000 documents in 4 categories; Debian's
``fortunes`` must be installed), in a temporary folder. The rows:

1. baseline: a Dataset that reads and tokenizes each file in ``__getitem__``, padded to
   ``--max-length`` (Hugging Face's ``padding="max_length"``), shuffled batches, fp32, 1 process;
2. + precache token cache: ``CachedDataset`` over ``precache run text`` (same tokenizer, same
   truncation), still padded to ``--max-length``;
3. + length bucketing: ``LengthBucketSampler``, each batch padded to its own longest document;
4. + bf16 autocast;
5. + ``torch.compile(dynamic=True)`` (its compile time is reported apart, not in the rate);
6. + 2 DDP processes (torchrun, gloo), same batch size per process.

Each row adds its step to the steps kept so far; a step that made training slower (bf16 on a
CPU without native bf16 instructions, for one) is reported and then left out of the later rows,
as a user would drop it.

Each row times ``--batches`` optimizer steps (``--padded-batches`` for rows 1-2, whose batches
all have the same shape) after ``--warmup`` steps, and extrapolates to the epoch's number of
batches. The bucketed batches come in a shuffled order, so the first ones are a fair sample of
the epoch. On 2 cores, rows 1-5 use both cores in one process; row 6 gives each rank one.

``--accuracy`` also trains ``pipelines/text/finetune.py`` and the from-scratch encoder of
``pipelines/text/train.py`` on the same split (every 10th document held out) and prints both
validation accuracies.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

import precache
from precache.loading import CachedDataset
from precache.loading.samplers.length_buckets import LengthBucketSampler
from precache.loading.loaders.text_collate import TokenCollate
from precache.processing.ops.text import resolve_tokenizer

ROOT = Path(__file__).resolve().parents[2]
ROWS = ["baseline", "cache", "bucketing", "bf16", "compile", "ddp2"]
TITLES = {"baseline": "baseline: tokenize in the DataLoader, pad to max length, fp32, 1 process",
          "cache": "+ precache token cache", "bucketing": "+ length bucketing",
          "bf16": "+ bf16 autocast", "compile": "+ torch.compile", "ddp2": "+ 2 DDP processes"}


def load_make_corpus():  # data/ is not a package
    spec = importlib.util.spec_from_file_location("make_corpus", ROOT / "data" / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.make_corpus


class TokenizeInLoader(Dataset):
    """The usual loader: read one file and tokenize it, padded to ``max_length``, per item."""

    def __init__(self, files: list[Path], max_length: int) -> None:
        from tokenizers import Tokenizer

        self.files = files
        self.tok = Tokenizer.from_file(str(resolve_tokenizer("minilm")))
        self.tok.enable_truncation(max_length)
        self.tok.enable_padding(length=max_length)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict:
        encoding = self.tok.encode(self.files[i].read_text(encoding="utf-8"))
        return {"input_ids": torch.tensor(encoding.ids),
                "attention_mask": torch.tensor(encoding.attention_mask),
                "label": self.files[i].parent.name}


def stack(samples: list[dict]) -> dict:
    return {"input_ids": torch.stack([s["input_ids"] for s in samples]),
            "attention_mask": torch.stack([s["attention_mask"] for s in samples]),
            "label": [s["label"] for s in samples]}


def make_loader(row: str, corpus: Path, cache: Path, batch_size: int, max_length: int,
                seed: int) -> tuple[DataLoader, int, list[str]]:
    """The row's loader over the training rows, batches per epoch, and the classes."""
    data = CachedDataset(cache, columns=["ids", "label", "length", "source_key"])
    meta = data.read_batch(range(len(data)))
    classes = sorted(set(meta["label"]))
    train = [i for i in range(len(data)) if i % 10]
    generator = torch.Generator().manual_seed(seed)
    if row == "baseline":  # the same documents, read and tokenized from their files
        files = [corpus / str(meta["source_key"][i]) for i in train]
        loader = DataLoader(TokenizeInLoader(files, max_length), batch_size=batch_size,
                            shuffle=True, generator=generator, collate_fn=stack)
    elif row == "cache":  # TokenCollate pads every batch to a multiple of max_length: to it
        loader = DataLoader(Subset(data, train), batch_size=batch_size, shuffle=True,
                            generator=generator, collate_fn=TokenCollate(multiple_of=max_length))
    else:
        sampler = LengthBucketSampler(meta["length"][train], batch_size, seed=seed)
        loader = DataLoader(Subset(data, train), batch_sampler=sampler,
                            collate_fn=TokenCollate(multiple_of=8))
    return loader, len(loader), classes


def time_row(row: str, corpus: Path, cache: Path, args: argparse.Namespace,
             kept: set[str]) -> dict:
    """Train ``args.warmup`` + N steps of the row's data set-up with the ``kept`` optional steps
    (``bf16``, ``compile``); samples/s and real tokens/s of the N."""
    import torch.distributed as dist

    from precache.pipelines.text.finetune import default_model, load_model
    from precache.training.distributed import init_distributed

    rank, world, _, device = init_distributed()
    torch.manual_seed(args.seed)
    data = row if row in ("baseline", "cache") else "bucketing"
    loader, batches_per_epoch, classes = make_loader(data, corpus, cache, args.batch_size,
                                                     args.max_length, args.seed)
    label_id = {name: i for i, name in enumerate(classes)}
    model = load_model(default_model(), classes)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=1e-2)
    amp = torch.bfloat16 if "bf16" in kept else None
    net = torch.compile(model, dynamic=True) if "compile" in kept else model
    timed = args.padded_batches if row in ("baseline", "cache") else args.batches
    batches = iter(loader)
    samples = tokens = 0
    started = time.perf_counter()
    warm_s = 0.0
    for i in range(args.warmup + timed):
        if i == args.warmup:
            warm_s = time.perf_counter() - started
            started, samples, tokens = time.perf_counter(), 0, 0
        batch = next(batches)
        targets = torch.tensor([label_id[name] for name in batch["label"]])
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = nn.functional.cross_entropy(logits.float(), targets)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        samples += len(targets)
        tokens += int(batch["attention_mask"].sum())
    elapsed = time.perf_counter() - started
    totals = torch.tensor([samples, tokens], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(totals)
        dist.destroy_process_group()
    samples_all, tokens_all = totals.tolist()
    return {"row": row, "samples_per_s": samples_all / elapsed, "tokens_per_s": tokens_all / elapsed,
            "minutes_per_epoch": batches_per_epoch * elapsed / timed / 60,
            "batches_timed": timed, "warmup_s": warm_s, "world_size": world, "rank": rank,
            "steps": sorted(kept)}


def run_ddp_row(corpus: Path, cache: Path, args: argparse.Namespace, out: Path,
                kept: set[str]) -> dict:
    """Row 6 under torchrun: 2 processes of this script's ``--worker`` mode, one core each."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               __file__, "--worker", "ddp2", "--corpus", str(corpus), "--cache", str(cache),
               "--result", str(out), "--kept", ",".join(sorted(kept)), *[f"--{k.replace('_', '-')}={v}" for k, v in
                                       vars(args).items() if k in ("batches", "padded_batches",
                                                                   "warmup", "batch_size",
                                                                   "max_length", "seed")]]
    subprocess.run(command, check=True, env=env)
    return json.loads(out.read_text())


def accuracy(cache: Path, work: Path, epochs: int) -> dict:
    """Validation accuracy of the fine-tuned MiniLM and of the from-scratch encoder (same split)."""
    results = {}
    for name, script, extra in [
        ("finetune", "pipelines/text/finetune.py", ["--lr", "1e-4"]),
        ("scratch", "pipelines/text/train.py", ["--lr", "1e-3"]),
    ]:
        out = work / name
        subprocess.run([sys.executable, str(ROOT / script), "--cache", str(cache), "--out", str(out),
                        "--epochs", str(epochs), "--workers", "0", *extra], check=True,
                       capture_output=True)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        epochs_done = [r for r in records if r.get("kind", "epoch") == "epoch"]
        results[name] = [round(r["val_accuracy"], 4) for r in epochs_done]
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=24, help="timed steps of the bucketed rows")
    p.add_argument("--padded-batches", type=int, default=8, help="timed steps of rows 1-2")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile included)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=256, help="truncation and the baseline's "
                   "padded length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", default=",".join(ROWS), help=f"a subset of {','.join(ROWS)}")
    p.add_argument("--accuracy", action="store_true",
                   help="also compare validation accuracy with the from-scratch encoder")
    p.add_argument("--accuracy-epochs", type=int, default=3)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--corpus", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--kept", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:  # one rank of row 6
        result = time_row(args.worker, Path(args.corpus), Path(args.cache), args,
                          set(filter(None, args.kept.split(","))))
        if result["rank"] == 0:
            Path(args.result).write_text(json.dumps(result))
        return

    with tempfile.TemporaryDirectory(prefix="bench_finetune_") as tmp:
        work = Path(tmp)
        corpus, cache = work / "corpus", work / "cache"
        count = load_make_corpus()(corpus)
        precache.run("text", corpus, cache, params={"max_length": args.max_length}, workers=2,
                     progress=False, log=lambda *a, **k: None)
        print(f"fortunes corpus: {count} documents, MiniLM-L6, batch {args.batch_size}, "
              f"max length {args.max_length}, {os.cpu_count()} cores, torch {torch.__version__}")
        torch.set_num_threads(os.cpu_count() or 1)
        results: list[dict] = []
        kept: set[str] = set()
        reference: dict = {}  # the last row whose steps were kept
        for row in args.rows.split(","):
            trying = kept | {row} if row in ("bf16", "compile") else kept
            if row == "ddp2":
                result = run_ddp_row(corpus, cache, args, work / "ddp2.json", trying)
            else:
                result = time_row(row, corpus, cache, args, trying)
            # An optional step stays for the later rows only if it made training faster.
            helped = not results or result["samples_per_s"] > reference["samples_per_s"]
            result["kept"] = row not in ("bf16", "compile") or helped
            if row in ("bf16", "compile") and helped:
                kept.add(row)
            if result["kept"]:
                reference = result
            results.append(result)
            print(json.dumps(result), flush=True)
        base = results[0]["minutes_per_epoch"]
        print("\n| | step | min/epoch | samples/s | real tokens/s | vs baseline | vs previous "
              "row | kept | warm-up s |")
        print("|---|---|--:|--:|--:|--:|--:|---|--:|")
        previous = base
        for n, r in enumerate(results, 1):
            print(f"| {n} | {TITLES[r['row']]} | {r['minutes_per_epoch']:.2f} | "
                  f"{r['samples_per_s']:.1f} | {r['tokens_per_s']:,.0f} | "
                  f"{base / r['minutes_per_epoch']:.2f}x | {previous / r['minutes_per_epoch']:.2f}x"
                  f" | {'yes' if r['kept'] else 'no: slower'} | {r['warmup_s']:.1f} |")
            if r["kept"]:
                previous = r["minutes_per_epoch"]
        if args.accuracy:
            scores = accuracy(cache, work, args.accuracy_epochs)
            print(f"\nvalidation accuracy per epoch: {json.dumps(scores)}")


if __name__ == "__main__":
    main()
