"""Video decoding, face tracking, batched MTCNN, labels and encoded crops, op by op."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from skimage import data as skdata

from precache.cache.image_codec import decode_image, encode_image, encoded_columns
from precache.processing.ops.face_track import Detection, Track, iou, track_faces
from precache.processing.ops.labels import LabelMissing, Labels, read_label_file
from precache.processing.ops.video_decode import VideoError, VideoTimeout, read_frames

FRAME = (96, 128)  # height, width


def write_video(path: Path, count: int = 30, fps: int = 15, codec: str = "libx264",
                gaps_ms: tuple[int, ...] | None = None, rotation: int | None = None) -> None:
    """Frames whose top-left pixel block encodes the frame number (value 8 * i); ``gaps_ms``:
    variable frame rate, pts in milliseconds cycling through these gaps."""
    container = av.open(str(path), "w")
    stream = container.add_stream(codec, rate=fps)
    stream.height, stream.width = FRAME
    stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
    if gaps_ms:
        stream.codec_context.time_base = Fraction(1, 1000)
    if rotation is not None:
        stream.set_display_rotation(rotation)
    pts = 0
    for i in range(count):
        image = np.zeros((*FRAME, 3), np.uint8)
        image[:, : FRAME[1] // 4] = 255  # a white band on the left, to see rotations
        image[40:56, 60:76] = 8 * i
        frame = av.VideoFrame.from_ndarray(image, format="rgb24")
        if gaps_ms:
            frame.pts, frame.time_base = pts, Fraction(1, 1000)
            pts += gaps_ms[i % len(gaps_ms)]
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)
    container.close()


def frame_number(image: np.ndarray) -> int:
    return int(round(float(image[44:52, 64:72].mean()) / 8))


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("videos")
    paths = {"cfr": folder / "cfr.mp4", "mjpeg": folder / "mjpeg.avi", "vfr": folder / "vfr.mp4",
             "rotated": folder / "rotated.mp4"}
    write_video(paths["cfr"])
    write_video(paths["mjpeg"], codec="mjpeg")
    write_video(paths["vfr"], gaps_ms=(40, 40, 40, 200))
    write_video(paths["rotated"], count=3, rotation=90)
    return paths


def test_frames_are_sampled_evenly_in_time_and_are_the_frames_they_claim(videos) -> None:
    for name in ("cfr", "mjpeg"):
        sampled = read_frames(videos[name].read_bytes(), frames=6)
        assert sampled.frame_count == 30 and sampled.fps == pytest.approx(15)
        assert sampled.duration_s == pytest.approx(2.0)
        # slot middles of 6 slots over 2 s: 1/6, 1/2, 5/6, ... s -> frames 2-3, 7-8, 12-13, ...
        assert np.all(np.abs(sampled.times - (np.arange(6) + 0.5) / 3) <= 0.5 / 15 + 1e-6)
        assert [frame_number(im) for im in sampled.images] == sampled.indices.tolist()
        assert np.allclose(sampled.times, sampled.indices / 15)
        assert sampled.warnings == []


def test_variable_frame_rate_is_sampled_by_time_not_by_frame_number(videos) -> None:
    sampled = read_frames(videos["vfr"].read_bytes(), frames=8)
    decoded = read_frames(videos["vfr"].read_bytes(), every=1)
    assert len(set(np.round(np.diff(decoded.times), 3))) == 2  # 40 ms and 200 ms gaps
    targets = (np.arange(8) + 0.5) * sampled.duration_s / 8
    for target, t in zip(targets, sampled.times):  # the frame nearest each target time
        assert abs(t - target) <= np.min(np.abs(decoded.times - target)) + 0.2
    # evenly spaced frame numbers would differ: time is not proportional to frame number here
    assert [frame_number(im) for im in sampled.images] == sampled.indices.tolist()


def test_every_and_fps_sampling(videos) -> None:
    data = videos["cfr"].read_bytes()
    assert read_frames(data, every=7).indices.tolist() == [0, 7, 14, 21, 28]
    assert read_frames(data, fps=5).indices.tolist() == list(range(0, 30, 3))


def test_rotation_metadata_is_applied(videos) -> None:
    image = read_frames(videos["rotated"].read_bytes(), frames=1).images[0]
    assert image.shape == (FRAME[1], FRAME[0], 3)  # portrait now
    bright_rows = np.flatnonzero(image[:, :, 1].mean(axis=1) > 200)
    # 90 degrees counter-clockwise (FFmpeg's display rotation): the left band is now at the bottom
    assert bright_rows.min() == FRAME[1] - FRAME[1] // 4 and bright_rows.max() == FRAME[1] - 1


def test_unreadable_inputs_raise_video_error_with_the_reason(tmp_path: Path, videos) -> None:
    with pytest.raises(VideoError, match="empty file"):
        read_frames(b"")
    with pytest.raises(VideoError, match="not a readable video"):
        read_frames(b"these are notes, not a video\n" * 20)
    audio = tmp_path / "audio.mp4"
    container = av.open(str(audio), "w")
    stream = container.add_stream("aac", rate=16000)
    samples = (np.sin(np.arange(16000) / 5) * 3000).astype(np.int16)[None]
    for start in range(0, 16000, 1024):
        frame = av.AudioFrame.from_ndarray(samples[:, start:start + 1024].copy(), format="s16",
                                           layout="mono")
        frame.sample_rate = 16000
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)
    container.close()
    with pytest.raises(VideoError, match="no video stream.*audio"):
        read_frames(audio.read_bytes())
    with pytest.raises(VideoTimeout, match="decode_timeout_s"):
        read_frames(videos["cfr"].read_bytes(), timeout_s=1e-9)


def boxes_at(x: float, y: float, side: float = 40.0) -> np.ndarray:
    return np.array([x, y, x + side, y + side], np.float32)


def detection(frame: int, x: float, y: float, side: float = 40.0) -> Detection:
    box = boxes_at(x, y, side)
    return Detection(frame, box, 0.99, np.tile(box[:2], (5, 1)).astype(np.float32))


def test_a_track_fills_the_frames_between_its_boxes_by_interpolation() -> None:
    # a face moving right 4 px per sampled frame, with boxes on every 3rd frame only
    top = Track(0, {f: detection(f, 10 + 4 * f, 10) for f in (0, 3, 6, 9)})
    rows = top.frames()
    assert [r[0] for r in rows] == list(range(10))
    assert [r[4] for r in rows] == [f % 3 == 0 for f in range(10)]
    for f, box, _, points, _ in rows:  # interpolated boxes lie on the true path
        np.testing.assert_allclose(box, boxes_at(10 + 4 * f, 10), atol=1e-4)
        np.testing.assert_allclose(points[0], [10 + 4 * f, 10], atol=1e-4)
    smooth = [r[1] for r in top.frames("smooth")]
    np.testing.assert_allclose(smooth[5], boxes_at(10 + 4 * 5, 10), atol=1e-4)  # linear path
    union = top.frames("union")[0][1]
    np.testing.assert_allclose(union, [10, 10, 10 + 36 + 40, 50])
    assert iou(boxes_at(0, 0), boxes_at(20, 0))[0, 0] == pytest.approx(20 * 40 / (2 * 1600 - 800))


class Scene:
    """A fake O-Net for track_faces: faces at known places per frame; ``refine`` finds the face
    nearest a given box (score 0.99) if it overlaps it, else scores 0.1. Records its calls."""

    def __init__(self, faces: dict[int, list[tuple[float, float]]],
                 misses: set[int] = frozenset()) -> None:
        self.faces, self.calls, self.misses = faces, [], set(misses)
        self.detected: list[int] = []  # frames detect_one ran on

    def detect(self, frames: list[int]) -> dict[int, list[Detection]]:
        return {f: [detection(f, x, y) for x, y in self.faces.get(f, [])] for f in frames}

    def detect_one(self, frame: int) -> list[Detection]:
        self.detected.append(frame)
        return self.detect([frame])[frame]

    def refine(self, frame: int, boxes: np.ndarray) -> list[Detection]:
        self.calls.append(frame)
        out = []
        for box in boxes:
            here = [detection(frame, x, y) for x, y in self.faces.get(frame, [])]
            if frame in self.misses:  # O-Net misses the face here once (a blink, a hand)
                self.misses.discard(frame)
                here = []
            best = max(here, key=lambda d: iou(box, d.box)[0, 0], default=None)
            if best is not None and iou(box, best.box)[0, 0] > 0.2:
                out.append(Detection(frame, best.box, 0.99, best.landmarks, detected=False))
            else:
                out.append(Detection(frame, box, 0.1, np.zeros((5, 2), np.float32), False))
        return out


def test_faces_are_followed_between_detections_and_traced_back_to_where_they_appear() -> None:
    # face A moves right 8 px a frame over frames 0-11; face B enters at frame 6 (between the
    # full detections at 0, 4, 8, 11) far away; a cut at frame 10 ends A (it is gone)
    faces = {f: [(10 + 8 * f, 10)] for f in range(10)}
    for f in range(6, 12):
        faces.setdefault(f, []).append((200.0, 120.0))
    scene = Scene(faces)
    rounds = [0, 4, 8, 11]
    tracks = track_faces(12, scene.detect(rounds), scene.refine, scene.detect_one)
    assert len(tracks) == 2
    a, b = tracks
    assert sorted(a.detections) == list(range(10))  # followed by O-Net to its last frame
    assert sorted(b.detections) == list(range(6, 12))  # traced back from frame 8 to frame 6
    assert [d.detected for _, d in sorted(a.detections.items())] == [f in rounds for f in range(10)]
    for f, d in a.detections.items():  # measured boxes, not interpolated ones
        np.testing.assert_allclose(d.box, boxes_at(10 + 8 * f, 10))
    assert {5, 4} & set(scene.calls) == {5}  # frame 5 looked at (B traced back), 4 never refined
    assert scene.detected == [10]  # the cascade where O-Net lost A (gone after the cut)


def test_two_tracks_that_converge_on_one_face_become_one() -> None:
    faces = {f: [(50.0, 50.0)] for f in range(6)}
    scene = Scene(faces)
    found = {0: [detection(0, 50, 50), detection(0, 60, 55)]}  # a duplicate at frame 0
    tracks = track_faces(6, found, scene.refine, scene.detect_one)
    assert sum(len(t.detections) > 1 for t in tracks) == 1


def test_batched_mtcnn_finds_what_it_finds_one_image_at_a_time() -> None:
    from precache.processing.ops.face_detect import DetectFaces

    detector = DetectFaces(min_face=20)
    detector.setup()
    astronaut = skdata.astronaut()
    frames = [astronaut, np.ascontiguousarray(astronaut[:, ::-1]), np.zeros_like(astronaut)]
    batched = detector.detect_many(frames)
    for frame, (boxes, scores, points) in zip(frames, batched):
        alone = detector._detect(frame)
        assert len(boxes) == len(alone[0])
        np.testing.assert_allclose(boxes, alone[0], atol=1e-3)
        np.testing.assert_allclose(points, alone[2], atol=1e-3)
    assert len(batched[0][0]) >= 1 and len(batched[2][0]) == 0


def sample(key: str) -> dict:
    return {"key": key, "source_key": key}


def test_labels_from_folders_csv_and_dfdc_json(tmp_path: Path) -> None:
    folder = Labels(labels="folder")
    assert folder(sample("real/a.mp4"))["label"] == "real"
    assert folder(sample("a.mp4"))["label"] == ""  # top level: explicitly no label
    assert "label" not in Labels(labels="none")(sample("real/a.mp4"))
    csv_file = tmp_path / "meta.csv"
    csv_file.write_text("file,label\nreal/a.mp4,REAL\nb.mp4,FAKE\n")
    labels = Labels(labels=str(csv_file))
    assert labels(sample("real/a.mp4"))["label"] == "REAL"
    assert labels(sample("deep/folder/b.mp4")) ["label"] == "FAKE"  # by bare file name
    with pytest.raises(LabelMissing, match="no label for 'c.mp4'.*meta.csv"):
        labels(sample("c.mp4"))
    meta = tmp_path / "metadata.json"
    meta.write_text(json.dumps({"x.mp4": {"label": "FAKE", "original": "y.mp4", "split": "train"},
                                "y.mp4": {"label": "REAL", "split": "train"}}))
    dfdc = Labels(labels=str(meta))
    assert dfdc(sample("x.mp4"))["original"] == "y.mp4"
    assert dfdc(sample("y.mp4")) == dict(sample("y.mp4"), label="REAL", original="")
    assert [p.name for p in dfdc.weight_files()] == ["metadata.json"]  # its hash: the fingerprint
    (tmp_path / "bad.csv").write_text("video,kind\nx,y\n")
    with pytest.raises(ValueError, match="needs a header with a file column"):
        read_label_file(tmp_path / "bad.csv")
    with pytest.raises(ValueError, match="does not exist"):
        Labels(labels=str(tmp_path / "missing.csv"))


def test_jpeg_and_webp_crops_decode_close_to_the_pixels() -> None:
    crop = np.ascontiguousarray(skdata.astronaut()[60:188, 150:278])
    for codec in ("jpeg", "webp"):
        encoded = encode_image(crop, codec, 95)
        assert len(encoded) < crop.nbytes / 3
        back = decode_image(encoded)
        assert back.shape == crop.shape and back.dtype == np.uint8
        assert np.abs(back.astype(int) - crop).mean() < 4
    with pytest.raises(ValueError, match="not a JPEG or WebP"):
        decode_image(b"\x89PNG....")
    ops = [{"name": "encode_image", "params": {"codec": "jpeg", "quality": 95, "column": "image"}},
           {"name": "labels", "params": {"labels": "folder"}}]
    assert encoded_columns(ops) == {"image": "jpeg"}
    assert encoded_columns([{"name": "encode_image", "params": {"codec": "raw"}}]) == {}


def test_a_face_lost_between_detections_and_found_again_stays_one_track() -> None:
    # moving 20 px a frame (a 40 px box: no overlap between frames 1 and 5); O-Net misses it
    # once at frame 2, the full detection at 5 finds it far away and follows it back to frame 1
    scene = Scene({f: [(10 + 20 * f, 10)] for f in range(8)}, misses={2})
    tracks = track_faces(8, scene.detect([0, 5, 7]), scene.refine, scene.detect_one)
    assert len(tracks) == 1 and sorted(tracks[0].detections) == list(range(8))
    assert scene.detected == [2]  # the frame where O-Net missed it got the whole cascade


def test_frames_seconds_apart_keep_every_face_and_say_when_they_cannot_be_linked(tmp_path) -> None:
    from precache.processing.ops.video_faces import VideoFaces
    from tests.helpers import load_script

    root = Path(__file__).resolve().parents[4]
    make_videos = load_script(root / "data" / "make_videos.py", "make_videos")
    truth = make_videos.write_videos(tmp_path / "videos", per_label=1, seconds=8)
    key = "real/real_000.mp4"  # a face gliding and bouncing: 2 s apart, boxes never overlap
    assert truth[key]["kind"] == "moving"
    sample = {"data": (tmp_path / "videos" / key).read_bytes(), "key": key, "source_key": key}

    def rows(**params: object) -> list[dict]:
        op = VideoFaces(size=32, **params)
        op.setup()
        return op(sample)

    every = rows(frames=4, keep="all")  # O-Net loses the face: the cascade finds it each time
    assert len(every) == 4 and not any(r["warning"] for r in every)
    one = rows(frames=4, keep="largest")
    assert len(one) == 1 and "could not be followed across frames 2.00 s apart" in one[0]["warning"]
    dense = rows(frames=32, keep="largest")  # 0.25 s apart: one track over every frame
    assert len(dense) == 32 and not any(r["warning"] for r in dense)
