"""make_loader / CacheLoader: counting what was handed out, and starting an epoch early."""

from __future__ import annotations

import pytest

from precache.loading import CachedDataset, make_loader
from tests.helpers import build_cache, write_photos


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    write_photos(root / "photos", 30)
    build_cache(root / "photos", root / "cache", pipeline="images", params={"size": 8}, workers=1,
                shard_rows=8)
    return CachedDataset(root / "cache", columns=["key", "image"])


def keys(batches) -> list[str]:
    return [k for batch in batches for k in batch["key"]]


def test_the_state_counts_the_batches_handed_out(dataset):
    loader = make_loader(dataset, 4, num_workers=0, seed=3)
    loader.set_epoch(2)
    batches = iter(loader)
    next(batches), next(batches)
    assert loader.state_dict() == {**loader.state_dict(consumed=8), "offset": 8}
    resumed = make_loader(dataset, 4, num_workers=0, seed=3)
    resumed.load_state_dict(loader.state_dict())
    resumed.set_epoch(2)
    fresh = make_loader(dataset, 4, num_workers=0, seed=3)
    fresh.set_epoch(2)
    assert keys(resumed) == keys(fresh)[8:]


def test_an_epoch_started_early_yields_the_same_batches_once(dataset):
    plain = make_loader(dataset, 4, num_workers=1, seed=1)
    plain.set_epoch(1)
    expected = keys(plain)
    early = make_loader(dataset, 4, num_workers=1, seed=1)
    early.set_epoch(0)
    keys(early)
    early.start_epoch(1)  # e.g. before validation
    assert early.state_dict() == {**early.state_dict(), "epoch": 1, "offset": 0}
    early.set_epoch(1)  # the training loop's usual call keeps the started batches
    assert keys(early) == expected
    early.set_epoch(2)
    assert sorted(keys(early)) == sorted(expected)  # an ordinary epoch after it


# ---- the loader contract: DataLoader(shuffle=True) and torchdata's StatefulDataLoader ----------

def passes(loader, count: int, stop: int | None = None) -> list[list[list[str]]]:
    """``count`` passes of ``iter(loader)`` without ``set_epoch``: per pass, its batches' keys;
    the first pass is abandoned after ``stop`` batches if given."""
    done = []
    for n in range(count):
        batches = []
        for batch in loader:
            batches.append(list(batch["key"]) if isinstance(batch, dict) else list(batch))
            if n == 0 and stop is not None and len(batches) == stop:
                break
        done.append(batches)
    return done


def round_trip(state: dict, tmp_path) -> dict:
    """The state through ``torch.save`` and ``torch.load(weights_only=True)``, as a checkpoint."""
    import torch

    torch.save({"loader": state}, tmp_path / "state.pt")
    return torch.load(tmp_path / "state.pt", weights_only=True)["loader"]


def contract(make, stop: int, tmp_path) -> dict:
    """What a framework sees of a loader: its ``len()`` at each point, the batches of every pass
    (3 uninterrupted; an epoch abandoned after ``stop`` batches, then the next; a stop after
    ``stop`` batches, the state through a checkpoint, then a new loader's passes)."""
    plain = make()
    lengths = [len(plain)]
    full = passes(plain, 3)
    lengths.append(len(plain))
    abandoned = passes(make(), 2, stop=stop)
    first = make()
    head = passes(first, 1, stop=stop)[0]
    state = round_trip(first.state_dict(), tmp_path)
    resumed = make()
    resumed.load_state_dict(state)
    lengths.append(len(resumed))
    rest = passes(resumed, 2)
    lengths.append(len(resumed))
    return {"lengths": lengths, "full": full, "abandoned": abandoned, "head": head,
            "rest": rest}


def flat(batches) -> list[str]:
    return [k for batch in batches for k in batch]


def shape(seen: dict) -> dict:
    """The parts of ``contract`` that do not depend on which shuffle made the order."""
    return {"lengths": seen["lengths"],
            "batches": [[len(b) for b in p] for p in [*seen["full"], *seen["abandoned"],
                                                        seen["head"], *seen["rest"]]]}


@pytest.mark.parametrize("stop", [1, 4, 7])  # early, in the middle, the last batch but one
@pytest.mark.parametrize("workers,kind", [(0, "auto"), (2, "threads"), (1, "processes")])
def test_the_loader_keeps_the_stateful_dataloader_contract_across_a_resume(
        dataset, tmp_path, stop, workers, kind):
    """The same calls on torchdata's real ``StatefulDataLoader`` and on a ``CacheLoader`` give
    the same lengths and batch counts, and the CacheLoader every sample once per epoch: epochs
    advance (and reshuffle) without ``set_epoch``; a resume from a checkpoint loaded
    weights-only gives exactly the rest of the epoch, then whole epochs again."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    keys_of = [dataset[i]["key"] for i in range(len(dataset))]
    reference = contract(lambda: StatefulDataLoader(keys_of, batch_size=4, shuffle=True),
                         stop, tmp_path)
    ours = contract(lambda: make_loader(dataset, 4, seed=5, num_workers=workers,
                                        worker_kind=kind), stop, tmp_path)
    assert shape(ours) == shape(reference)
    assert ours["lengths"] == [8] * 4  # 30 samples in batches of 4, before and after a resume
    full = ours["full"]
    assert all(sorted(flat(p)) == sorted(keys_of) for p in full)
    assert full[0] != full[1] != full[2]  # each pass a new epoch, reshuffled
    assert ours["abandoned"][1] == full[1]  # an abandoned epoch 0 is followed by epoch 1
    assert ours["head"] == full[0][:stop]
    assert ours["rest"] == [full[0][stop:], full[1]]  # the rest of epoch 0, then epoch 1


def test_set_epoch_chooses_the_next_pass_and_a_finished_saved_epoch_resumes_at_the_next(
        dataset, tmp_path):
    loader = make_loader(dataset, 4, num_workers=0, seed=5)
    by_epoch = passes(loader, 3)
    loader.set_epoch(1)
    assert passes(loader, 2) == [by_epoch[1], by_epoch[2]]  # set_epoch, then on from there
    finished = make_loader(dataset, 4, num_workers=0, seed=5)
    passes(finished, 1)
    state = round_trip(finished.state_dict(), tmp_path)
    assert (state["epoch"], state["offset"]) == (0, 30)
    resumed = make_loader(dataset, 4, num_workers=0, seed=5)
    resumed.load_state_dict(state)
    assert passes(resumed, 1) == [by_epoch[1]]
    again = make_loader(dataset, 4, num_workers=0, seed=5)
    again.load_state_dict(state)
    again.set_epoch(0)  # chosen explicitly: the finished epoch 0, nothing left of it
    assert passes(again, 2) == [[], by_epoch[1]]
    moved = make_loader(dataset, 4, num_workers=0, seed=5)
    next(iter(moved))
    moved.sampler.set_epoch(3)  # as Lightning does, past the loader: its count is stale
    assert (moved.state_dict()["epoch"], moved.state_dict()["offset"]) == (3, 0)


# ---- make_loader(batch_sampler=...): the same contract over a resumable batch sampler ----------

def bucketed(dataset, workers: int, kind: str):
    """A loader over a ``LengthBucketSampler`` of 30 samples in 6 batches of 5 (no repeats)."""
    from precache.loading import LengthBucketSampler

    lengths = [(7 * i) % 11 + 1 for i in range(len(dataset))]
    return make_loader(dataset, batch_sampler=LengthBucketSampler(lengths, 5, seed=5),
                       num_workers=workers, worker_kind=kind)


@pytest.mark.parametrize("stop,workers,kind", [(1, 0, "auto"), (5, 0, "auto"),
                                               (3, 2, "threads"), (3, 1, "processes")])
def test_a_batch_sampler_loader_keeps_the_contract_across_a_resume(dataset, tmp_path, stop,
                                                                   workers, kind):
    """Its ``len()`` is a whole epoch's batches before and after a resume, every pass is the
    next epoch without ``set_epoch``, and a resume gives exactly the samples left of the epoch
    (the sampler plans their batches anew), then the next, whichever workers read them."""
    keys_of = [dataset[i]["key"] for i in range(len(dataset))]
    ours = contract(lambda: bucketed(dataset, workers, kind), stop, tmp_path)
    assert bucketed(dataset, workers, kind).worker_kind == ("none" if not workers else
                                                            "threads" if kind == "auto" else kind)
    assert ours["lengths"] == [6] * 4
    full = ours["full"]
    assert all(sorted(flat(p)) == sorted(keys_of) and len(p) == 6 for p in full)
    assert full[0] != full[1] != full[2]  # each pass a new epoch, reshuffled
    assert ours["abandoned"][1] == full[1]  # an abandoned epoch 0 is followed by epoch 1
    assert ours["head"] == full[0][:stop]
    rest, next_epoch = ours["rest"]
    assert sorted(flat(rest)) == sorted(flat(full[0][stop:])) and len(rest) == 6 - stop
    assert next_epoch == full[1]


def test_a_finished_bucketed_epoch_resumes_at_the_next_and_set_epoch_chooses(dataset, tmp_path):
    loader = bucketed(dataset, 0, "auto")
    by_epoch = passes(loader, 3)
    loader.set_epoch(1)
    assert passes(loader, 2) == [by_epoch[1], by_epoch[2]]
    finished = bucketed(dataset, 0, "auto")
    passes(finished, 1)
    state = round_trip(finished.state_dict(), tmp_path)
    resumed = bucketed(dataset, 0, "auto")
    resumed.load_state_dict(state)
    assert passes(resumed, 1) == [by_epoch[1]]
    again = bucketed(dataset, 0, "auto")
    again.load_state_dict(state)
    again.set_epoch(0)  # chosen explicitly: the finished epoch 0, nothing left of it
    assert passes(again, 2) == [[], by_epoch[1]]


def test_a_batch_sampler_that_cannot_resume_or_comes_with_a_batch_size_is_refused(dataset):
    from torch.utils.data import BatchSampler, SequentialSampler

    from precache.loading import LengthBucketSampler, TokenCollate

    plain = BatchSampler(SequentialSampler(dataset), 4, drop_last=False)
    with pytest.raises(ValueError, match=r"batch_sampler BatchSampler has no epoch, set_epoch, "
                                         r"epoch_batches, state_dict, load_state_dict: "):
        make_loader(dataset, batch_sampler=plain)
    buckets = LengthBucketSampler([1] * len(dataset), 4)
    with pytest.raises(ValueError, match=r"batch_size, drop_last given beside batch_sampler "
                                         r"LengthBucketSampler, which decides them itself"):
        make_loader(dataset, 4, drop_last=True, batch_sampler=buckets)
    with pytest.raises(ValueError, match="batch_size must be at least 1, not None"):
        make_loader(dataset)
    # TokenCollate pads a batch with a few NumPy calls: auto reads with threads
    assert make_loader(dataset, 4, num_workers=2, collate_fn=TokenCollate()).worker_kind \
        == "threads"


def test_cache_backed_declares_shard_ids_encoded_columns_and_decoding(dataset):
    """What the loaders and the loop ask is declared: a dataset with only path, generation,
    kept_generations and close is not CacheBacked; a CachedDataset is, and answers them."""
    import numpy as np

    from precache.loading import CacheBacked

    class OnlyGenerations:
        path, generation = "cache/", 1

        def kept_generations(self) -> list[int]:
            return [1]

        def close(self) -> None:
            pass

    assert not isinstance(OnlyGenerations(), CacheBacked)
    assert isinstance(dataset, CacheBacked)
    assert dataset.shard_ids.shape == (30,) and np.array_equal(
        dataset.shard_ids, np.repeat(np.arange(4), [8, 8, 8, 6]))  # 8-row shards
    assert dataset.encoded_columns == [] and dataset.decode_images is True  # raw images


def test_the_loader_finds_the_cache_backed_dataset_under_subsets_by_its_declared_protocol(
        dataset):
    from torch.utils.data import Subset

    from precache.loading import CacheBacked

    assert isinstance(dataset, CacheBacked) and not isinstance(Subset(dataset, [0]), CacheBacked)
    nested = Subset(Subset(dataset, range(20)), range(10))
    assert make_loader(nested, 4, num_workers=0).cached_dataset() is dataset
    assert make_loader(list(range(10)), 4, num_workers=0).cached_dataset() is None
