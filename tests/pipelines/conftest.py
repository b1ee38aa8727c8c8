"""Caches the pipeline tests share, built once per session: stage 1 (face detection, video
decoding, tokenizing) costs more than most tests that read them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.helpers import build_cache, make_face_cache
from tests.helpers.caches import make_video_cache

WORDS = {"cats": "cat meow purr whiskers kitten fur paw tail".split(),
         "cars": "engine wheel road fuel brake gear tire motor".split()}


@pytest.fixture(scope="session")
def face_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A faces cache of 18 sample pictures (15 faces found, 13 to train on: odd, so an epoch on
    2 ranks repeats one), 32 px crops."""
    return make_face_cache(tmp_path_factory.mktemp("faces"), count=18, size=32)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 documents of two labels (cats, cars), each from its own word list."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for n in range(60):
        label = ["cats", "cars"][n % 2]
        (root / label).mkdir(parents=True, exist_ok=True)
        words = [rng.choice(WORDS[label]) for _ in range(rng.randint(3, 30))]
        (root / label / f"{n}.txt").write_text(" ".join(words) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def text_cache(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``corpus`` through the text pipeline (the default tokenizer, MiniLM's): 54 documents to
    train on, 6 held out."""
    out = tmp_path_factory.mktemp("text") / "cache"
    build_cache(corpus, out, pipeline="text", workers=1)
    return out


@pytest.fixture(scope="session")
def video_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A video-faces cache of 8 short sample videos (4 real, 4 fakes of them, DFDC-style
    labels with ``original``), 32 px crops of 4 frames."""
    return make_video_cache(tmp_path_factory.mktemp("videos"), per_label=4, seconds=1.0, size=32,
                            frames=4)
