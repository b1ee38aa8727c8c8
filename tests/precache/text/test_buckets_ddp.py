"""LengthBucketSampler under real DDP: two gloo ranks, each with a DataLoader worker, read a
tokenized text cache in length-bucketed batches; together they see every document once (plus the
documented padding), with equal batch counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import precache
from tests.conftest import REPO, free_port

pytestmark = pytest.mark.slow
pytest.importorskip("tokenizers")
BATCH = 3


def rank_main(cache: str, out: str) -> None:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from precache.loading import CachedDataset
    from precache.loading.buckets import LengthBucketSampler
    from precache.loading.text import TokenCollate

    dist.init_process_group("gloo")
    dataset = CachedDataset(cache, columns=["key", "ids", "length"])
    lengths = dataset.read_batch(range(len(dataset)))["length"]
    sampler = LengthBucketSampler(lengths, BATCH, seed=2, bucket_batches=2)
    sampler.set_epoch(0)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=1, collate_fn=TokenCollate())
    keys, widths = [], []
    for batch in loader:
        keys += batch["key"]
        widths.append(int(batch["input_ids"].shape[1]))
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps({"keys": keys, "widths": widths}))
    dist.barrier()
    dist.destroy_process_group()


def test_two_gloo_ranks_read_every_document_once_in_bucketed_batches(tmp_path):
    corpus = tmp_path / "in"
    corpus.mkdir()
    for i in range(23):  # 23 documents of very different lengths: not a multiple of 2 x 3
        (corpus / f"d{i:02d}.txt").write_text("word " * (1 + (i * 37) % 200), encoding="utf-8")
    cache = tmp_path / "cache"
    precache.run("text", corpus, cache, workers=1, shard_rows=8, progress=False,
                 log=lambda *a, **k: None)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.precache.text.test_buckets_ddp",
                               str(cache), str(tmp_path)], cwd=REPO, env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), outputs
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(ranks[0]["widths"]) == len(ranks[1]["widths"]) == 4  # 24 slots / (2 x 3)
    seen = Counter(k for r in ranks for k in r["keys"])
    assert len(seen) == 23 and sum(seen.values()) == 24  # one document repeated as padding
    assert all(w % 8 == 0 for r in ranks for w in r["widths"])


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2])
