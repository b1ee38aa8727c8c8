"""``PackedBlocks`` cuts its blocks from one generation: the token ids and the document lengths
come from the same one, though stage 1 publishes another between the two reads. Before, the
lengths were read from whichever generation was current then, and blocks of the ids' stream
were cut at another stream's offsets (blocks of 7, 6 and 0 tokens)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import precache
import precache.loading.packing as packing
from precache.loading.dataset import CachedDataset
from tests.helpers import build_cache

pytest.importorskip("tokenizers")

BLOCK = 8


def write_docs(path, words: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocabulary = "the quick brown fox jumps over a lazy dog while seven cats watch".split()
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(vocabulary, size=words))})
                            + "\n" for _ in range(12)))


def test_ids_and_lengths_come_from_one_generation_across_a_publish(tmp_path, monkeypatch):
    docs, cache = tmp_path / "docs.jsonl", tmp_path / "cache"
    run = dict(pipeline="text", workers=1, shard_rows=4)
    write_docs(docs, words=5, seed=0)
    build_cache(docs, cache, **run)
    first = [np.asarray(ids, np.int64) for ids in precache.Cache(cache).read_all(["ids"])["ids"]]

    class RerunAfterTheIds(CachedDataset):
        """The real dataset; once the ids are open, stage 1 publishes generation 2, whose
        documents are longer."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.columns == ["ids"]:
                write_docs(docs, words=9, seed=1)
                build_cache(docs, cache, **run)

    monkeypatch.setattr(packing, "CachedDataset", RerunAfterTheIds)
    blocks = packing.PackedBlocks(cache, BLOCK)
    assert precache.Cache(cache).generation == 2
    stream = np.concatenate(first)
    assert len(blocks) == len(stream) // BLOCK
    got = [blocks[i]["input_ids"].numpy() for i in range(len(blocks))]
    assert all(len(block) == BLOCK for block in got)
    assert np.array_equal(np.concatenate(got), stream[:len(blocks) * BLOCK])
    assert blocks.generation == 1
    blocks.close()
