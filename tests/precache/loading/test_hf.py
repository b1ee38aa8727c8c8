"""Hugging Face interop (precache.loading.hf): transformers' Trainer trains from a text cache
through PrecacheTrainer on 1 process and on 2 torchrun processes, every sample exactly once per
epoch across ranks; the real MiniLM trains through it; a cache becomes a datasets.Dataset."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import precache

pytest.importorskip("transformers")
pytest.importorskip("datasets")
from precache.loading import CachedDataset  # noqa: E402
from precache.loading.hf import HFTokenCollate, to_hf_dataset  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
WORDS = {"cats": "cat meow purr whiskers kitten fur paw tail".split(),
         "cars": "engine wheel road fuel brake gear tire motor".split()}


@pytest.fixture(scope="module")
def text_cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    rng = random.Random(0)
    for n in range(64):  # 64 = 8 rounds of 2 ranks x 4: no sample repeated to even the ranks
        label = ["cats", "cars"][n % 2]
        (root / "in" / label).mkdir(parents=True, exist_ok=True)
        words = [rng.choice(WORDS[label]) for _ in range(rng.randint(3, 30))]
        (root / "in" / label / f"{n}.txt").write_text(" ".join(words) + "\n", encoding="utf-8")
    precache.run("text", root / "in", root / "cache", workers=1, progress=False,
                 log=lambda *a, **k: None)
    return root / "cache"


def all_keys(cache: Path) -> list[str]:
    data = CachedDataset(cache, columns=["key"])
    return sorted(data.read_batch(range(len(data)))["key"])


def keys_by_epoch(out: Path, ranks: int) -> dict[int, list[list[str]]]:
    """epoch -> per rank, the keys it trained on."""
    found: dict[int, list[list[str]]] = {}
    for rank in range(ranks):
        for line in (out / f"keys-rank{rank}.tsv").read_text().splitlines():
            epoch, key = line.split("\t")
            found.setdefault(int(epoch), [[] for _ in range(ranks)])[rank].append(key)
    return found


def run_job(out: Path, cache: Path, ranks: int, *args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = [str(REPO / "tests" / "precache" / "loading" / "hf_trainer_job.py"), "--cache",
           str(cache), "--out", str(out), *args]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={ranks}"] if ranks > 1 else [sys.executable])
    done = subprocess.run([*launcher, *job], capture_output=True, text=True, timeout=400,
                          env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_trainer_sees_every_sample_once_per_epoch(text_cache, ranks, tmp_path):
    result = run_job(tmp_path, text_cache, ranks)
    assert result["world_size"] == ranks
    assert result["steps"] == 2 * 64 // (4 * ranks)  # its batches, not accelerate's re-split
    assert all(math.isfinite(loss) for loss in result["losses"])
    epochs = keys_by_epoch(tmp_path, ranks)
    assert sorted(epochs) == [0, 1]
    for per_rank in epochs.values():
        assert len({len(keys) for keys in per_rank}) == 1  # the ranks in lock-step
        assert sorted(k for keys in per_rank for k in keys) == all_keys(text_cache)  # once each
    assert epochs[0] != epochs[1]  # reshuffled per epoch (set_epoch reached the sampler)


@pytest.mark.slow
def test_the_shipped_minilm_trains_through_the_trainer(text_cache, tmp_path):
    from precache.pipelines.text.finetune import default_model

    result = run_job(tmp_path, text_cache, 1, "--model", str(default_model()), "--max-steps", "3")
    assert result["steps"] == 3 and result["changed"]
    assert len(result["losses"]) == 3 and all(math.isfinite(x) for x in result["losses"])


def test_the_collator_gives_model_inputs_only_and_names_an_unknown_label():
    samples = [{"ids": [101, 7, 102], "label": "b", "key": "x"},
               {"ids": [101, 102], "label": "a", "key": "y"}]
    import numpy as np

    samples = [dict(s, ids=np.array(s["ids"], dtype=np.uint16)) for s in samples]
    batch = HFTokenCollate({"a": 0, "b": 1})(samples)
    assert sorted(batch) == ["attention_mask", "input_ids", "labels"]
    assert batch["input_ids"].shape == (2, 8) and batch["labels"].tolist() == [1, 0]
    assert batch["attention_mask"].sum(1).tolist() == [3, 2]
    with pytest.raises(KeyError, match="label 'b' is not in label_ids"):
        HFTokenCollate({"a": 0})(samples)


def test_a_cache_becomes_a_datasets_dataset_with_the_same_rows(text_cache, tmp_path):
    hf = to_hf_dataset(text_cache, columns=["ids", "label", "key"], cache_dir=str(tmp_path))
    data = CachedDataset(text_cache, columns=["ids", "label", "key"])
    assert len(hf) == len(data) == 64
    for i in (0, 17, 63):
        assert hf[i]["key"] == data[i]["key"] and hf[i]["label"] == data[i]["label"]
        assert hf[i]["ids"] == data[i]["ids"].tolist()
    assert Counter(hf["label"]) == {"cats": 32, "cars": 32}
