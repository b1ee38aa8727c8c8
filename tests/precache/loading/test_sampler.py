"""DistributedShardSampler without processes: every rank simulated, epochs exact, resume exact."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

import precache.loading.samplers.shard_sampler as sampler_module
from precache.loading._engine.lazy_order import LazyOrder
from precache.loading.samplers.shard_sampler import DistributedShardSampler

SIZES = [0, 1, 2, 3, 5, 7, 10, 37, 64]


@pytest.fixture(params=["permutation", "lazy"])
def order_kind(request, monkeypatch) -> str:
    """Run a test with each shuffled order: NumPy's permutation (caches up to LAZY_ORDER_ROWS
    samples) and LazyOrder (larger ones; here every size, by lowering the bound)."""
    if request.param == "lazy":
        monkeypatch.setattr(sampler_module, "LAZY_ORDER_ROWS", 0)
    return request.param


class FakeShardedDataset:
    """A dataset of ``len(shard_ids)`` samples that only knows the shard of each index."""

    def __init__(self, shard_ids: np.ndarray) -> None:
        self.shard_ids = np.asarray(shard_ids)

    def __len__(self) -> int:
        return len(self.shard_ids)


def uneven_shards(rows: list[int]) -> FakeShardedDataset:
    return FakeShardedDataset(np.repeat(np.arange(len(rows)), rows))


def samplers(dataset, world: int, **kwargs) -> list[DistributedShardSampler]:
    return [DistributedShardSampler(dataset, rank=r, world_size=world, **kwargs)
            for r in range(world)]


def take(ranks: list[DistributedShardSampler], count: int | None = None) -> list[list[int]]:
    """What each rank yields this epoch (its first ``count`` indices if given)."""
    return [list(s)[:count] for s in ranks]


def flat(per_rank: list[list[int]]) -> list[int]:
    return [i for seen in per_rank for i in seen]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", SIZES)
def test_padding_covers_every_index_with_at_most_world_minus_one_repeats(n, world, shuffle,
                                                                        order_kind):
    ranks = samplers(range(n), world, shuffle=shuffle, seed=3)
    for s in ranks:
        s.set_epoch(2)
    seen = take(ranks)
    assert {len(x) for x in seen} == {-(-n // world)} == {len(s) for s in ranks}
    everything = flat(seen)
    assert set(everything) == set(range(n))
    assert len(everything) - n == (-n) % world <= world - 1
    if n >= world:  # with fewer samples than ranks, one sample may fill several pad slots
        assert max(Counter(everything).values(), default=1) <= 2
    assert all(type(i) is int for i in everything)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", SIZES)
def test_drop_last_skips_at_most_world_minus_one_and_repeats_nothing(n, world, order_kind):
    ranks = samplers(range(n), world, drop_last=True)
    seen = take(ranks)
    assert {len(x) for x in seen} == {n // world} == {len(s) for s in ranks}
    everything = flat(seen)
    assert len(everything) == len(set(everything)) and set(everything) <= set(range(n))
    assert n - len(everything) == n % world <= world - 1


def test_every_rank_computes_the_same_order_and_epochs_and_seeds_change_it():
    ranks = samplers(range(100), 3, seed=7)
    for s in ranks:
        s.set_epoch(4)
    order = ranks[0].epoch_order()
    assert sorted(order) == list(range(100))
    assert all(np.array_equal(s.epoch_order(), order) for s in ranks)
    padded = np.concatenate([order, order[:2]])  # 100 -> 102, the first two again
    assert [list(s) for s in ranks] == [padded[r::3].tolist() for r in range(3)]
    again = DistributedShardSampler(range(100), seed=7, rank=1, world_size=3)
    again.set_epoch(4)
    assert list(again) == list(ranks[1])
    ranks[0].set_epoch(5)
    other_seed = DistributedShardSampler(range(100), seed=8)
    other_seed.set_epoch(4)
    assert not np.array_equal(ranks[0].epoch_order(), order)
    assert not np.array_equal(other_seed.epoch_order(), order)


def test_without_shuffle_ranks_take_the_natural_order_strided():
    ranks = samplers(range(10), 3, shuffle=False)
    assert take(ranks) == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    assert list(DistributedShardSampler(range(10), shuffle=False)) == list(range(10))


@pytest.mark.parametrize("window", [1, 2, 3, 10])
def test_a_shard_window_keeps_each_windows_indices_together(window):
    rows = [5, 8, 1, 8, 3, 8, 6]  # uneven, as after deletions
    dataset = uneven_shards(rows)
    sampler = DistributedShardSampler(dataset, shard_window=window, seed=1)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        order = sampler.epoch_order()
        assert sorted(order) == list(range(len(dataset)))
        shards = dataset.shard_ids[order]
        first = sorted(set(shards.tolist()), key=lambda s: np.argmax(shards == s))
        start = 0
        for w in range(0, len(first), window):
            members = first[w:w + window]
            end = start + sum(rows[s] for s in members)
            assert set(shards[start:end].tolist()) == set(members)  # one contiguous block
            start = end
        orders.append((first, order))
    assert len({tuple(f) for f, _ in orders}) > 1 or window >= len(rows)  # shard order changes
    assert len({tuple(o) for _, o in orders}) == 3
    if window == 2:  # inside a window the samples are mixed, not shard after shard
        assert any(len(set(dataset.shard_ids[o][:4].tolist())) > 1 for _, o in orders)


def test_a_shard_window_needs_shard_ids_and_shuffle():
    with pytest.raises(ValueError, match="shard_ids"):
        DistributedShardSampler(range(10), shard_window=2)
    with pytest.raises(ValueError, match="shuffle"):
        DistributedShardSampler(uneven_shards([4, 4]), shard_window=2, shuffle=False)
    with pytest.raises(ValueError, match="shard_window"):
        DistributedShardSampler(uneven_shards([4, 4]), shard_window=0)


def resume(state: dict, world: int, **kwargs) -> list[DistributedShardSampler]:
    ranks = samplers(kwargs.pop("dataset", range(state["size"])), world, **kwargs)
    for s in ranks:
        s.load_state_dict(json.loads(json.dumps(state)))  # it must survive JSON
        s.set_epoch(state["epoch"])
    return ranks


def saved(ranks: list[DistributedShardSampler], consumed: int) -> dict:
    states = [s.state_dict(consumed=consumed) for s in ranks]
    assert all(state == states[0] for state in states)  # lock-step ranks agree
    return states[0]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("w2", [1, 2, 3, 4])
@pytest.mark.parametrize("w1", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 5, 37])
def test_resuming_on_another_world_size_finishes_the_epoch_exactly(n, w1, w2, drop_last,
                                                                   order_kind):
    kwargs = dict(seed=5, drop_last=drop_last)
    first_ranks = samplers(range(n), w1, **kwargs)
    for s in first_ranks:
        s.set_epoch(3)
    order = first_ranks[0].epoch_order().tolist()
    per_rank = len(first_ranks[0])
    for k in sorted({0, per_rank // 2, max(0, per_rank - 1), per_rank}):
        first = flat(take(first_ranks, k))
        state = saved(first_ranks, k)
        assert state["order"] == order_kind
        second = flat(take(resume(state, w2, **kwargs)))
        done = k == per_rank
        offset = n if done else k * w1
        assert state["offset"] == offset and state["epoch"] == 3
        assert sorted(set(first)) == sorted(order[:min(offset, k * w1)])  # a prefix
        left = n - offset
        if drop_last:
            assert len(first) == len(set(first)) == k * w1
            assert len(second) == len(set(second)) == left - left % w2
            skipped = n % w1 if done else left % w2
            assert set(first) | set(second) == set(order[:n - skipped])  # the tail is cut
            assert not set(first) & set(second) and n - len(first) - len(second) == skipped
        else:
            assert not set(first) & set(second)
            assert set(first) | set(second) == set(range(n))
            first_pad = max(0, k * w1 - n)
            assert len(first) + len(second) == n + first_pad + (-left) % w2


def test_resuming_twice_across_world_sizes_is_still_exact(order_kind):
    n = 37
    ranks = samplers(range(n), 2, seed=9)
    for s in ranks:
        s.set_epoch(1)
    first = flat(take(ranks, 6))  # 12 of 37
    ranks = resume(saved(ranks, 6), 3, seed=9)
    second = flat(take(ranks, 4))  # 12 more: offset 24
    state = saved(ranks, 4)
    assert state["offset"] == 24
    third = flat(take(resume(state, 2, seed=9)))  # 13 left -> 14 with one pad
    everything = first + second + third
    assert set(everything) == set(range(n)) and len(everything) == n + 1
    assert Counter(everything).most_common(1)[0][1] == 2
    assert len(set(first + second)) == 24


def test_set_epoch_keeps_a_loaded_position_once_and_resets_otherwise():
    state = {"epoch": 2, "seed": 0, "offset": 10, "size": 37, "shuffle": True,
             "shard_window": None, "drop_last": False}
    s = DistributedShardSampler(range(37), rank=0, world_size=3)
    s.load_state_dict(state)
    assert s.offset == 10 and len(s) == 9
    s.set_epoch(2)  # the training loop's call at the top of the resumed epoch
    assert s.offset == 10 and len(s) == 9 and s.state_dict(consumed=0)["offset"] == 10
    s.set_epoch(2)  # a second call means: this epoch from its start
    assert s.offset == 0 and len(s) == 13
    s.load_state_dict(state)
    s.set_epoch(3)
    assert s.offset == 0 and s.epoch == 3 and len(s) == 13


def test_a_state_from_another_dataset_or_order_is_refused():
    s = DistributedShardSampler(range(37), seed=1)
    state = s.state_dict(consumed=5)
    with pytest.raises(ValueError, match="size=37"):
        DistributedShardSampler(range(36), seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        DistributedShardSampler(range(37), seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle"):
        DistributedShardSampler(range(37), seed=1, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="shard_window"):
        DistributedShardSampler(uneven_shards([20, 17]), seed=1, shard_window=1).load_state_dict(
            state)
    with pytest.raises(ValueError, match="offset"):
        s.load_state_dict(dict(state, offset=38))
    with pytest.raises(ValueError, match="lacks"):
        s.load_state_dict({"epoch": 0})


def test_arguments_are_checked():
    for bad in (dict(rank=2, world_size=2), dict(rank=-1, world_size=2), dict(world_size=0),
                dict(seed=-1)):
        with pytest.raises(ValueError):
            DistributedShardSampler(range(4), **bad)
    s = DistributedShardSampler(range(10), rank=0, world_size=3)
    with pytest.raises(ValueError, match="consumed"):
        s.state_dict(consumed=5)
    with pytest.raises(ValueError, match="epoch"):
        s.set_epoch(-1)


def test_rank_and_world_size_come_from_torch_distributed_when_initialised(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    s = DistributedShardSampler(range(10))
    assert (s.rank, s.world_size) == (2, 3)
    assert (DistributedShardSampler(range(10), rank=0, world_size=1).world_size) == 1


def test_large_epochs_come_out_whole_and_in_order(order_kind):
    s = DistributedShardSampler(range(100_003), rank=1, world_size=2)
    out = list(s)
    assert len(out) == len(s) == 50_002 and out == s.indices().tolist()


def test_shuffle_quality_tells_a_full_shuffle_from_windows_and_sequential_reads():
    from precache.loading.samplers.shard_sampler import shuffle_quality

    shard_ids = np.repeat(np.arange(4), 8)  # 4 shards of 8 rows

    class Shards:
        def __len__(self):
            return 32

        shard_ids = np.repeat(np.arange(4), 8)

    sequential = shuffle_quality(np.arange(32), shard_ids, batch_size=8)
    assert sequential == {"batch_entropy": 0.0, "same_shard": 28 / 31}  # one shard per batch
    full = shuffle_quality(DistributedShardSampler(Shards(), seed=1).epoch_order(), shard_ids, 8)
    window = shuffle_quality(DistributedShardSampler(Shards(), seed=1, shard_window=1)
                             .epoch_order(), shard_ids, 8)
    assert window["batch_entropy"] == 0.0 and window["same_shard"] == 28 / 31
    assert full["batch_entropy"] > 0.8 and full["same_shard"] < 0.5
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        shuffle_quality(np.arange(32), shard_ids, batch_size=0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 1000, 65_537])
def test_a_lazy_order_is_a_permutation_fixed_by_its_seed(n):
    order = LazyOrder(n, [7, 1])
    whole = order[np.arange(n)]
    assert np.array_equal(np.sort(whole), np.arange(n))
    picked = np.random.default_rng(0).integers(0, n, 50)
    assert np.array_equal(order[picked], whole[picked])  # any positions, in any order
    assert np.array_equal(LazyOrder(n, [7, 1])[np.arange(n)], whole)
    if n >= 17:
        assert not np.array_equal(LazyOrder(n, [7, 2])[np.arange(n)], whole)
        assert not np.array_equal(whole, np.arange(n))
    with pytest.raises(IndexError):
        order[np.array([n])]


def test_past_the_bound_an_epoch_computes_only_the_indices_it_hands_out(monkeypatch):
    """The first batch of a lazily ordered epoch asks for one span of positions, not all N."""
    from precache.loading.loaders.cache_loader import ReadAheadBatches

    monkeypatch.setattr(sampler_module, "LAZY_ORDER_ROWS", 1000)
    asked = []
    original = LazyOrder.__getitem__
    monkeypatch.setattr(LazyOrder, "__getitem__",
                        lambda self, positions: asked.append(len(positions)) or
                        original(self, positions))
    sampler = DistributedShardSampler(range(1_000_000), seed=2)
    assert sampler.order_kind() == "lazy" and sampler.state_dict(0)["order"] == "lazy"
    first = next(iter(ReadAheadBatches(sampler, batch_size=256, ahead_by=2)))
    assert len(first) == 256 and sum(asked) <= 1 << 16
    assert DistributedShardSampler(range(1000), seed=2).order_kind() == "permutation"


def test_a_state_saved_before_orders_were_recorded_resumes_in_numpys_order(monkeypatch):
    """A checkpoint from before this change has no "order": its epoch goes on in NumPy's
    permutation, even for a size that now gets a lazy order; the next epoch is lazy."""
    ranks = samplers(range(50), 2, seed=6)
    for s in ranks:
        s.set_epoch(1)
    first = flat(take(ranks, 10))
    state = saved(ranks, 10)
    del state["order"]
    monkeypatch.setattr(sampler_module, "LAZY_ORDER_ROWS", 10)
    resumed = resume(state, 2, seed=6)
    assert resumed[0].order_kind() == "permutation"
    assert sorted(first + flat(take(resumed))) == list(range(50))
    resumed[0].set_epoch(2)
    assert resumed[0].order_kind() == "lazy"
    with pytest.raises(ValueError, match="order 'by-hash', which a sampler with shuffle=True"):
        resume(dict(state, order="by-hash"), 1, seed=6)


def test_a_lazy_order_mixes_shards_as_well_as_numpys(monkeypatch):
    from precache.loading.samplers.shard_sampler import shuffle_quality

    shard_ids = np.repeat(np.arange(64), 256)  # 64 shards of 256 rows
    dataset = FakeShardedDataset(shard_ids)
    numpys = shuffle_quality(DistributedShardSampler(dataset, seed=3).epoch_order(), shard_ids, 256)
    monkeypatch.setattr(sampler_module, "LAZY_ORDER_ROWS", 0)
    lazy = shuffle_quality(DistributedShardSampler(dataset, seed=3).epoch_order(), shard_ids, 256)
    assert lazy["batch_entropy"] > 0.97 * numpys["batch_entropy"]
    assert abs(lazy["same_shard"] - numpys["same_shard"]) < 0.01
