"""LengthBucketSampler under real DDP: gloo ranks as processes, each with a DataLoader worker, read
a tokenized text cache in length-bucketed batches; together they see every document once (plus
the documented padding), with equal batch counts; ranks that stop mid-epoch save the sampler's
state, and a new set of ranks (as many or another number) finishes the epoch from it exactly.

Each rank runs this module as a script (``rank_main``) and writes what it saw (and the sampler
state) to ``rank<r>.json`` for the parent test to check.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

import precache
from tests.helpers import build_cache, launch_ranks
from tests.helpers.sampling import padded

pytestmark = pytest.mark.slow
pytest.importorskip("tokenizers")
DOCS, BATCH, SEED, BUCKETS, EPOCH = 41, 3, 2, 2, 1  # 41: not a multiple of 2 x 3 or 3 x 3
TIMEOUT = 90.0  # seconds for one launch of all ranks: only against a hang, never reached


def rank_main(cache: str, out: str, stop_after: int, state_path: str) -> None:
    """One rank: read its share of the epoch (``stop_after`` batches; 0: all), report it."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from precache.loading import CachedDataset
    from precache.loading.samplers.length_buckets import LengthBucketSampler
    from precache.loading.loaders.text_collate import TokenCollate

    dist.init_process_group("gloo")  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from the parent
    rank = dist.get_rank()
    dataset = CachedDataset(cache, columns=["key", "ids", "length"])
    lengths = dataset.read_batch(range(len(dataset)))["length"]
    sampler = LengthBucketSampler(lengths, BATCH, seed=SEED, bucket_batches=BUCKETS)
    if state_path:
        sampler.load_state_dict(json.loads(Path(state_path).read_text()))
    sampler.set_epoch(EPOCH)  # keeps the resumed position
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=1, collate_fn=TokenCollate())
    keys: list[str] = []
    widths: list[int] = []
    for batch in loader:
        keys += batch["key"]
        widths.append(int(batch["input_ids"].shape[1]))
        if len(widths) == stop_after:
            break
    state = sampler.state_dict(batches=len(widths))
    if rank == 0:
        Path(out, "state.json").write_text(json.dumps(state))
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"keys": keys, "widths": widths, "state": state, "planned": len(sampler)}))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, cache: Path, out: Path, stop_after: int = 0,
           state: Path | None = None) -> list[dict]:
    """Run ``world`` rank processes of this module to the end (``launch_ranks``)."""
    return launch_ranks("tests.precache.text.test_buckets_ddp", world, out,
                        [str(cache), str(out), str(stop_after), str(state or "")], TIMEOUT)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("buckets_ddp")
    corpus = root / "in"
    corpus.mkdir()
    for i in range(DOCS):  # documents of very different lengths
        (corpus / f"d{i:02d}.txt").write_text("word " * (1 + (i * 37) % 200), encoding="utf-8")
    build_cache(corpus, root / "cache", pipeline="text", workers=1, shard_rows=8)
    return root / "cache"


@pytest.fixture(scope="module")
def keys(cache) -> list[str]:
    """The cache's keys, by sample index."""
    return precache.Cache(cache).read_all(["key"])["key"]


def expected_keys(cache: Path, keys: list[str], world: int,
                  state: dict | None = None) -> list[list[str]]:
    """What each rank should see, from a sampler built here for every rank."""
    from precache.loading.samplers.length_buckets import LengthBucketSampler

    lengths = precache.Cache(cache).read_all(["length"])["length"]
    out = []
    for rank in range(world):
        sampler = LengthBucketSampler(lengths, BATCH, seed=SEED, bucket_batches=BUCKETS,
                                      rank=rank, world_size=world)
        if state:
            sampler.load_state_dict(state)
        sampler.set_epoch(EPOCH)
        out.append([keys[i] for batch in sampler for i in batch])
    return out


def indices(keys: list[str], seen: list[str]) -> list[int]:
    index = {key: i for i, key in enumerate(keys)}
    return [index[key] for key in seen]


def test_two_gloo_ranks_read_every_document_once_in_bucketed_batches(cache, keys, tmp_path):
    ranks = launch(2, cache, tmp_path / "run")
    assert [len(r["widths"]) for r in ranks] == [7, 7]  # 42 slots / (2 x 3): equal counts
    seen = indices(keys, [k for r in ranks for k in r["keys"]])
    assert Counter(seen) == padded(list(range(DOCS)), 2 * BATCH)  # each once, the first twice
    assert all(w % 8 == 0 for r in ranks for w in r["widths"])
    assert [r["keys"] for r in ranks] == expected_keys(cache, keys, 2)


K = 3  # batches per rank before the stop: 18 of 41 documents seen, 23 left


@pytest.fixture(scope="module")
def first_part(cache, tmp_path_factory) -> tuple[list[dict], Path]:
    """Two ranks stop after ``K`` batches each and save the state."""
    out = tmp_path_factory.mktemp("first") / "run"
    return launch(2, cache, out, stop_after=K), out / "state.json"


@pytest.mark.parametrize("world", [3, 2])
def test_ranks_stop_mid_epoch_and_new_ranks_finish_it_exactly(cache, keys, first_part, world,
                                                              tmp_path):
    first_ranks, state_path = first_part
    state = json.loads(state_path.read_text())
    assert first_ranks[0]["state"] == first_ranks[1]["state"] == state
    assert state == {"epoch": EPOCH, "seed": SEED, "size": DOCS, "bucket_batches": BUCKETS,
                     "drop_last": False, "done": [[2, BATCH, K]]}
    first = indices(keys, [k for r in first_ranks for k in r["keys"]])
    assert len(first) == 2 * K * BATCH
    whole_epoch = expected_keys(cache, keys, 2)
    assert [r["keys"] for r in first_ranks] == [e[:K * BATCH] for e in whole_epoch]
    # Before the stop, the only repeat can be the plan's padding (the first document).
    assert Counter(first) - padded(list(range(DOCS)), 2 * BATCH) == Counter()

    ranks = launch(world, cache, tmp_path / "run", state=state_path)
    assert len({len(r["widths"]) for r in ranks}) == 1  # equal batch counts: DDP cannot hang
    second = indices(keys, [k for r in ranks for k in r["keys"]])
    assert set(first).isdisjoint(second)  # nothing seen before the stop is served again
    # Every other document once, plus the new plan's padding: the first of those left.
    left = sorted(set(range(DOCS)) - set(first))
    assert Counter(second) == padded(left, world * BATCH)
    assert [r["keys"] for r in ranks] == expected_keys(cache, keys, world, state)
    done = [[2, BATCH, K], [world, BATCH, len(ranks[0]["widths"])]]
    assert all(r["state"]["done"] == done and r["planned"] == len(r["widths"]) for r in ranks)


if __name__ == "__main__":  # one rank, started by ``launch``
    rank_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
