"""PackedBlocks: the cached token stream cut into fixed-length blocks, with no padding."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import precache
from precache.loading.datasets.text_blocks import PackedBlocks
from tests.helpers import build_cache

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("packing")
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over a lazy dog while seven cats watch quietly".split()
    lines = [json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(1, 40))))})
             for _ in range(40)]
    (folder / "docs.jsonl").write_text("\n".join(lines) + "\n")
    out = folder / "cache"
    build_cache(folder / "docs.jsonl", out, pipeline="text", workers=1, shard_rows=8)
    ids = precache.Cache(out).read_all(["ids"])["ids"]
    return out, [np.asarray(i, dtype=np.int64) for i in ids]


@pytest.mark.parametrize("block_size", [7, 64, 500])
def test_blocks_are_the_token_stream_cut_every_block_size(token_cache, block_size):
    cache, docs = token_cache
    stream = np.concatenate(docs)
    blocks = PackedBlocks(cache, block_size)
    assert len(blocks) == len(stream) // block_size and blocks.tokens == len(stream)
    got = np.concatenate([blocks[i]["input_ids"].numpy() for i in range(len(blocks))])
    assert np.array_equal(got, stream[:len(blocks) * block_size])
    assert all(blocks[i]["input_ids"].shape == (block_size,) for i in (0, len(blocks) - 1))
    assert np.array_equal(blocks[-1]["input_ids"].numpy(), blocks[len(blocks) - 1]["input_ids"].numpy())
    with pytest.raises(IndexError, match="out of range"):
        blocks[len(blocks)]


def test_a_separator_follows_every_document(token_cache):
    cache, docs = token_cache
    stream = np.concatenate([part for d in docs for part in (d, [9999])])
    blocks = PackedBlocks(cache, 16, sep_id=9999)
    assert len(blocks) == len(stream) // 16
    got = np.concatenate([blocks[i]["input_ids"].numpy() for i in range(len(blocks))])
    assert np.array_equal(got, stream[:len(blocks) * 16])


def test_blocks_load_in_worker_processes(token_cache):
    cache, docs = token_cache
    blocks = PackedBlocks(cache, 32)
    loader = DataLoader(blocks, batch_size=4, shuffle=True, num_workers=2,
                        generator=torch.Generator().manual_seed(0))
    seen = torch.cat([b["input_ids"] for b in loader])
    expected = torch.stack([blocks[i]["input_ids"] for i in range(len(blocks))])
    assert seen.shape == expected.shape and seen.dtype == torch.int64
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, expected.tolist()))


def test_bad_block_size_is_an_error(token_cache):
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        PackedBlocks(token_cache[0], 0)


def test_blocks_declare_cache_backed_with_the_shard_of_each_blocks_first_document(token_cache):
    """``shard_ids`` has one entry per block (the shard of the document it starts in), so
    ``make_loader(shard_window=...)`` samples blocks; token ids are never images."""
    from precache.loading import CacheBacked, CachedDataset, make_loader

    cache, docs = token_cache
    blocks = PackedBlocks(cache, 16)
    ids = CachedDataset(cache, columns=["ids"])
    assert isinstance(blocks, CacheBacked) and blocks.rows.path == blocks.path == str(cache)
    assert blocks.generation == ids.generation
    doc_of_token = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    expected = ids.shard_ids[doc_of_token[np.arange(len(blocks)) * 16]]
    assert len(set(expected.tolist())) > 1  # blocks start in several of the 8-document shards
    assert np.array_equal(blocks.shard_ids, expected)
    assert blocks.encoded_columns == [] and blocks.decode_images is True
    loader = make_loader(blocks, batch_size=4, num_workers=0, shard_window=2)
    loader.set_epoch(0)
    seen = torch.cat([batch["input_ids"] for batch in loader])
    assert sorted(map(tuple, seen.tolist())) == sorted(
        tuple(blocks[i]["input_ids"].tolist()) for i in range(len(blocks)))
    blocks.close()
    ids.close()
