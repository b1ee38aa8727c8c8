"""make_loader over a LengthBucketSampler (the text task's loader): its positions are samples, like
any CacheLoader's, so the loop resumes a length-bucketed epoch on another number of ranks with
every document once. (The ranks are LengthBucketSamplers given their rank and world size, in this
process.)"""

from __future__ import annotations

from collections import Counter
from itertools import islice

import numpy as np
import pytest

from precache.loading import CacheLoader, LengthBucketSampler, make_loader


def identity(batch):
    return batch


def loaders(lengths: np.ndarray, world: int, workers: int) -> list[CacheLoader]:
    return [make_loader(list(range(len(lengths))),
                        batch_sampler=LengthBucketSampler(lengths, 2, seed=0, rank=rank,
                                                          world_size=world),
                        collate_fn=identity, num_workers=workers, pin_memory=False,
                        worker_kind="threads")
            for rank in range(world)]


@pytest.mark.parametrize("workers", [0, 2])  # read in the loop; by 2 threads
def test_a_bucketed_epoch_stopped_on_three_ranks_resumes_on_two_with_each_document_once(workers):
    lengths = np.random.default_rng(0).integers(1, 50, 30)
    first = loaders(lengths, 3, workers)
    assert {loader.worker_kind for loader in first} == {"threads" if workers else "none"}
    trained = []
    for loader in first:
        loader.set_epoch(0)
        trained += [i for batch in islice(loader, 2) for i in batch]  # 2 batches of 2 each
    state = first[0].state_dict(consumed=4)  # samples: 2 batches of 2
    assert state["done"] == [[3, 2, 2]] and state["epoch"] == 0

    second = loaders(lengths, 2, workers)
    for loader in second:
        loader.load_state_dict(state)
        loader.set_epoch(0)  # keeps the resumed epoch
    rest = [i for loader in second for batch in loader for i in batch]
    counts = Counter(trained + rest)
    assert set(counts) == set(range(30))
    # 18 left: 5 global batches of 2 ranks x 2, the last filled by repeating 2 documents
    assert sorted(counts.values()) == [1] * 28 + [2] * 2
    for loader in first + second:
        loader.close()
