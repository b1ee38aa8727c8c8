"""ClipDataset and VideoFrameDataset over a real video-faces-shaped cache (clip_pipeline.py):
clips of one track in frame order, padding, track and start choices, k frames per video, and
make_loader with workers, mid-epoch resume and real DDP ranks at the video level.

The DDP ranks run this module as a script (``rank_main``), like test_ddp.py.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import precache
from tests.helpers import build_cache, launch_ranks
from tests.precache.loading.clip_pipeline import FPS, pixel_code, video_number

PIPELINE = str(Path(__file__).with_name("clip_pipeline.py"))
VIDEOS = {  # video key -> (label, {track: cached frames})
    "fake/v01.json": ("fake", {0: 20, 1: 7}),
    "fake/v02.json": ("fake", {0: 3}),
    "fake/v03.json": ("fake", {0: 5, 1: 12}),
    "real/v04.json": ("real", {0: 40}),
    "real/v05.json": ("real", {0: 9}),
    "real/v06.json": ("real", {0: 1, 1: 2}),
}
KEYS = sorted(VIDEOS)
LONGEST = {"fake/v01.json": 0, "fake/v02.json": 0, "fake/v03.json": 1, "real/v04.json": 0,
           "real/v05.json": 0, "real/v06.json": 1}


def build(root: Path, videos: dict, format: str = "parquet", codec: str = "raw") -> Path:
    for key, (label, tracks) in videos.items():
        path = root / "in" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"label": label,
                                    "tracks": {str(t): n for t, n in tracks.items()}}))
    build_cache(root / "in", root / "cache", pipeline=PIPELINE, workers=1, shard_rows=2,
                format=format, params={"codec": codec})
    return root / "cache"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    out = build(tmp_path_factory.mktemp("clips"), VIDEOS)
    assert len(precache.Cache(out).manifest.shards) == 3  # a video's rows are in one shard each
    return out


def check_item(item: dict, frames: int) -> None:
    """The frames are real rows of ``item["video"]``: image pixels, frame_index, time_s agree."""
    assert item["image"].shape == (frames, 8, 8, 3) and item["image"].dtype == np.uint8
    tracks = np.broadcast_to(item["track"], (frames,))
    for image, frame, track, time_s in zip(item["image"], item["frame_index"], tracks,
                                           item["time_s"]):
        assert (image == pixel_code(item["video"], int(track), int(frame))).all()
        assert time_s == pytest.approx(frame / FPS)
    assert item["landmarks5"].shape == (frames, 5, 2)
    assert item["label"] == VIDEOS[item["video"]][0]


def test_the_index_lists_videos_labels_and_classes(cache):
    from precache.loading.datasets.video_clips import ClipDataset

    ds = ClipDataset(cache, frames=2)
    assert len(ds) == 6 and ds.videos == KEYS
    assert ds.labels == [VIDEOS[k][0] for k in KEYS] and ds.classes == ["fake", "real"]
    assert [int(ds[i]["target"]) for i in range(6)] == [ds.classes.index(ds.labels[i])
                                                        for i in range(6)]
    flipped = ClipDataset(cache, frames=2, classes=["real", "fake", "other"])
    assert [int(flipped[i]["target"]) for i in range(6)] == [1, 1, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="not in classes"):
        ClipDataset(cache, classes=["fake"])
    index = ds.index  # rows of each (video, track) in frame order
    for group in range(len(index.group_track)):
        rows = index.group_rows(group)
        frames = ds.rows.read_batch(rows)["frame_index"]
        assert list(frames) == list(range(len(rows)))


def test_both_datasets_declare_cache_backed_through_their_rows_with_shard_ids_per_video(cache):
    """The members are the inner CachedDataset's (``rows``), except ``shard_ids``: one per
    video (the shard of its first row), so ``shard_window`` samples videos."""
    from precache.loading import CacheBacked, make_loader
    from precache.loading.datasets.video_clips import ClipDataset, VideoFrameDataset, collate_clips

    shards = {}  # video -> the shards of its rows
    frames = precache.CachedDataset(cache, columns=["video"])
    for video, shard in zip(frames.read_column("video"), frames.shard_ids):
        shards.setdefault(str(video), set()).add(int(shard))
    assert all(len(s) == 1 for s in shards.values())  # (the fixture's layout)
    for ds in (ClipDataset(cache, frames=2), VideoFrameDataset(cache, frames_per_video=2)):
        assert isinstance(ds, CacheBacked) and isinstance(ds.rows, precache.CachedDataset)
        assert ds.path == ds.rows.path == str(cache)
        assert ds.generation == ds.rows.generation == frames.generation
        assert ds.kept_generations() == frames.kept_generations()
        assert ds.shard_ids.tolist() == [min(shards[video]) for video in KEYS]
        assert ds.encoded_columns == [] and ds.decode_images is True  # raw frames
        loader = make_loader(ds, batch_size=2, num_workers=0, shard_window=1,
                             collate_fn=collate_clips)
        loader.set_epoch(0)
        assert sorted(v for batch in loader for v in batch["video"]) == KEYS
        ds.close()
    frames.close()


def test_a_clip_is_one_track_of_its_video_in_frame_order_spaced_by_stride(cache):
    from precache.loading.datasets.video_clips import ClipDataset

    ds = ClipDataset(cache, frames=4, stride=2)
    starts: dict[str, set[int]] = {k: set() for k in KEYS}
    for _ in range(8):
        for i, item in enumerate(ds.__getitems__(range(6))):
            assert item["video"] == KEYS[i] and item["track"] == LONGEST[KEYS[i]]
            check_item(item, 4)
            frames, valid = item["frame_index"], item["valid"]
            assert valid == min(4, (VIDEOS[KEYS[i]][1][item["track"]] - 1) // 2 + 1)
            assert (np.diff(frames[:valid]) == 2).all()
            assert (frames[valid:] == frames[valid - 1]).all()
            starts[item["video"]].add(int(frames[0]))
    assert len(starts["real/v04.json"]) > 1  # random starts: 34 possible
    assert starts["fake/v02.json"] == {0}  # too short: from its first frame


def test_first_and_center_starts_are_deterministic(cache):
    from precache.loading.datasets.video_clips import ClipDataset

    first = ClipDataset(cache, frames=3, stride=3, start="first")
    center = ClipDataset(cache, frames=3, stride=3, start="center")
    v04 = KEYS.index("real/v04.json")
    for _ in range(3):
        assert list(first[v04]["frame_index"]) == [0, 3, 6]
        assert list(center[v04]["frame_index"]) == [16, 19, 22]  # (40 - 7) // 2 = 16
    assert list(first[KEYS.index("fake/v03.json")]["frame_index"]) == [0, 3, 6]  # track 1


def test_a_short_track_repeats_its_last_frame_and_reports_valid(cache):
    from precache.loading.datasets.video_clips import ClipDataset

    ds = ClipDataset(cache, frames=5, start="first")
    item = ds[KEYS.index("real/v06.json")]  # longest track: 1, with 2 frames
    assert item["track"] == 1 and item["valid"] == 2
    assert list(item["frame_index"]) == [0, 1, 1, 1, 1]
    check_item(item, 5)
    item = ClipDataset(cache, frames=3, stride=2)[KEYS.index("fake/v02.json")]  # 3 frames
    assert item["valid"] == 2 and list(item["frame_index"]) == [0, 2, 2]


def test_random_tracks_visit_every_track(cache):
    from precache.loading.datasets.video_clips import ClipDataset

    ds = ClipDataset(cache, frames=2, track="random")
    seen = {ds[0]["track"] for _ in range(40)}
    assert seen == {0, 1}


def test_bad_arguments_and_a_cache_of_no_videos_are_refused(cache, tmp_path):
    from precache.loading.datasets.video_clips import ClipDataset, VideoFrameDataset

    for bad in (dict(frames=0), dict(stride=0), dict(start="middle"), dict(track="first")):
        with pytest.raises(ValueError):
            ClipDataset(cache, **bad)
    with pytest.raises(ValueError):
        VideoFrameDataset(cache, frames_per_video=0)
    with pytest.raises(KeyError, match="mesh"):
        ClipDataset(cache, columns=["image", "mesh"])
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.bin").write_bytes(b"\1")
    build_cache(tmp_path / "in", tmp_path / "plain",
                pipeline=str(Path(__file__).with_name("synthetic_pipeline.py")), workers=1)
    with pytest.raises(ValueError, match=r"plain.*video-faces cache"):
        ClipDataset(tmp_path / "plain")


def test_columns_and_transforms(cache):
    from precache.augment import FaceAugment
    from precache.loading.datasets.video_clips import ClipDataset

    ds = ClipDataset(cache, frames=3, columns=["image", "key"])
    item = ds[0]
    assert sorted(item) == ["frame_index", "image", "key", "label", "target", "time_s", "track",
                            "valid", "video"]
    assert len(item["key"]) == 3 and all(isinstance(k, str) for k in item["key"])

    class Shared:
        calls: list[int] = []

        def __call__(self, frame):
            raise AssertionError("same() should be used")

        def same(self, frames):
            self.calls.append(len(frames))
            return [dict(f, seen=np.int64(len(frames))) for f in frames]

    shared = Shared()
    item = ClipDataset(cache, frames=4, transform=shared)[3]
    assert shared.calls == [4] and list(item["seen"]) == [4] * 4
    per_frame = []
    item = ClipDataset(cache, frames=4, transform=lambda f: per_frame.append(1) or f)[3]
    assert len(per_frame) == 4
    check_item(item, 4)
    # FaceAugment: one warp for the whole clip (the input landmarks differ by a constant shift
    # per frame, so the outputs differ by a constant shift per frame too)
    aug = FaceAugment(flip_p=0.5, affine_p=1.0, color_p=0, blur_p=0, cutout_p=0, seed=1)
    for _ in range(3):
        item = ClipDataset(cache, frames=6, transform=aug)[3]
        moved = item["landmarks5"] - item["landmarks5"][:1]
        assert np.ptp(moved, axis=1).max() < 1e-4
        assert np.abs(moved).max() > 0.1  # the frames' shifts survive the warp


def test_video_frames_are_k_distinct_rows_of_the_video_new_every_call(cache):
    from precache.loading.datasets.video_clips import VideoFrameDataset

    ds = VideoFrameDataset(cache, frames_per_video=4)
    v01 = KEYS.index("fake/v01.json")
    picks = set()
    for _ in range(10):
        item = ds[v01]
        assert item["video"] == "fake/v01.json" and item["valid"] == 4
        assert item["track"].shape == (4,)
        check_item(item, 4)
        rows = list(zip(item["track"].tolist(), item["frame_index"].tolist()))
        assert len(set(rows)) == 4 and rows == sorted(rows)
        picks.add(tuple(rows))
    assert len(picks) > 5
    item = ds[KEYS.index("real/v06.json")]  # 3 rows for 4 frames: every row, one repeated
    assert item["valid"] == 3
    rows = set(zip(item["track"].tolist(), item["frame_index"].tolist()))
    assert rows == {(0, 0), (1, 0), (1, 1)}


def test_every_video_gives_k_frames_per_epoch_however_long(cache):
    from precache.loading import make_loader
    from precache.loading.datasets.video_clips import VideoFrameDataset, collate_clips

    loader = make_loader(VideoFrameDataset(cache, frames_per_video=3), batch_size=4,
                         num_workers=0, collate_fn=collate_clips)
    loader.set_epoch(0)
    count: Counter = Counter()
    for batch in loader:
        assert batch["image"].shape[1:] == (3, 8, 8, 3)
        for video, images in zip(batch["video"], batch["image"]):
            assert (images[..., 0] == video_number(video)).all()
            count[video] += len(images)
    assert count == {k: 3 for k in KEYS}  # 40 cached frames or 3: 3 each


def test_make_loader_with_two_workers_gives_every_video_once_per_epoch(cache):
    from precache.loading import make_loader
    from precache.loading.datasets.video_clips import ClipDataset, collate_clips

    for collate in (collate_clips, None):  # collate_clips, and make_loader's default
        loader = make_loader(ClipDataset(cache, frames=4), batch_size=4, num_workers=2, seed=3,
                             collate_fn=collate)
        for epoch in range(2):
            loader.set_epoch(epoch)
            videos = []
            for batch in loader:
                assert batch["image"].shape == (len(batch["video"]), 4, 8, 8, 3)
                assert batch["image"].dtype == torch.uint8 and batch["target"].dtype == torch.int64
                assert batch["frame_index"].shape == (len(batch["video"]), 4)
                videos += batch["video"]
            assert sorted(videos) == KEYS


def test_a_loader_resumes_mid_epoch_at_the_video_level(cache):
    from precache.loading import make_loader
    from precache.loading.datasets.video_clips import ClipDataset, collate_clips

    def loader():
        return make_loader(ClipDataset(cache, frames=2), batch_size=2, num_workers=2, seed=7,
                           collate_fn=collate_clips)

    first = loader()
    first.set_epoch(4)
    seen = []
    for batch in first:
        seen += batch["video"]
        if len(seen) == 4:
            state = first.state_dict()
            break
    assert state["offset"] == 4 and state["size"] == 6 and "generation" in state
    second = loader()
    second.load_state_dict(json.loads(json.dumps(state)))
    second.set_epoch(4)
    rest = [v for batch in second for v in batch["video"]]
    assert len(rest) == 2 and sorted(seen + rest) == KEYS
    whole = loader()  # the same epoch uninterrupted: the same order
    whole.set_epoch(4)
    assert [v for batch in whole for v in batch["video"]] == seen + rest


def test_hdf5_caches_read_the_same(tmp_path):
    from precache.loading.datasets.video_clips import ClipDataset

    ds = ClipDataset(build(tmp_path, VIDEOS, format="hdf5"), frames=4, start="first")
    for i, item in enumerate(ds.__getitems__(range(6))):
        assert item["video"] == KEYS[i]
        check_item(item, 4)


def test_jpeg_frames_travel_as_bytes_and_decode_as_clips(tmp_path):
    """decode_images=False (what the trainers ask for on a GPU): each clip's frames are its
    rows' JPEG bytes, and decode_images turns a batch of clips into (B, T, H, W, 3)."""
    from precache.loading import decode_images, make_loader
    from precache.loading.datasets.video_clips import ClipDataset, collate_clips

    dataset = ClipDataset(build(tmp_path, VIDEOS, codec="jpeg"), frames=4, start="first",
                          decode_images=False)
    assert not dataset.decode_images and dataset.encoded_columns == ["image"]
    loader = make_loader(dataset, batch_size=4, shuffle=False, num_workers=0,
                         collate_fn=collate_clips)
    loader.set_epoch(0)
    batches = list(loader)
    for batch in batches:
        frames = batch["image"]
        assert isinstance(frames, list) and all(len(clip) == 4 for clip in frames)
        assert all(isinstance(row, np.ndarray) and row.dtype == np.uint8 and row[0] == 0xFF
                   for clip in frames for row in clip)
        images = decode_images(frames, "cpu").numpy()
        assert images.shape == (len(frames), 4, 8, 8, 3)
        for video, clip, indices in zip(batch["video"], images, batch["frame_index"]):
            for image, frame in zip(clip, indices.tolist()):  # the longest track, by default
                code = np.array(pixel_code(video, LONGEST[video], frame))
                assert np.abs(image.astype(int) - code).max() <= 3  # JPEG q95 of a flat colour
    assert sorted(v for b in batches for v in b["video"]) == KEYS


def rank_main(cache: str, out: str) -> None:
    """One DDP rank: one epoch of make_loader(ClipDataset); writes the videos it saw."""
    import torch.distributed as dist

    from precache.loading import make_loader
    from precache.loading.datasets.video_clips import ClipDataset, collate_clips

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = make_loader(ClipDataset(cache, frames=3), batch_size=2, num_workers=2, seed=5,
                         collate_fn=collate_clips)
    loader.set_epoch(0)
    videos, shapes = [], []
    for batch in loader:
        videos += batch["video"]
        shapes.append(list(batch["image"].shape))
        for video, images in zip(batch["video"], batch["image"]):
            assert (images[..., 0] == video_number(video)).all()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"videos": videos, "shapes": shapes}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ddp_ranks_see_every_video_exactly_once(cache, tmp_path):
    ranks = launch_ranks("tests.precache.loading.test_clips", 2, tmp_path / "run",
                         [str(cache), str(tmp_path / "run")], 90.0)
    assert sorted(v for r in ranks for v in r["videos"]) == KEYS
    assert [len(r["videos"]) for r in ranks] == [3, 3]
    assert all(s[1:] == [3, 8, 8, 3] for r in ranks for s in r["shapes"])


if __name__ == "__main__":  # one rank, started by launch_ranks
    rank_main(sys.argv[1], sys.argv[2])
