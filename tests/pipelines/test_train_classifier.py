"""pipelines/faces/train_classifier.py end to end: it learns (video-level ROC AUC >= 0.9 on
held-out videos, in this process), and on 2 ranks it trains clips under each strategy with the
step timeline and --compile: a run stopped under fsdp resumes under zero, then with one more
epoch under ddp, every video once per epoch. The per-video metrics and the split are tested in
tests/precache/training/test_video_eval.py; the loop's guarantees in test_loop.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from precache.training.checkpoint import load_checkpoint
from tests.helpers import (REPO, assert_each_sample_once_per_epoch, keys_per_epoch, load_script,
                           precache_cli, run_torchrun)
from tests.helpers.caches import make_video_cache
from tests.helpers.training import read_metrics

TRAIN = REPO / "pipelines" / "faces" / "train_classifier.py"


@pytest.fixture(scope="module")
def labelled_videos(tmp_path_factory) -> Path:
    """32 sample videos (16 real, 16 fakes of them), DFDC-style labels with ``original``."""
    return make_video_cache(tmp_path_factory.mktemp("classifier"), per_label=16, seconds=1.5,
                            size=64, frames=16)


@pytest.mark.slow
@pytest.mark.parametrize("where", [["--workers", "0"],  # augmented on the device, after loading
                                   ["--workers", "2", "--worker-kind", "processes",
                                    "--augment-on", "loader"]])
def test_the_classifier_learns_fakes_scored_per_video(labelled_videos, tmp_path, capsys,
                                                      where) -> None:
    out = tmp_path / "run"
    load_script(TRAIN, "train_classifier").main([
        "--cache", str(labelled_videos), "--out", str(out), "--epochs", "8", *where])
    assert "32 videos (0 without faces): 24 train, 8 validation" in capsys.readouterr().out
    config = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["config"]
    assert config["transform_in_loader"] == ("loader" in where)
    records = read_metrics(out)
    assert [r["epoch"] for r in records] == list(range(8))
    assert records[-1]["val_videos"] == 8
    assert records[-1]["val_auc_mean"] >= 0.9 and records[-1]["val_auc_confident"] >= 0.9
    assert records[-1]["val_logloss_mean"] < records[0]["val_logloss_mean"]
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert all(r["frames_per_s"] == pytest.approx(8 * r["samples_per_s"]) for r in records)
    assert load_checkpoint(out / "last.pt")["classes"] == ["FAKE", "REAL"]


@pytest.mark.slow
def test_clips_train_under_fsdp_with_compile_then_resume_under_zero_and_ddp(video_cache,
                                                                           tmp_path) -> None:
    out, keys = tmp_path / "run", tmp_path / "keys"
    common = ["--cache", str(video_cache), "--out", str(out), "--mode", "clips",
              "--clip-frames", "2", "--batch-size", "2", "--workers", "0", "--precision", "fp32",
              "--log-keys", str(keys)]
    first = run_torchrun(TRAIN, 2, *common, "--strategy", "fsdp", "--compile",
                         "--timeline-every", "1", "--epochs", "1", "--max-steps", "1")
    assert load_checkpoint(out / "last.pt")["strategy"] == "fsdp"
    rest = run_torchrun(TRAIN, 2, *common, "--strategy", "zero", "--epochs", "1",
                        "--resume", str(out / "last.pt"))
    more = run_torchrun(TRAIN, 2, *common, "--strategy", "ddp", "--epochs", "2",
                        "--resume", str(out / "last.pt"))
    records = first + rest + more
    assert [(r["epoch"], r["step"], r["strategy"]) for r in records] == [
        (0, 1, "fsdp"), (0, 2, "zero"), (1, 4, "ddp")]  # 6 videos: 2 batches per rank
    assert all(r["val_videos"] == 2 and r["frames_per_s"] == pytest.approx(
        2 * r["samples_per_s"]) for r in records)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["kind"] == "run" and lines[0]["config"]["compile"] is True
    assert [r["kind"] for r in lines[1:3]] == ["step", "epoch"]  # --timeline-every 1: its batch
    assert first[0]["timeline"]["sampled"] == 1
    videos = sorted({video for epoch in keys_per_epoch(keys, 2).values() for video in epoch})
    assert len(videos) == 6
    assert_each_sample_once_per_epoch(keys_per_epoch(keys, 2), videos, pads=[0, 0])


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
