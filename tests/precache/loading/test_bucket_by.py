"""make_loader keeps its worker threads for precache's own collates and batch transforms (they
declare ``thread_safe = True``; a user's callable may too) and says so in ``describe()``; and
``bucket_by="length"`` gives exact-once, resumable length buckets across ranks (the ranks here
are loaders given their rank and world size, in this process)."""

from __future__ import annotations

from collections import Counter
from itertools import islice

import pytest

import precache
from precache.loading import CachedDataset, ExactOnceBucketSampler, TokenCollate, make_loader
from tests.helpers import build_cache

pytest.importorskip("tokenizers")
DOCS, BATCH = 23, 3  # 23: not a multiple of 2 ranks x 3, so the last global batch is smaller


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("bucket_by")
    (root / "in").mkdir()
    for i in range(DOCS):  # documents of very different lengths
        (root / "in" / f"d{i:02d}.txt").write_text("word " * (1 + (i * 37) % 90), encoding="utf-8")
    build_cache(root / "in", root / "cache", pipeline="text", workers=1, shard_rows=8)
    return root / "cache"


class Declared:
    """A user's batch transform that declares itself thread-safe."""

    thread_safe = True

    def __call__(self, batch: dict) -> dict:
        return {**batch, "tokens": batch["attention_mask"].sum()}


def test_declared_collates_and_transforms_keep_threads_and_describe_says_why(cache):
    from precache.augment import FaceAugment, VolumeAugment
    from precache.loading import collate_clips

    assert all(getattr(f, "thread_safe", False) is True for f in (
        TokenCollate(), FaceAugment(), VolumeAugment(), collate_clips))
    dataset = CachedDataset(cache, columns=["key", "ids"])
    loader = make_loader(dataset, 4, num_workers=2, collate_fn=TokenCollate(),
                         batch_transform=Declared())
    assert loader.worker_kind == "threads"
    assert "collate_fn TokenCollate and batch_transform Declared declare thread_safe" \
        in loader.describe()
    loader.set_epoch(0)
    batches = list(loader)
    loader.close()
    assert sum(len(b["key"]) for b in batches) == DOCS
    assert all(int(b["tokens"]) == int(b["attention_mask"].sum()) for b in batches)
    undeclared = make_loader(dataset, 4, num_workers=2, collate_fn=TokenCollate(),
                             batch_transform=lambda batch: batch)
    assert undeclared.worker_kind == "processes"
    assert "batch_transform <lambda> does not declare thread_safe" in undeclared.describe()


def ranks(dataset, world: int, workers: int = 0):
    return [make_loader(dataset, BATCH, num_workers=workers, seed=1, bucket_by="length",
                        collate_fn=TokenCollate(), rank=rank, world_size=world)
            for rank in range(world)]


def keys_of(batches) -> list[str]:
    return [k for batch in batches for k in batch["key"]]


def test_bucket_by_length_gives_every_document_once_across_ranks_and_resumes(cache):
    everything = sorted(precache.Cache(cache).read_all(["key"])["key"])
    dataset = CachedDataset(cache, columns=["key", "ids"])  # lengths read from the cache
    whole = ranks(dataset, 2)
    assert isinstance(whole[0].sampler.batch_sampler, ExactOnceBucketSampler)
    assert len(whole[0]) == len(whole[1]) == 4  # 23 = 3 global batches of 6 and one of 5
    for loader in whole:
        loader.set_epoch(0)
    seen = [keys_of(loader) for loader in whole]
    assert sorted(seen[0] + seen[1]) == everything  # each document exactly once
    first, trained = ranks(dataset, 2, workers=2), []
    for loader in first:
        loader.set_epoch(0)
        trained += keys_of(islice(iter(loader), 2))  # 2 batches of 3 on each rank
    state = first[0].state_dict()
    assert state == first[1].state_dict() and state["done"] == [[2, BATCH, 2]]
    rest = []
    for loader in ranks(dataset, 3):  # resumed on 3 ranks
        loader.load_state_dict(state)
        loader.set_epoch(0)
        rest += keys_of(loader)
    assert sorted(trained + rest) == everything and max(Counter(trained + rest).values()) == 1
    for loader in first:
        loader.close()
    some = everything[::2]  # rows held by where=: their own lengths, each once
    held = ranks(CachedDataset(cache, columns=["key", "ids"], where={"key": some}), 2)
    for loader in held:
        loader.set_epoch(0)
    assert sorted(k for loader in held for k in keys_of(loader)) == some
    with pytest.raises(ValueError, match="shuffle=False given beside bucket_by='length'"):
        make_loader(dataset, BATCH, shuffle=False, bucket_by="length")
