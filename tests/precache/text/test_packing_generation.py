"""``PackedBlocks`` cuts its blocks from one generation: the token ids and the document lengths
come from the same one, though stage 1 publishes another between the two reads. Before, the
lengths were read from whichever generation was current then, and blocks of the ids' stream
were cut at another stream's offsets (blocks of 7, 6 and 0 tokens)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import precache
import precache.loading.datasets.text_blocks as packing
from precache.loading.datasets.cached import CachedDataset
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


def test_a_loader_state_of_another_generation_of_the_blocks_is_refused_in_one_line(tmp_path):
    """A ``make_loader`` loader over ``PackedBlocks`` records the blocks' generation; a state
    saved on generation 1 is refused by a loader over generation 2 with the way to resume, as
    over a ``CachedDataset`` (it raised ``AttributeError``: no ``kept_generations``)."""
    from precache.loading import make_loader

    docs, cache = tmp_path / "docs.jsonl", tmp_path / "cache"
    write_docs(docs, words=5, seed=0)
    build_cache(docs, cache, pipeline="text", workers=1, shard_rows=4)
    old = packing.PackedBlocks(cache, BLOCK)
    loader = make_loader(old, 2, num_workers=0)
    next(iter(loader))
    state = loader.state_dict()
    assert state["generation"] == 1
    write_docs(docs, words=9, seed=1)
    build_cache(docs, cache, pipeline="text", workers=1, shard_rows=4)
    new = packing.PackedBlocks(cache, BLOCK)
    with pytest.raises(ValueError, match=r"saved reading generation 1 .* reads generation 2; "
                                         r"to resume exactly, open .*generation=1"):
        make_loader(new, 2, num_workers=0).load_state_dict(state)
    old.close()
    new.close()
