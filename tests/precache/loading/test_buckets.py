"""LengthBucketSampler: exact-once across ranks with equal batch counts, resumable on another
world size, and far less padding than random batches of the same size."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from precache.loading.samplers.length_buckets import LengthBucketSampler
from tests.helpers.sampling import padded

RNG = np.random.default_rng(5)
LENGTHS = RNG.integers(5, 500, 1003)  # like documents: a wide spread of lengths


def epoch(world: int, batch: int, epoch_no: int = 0, state: dict | None = None,
          **kw) -> list[list[list[int]]]:
    """Every rank's batches of epoch ``epoch_no`` (from ``state`` on, if given)."""
    out = []
    for rank in range(world):
        s = LengthBucketSampler(LENGTHS, batch, rank=rank, world_size=world, **kw)
        if state is not None:
            s.load_state_dict(state)
        s.set_epoch(epoch_no)  # the loop's usual call keeps a resumed position
        out.append(list(s))
    return out


def flat(per_rank: list[list[list[int]]], batches: int | None = None) -> list[int]:
    """The samples of every rank's first ``batches`` batches (all of them by default)."""
    return [i for rank in per_rank for b in rank[:batches] for i in b]


def save(world: int, batch: int, batches: int, epoch_no: int, state: dict | None = None) -> dict:
    """The state after every rank took ``batches`` batches, through JSON as a checkpoint."""
    s = LengthBucketSampler(LENGTHS, batch, rank=0, world_size=world)
    if state is not None:
        s.load_state_dict(state)
    s.set_epoch(epoch_no)
    return json.loads(json.dumps(s.state_dict(batches=batches)))


@pytest.mark.parametrize("world, batch", [(1, 16), (2, 16), (3, 7), (4, 32)])
def test_every_sample_once_and_equal_batch_counts(world, batch):
    per_rank = epoch(world, batch)
    assert len({len(b) for b in per_rank}) == 1  # same number of batches on every rank
    assert all(len(b) == batch for batches in per_rank for b in batches)
    # Every sample once, and the padding exactly: the first -1003 % (world x batch) samples twice.
    assert Counter(flat(per_rank)) == padded(list(range(len(LENGTHS))), world * batch)


def test_drop_last_skips_less_than_one_global_batch_and_repeats_nothing():
    seen = Counter(flat(epoch(3, 7, drop_last=True)))
    assert max(seen.values()) == 1 and len(seen) == len(LENGTHS) // 21 * 21  # 1003 = 47 x 21 + 16


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
    second = epoch(after, 8, 4, state=save(before, 8, k, 4))
    assert len({len(b) for b in second}) == 1
    part1, part2 = flat(first, k), flat(second)
    # Before the stop: k global batches of the uninterrupted plan, whose only repeats are its
    # padding (the first -1003 % (before x 8) samples), where both copies fell in them.
    assert len(part1) == k * before * 8
    assert Counter(part1) - padded(list(range(len(LENGTHS))), before * 8) == Counter()
    # After it: nothing seen before the stop again; every other sample once, plus the padding of
    # the new plan, which repeats the first of the samples left.
    assert set(part1).isdisjoint(part2)
    left = sorted(set(range(len(LENGTHS))) - set(part1))
    assert Counter(part2) == padded(left, after * 8)


def test_a_resumed_run_stopped_and_resumed_again_on_other_sizes_finishes_exactly():
    """Three parts, each on another world size and batch size: the state lists them all."""
    first = epoch(2, 8, 1)
    state = save(2, 8, 20, 1)
    second = epoch(3, 5, 1, state=state)
    state2 = save(3, 5, 15, 1, state=state)
    assert state2["done"] == [[2, 8, 20], [3, 5, 15]]
    third = epoch(4, 8, 1, state=state2)
    parts = [flat(first, 20), flat(second, 15), flat(third)]
    assert [len(p) for p in parts[:2]] == [320, 225]
    everything = set(range(len(LENGTHS)))
    # Each part repeats at most its own plan's padding, and nothing of the parts before it.
    assert Counter(parts[0]) - padded(list(everything), 2 * 8) == Counter()
    assert set(parts[0]).isdisjoint(parts[1])
    assert Counter(parts[1]) - padded(list(everything - set(parts[0])), 3 * 5) == Counter()
    assert set(parts[2]).isdisjoint(parts[0] + parts[1])
    left = everything - set(parts[0]) - set(parts[1])
    assert Counter(parts[2]) == padded(list(left), 4 * 8)


def test_an_epoch_finished_then_resumed_yields_nothing_and_a_new_epoch_starts_over():
    full = len(epoch(2, 8, 3)[0])
    assert epoch(2, 8, 3, state=save(2, 8, full, 3)) == [[], []]
    assert epoch(2, 8, 4, state=save(2, 8, full, 3)) == epoch(2, 8, 4)  # another epoch: no resume


def test_a_state_from_another_dataset_is_refused():
    s = LengthBucketSampler(LENGTHS, 8)
    state = s.state_dict(0)
    with pytest.raises(ValueError, match="size"):
        LengthBucketSampler(LENGTHS[:-1], 8).load_state_dict(state)


@pytest.mark.parametrize("key, value", [("seed", 1), ("bucket_batches", 3), ("drop_last", True)])
def test_a_state_of_another_plan_is_refused(key, value):
    """The replay must plan the parts before as they were planned: a state saved with
    ``drop_last`` (or another seed) would otherwise re-serve samples already seen."""
    state = LengthBucketSampler(LENGTHS, 8, **{key: value}).state_dict(5)
    with pytest.raises(ValueError, match=key):
        LengthBucketSampler(LENGTHS, 8).load_state_dict(state)
