"""Hugging Face interop (precache.loading.interop.hf): transformers' Trainer trains from a text cache
through PrecacheTrainer on 1 process and on 2 torchrun processes, every sample exactly once per
epoch across ranks, also after a mid-epoch resume; the real MiniLM trains through it; a cache
becomes a datasets.Dataset; a saved datasets.Dataset is a stage-1 input like JSON Lines."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
from precache.processing.sources import InputError  # noqa: E402
from precache.cache import Cache  # noqa: E402
from precache.loading import CachedDataset  # noqa: E402
from precache.loading.interop.hf import ExactOnceBucketSampler, HFTokenCollate, to_hf_dataset  # noqa: E402
from precache.processing.ops.text import resolve_tokenizer  # noqa: E402
from tests.helpers import build_cache  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
JOB = REPO / "tests" / "precache" / "loading" / "hf_trainer_job.py"
WORDS = {"cats": "cat meow purr whiskers kitten fur paw tail".split(),
         "cars": "engine wheel road fuel brake gear tire motor".split()}
DOCS = 60  # not a multiple of 2 ranks x 4: the last global batch is smaller, not padded


def documents(n: int = DOCS, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        label = ["cats", "cars"][i % 2]
        words = [rng.choice(WORDS[label]) for _ in range(rng.randint(3, 30))]
        docs.append({"text": " ".join(words), "label": label})
    return docs


def write_jsonl(path: Path, docs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """``docs.jsonl`` and its text cache ``cache/``."""
    root = tmp_path_factory.mktemp("hf")
    build_cache(write_jsonl(root / "docs.jsonl", documents()), root / "cache", pipeline="text",
                workers=1)
    return root


def rows(cache: Path, columns: list[str]) -> dict:
    data = CachedDataset(cache, columns=columns)
    try:
        return data.read_batch(range(len(data)))
    finally:
        data.close()


# ---- the sampler: pure, every split checked in one process -----------------------------------

def plan(n: int, world: int, batch: int, epoch: int = 0, **kw) -> list[list[list[int]]]:
    """Per rank, its batches of ``epoch``."""
    out = []
    for rank in range(world):
        sampler = ExactOnceBucketSampler(np.arange(n) % 7 + 1, batch, rank=rank,
                                         world_size=world, bucket_batches=2, **kw)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("n,world,batch", [(60, 2, 4), (57, 2, 4), (9, 2, 4), (61, 3, 4),
                                           (64, 2, 4), (10, 4, 2), (7, 1, 3)])
def test_the_sampler_gives_every_sample_once_in_equal_batch_counts(n, world, batch):
    for epoch in (0, 1):
        ranks = plan(n, world, batch, epoch)
        assert len({len(batches) for batches in ranks}) == 1  # DDP: the same steps on every rank
        assert all(1 <= len(b) <= batch for batches in ranks for b in batches)
        assert sorted(i for batches in ranks for b in batches for i in b) == list(range(n))
    assert plan(n, world, batch, 0) != plan(n, world, batch, 1)


def test_the_sampler_drops_other_samples_every_epoch_with_drop_last():
    dropped = []
    for epoch in range(4):
        ranks = plan(61, 2, 4, epoch, drop_last=True)
        assert all(len(b) == 4 for batches in ranks for b in batches)
        seen = [i for batches in ranks for b in batches for i in b]
        assert len(seen) == len(set(seen)) == 56
        dropped.append(frozenset(set(range(61)) - set(seen)))
    assert len(set(dropped)) > 1


def test_the_sampler_resumes_on_another_world_size_without_repeats():
    first = [ExactOnceBucketSampler(np.arange(61) % 5 + 1, 4, rank=r, world_size=2)
             for r in range(2)]
    seen = [i for s in first for b in list(s)[:3] for i in b]
    state = first[0].state_dict(3)
    rest = []
    for rank in range(3):
        s = ExactOnceBucketSampler(np.arange(61) % 5 + 1, 4, rank=rank, world_size=3)
        s.load_state_dict(state)
        s.set_epoch(0)
        rest.append(list(s))
    assert len({len(b) for b in rest}) == 1
    assert sorted(seen + [i for batches in rest for b in batches for i in b]) == list(range(61))


def test_the_sampler_repeats_with_a_warning_where_no_exact_split_exists():
    with pytest.warns(UserWarning, match="1 are repeated"):
        ranks = plan(5, 2, 1)  # batch 1: 5 samples cannot give 2 ranks the same batch count
    assert sorted(set(i for batches in ranks for b in batches for i in b)) == list(range(5))


# ---- the collator ------------------------------------------------------------------------------

def test_the_collator_gives_model_inputs_only_and_names_an_unknown_label():
    samples = [{"ids": np.array([101, 7, 102], np.uint16), "label": "b", "key": "x"},
               {"ids": np.array([101, 102], np.uint16), "label": "a", "key": "y"}]
    batch = HFTokenCollate({"a": 0, "b": 1})(samples)
    assert sorted(batch) == ["attention_mask", "input_ids", "labels"]
    assert batch["input_ids"].shape == (2, 8) and batch["labels"].tolist() == [1, 0]
    assert batch["attention_mask"].sum(1).tolist() == [3, 2]
    with pytest.raises(KeyError, match="label 'b' is not in label_ids"):
        HFTokenCollate({"a": 0})(samples)


# ---- Trainer, in real processes -----------------------------------------------------------------

def run_job(out: Path, cache: Path, ranks: int, *args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    job = [str(JOB), "--cache", str(cache), "--out", str(out), *args]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={ranks}"] if ranks > 1 else [sys.executable])
    done = subprocess.run([*launcher, *job], capture_output=True, text=True, timeout=400,
                          env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    result = out / "result.json"  # a launch of several resumes writes one per resume instead
    return json.loads(result.read_text()) if result.exists() else {}


def batches_by_epoch(out: Path, ranks: int) -> dict[int, list[list[list[str]]]]:
    """epoch -> per rank, its batches (lists of keys) in order."""
    found: dict[int, list[list[list[str]]]] = {}
    for rank in range(ranks):
        for line in (out / f"batches-rank{rank}.tsv").read_text().splitlines():
            epoch, keys = line.split("\t")
            found.setdefault(int(epoch), [[] for _ in range(ranks)])[rank].append(keys.split(","))
    return found


def assert_once_per_epoch(epochs: dict, keys: list[str]) -> None:
    for per_rank in epochs.values():
        assert len({len(batches) for batches in per_rank}) == 1  # the ranks in lock-step
        assert sorted(k for batches in per_rank for b in batches for k in b) == keys


@pytest.mark.slow
def test_the_shipped_minilm_trains_on_one_process_seeing_every_sample_once_per_epoch(
        corpus, tmp_path):
    """One launch for two guarantees (a Python with transformers takes seconds to start): the
    real MiniLM shipped with precache trains through the Trainer (its weights change, its losses
    are numbers), and one process trains on every sample once per epoch, reshuffled."""
    minilm = resolve_tokenizer("minilm").parent  # config.json and model.safetensors beside it
    result = run_job(tmp_path, corpus / "cache", 1, "--model", str(minilm))
    assert result["world_size"] == 1 and result["steps"] == 2 * DOCS // 4 and result["changed"]
    assert len(result["losses"]) == result["steps"]
    assert all(math.isfinite(x) for x in result["losses"]) and math.isfinite(result["eval_loss"])
    epochs = batches_by_epoch(tmp_path, 1)
    assert sorted(epochs) == [0, 1]
    assert_once_per_epoch(epochs, sorted(rows(corpus / "cache", ["key"])["key"]))
    assert epochs[0] != epochs[1]  # reshuffled per epoch (set_epoch reached the sampler)


@pytest.mark.slow
def test_trainer_on_two_ranks_sees_every_sample_once_also_after_a_resume(corpus, tmp_path):
    """Checkpoints after an early, a middle and a late step of epoch 0; each resumed
    (``resume_from_checkpoint``, one launch for the three) trains the rest of epoch 0 and then
    epoch 1, the batches the uninterrupted run trained on."""
    keys = sorted(rows(corpus / "cache", ["key"])["key"])
    steps = -(-DOCS // 8)  # 7 full global batches of 2 x 4, and one of 2 + 2
    stops = (1, 4, 7)
    result = run_job(tmp_path / "a", corpus / "cache", 2, "--save-at", ",".join(map(str, stops)))
    assert result["world_size"] == 2 and result["steps"] == 2 * steps  # not re-split by accelerate
    assert all(math.isfinite(x) for x in result["losses"]) and math.isfinite(result["eval_loss"])
    epochs = batches_by_epoch(tmp_path / "a", 2)
    assert sorted(epochs) == [0, 1] and epochs[0] != epochs[1]
    assert_once_per_epoch(epochs, keys)
    assert [len(b) for b in epochs[0][0]].count(2) == 1  # the smaller last batch, no repeats

    checkpoints = [tmp_path / "a" / "trainer" / f"checkpoint-{stop}" for stop in stops]
    run_job(tmp_path / "b", corpus / "cache", 2, "--resume", ",".join(map(str, checkpoints)))
    for stop, checkpoint in zip(stops, checkpoints):
        resumed = json.loads((tmp_path / "b" / checkpoint.name / "result.json").read_text())
        assert resumed["steps"] == 2 * steps
        after = batches_by_epoch(tmp_path / "b" / checkpoint.name, 2)
        assert sorted(after) == [0, 1]  # the rest of epoch 0, then epoch 1 as the first run
        assert after[0] == [batches[stop:] for batches in epochs[0]], stop
        assert after[1] == epochs[1], stop


# ---- a cache as a datasets.Dataset --------------------------------------------------------------

def assert_same_rows(hf, cache: Path) -> None:
    data = rows(cache, ["ids", "label", "key", "length"])
    assert len(hf) == len(data["key"])
    assert hf["key"] == list(data["key"]) and hf["label"] == list(data["label"])
    assert hf["ids"] == [ids.tolist() for ids in data["ids"]]
    assert hf["length"] == data["length"].tolist()


@pytest.mark.parametrize("format", ["parquet", "hdf5"])
def test_a_cache_becomes_a_datasets_dataset_with_the_same_rows(corpus, tmp_path, format):
    cache = corpus / "cache"
    if format == "hdf5":
        cache = tmp_path / "cache"
        build_cache(corpus / "docs.jsonl", cache, pipeline="text", format="hdf5", workers=1)
    hf = to_hf_dataset(cache, columns=["ids", "label", "key", "length"],
                       cache_dir=str(tmp_path / "hf"))
    assert str(hf.features["ids"].feature.dtype) == "uint16"  # the cached type, a list column
    assert_same_rows(hf, cache)
    assert sorted(set(hf["label"])) == ["cars", "cats"]


def test_a_changed_cache_gives_a_new_datasets_dataset_without_its_deleted_rows(tmp_path):
    docs = documents(20)
    source = write_jsonl(tmp_path / "docs.jsonl", docs)
    build_cache(source, tmp_path / "cache", pipeline="text", workers=1)
    first = to_hf_dataset(tmp_path / "cache", cache_dir=str(tmp_path / "hf"))
    docs[3] = {"text": "engine engine engine", "label": "cars"}
    write_jsonl(source, docs)  # one record changed: its old row is marked deleted in its shard
    summary = build_cache(source, tmp_path / "cache", pipeline="text", workers=1)
    assert summary.computed == 1
    assert any(shard.deleted for shard in Cache(tmp_path / "cache").manifest.shards)
    second = to_hf_dataset(tmp_path / "cache", cache_dir=str(tmp_path / "hf"))
    assert len(second) == len(first) == 20 and second["ids"] != first["ids"]
    assert_same_rows(second, tmp_path / "cache")


# ---- a datasets.Dataset as a stage-1 input ------------------------------------------------------

def test_a_saved_datasets_dataset_tokenizes_like_the_same_json_lines(corpus, tmp_path):
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["cars", "cats"])})
    docs = documents()
    saved = datasets.Dataset.from_list(docs, features=features)
    saved.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    summary = build_cache(tmp_path / "saved", tmp_path / "cache", pipeline="text", workers=1)
    assert summary.computed == DOCS and summary.failed == 0
    got = rows(tmp_path / "cache", ["ids", "label", "key"])
    want = rows(corpus / "cache", ["ids", "label"])
    assert got["key"][0] == "data-00000-of-00002.arrow:0"
    assert [ids.tolist() for ids in got["ids"]] == [ids.tolist() for ids in want["ids"]]
    assert list(got["label"]) == list(want["label"])  # class names, not indices

    # the same files behind a loaded Dataset: the same inputs, so nothing is recomputed
    summary = build_cache(datasets.load_from_disk(str(tmp_path / "saved")), tmp_path / "cache",
                          pipeline="text", workers=1)
    assert summary.computed == 0 and summary.reused == DOCS


def test_a_datasets_dataset_without_its_rows_in_files_is_refused(tmp_path):
    in_memory = datasets.Dataset.from_list(documents(4))
    with pytest.raises(InputError, match="in memory.*save_to_disk"):
        build_cache(in_memory, tmp_path / "cache", pipeline="text", workers=1)
    in_memory.save_to_disk(str(tmp_path / "saved"))
    shuffled = datasets.load_from_disk(str(tmp_path / "saved")).shuffle(seed=0)
    with pytest.raises(InputError, match="indices mapping.*flatten_indices"):
        build_cache(shuffled, tmp_path / "cache", pipeline="text", workers=1)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    shutil.rmtree(tmp_path / "saved")


def test_a_target_column_becomes_a_class_label_of_sorted_names(corpus, tmp_path):
    cache = corpus / "cache"
    data = rows(cache, ["label", "length"])
    hf = to_hf_dataset(cache, columns=["key"], target="label", cache_dir=str(tmp_path / "hf"))
    assert isinstance(hf.features["label"], datasets.ClassLabel)
    assert hf.features["label"].names == ["cars", "cats"]
    assert hf["label"] == [["cars", "cats"].index(label) for label in data["label"]]
    # an integer column: its sorted values, named as str, each row its value's index
    lengths = to_hf_dataset(cache, columns=["key"], target="length",
                            cache_dir=str(tmp_path / "hf"))
    values = sorted(set(data["length"].tolist()))
    assert lengths.features["length"].names == [str(v) for v in values]
    assert lengths["length"] == [values.index(v) for v in data["length"].tolist()]


def test_the_hf_collator_keeps_make_loaders_threads(corpus):
    from precache.loading import make_loader

    dataset = CachedDataset(corpus / "cache", columns=["ids", "label"])
    loader = make_loader(dataset, 8, num_workers=2,
                         collate_fn=HFTokenCollate(label_ids={"cars": 0, "cats": 1}))
    assert loader.worker_kind == "threads" and "HFTokenCollate" in loader.describe()
    loader.set_epoch(0)
    assert sum(len(batch["labels"]) for batch in loader) == DOCS
    loader.close()
