"""pipelines/faces/train_classifier.py on a video-faces cache of the sample videos: it learns
(video-level ROC AUC >= 0.9 on held-out videos), and under torchrun every video is trained on
once per epoch, also when a stopped run resumes on another number of ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from precache.training.checkpoint import load_checkpoint
from tests.conftest import load_script, precache_cli, run_torchrun
from tests.pipelines.resume_checks import assert_each_sample_once_per_epoch, keys_per_epoch

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "pipelines" / "faces" / "train_classifier.py"


@pytest.fixture(scope="module")
def video_cache(tmp_path_factory) -> Path:
    """32 sample videos (16 real, 16 fakes of them), DFDC-style labels with ``original``."""
    root = tmp_path_factory.mktemp("classifier")
    load_script(REPO / "data" / "make_videos.py", "make_videos").write_videos(
        root / "videos", per_label=16, seconds=1.5)
    done = precache_cli("run", "video-faces", "-i", str(root / "videos"), "-o", str(root / "cache"),
                        "--set", "size=64", "--set", "frames=16",
                        "--set", f"labels={root / 'videos_metadata.json'}", "-q", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return root / "cache"


@pytest.mark.slow
def test_the_classifier_learns_fakes_scored_per_video(video_cache, tmp_path) -> None:
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, str(TRAIN), "--cache", str(video_cache), "--out",
                           str(out), "--epochs", "8", "--workers", "0"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "32 videos (0 without faces): 24 train, 8 validation" in done.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(8))
    assert records[-1]["val_videos"] == 8
    assert records[-1]["val_auc_mean"] >= 0.9 and records[-1]["val_auc_confident"] >= 0.9
    assert records[-1]["val_logloss_mean"] < records[0]["val_logloss_mean"]
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert all(0 <= r["data_wait"] <= 1 and r["frames_per_s"] > 0 for r in records)
    assert load_checkpoint(out / "last.pt")["classes"] == ["FAKE", "REAL"]


def test_video_scores_metrics_and_the_split_keep_pairs_together() -> None:
    train = load_script(TRAIN, "train_classifier")
    assert train.roc_auc([1, 1, 0, 0], [0.9, 0.8, 0.3, 0.1]) == 1.0
    assert train.roc_auc([1, 0, 1, 0], [0.9, 0.8, 0.3, 0.1]) == 0.75
    assert train.roc_auc([1, 0], [0.5, 0.5]) == 0.5
    assert np.isnan(train.roc_auc([1, 1], [0.2, 0.4]))
    assert train.log_loss([1, 0], [0.5, 0.5]) == pytest.approx(np.log(2))
    assert train.aggregate(np.array([]), "mean") == 0.5  # a video without faces
    # one very confident frame among unsure ones counts more in the confident variant
    scores = np.array([0.99, 0.55, 0.5, 0.45])
    assert train.aggregate(scores, "confident") > train.aggregate(scores, "mean")
    videos = [f"real/r{i}.mp4" for i in range(10)] + [f"fake/f{i}.mp4" for i in range(10)]
    labels = ["REAL"] * 10 + ["FAKE"] * 10
    groups = videos[:10] + videos[:10]  # each fake's group is its original
    held = train.split_videos(videos, labels, groups, 0.25)
    assert {v.split("/")[0] for v in held} == {"real", "fake"}
    for i in range(10):  # a fake and its original on the same side, always
        assert (f"real/r{i}.mp4" in held) == (f"fake/f{i}.mp4" in held)
    assert 4 <= len(held) <= 6
    assert held == train.split_videos(videos, labels, groups, 0.25)  # the same on every rank


@pytest.mark.slow
def test_ddp_each_video_once_per_epoch_and_resume_on_fewer_ranks(video_cache, tmp_path) -> None:
    out, keys = tmp_path / "run", tmp_path / "keys"
    common = ["--cache", str(video_cache), "--out", str(out), "--batch-size", "2",
              "--frames-per-video", "2", "--workers", "0", "--log-keys", str(keys),
              "--precision", "fp32"]
    first = run_torchrun(TRAIN, 2, *common, "--epochs", "1", "--max-steps", "2")
    state = load_checkpoint(out / "last.pt")
    assert first[-1]["world_size"] == 2 and state["step"] == 2 and state["epoch"] == 0
    assert state["loader"]["offset"] == 2 * 2 * 2 < state["loader"]["size"] == 24  # mid-epoch
    resumed = run_torchrun(TRAIN, 1, *common, "--epochs", "2", "--resume", str(out / "last.pt"))
    assert [(r["epoch"], r["world_size"]) for r in resumed] == [(0, 1), (1, 1)]
    assert all(r["val_videos"] == 8 for r in first + resumed)  # scored once, across ranks
    train_videos = sorted({k for ks in keys_per_epoch(keys, 2).values() for k in ks})
    assert len(train_videos) == 24
    assert_each_sample_once_per_epoch(keys_per_epoch(keys, 2), train_videos, pads=[0, 0])


@pytest.mark.slow
def test_clip_mode_trains_on_clips_with_one_augmentation_draw_each(video_cache, tmp_path) -> None:
    out = tmp_path / "clips"
    done = subprocess.run([sys.executable, str(TRAIN), "--cache", str(video_cache), "--out",
                           str(out), "--mode", "clips", "--clip-frames", "4", "--epochs", "1",
                           "--batch-size", "4", "--workers", "0"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["videos_per_s"] > 0 and record["frames_per_s"] == pytest.approx(
        4 * record["videos_per_s"])
    assert record["samples_seen"] == 24 and record["val_videos"] == 8


def test_videos_without_faces_are_listed_with_their_folder_label(tmp_path) -> None:
    import av

    folder = tmp_path / "videos"
    load_script(REPO / "data" / "make_videos.py", "make_videos").write_videos(folder, per_label=1,
                                                                       seconds=0.5)
    (folder / "empty").mkdir()
    container = av.open(str(folder / "empty" / "wall.mp4"), "w")
    stream = container.add_stream("libx264", rate=10)
    stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
    for _ in range(5):  # a grey wall: no face
        frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 128, np.uint8), format="rgb24")
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)
    container.close()
    done = precache_cli("run", "video-faces", "-i", str(folder), "-o", str(tmp_path / "cache"),
                        "--set", "size=32", "--set", "frames=4", "-q", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    from precache.cache import Cache

    train = load_script(TRAIN, "train_classifier")
    generation = Cache(tmp_path / "cache").generation
    assert train.no_face_videos(str(tmp_path / "cache"), generation) == [("empty/wall.mp4", "empty")]
