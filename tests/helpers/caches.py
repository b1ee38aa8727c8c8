"""Building caches in a test: ``build_cache`` is ``precache.run`` without its progress bar and log
lines, so that a test states only the settings it is about."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

from precache.processing import RunSummary
from tests.helpers.files import COUNTING_PIPELINE, REPO


def quiet(*args: object, **kwargs: object) -> None:
    """A ``log`` that drops every line."""


def build_cache(input: str | os.PathLike[str], output: str | os.PathLike[str], *,
                pipeline: object = COUNTING_PIPELINE, **options: object) -> RunSummary:
    """``precache.run(pipeline, input, output, **options)`` with no progress bar and no log lines
    (unless ``options`` give ``progress`` or ``log``); the pipeline is tests/counting_pipeline.py
    unless named (a registered name such as ``"images"``, a file, a ``Pipeline``)."""
    import precache

    options.setdefault("progress", False)
    options.setdefault("log", quiet)
    return precache.run(pipeline, input, output, **options)  # type: ignore[arg-type]


#: The counting pipeline with one worker and 8 rows a shard; a replaced generation's files go at
#: once (``retention_s=0``: no reader holds them; tests of keeping them say so). Any setting can
#: be given again.
build_counting = partial(build_cache, workers=1, shard_rows=8, retention_s=0)


def make_face_cache(root: Path, count: int, size: int, workers: int = 1) -> Path:
    """A faces cache (crops of ``size`` px) of ``count`` sample pictures from data/make_samples.py."""
    subprocess.run([sys.executable, str(REPO / "data" / "make_samples.py"), "--output",
                    str(root / "photos"), "--count", str(count)], check=True, capture_output=True)
    build_cache(root / "photos", root / "cache", pipeline="faces", params={"size": size},
                workers=workers)
    return root / "cache"


def make_video_cache(root: Path, per_label: int, seconds: float, size: int, frames: int) -> Path:
    """A video-faces cache of sample videos from data/make_videos.py (``per_label`` real ones
    and as many fakes of them, DFDC-style labels with ``original``): ``size`` px crops of
    ``frames`` frames a video, through the ``precache`` command."""
    from tests.helpers.files import load_script
    from tests.helpers.processes import precache_cli

    load_script(REPO / "data" / "make_videos.py", "make_videos").write_videos(
        root / "videos", per_label=per_label, seconds=seconds)
    done = precache_cli("run", "video-faces", "-i", str(root / "videos"), "-o", str(root / "cache"),
                        "--set", f"size={size}", "--set", f"frames={frames}",
                        "--set", f"labels={root / 'videos_metadata.json'}", "-q", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return root / "cache"


def make_volume_cache(root: Path, count: int, size: int) -> Path:
    """A volumes cache of ``count`` synthetic cubes of ``size`` voxels (data/make_volumes.py's
    MedMNIST-style ``.npz``: 70% train, 15% val, 15% test), stored at ``size``."""
    from tests.helpers.files import load_script

    make_volumes = load_script(REPO / "data" / "make_volumes.py", "make_volumes")
    make_volumes.make_npz(root / "set.npz", count=count, size=size)
    build_cache(root / "set.npz", root / "cache", pipeline="volumes", params={"shape": (size,)},
                workers=1)
    return root / "cache"
