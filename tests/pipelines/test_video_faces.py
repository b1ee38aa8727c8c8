"""The video-faces pipeline end to end, with the real command: generated labelled videos (moving,
zooming, crossing faces, a cut; H.264 MP4, MJPEG AVI, a variable frame rate) and broken ones."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from precache import CachedDataset
from precache.cache import Cache
from precache.processing.ops.face_track import iou
from tests.helpers import load_script, precache_cli

REPO = Path(__file__).resolve().parents[2]


def load_make_videos():
    return load_script(REPO / "data" / "make_videos.py", "make_videos")


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> tuple[Path, dict, Path]:
    """real/ and fake/ (4 each, 1.2 s) plus broken/; the truth; the DFDC-style metadata."""
    root = tmp_path_factory.mktemp("video")
    make_videos = load_make_videos()
    truth = make_videos.write_videos(root / "videos", per_label=4, seconds=1.2, fps=15)
    good_mp4 = next((root / "videos").rglob("*.mp4"))
    good_avi = next((root / "videos").rglob("*.avi"))
    broken = make_videos.write_broken_videos(root / "videos" / "broken", good_mp4, good_avi)
    assert len(broken) == 6
    return root / "videos", truth, root / "videos_metadata.json"


def run(*args: str) -> str:
    done = precache_cli("run", "video-faces", *args, "-q", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def rows_and_index(cache: Path) -> tuple[dict, dict]:
    dataset = CachedDataset(cache)
    rows = dataset.read_batch(np.arange(len(dataset)))
    dataset.close()
    return rows, Cache(cache).read_index().to_pydict()


@pytest.mark.slow
def test_tracked_crops_with_labels_and_broken_videos_as_error_rows(videos, tmp_path) -> None:
    folder, truth, _ = videos
    cache = tmp_path / "cache"
    out = run("-i", str(folder), "-o", str(cache), "--set", "size=64", "--set", "frames=8")
    rows, index = rows_and_index(cache)
    status = dict(zip(index["key"], index["status"]))
    message = dict(zip(index["key"], index["message"]))
    for key in truth:  # every good video has rows
        assert status[key] == "ok", (key, message[key])
    # one row per (video, track, sampled frame), keyed so
    for key, video, track, frame in zip(rows["key"], rows["video"], rows["track"],
                                        rows["frame_index"]):
        assert key == f"{video}#t{track}#f{frame}"
    assert set(rows["label"]) >= {"real", "fake"}
    assert all(label == video.split("/")[0] for label, video in zip(rows["label"], rows["video"]))
    # keep=largest: one track per video, at most 8 sampled frames, in frame order
    for video in truth:
        mine = [i for i, v in enumerate(rows["video"]) if v == video]
        assert len(set(rows["track"][mine])) == 1 and 1 <= len(mine) <= 8
        assert list(rows["frame_index"][mine]) == sorted(rows["frame_index"][mine])
        assert rows["frame_count"][mine[0]] == len(truth[video]["times"])
    # boxes are where the faces are, detected or interpolated
    overlaps = [max(iou(box[None], np.array(truth[v]["boxes"][f]))[0], default=0.0)
                for v, f, box in zip(rows["video"], rows["frame_index"], rows["box"])
                if v in truth]
    assert np.mean(np.array(overlaps) >= 0.5) >= 0.95
    assert rows["image"].shape[1:] == (64, 64, 3) and rows["mesh"].shape[1:] == (468, 2)
    assert not rows["detected"].all()  # detect_every=8: O-Net followed the faces between
    # the broken videos: error rows with the reason, or rows with a warning; none stops the run
    assert status["broken/empty.mp4"] == "failed" and "empty file" in message["broken/empty.mp4"]
    assert status["broken/not_a_video.mp4"] == "failed"
    assert "not a readable video" in message["broken/not_a_video.mp4"]
    assert status["broken/audio_only.mp4"] == "failed"
    assert "no video stream" in message["broken/audio_only.mp4"]
    assert status["broken/truncated.mp4"] == "failed" or any(
        "broken/truncated.mp4" == v for v in rows["video"])
    wrong = [w for v, w in zip(rows["video"], rows["warning"]) if v == "broken/wrong_count.avi"]
    assert wrong and all(re.search(r"header says \d+ frames, \d+ decoded", w) for w in wrong)
    # FFmpeg conceals damaged packets and only logs them: the log becomes the rows' warning
    corrupt = [w for v, w in zip(rows["video"], rows["warning"]) if v == "broken/corrupt_packets.mp4"]
    assert corrupt and all("FFmpeg reported" in w and "decoding error" in w for w in corrupt)
    good = [w for v, w in zip(rows["video"], rows["warning"]) if v in truth]
    assert good and not any(good)
    assert "failed" in out  # the summary names the failures


@pytest.mark.slow
def test_dfdc_metadata_labels_jpeg_crops_and_every_track(videos, tmp_path) -> None:
    folder, truth, metadata = videos
    good = tmp_path / "good"
    shutil.copytree(folder, good, ignore=shutil.ignore_patterns("broken"))
    entries = json.loads(metadata.read_text())
    unlisted = next(iter(entries))
    del entries[unlisted]
    partial = tmp_path / "metadata.json"
    partial.write_text(json.dumps(entries))
    cache = tmp_path / "cache"
    run("-i", str(good), "-o", str(cache), "--set", "size=64", "--set", "frames=6",
        "--set", f"labels={partial}", "--set", "image_codec=jpeg", "--set", "quality=95",
        "--set", "keep=all", "--set", "track_box=smooth")
    rows, index = rows_and_index(cache)
    status = dict(zip(index["key"], index["status"]))
    message = dict(zip(index["key"], index["message"]))
    missing = next(k for k in status if k.endswith(unlisted))
    assert status[missing] == "failed" and "no label for" in message[missing]
    for video, label, original in zip(rows["video"], rows["label"], rows["original"]):
        name = video.split("/")[-1]
        assert label == entries[name]["label"] and original == entries[name].get("original", "")
    assert {"REAL", "FAKE"} <= set(rows["label"])
    # JPEG crops come back decoded, with the shape of the raw crops
    assert rows["image"].dtype == np.uint8 and rows["image"].shape[1:] == (64, 64, 3)
    stored = pq.read_table(next((cache / "shards").rglob("*.parquet")), columns=["image"])
    assert pa.types.is_large_binary(stored.schema.field("image").type)
    encoded = stored.column("image").to_pylist()
    assert all(e[:2] == b"\xff\xd8" for e in encoded)  # JPEG files, a fraction of the raw size
    assert np.mean([len(e) for e in encoded]) < 64 * 64 * 3 / 3
    # keep=all: the crossing scenes have two tracks
    crossing = [v for v, t in truth.items() if t["kind"] == "crossing" and v in set(rows["video"])]
    assert crossing
    for video in crossing:
        assert len({t for v, t in zip(rows["video"], rows["track"]) if v == video}) == 2


@pytest.mark.slow
def test_a_video_over_its_time_limit_fails_alone_and_the_run_finishes(videos, tmp_path) -> None:
    folder, truth, _ = videos
    cache = tmp_path / "cache"
    out = run("-i", str(folder / "real"), "-o", str(cache), "--set", "size=64",
              "--set", "frames=4", "--set", "decode_timeout_s=1e-9")
    index = Cache(cache).read_index().to_pydict() if (cache / "manifest.json").exists() else None
    assert "0 ok" in out and "failed" in out
    if index is not None:
        assert set(index["status"]) == {"failed"}
        assert all("decode_timeout_s" in m for m in index["message"])
    # the same videos with the default limit: all ok (the limit is what failed them)
    run("-i", str(folder / "real"), "-o", str(tmp_path / "ok"), "--set", "size=64",
        "--set", "frames=4")
    _, index = rows_and_index(tmp_path / "ok")
    assert set(index["status"]) == {"ok"}
