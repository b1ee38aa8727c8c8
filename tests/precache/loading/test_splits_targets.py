"""Splits and targets on a ``CachedDataset`` (issue 38 item 1): ``where=`` and ``select`` hold
exactly the rows asked for, through every loader (the loop's own thread, worker threads, a worker
process, two ranks) and across an epoch boundary (cold, then warm through the row tables);
``target=`` gives ``classes``/``targets`` for string and integer labels; ``split`` keeps groups
whole; stage 1 keeps integer labels (MedMNIST ``.npz``, a labels CSV) as integers. Real stage 1
runs: MedMNIST-style ``.npz`` volumes (data/make_volumes.py) and photos with a labels CSV."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from precache.cache import Cache
from precache.loading import CachedDataset, make_loader
from precache.processing.ops.labels import read_label_file
from tests.helpers import REPO, build_cache, load_script, write_photos


@pytest.fixture(scope="module")
def volumes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 MedMNIST-style ``.npz`` files (the groups: ``source_key``) of 6 volumes of 8^3 each (4
    train, 1 val, 1 test; labels 0, 1, 2 as uint8), 2 files a shard: 36 rows in 3 shards."""
    root = tmp_path_factory.mktemp("split_volumes")
    make_volumes = load_script(REPO / "data" / "make_volumes.py", "make_volumes")
    (root / "in").mkdir()
    for n in range(6):
        make_volumes.make_npz(root / "in" / f"set{n}.npz", count=6, size=8, seed=n)
    build_cache(root / "in", root / "cache", pipeline="volumes", params={"shape": (8,)},
                workers=1, shard_rows=2)
    return root / "cache"


@pytest.fixture(scope="module")
def whole(volumes: Path) -> dict[str, dict]:
    """Every row of the volumes cache by key: its volume, label and split."""
    rows = Cache(volumes).read_all(["key", "volume", "label", "split", "source_key"])
    return {key: {name: rows[name][i] for name in ("volume", "label", "split", "source_key")}
            for i, key in enumerate(rows["key"])}


def write_labels(photos: list[Path], labels: list[str], path: Path) -> Path:
    path.write_text("file,label\n" + "".join(f"{p.name},{label}\n"
                                             for p, label in zip(photos, labels)))
    return path


@pytest.fixture(scope="module")
def photo_caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """12 photos through the images pipeline twice: with string labels (cat, dog, bird) and with
    integer labels (0, 1, 2, 10) from a labels CSV; 3 photos a shard."""
    root = tmp_path_factory.mktemp("split_photos")
    photos = write_photos(root / "photos", 12)
    caches = {}
    for name, labels in (("str", ["cat", "dog", "bird"] * 4), ("int", ["0", "1", "2", "10"] * 3)):
        csv = write_labels(photos, labels, root / f"{name}.csv")
        build_cache(root / "photos", root / name, pipeline="images",
                    params={"size": 8, "labels": str(csv)}, workers=1, shard_rows=3)
        caches[name] = root / name
    return caches


LOADERS = {"loop": {"num_workers": 0}, "threads": {"num_workers": 2, "worker_kind": "threads"},
           "process": {"num_workers": 1, "worker_kind": "processes"}}


def epochs_of_keys(dataset: CachedDataset, whole: dict[str, dict], epochs: int = 2,
                   **options) -> list[list[str]]:
    """Each epoch's keys through ``make_loader(dataset, 4, **options)``, every batch's volumes
    and targets checked against the whole cache's rows of those keys."""
    loader = make_loader(dataset, 4, seed=1, **options)
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        keys = []
        for batch in loader:
            for i, key in enumerate(batch["key"]):
                assert np.array_equal(batch["volume"][i].numpy(), whole[key]["volume"]), key
                if "target" in batch:
                    assert str(batch["target"].dtype) == "torch.int64"
                    assert int(batch["target"][i]) == dataset.classes.index(whole[key]["label"])
            keys += batch["key"]
        out.append(keys)
    return out


def selections(volumes: Path, whole: dict[str, dict]) -> dict[str, tuple[CachedDataset, list]]:
    """name -> (a dataset of some rows, the keys it must hold)."""
    columns = ["key", "volume"]
    val_test = CachedDataset(volumes, columns=columns, where={"split": ["val", "test"]},
                             target="label")
    keys = list(whole)  # stored order
    picked = [31, 2, 7, 2, -1, 13, 12, 20, 33, 0, 25]  # out of order, a repeat, one from the end
    chosen = CachedDataset(volumes, columns=columns, target="label").select(picked)
    odd = CachedDataset(volumes, columns=columns,
                        where={"key": lambda keys: [k[-1] in "135" for k in keys]})
    return {"where": (val_test, [k for k in keys if whole[k]["split"] in ("val", "test")]),
            "select": (chosen, [keys[i] for i in sorted({i % len(keys) for i in picked})]),
            "callable": (odd, [k for k in keys if k[-1] in "135"])}


@pytest.mark.parametrize("how", ["where", "select", "callable"])
def test_a_selection_reads_exactly_its_rows_through_every_loader_and_epoch(
        volumes: Path, whole: dict[str, dict], how: str):
    dataset, expected = selections(volumes, whole)[how]
    assert len(dataset) == len(expected) and dataset.read_column("key") == expected
    for name, options in LOADERS.items():
        for keys in epochs_of_keys(dataset, whole, **options):  # cold, then warm (row tables)
            assert sorted(keys) == sorted(expected), name
    for epoch in range(2):  # two ranks: every row once across them, each epoch
        both = []
        for rank in range(2):
            loader = make_loader(dataset, 3, num_workers=0, seed=4, rank=rank, world_size=2)
            loader.set_epoch(epoch)
            both += [k for batch in loader for k in batch["key"]]
        assert Counter(both) == Counter(expected)
    assert set(np.unique(dataset.shard_ids)) <= {0, 1, 2}


def test_a_selection_of_a_selection_and_resident_columns_read_their_rows(
        volumes: Path, whole: dict[str, dict]):
    train = CachedDataset(volumes, columns=["volume", "split"], where={"split": "train"},
                          resident=True)
    assert train.resident and len(train) == 24
    keys = [k for k in whole if whole[k]["split"] == "train"]
    batch = train.read_batch([5, 0, 23])
    for i, n in enumerate([5, 0, 23]):
        assert np.array_equal(batch["volume"][i], whole[keys[n]]["volume"])
    assert batch["split"] == ["train"] * 3
    assert train.read_column("key") == keys  # a column it does not read, for its rows
    inner = train.select([1, 20])
    assert inner.read_column("key") == [keys[1], keys[20]] and inner.generation == train.generation
    assert np.array_equal(inner.read_batch([1])["volume"][0], whole[keys[20]]["volume"])


def test_targets_and_classes_for_integer_and_string_labels(volumes: Path, whole: dict[str, dict],
                                                           photo_caches: dict[str, Path]):
    every = CachedDataset(volumes, columns=["key"], target="label")
    assert every.classes == [0, 1, 2] and every.targets.dtype == np.int64
    assert every.targets.tolist() == [whole[k]["label"] for k in whole]
    test = CachedDataset(volumes, columns=["key"], where={"split": "test"}, target="label")
    assert test.classes == [0, 1, 2]  # the whole cache's, whatever the split holds
    assert test.targets.tolist() == [whole[k]["label"] for k in test.read_column("key")]
    words = CachedDataset(photo_caches["str"], columns=["key", "label"], target="label",
                          transform=lambda sample: sample)
    assert words.classes == ["bird", "cat", "dog"]
    sample = words[4]
    assert isinstance(sample["target"], np.int64)
    assert words.classes[sample["target"]] == sample["label"] == "dog"
    numbers = CachedDataset(photo_caches["int"], columns=["key"], target="label")
    assert numbers.classes == [0, 1, 2, 10]  # integers sorted as integers, not as "10" < "2"
    assert numbers.targets.tolist() == [0, 1, 2, 3] * 3
    keys = numbers.read_column("key")
    for _ in range(2):  # cold (by shard), then warm (the row table): the target follows the rows
        batch = numbers.read_batch([3, 0, 7], storage_order=True)
        assert batch["key"] == [keys[0], keys[3], keys[7]]
        assert batch["target"].tolist() == [0, 3, 3]


def test_split_keeps_each_group_on_one_side_and_is_the_same_for_a_seed(
        volumes: Path, whole: dict[str, dict]):
    dataset = CachedDataset(volumes, columns=["key", "volume"], target="label")
    parts = dataset.split({"train": 0.5, "val": 0.25, "test": 0.25}, by="source_key", seed=3)
    keys = {name: part.read_column("key") for name, part in parts.items()}
    assert sorted(k for ks in keys.values() for k in ks) == sorted(whole)  # each row once
    groups = {name: {whole[k]["source_key"] for k in ks} for name, ks in keys.items()}
    assert [len(ks) for ks in keys.values()] == [18, 6, 12]  # 6 rows a group; see group_split
    assert not (groups["train"] & groups["val"] or groups["train"] & groups["test"]
                or groups["val"] & groups["test"])
    again = dataset.split({"train": 0.5, "val": 0.25, "test": 0.25}, by="source_key", seed=3)
    assert {name: part.read_column("key") for name, part in again.items()} == keys
    assert parts["val"].classes == [0, 1, 2]
    assert parts["val"].targets.tolist() == [whole[k]["label"] for k in keys["val"]]
    assert sorted(epochs_of_keys(parts["train"], whole, 1, num_workers=0)[0]) == sorted(
        keys["train"])
    train = CachedDataset(volumes, columns=["key"], where={"split": "train"})
    halves = train.split({"a": 0.5, "b": 0.5}, by="key")  # a group a row: about half each
    assert sorted(len(p) for p in halves.values()) == [12, 12]


def test_stage_1_keeps_integer_labels_as_integers(volumes: Path, photo_caches: dict[str, Path],
                                                  tmp_path: Path):
    for cache in (volumes, photo_caches["int"]):
        assert Cache(cache).manifest.schema["label"].describe() == "scalar int64"
    assert Cache(photo_caches["str"]).manifest.schema["label"].describe() == "str"
    assert Cache(photo_caches["int"]).read_all(["label"])["label"].tolist() == [0, 1, 2, 10] * 3
    mixed = tmp_path / "mixed.csv"  # one label that is no integer as written: all strings
    mixed.write_text("file,label\na.png,0\nb.png,07\nc.png,-3\n")
    assert [e["label"] for e in read_label_file(mixed).values()] == ["0", "07", "-3"]
    meta = tmp_path / "meta.json"
    meta.write_text('{"a.mp4": {"label": 1}, "b.mp4": {"label": "-2"}}')
    assert [e["label"] for e in read_label_file(meta).values()] == [1, -2]


def test_bad_where_target_and_select_say_what_the_cache_has(volumes: Path):
    with pytest.raises(KeyError) as missing:
        CachedDataset(volumes, where={"splitt": "train"})
    message = missing.value.args[0]
    assert message.startswith(f"{volumes}: no column 'splitt' for where=; it has [")
    assert "'split'" in message and "\n" not in message
    with pytest.raises(KeyError, match="no column 'labels' for target=; it has"):
        CachedDataset(volumes, target="labels")
    with pytest.raises(ValueError) as nothing:
        CachedDataset(volumes, where={"label": "1"})  # the labels are integers
    assert "keeps none of the cache's 36 rows (label has [0, 1, 2])" in str(nothing.value)
    with pytest.raises(ValueError, match=r"split has \['test', 'train', 'val'\]"):
        CachedDataset(volumes, where={"split": "training"})
    with pytest.raises(ValueError, match="one bool per row"):
        CachedDataset(volumes, where={"label": lambda v: v.sum()})
    with pytest.raises(ValueError, match=r"'spacing' is ndarray float32\[3\]; target= takes a "):
        CachedDataset(volumes, target="spacing")
    dataset = CachedDataset(volumes, columns=["key"])
    with pytest.raises(ValueError, match="select\\(\\) of no rows"):
        dataset.select([])
    with pytest.raises(IndexError, match="index 36 is out of range for a dataset of 36 rows"):
        dataset.select([0, 36])
    with pytest.raises(ValueError, match="fractions must be positive and sum to 1"):
        dataset.split({"train": 0.8, "val": 0.3})
    with pytest.raises(ValueError, match=r"6 groups of 36 rows"):
        dataset.split({"train": 0.99, "val": 0.01})
