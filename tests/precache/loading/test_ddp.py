"""DistributedShardSampler under real DDP: gloo ranks as processes, two DataLoader workers each.

Each rank runs this module as a script (``rank_main``): it reads a real cache through
``CachedDataset`` + ``DistributedShardSampler`` + ``DataLoader`` and writes the keys it saw (and
the sampler state) to ``rank<r>.json`` for the parent test to check.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

import precache
from tests.helpers import build_cache, launch_ranks, write_photos

pytestmark = pytest.mark.slow

SIZE, BATCH, SEED, EPOCH = 37, 4, 11, 1  # 37 keys: not a multiple of 2 or 3
TIMEOUT = 60.0  # seconds for one launch of all ranks


def rank_main(cache: str, out: str, stop_after: int, shard_window: int, state_path: str) -> None:
    """One rank: read its share of the epoch (``stop_after`` batches; 0: all), report it."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from precache.loading.datasets.cached import CachedDataset
    from precache.loading.samplers.shard_sampler import DistributedShardSampler

    dist.init_process_group("gloo")  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from the parent
    rank = dist.get_rank()
    dataset = CachedDataset(cache, columns=["key"])
    sampler = DistributedShardSampler(dataset, seed=SEED, shard_window=shard_window or None)
    if state_path:
        sampler.load_state_dict(json.loads(Path(state_path).read_text()))
    sampler.set_epoch(EPOCH)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=2)
    keys: list[str] = []
    batches = 0
    for batch in loader:
        keys.extend(batch["key"])
        batches += 1
        if batches == stop_after:
            break
    state = sampler.state_dict(consumed=min(batches * BATCH, len(sampler)))
    if rank == 0:
        Path(out, "state.json").write_text(json.dumps(state))
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"keys": keys, "batches": batches, "state": state, "world_size": dist.get_world_size()}))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, cache: Path, out: Path, stop_after: int = 0, shard_window: int = 0,
           state: Path | None = None) -> list[dict]:
    """Run ``world`` rank processes of this module to the end (``launch_ranks``)."""
    return launch_ranks("tests.precache.loading.test_ddp", world, out,
                        [str(cache), str(out), str(stop_after), str(shard_window), str(state or "")], TIMEOUT)


def expected_keys(cache: Path, world: int, shard_window: int = 0,
                  state: dict | None = None) -> list[list[str]]:
    """What each rank should see, from a sampler built here for every rank."""
    from precache.loading.datasets.cached import CachedDataset
    from precache.loading.samplers.shard_sampler import DistributedShardSampler

    dataset = CachedDataset(cache, columns=["key"])
    keys = dataset.read_batch(range(len(dataset)))["key"]
    out = []
    for rank in range(world):
        sampler = DistributedShardSampler(dataset, seed=SEED, shard_window=shard_window or None,
                                          rank=rank, world_size=world)
        if state:
            sampler.load_state_dict(state)
        sampler.set_epoch(EPOCH)
        out.append([keys[i] for i in sampler])
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ddp")
    write_photos(root / "photos", SIZE)
    build_cache(root / "photos", root / "cache", pipeline="images", params={"size": 16}, workers=1,
                shard_rows=8)
    assert len(precache.Cache(root / "cache").manifest.shards) == 5
    return root / "cache"


@pytest.fixture(scope="module")
def all_keys(cache) -> set[str]:
    return set(precache.Cache(cache).read_all(["key"])["key"])


def test_two_ranks_read_the_whole_cache_once_plus_one_pad(cache, all_keys, tmp_path):
    ranks = launch(2, cache, tmp_path / "run")
    seen = [k for r in ranks for k in r["keys"]]
    assert set(seen) == all_keys
    assert len(seen) == SIZE + 1 and sorted(Counter(seen).values())[-2:] == [1, 2]  # one pad
    assert [r["batches"] for r in ranks] == [5, 5]  # 19 samples each: 4+4+4+4+3
    assert [r["keys"] for r in ranks] == expected_keys(cache, 2)


K = 3  # batches per rank before the stop: 24 of 37 samples seen, 13 left


@pytest.fixture(scope="module")
def first_part(cache, tmp_path_factory) -> tuple[list[dict], Path]:
    """Two ranks (shard windows of 2 shards) stop after ``K`` batches each and save the state."""
    out = tmp_path_factory.mktemp("first") / "run"
    return launch(2, cache, out, stop_after=K, shard_window=2), out / "state.json"


@pytest.mark.parametrize("world", [3, 2])
def test_two_ranks_stop_mid_epoch_and_new_ranks_finish_it_exactly(
        cache, all_keys, first_part, world, tmp_path):
    first_ranks, state_path = first_part
    state = json.loads(state_path.read_text())
    assert first_ranks[0]["state"] == first_ranks[1]["state"] == state
    assert state == {"epoch": EPOCH, "seed": SEED, "offset": 2 * K * BATCH, "size": SIZE,
                     "shuffle": True, "shard_window": 2, "drop_last": False, "order": "windows"}
    first = [k for r in first_ranks for k in r["keys"]]
    assert len(first) == len(set(first)) == 2 * K * BATCH  # no padding before the end

    ranks = launch(world, cache, tmp_path / "run", shard_window=2, state=state_path)
    second = [k for r in ranks for k in r["keys"]]
    left = SIZE - 2 * K * BATCH
    pad = -left % world  # 3 ranks: 13 -> 15; 2 ranks: 13 -> 14
    assert len({r["batches"] for r in ranks}) == 1  # equal batch counts: DDP cannot hang
    assert not set(first) & set(second) and set(first) | set(second) == all_keys
    assert len(second) == left + pad
    assert [r["keys"] for r in ranks] == expected_keys(cache, world, 2, state)
    # The pad repeats the first samples left; rank r took remaining[r::world].
    remaining = [k for i in range(left) for k in [ranks[i % world]["keys"][i // world]]]
    assert sorted(k for k, c in Counter(second).items() if c == 2) == sorted(remaining[:pad])
    assert all(r["state"]["offset"] == SIZE for r in ranks)  # the epoch is done


if __name__ == "__main__":  # one rank, started by ``launch``
    rank_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
