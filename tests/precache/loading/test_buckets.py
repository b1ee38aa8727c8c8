"""LengthBucketSampler: exact-once across ranks with equal batch counts, resumable on another
world size, and far less padding than random batches of the same size."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from precache.loading.buckets import LengthBucketSampler

RNG = np.random.default_rng(5)
LENGTHS = RNG.integers(5, 500, 1003)  # like documents: a wide spread of lengths


def epoch(world: int, batch: int, epoch_no: int = 0, **kw) -> list[list[list[int]]]:
    out = []
    for rank in range(world):
        s = LengthBucketSampler(LENGTHS, batch, rank=rank, world_size=world, **kw)
        s.set_epoch(epoch_no)
        out.append(list(s))
    return out


@pytest.mark.parametrize("world, batch", [(1, 16), (2, 16), (3, 7), (4, 32)])
def test_every_sample_once_and_equal_batch_counts(world, batch):
    per_rank = epoch(world, batch)
    assert len({len(b) for b in per_rank}) == 1  # same number of batches on every rank
    assert all(len(b) == batch for batches in per_rank for b in batches)
    seen = Counter(i for batches in per_rank for b in batches for i in b)
    assert set(seen) == set(range(len(LENGTHS)))
    assert sum(seen.values()) - len(LENGTHS) < world * batch  # the padding of one global batch


def test_drop_last_skips_less_than_one_global_batch_and_repeats_nothing():
    seen = Counter(i for batches in epoch(3, 7, drop_last=True) for b in batches for i in b)
    assert max(seen.values()) == 1 and len(LENGTHS) - len(seen) < 21


def test_batches_hold_similar_lengths_and_pad_far_less_than_random_batches():
    batches = epoch(1, 32)[0]
    padded = sum(32 * LENGTHS[b].max() for b in batches)
    rng = np.random.default_rng(0)
    random_batches = rng.permutation(np.resize(np.arange(len(LENGTHS)), len(batches) * 32)).reshape(-1, 32)
    random_padded = sum(32 * LENGTHS[b].max() for b in random_batches)
    real = sum(LENGTHS[b].sum() for b in batches)
    bucket_waste, random_waste = 1 - real / padded, 1 - LENGTHS[random_batches].sum() / random_padded
    print(f"padding: bucketed {bucket_waste:.1%}, random {random_waste:.1%}")
    assert bucket_waste < 0.05 and random_waste > 0.3


def test_epochs_differ_and_ranks_agree():
    assert epoch(2, 16, 0) != epoch(2, 16, 1)
    assert epoch(2, 16, 0) == epoch(2, 16, 0)


@pytest.mark.parametrize("before, after", [(2, 3), (3, 2), (2, 2), (1, 4)])
def test_a_resume_on_another_world_size_finishes_the_epoch_exactly(before, after):
    first = epoch(before, 8, 4)
    k = len(first[0]) // 3
    saver = LengthBucketSampler(LENGTHS, 8, rank=0, world_size=before)
    saver.set_epoch(4)
    state = json.loads(json.dumps(saver.state_dict(batches=k)))
    second = []
    for rank in range(after):
        s = LengthBucketSampler(LENGTHS, 8, rank=rank, world_size=after)
        s.load_state_dict(state)
        s.set_epoch(4)  # the loop's usual call keeps the resumed position
        second.append(list(s))
    assert len({len(b) for b in second}) == 1
    part1 = [i for batches in first for b in batches[:k] for i in b]
    part2 = [i for batches in second for b in batches for i in b]
    seen = Counter(part1 + part2)
    assert set(seen) == set(range(len(LENGTHS)))
    padding = sum(seen.values()) - len(LENGTHS)
    assert padding < before * 8 + after * 8  # at most one pad per planned part
    assert not set(part1) & set(part2) - {i for i, n in seen.items() if n > 1}


def test_a_state_from_another_dataset_is_refused():
    s = LengthBucketSampler(LENGTHS, 8)
    state = s.state_dict(0)
    with pytest.raises(ValueError, match="size"):
        LengthBucketSampler(LENGTHS[:-1], 8).load_state_dict(state)
