"""Text benchmark: stage-1 tokens/s, tokenize-on-the-fly vs cached loading, bucketed padding.

    .venv/bin/python tests/benchmarks/bench_text.py [--repeat 2] [--batch-size 32]

On the fortunes corpus (``data/make_corpus.py``, ~3,000 documents; Debian's ``fortunes`` must be
installed), in a temporary folder, it measures:

1. stage 1: ``precache run text`` with 1 and 2 workers, inputs/s and tokens/s, best of
   ``--repeat`` (fresh output each time): on the corpus folder (3,000 files: runs of about a
   second, where worker start-up counts), and on the corpus ``--copies`` times over as one JSON
   Lines file (long enough for a second worker to pay off);
2. loading, same batch size, shuffled, in-process: a dataset that reads and tokenizes each file
   in ``__getitem__`` (the usual way) against ``CachedDataset`` over the cache, both padded per
   batch by ``TokenCollate``; samples/s and the ratio;
3. padding: the share of padded positions with random batches against ``LengthBucketSampler``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import precache
from precache.loading import CachedDataset
from precache.loading.samplers.length_buckets import LengthBucketSampler
from precache.loading.loaders.text_collate import TokenCollate
from precache.processing.ops.text import resolve_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def load_make_corpus():  # data/ is not a package
    spec = importlib.util.spec_from_file_location("make_corpus", ROOT / "data" / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.make_corpus


class TokenizeOnTheFly(Dataset):
    """The usual loader: read and tokenize one file per ``__getitem__``."""

    def __init__(self, files: list[Path], max_length: int = 512) -> None:
        from tokenizers import Tokenizer

        self.files = files
        self.tok = Tokenizer.from_file(str(resolve_tokenizer("minilm")))
        self.tok.no_padding()
        self.tok.enable_truncation(max_length)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict:
        text = self.files[i].read_text(encoding="utf-8")
        return {"ids": np.asarray(self.tok.encode(text).ids, dtype=np.uint16)}


def rate(loader: DataLoader, epochs: int = 2) -> float:
    """Samples/s over ``epochs`` full passes (after one untimed pass)."""
    for _ in loader:
        pass
    count, start = 0, time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            count += len(batch["input_ids"])
    return count / (time.perf_counter() - start)


def best_run(corpus: Path, output: Path, workers: int, repeat: int) -> tuple[float, Path]:
    """Best wall time of ``repeat`` runs of the text pipeline (a fresh output each), and the
    last output."""
    best = float("inf")
    for r in range(repeat):
        out = output.with_name(f"{output.name}-{r}")
        start = time.perf_counter()
        precache.run("text", corpus, out, workers=workers, progress=False, log=lambda *a, **k: None)
        best = min(best, time.perf_counter() - start)
    return best, out


def padding(batches: list[np.ndarray], lengths: np.ndarray) -> float:
    padded = sum(len(b) * lengths[b].max() for b in batches)
    return 1 - sum(lengths[b].sum() for b in batches) / padded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--copies", type=int, default=10, help="JSON Lines corpus: copies of it")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="precache-bench-text-"))
    try:
        corpus = work / "corpus"
        count = load_make_corpus()(corpus)
        print(f"corpus: {count} documents (Debian fortunes), batch {args.batch_size}, 2 cores\n")

        print("1. stage 1 (precache run text, minilm WordPiece, best of "
              f"{args.repeat})")
        tokens = 0
        for workers in (1, 2):
            best, out = best_run(corpus, work / f"cache-{workers}", workers, args.repeat)
            tokens = int(precache.Cache(out).read_all(["length"])["length"].sum())
            print(f"   folder, workers={workers}: {count / best:8.0f} docs/s  "
                  f"{tokens / best:10,.0f} tokens/s")
        cache = out
        jsonl = work / "corpus.jsonl"
        texts = [json.dumps({"text": f.read_text(encoding="utf-8"), "label": f.parent.name})
                 for f in sorted(corpus.rglob("*.txt"))]
        jsonl.write_text("\n".join(texts * args.copies) + "\n", encoding="utf-8")
        rates = {}
        for workers in (1, 2):
            best, out = best_run(jsonl, work / f"jsonl-{workers}", workers, args.repeat)
            shutil.rmtree(out)
            rates[workers] = tokens * args.copies / best
            print(f"   JSON Lines x{args.copies} ({len(texts) * args.copies} records), "
                  f"workers={workers}: {len(texts) * args.copies / best:8.0f} docs/s  "
                  f"{rates[workers]:10,.0f} tokens/s")
        print(f"   2 workers / 1 worker: {rates[2] / rates[1]:.2f}x")

        print("\n2. loading, in-process, shuffled, padded per batch by TokenCollate (samples/s)")
        files = sorted(corpus.rglob("*.txt"))
        collate = TokenCollate(multiple_of=8)
        naive = rate(DataLoader(TokenizeOnTheFly(files), batch_size=args.batch_size,
                                shuffle=True, collate_fn=collate))
        dataset = CachedDataset(cache, columns=["ids"])
        lengths = CachedDataset(cache, columns=["length"]).read_batch(range(len(dataset)))["length"]
        cached = rate(DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                 collate_fn=collate))
        bucketed = rate(DataLoader(dataset, batch_sampler=LengthBucketSampler(
            lengths, args.batch_size), collate_fn=collate))
        print(f"   tokenize on the fly  {naive:10,.0f}")
        print(f"   cached, random       {cached:10,.0f}   {cached / naive:5.1f}x")
        print(f"   cached, bucketed     {bucketed:10,.0f}   {bucketed / naive:5.1f}x")

        print("\n3. padded share of the positions in a batch")
        rng = np.random.default_rng(0)
        order = rng.permutation(len(lengths))
        random_batches = [order[i:i + args.batch_size] for i in range(0, len(order), args.batch_size)]
        bucket_batches = [np.asarray(b) for b in LengthBucketSampler(lengths, args.batch_size)]
        print(f"   random batches       {padding(random_batches, lengths):6.1%}")
        print(f"   LengthBucketSampler  {padding(bucket_batches, lengths):6.1%}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
