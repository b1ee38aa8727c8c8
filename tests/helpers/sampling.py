"""Which samples the ranks of a training run saw, and the one check that every training sample was
seen exactly once per epoch (the multi-node, Slurm and trainer tests, and any resume)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path


def padded(samples: list[int], global_batch: int) -> Counter:
    """What the documentation promises for a plan over ``samples``: each once, and the first
    ones (in index order) once more, as many as fill the last global batch."""
    left = sorted(samples)
    return Counter(left + left[: -len(left) % global_batch])


def seen_keys(folder: Path, world: int) -> list[dict[int, list[str]]]:
    """Per rank: epoch -> the keys that rank trained on, from the trainers' ``--log-keys`` files
    (``keys-rank<R>.tsv``, every launch appending)."""
    ranks = []
    for rank in range(world):
        epochs: dict[int, list[str]] = {}
        for line in (folder / f"keys-rank{rank}.tsv").read_text().splitlines():
            epoch, key = line.split("\t")
            epochs.setdefault(int(epoch), []).append(key)
        ranks.append(epochs)
    return ranks


def keys_per_epoch(folder: Path, ranks: int) -> dict[int, list[str]]:
    """epoch -> every key trained on in it, by any of ``ranks`` ranks in any launch."""
    merged: dict[int, list[str]] = {}
    for rank in seen_keys(folder, ranks):
        for epoch, keys in rank.items():
            merged.setdefault(epoch, []).extend(keys)
    return merged


def assert_each_sample_once_per_epoch(seen: dict[int, list[str]] | list[dict[int, list[str]]],
                                      train: list[str], pads: list[int]) -> None:
    """Epochs ``0 .. len(pads) - 1`` and no other were trained; in each, every key of ``train``
    was trained on once, but ``pads[epoch]`` of them twice (a sampler repeats that many to fill the
    last batch round of the ranks), and no other key.

    ``seen`` is epoch -> keys of all ranks together (``keys_per_epoch``: across launches, where
    a resumed epoch's ranks may differ), or one such mapping per rank (``seen_keys``: one launch),
    which also asserts that every rank trained in every epoch, on as many samples as the others.
    """
    ranks = seen if isinstance(seen, list) else None
    if ranks is not None:
        merged: dict[int, list[str]] = {}
        for rank in ranks:
            for epoch, keys in rank.items():
                merged.setdefault(epoch, []).extend(keys)
        for epoch in range(len(pads)):
            counts = [len(rank.get(epoch, [])) for rank in ranks]
            assert all(counts) and len(set(counts)) == 1, (epoch, counts)
    else:
        merged = seen  # type: ignore[assignment]
    assert sorted(merged) == list(range(len(pads))), sorted(merged)
    for epoch, pad in enumerate(pads):
        counts = Counter(merged[epoch])
        assert set(counts) == set(train), (epoch, sorted(set(counts) ^ set(train))[:10])
        assert sorted(counts.values()) == [1] * (len(train) - pad) + [2] * pad, epoch
