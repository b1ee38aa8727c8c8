"""data/make_videos.py: labelled face videos (codecs, times, face boxes, fakes) and broken ones."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av")

SCRIPT = Path(__file__).resolve().parents[2] / "data" / "make_videos.py"
PER_LABEL, SECONDS, FPS, WIDTH, HEIGHT = 4, 1.0, 15, 320, 240


def load_script():
    """``data/make_videos.py`` as a module (``data/`` is not a package)."""
    spec = importlib.util.spec_from_file_location("precache_test_make_videos", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> tuple[Path, dict]:
    """A small set (4 real, 4 fake, 1 s each): the output folder and the returned truth."""
    out = tmp_path_factory.mktemp("videos") / "videos"
    truth = load_script().write_videos(out, per_label=PER_LABEL, seconds=SECONDS, fps=FPS,
                                       width=WIDTH, height=HEIGHT)
    return out, truth


def decode(path: Path) -> tuple[list[np.ndarray], list[float]]:
    """Every frame of ``path`` as RGB and its time in seconds."""
    with av.open(str(path)) as container:
        frames = list(container.decode(video=0))
    return [f.to_ndarray(format="rgb24") for f in frames], [float(f.time) for f in frames]


def test_folders_names_and_truth_file(videos) -> None:
    out, truth = videos
    real = sorted(p.name for p in (out / "real").iterdir())
    fake = sorted(p.name for p in (out / "fake").iterdir())
    assert real == ["real_000.mp4", "real_001.mp4", "real_002.mp4", "real_003.avi"]
    assert fake == [name.replace("real", "fake") for name in real]
    assert not set(real) & set(fake)  # a join on the bare file name works
    assert sorted(p.name for p in out.iterdir()) == ["fake", "real"]  # the json files lie beside
    assert json.loads((out.parent / "videos_truth.json").read_text()) == truth
    assert sorted(truth) == sorted([f"real/{n}" for n in real] + [f"fake/{n}" for n in fake])
    assert {truth[f"real/{n}"]["kind"] for n in real} == {"moving", "zoom", "crossing", "cut"}
    for name, entry in truth.items():
        assert entry["fps"] == FPS
        assert len(entry["times"]) == len(entry["boxes"]) > 0
        label = name.split("/")[0]
        twin = name.replace(label, "fake" if label == "real" else "real")
        assert truth[twin]["kind"] == entry["kind"] and truth[twin]["times"] == entry["times"]
        assert truth[twin]["boxes"] == entry["boxes"]  # a fake is its real scene, face swapped


def test_codecs(videos) -> None:
    out, truth = videos
    for name in truth:
        with av.open(str(out / name)) as container:
            stream = container.streams.video[0]
            assert (stream.width, stream.height) == (WIDTH, HEIGHT)
            if name.endswith(".avi"):
                assert stream.codec_context.name == "mjpeg"
                assert stream.codec_context.pix_fmt == "yuvj420p"
            else:
                assert stream.codec_context.name == "h264"
                assert stream.codec_context.pix_fmt == "yuv420p"


def test_decoded_frames_match_the_truth_times(videos) -> None:
    out, truth = videos
    for name, entry in truth.items():
        frames, times = decode(out / name)
        assert len(frames) == len(entry["times"]), name
        assert np.allclose(times, entry["times"], atol=1e-3), name
        gaps = set(np.round(np.diff(times), 3))
        if name.endswith("_001.mp4"):  # the variable frame rate: 50 and 90 ms at 15 fps
            assert gaps == {0.05, 0.09}, (name, gaps)
        else:
            assert gaps == {round(1 / FPS, 3)}, (name, gaps)


def test_face_boxes(videos) -> None:
    _, truth = videos
    for name, entry in truth.items():
        kind, boxes = entry["kind"], entry["boxes"]
        counts = [len(frame) for frame in boxes]
        assert counts == [2 if kind == "crossing" else 1] * len(boxes), name
        for frame in boxes:
            for x0, y0, x1, y1 in frame:
                assert 0 <= x0 < x1 <= WIDTH and 0 <= y0 < y1 <= HEIGHT, (name, frame)
                assert 45 <= x1 - x0 <= 115, (name, frame)  # MTCNN-sized faces at 320x240
        # slow motion: no edge moves more than 15 % of the face width between frames (but at a cut)
        moves = [np.max(np.abs(np.subtract(b, a))) / (a[2] - a[0])
                 for before, after in zip(boxes, boxes[1:]) for a, b in zip(before, after)]
        if kind == "cut":
            assert sorted(moves)[-1] > 0.3 and sorted(moves)[-2] < 0.15, name  # one hard cut
        else:
            assert max(moves) < 0.15, name
        if kind == "crossing":  # the two faces swap sides horizontally and never overlap
            first, last = boxes[0], boxes[-1]
            assert np.sign(first[0][0] - first[1][0]) == -np.sign(last[0][0] - last[1][0]), name
            for a, b in boxes:
                assert a[3] < b[1] or b[3] < a[1], name
        if kind == "zoom":
            widths = [frame[0][2] - frame[0][0] for frame in boxes]
            assert max(widths) > 1.3 * min(widths), name


def test_metadata_and_labels(videos) -> None:
    out, truth = videos
    metadata = json.loads((out.parent / "videos_metadata.json").read_text())
    on_disk = {p.name: p.parent.name for p in out.glob("*/*")}
    assert sorted(metadata) == sorted(on_disk)
    for name, entry in metadata.items():
        assert entry["split"] == "train"
        assert entry["label"] == on_disk[name].upper()
        if entry["label"] == "FAKE":
            assert metadata[entry["original"]]["label"] == "REAL"
            assert (out / "real" / entry["original"]).is_file()
            assert name.split("_")[1] == entry["original"].split("_")[1]
        else:
            assert "original" not in entry
    with (out.parent / "videos_labels.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["file", "label"]
    assert sorted(rows[1:]) == sorted([f"{label}/{name}", label] for name, label in on_disk.items())
    assert sorted(row[0] for row in rows[1:]) == sorted(truth)


def box_mask(boxes: list[list[float]]) -> np.ndarray:
    """True inside any of ``boxes``."""
    mask = np.zeros((HEIGHT, WIDTH), dtype=bool)
    for x0, y0, x1, y1 in boxes:
        mask[int(y0):int(np.ceil(y1)), int(x0):int(np.ceil(x1))] = True
    return mask


def test_fakes_differ_from_reals_inside_the_faces(videos) -> None:
    out, truth = videos
    for index in range(PER_LABEL):
        real = next(name for name in truth if name.startswith(f"real/real_{index:03d}"))
        fake = real.replace("real", "fake")
        real_frames, _ = decode(out / real)
        fake_frames, _ = decode(out / fake)
        insides, outsides = [], []
        for a, b, boxes in zip(real_frames, fake_frames, truth[real]["boxes"]):
            diff = np.abs(a.astype(np.float32) - b.astype(np.float32)).mean(axis=2)
            mask = box_mask(boxes)
            insides.append(diff[mask].mean())
            outsides.append(diff[~mask].mean())  # H.264 encodes the same pixels a bit differently
        assert min(insides) > 5 and max(outsides) < 3, (real, insides, outsides)
        assert np.mean(insides) > 4 * np.mean(outsides), (real, insides, outsides)


def test_the_same_frames_every_run_whatever_the_count(videos, tmp_path) -> None:
    out, truth = videos
    again = tmp_path / "again"
    run = subprocess.run([sys.executable, str(SCRIPT), "--output", str(again), "--per-label", "2",
                          "--seconds", str(SECONDS), "--fps", str(FPS)],
                         check=True, capture_output=True, text=True, timeout=120)
    assert "wrote 4 videos" in run.stdout
    second = json.loads((tmp_path / "again_truth.json").read_text())
    assert second == {name: truth[name] for name in second}
    assert sorted(second) == ["fake/fake_000.mp4", "fake/fake_001.mp4", "real/real_000.mp4",
                              "real/real_001.mp4"]
    # libx264 here does not always write the same bytes for the same frames: compare loosely
    for name in second:
        first_frames, _ = decode(out / name)
        second_frames, _ = decode(again / name)
        assert len(first_frames) == len(second_frames), name
        for a, b in zip(first_frames, second_frames):
            assert np.abs(a.astype(np.float32) - b.astype(np.float32)).mean() < 2, name


def test_rendered_frames_are_the_same_every_time() -> None:
    make_videos = load_script()
    faces, backgrounds = make_videos.samples.load_photos()

    def frames(index: int, fake: bool) -> list[np.ndarray]:
        rng = np.random.default_rng([make_videos.SEED, index])
        kind = make_videos.scene_kind(index)
        shots = make_videos.make_scene(kind, faces, backgrounds, rng, (WIDTH, HEIGHT), SECONDS, FPS)
        look = make_videos.fake_look(np.random.default_rng([make_videos.SEED, index, 1]))
        return [make_videos.render(shots, t, rng, look if fake else None)[0]
                for t in make_videos.frame_times(index, SECONDS, FPS)]

    for index in range(PER_LABEL):
        for fake in (False, True):
            first, second = frames(index, fake), frames(index, fake)
            assert all(np.array_equal(a, b) for a, b in zip(first, second)), (index, fake)


@pytest.fixture(scope="module")
def broken(videos, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    out, _ = videos
    folder = tmp_path_factory.mktemp("broken")
    written = load_script().write_broken_videos(folder, out / "real" / "real_000.mp4",
                                                out / "real" / "real_003.avi")
    return folder, written


def test_broken_videos_are_written_and_described(broken) -> None:
    folder, written = broken
    assert sorted(written) == sorted(["empty.mp4", "truncated.mp4", "not_a_video.mp4",
                                      "audio_only.mp4", "wrong_count.avi", "corrupt_packets.mp4"])
    assert sorted(p.name for p in folder.iterdir()) == sorted(written)
    for description in written.values():
        assert description and "\n" not in description
    assert (folder / "empty.mp4").stat().st_size == 0
    (folder / "not_a_video.mp4").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["empty.mp4", "truncated.mp4", "not_a_video.mp4"])
def test_unreadable_files_raise_av_errors(broken, name) -> None:
    folder, _ = broken
    with pytest.raises(av.error.InvalidDataError):
        with av.open(str(folder / name)) as container:
            for _ in container.decode(video=0):
                pass


def test_audio_only_has_no_video_stream(broken) -> None:
    folder, _ = broken
    with av.open(str(folder / "audio_only.mp4")) as container:
        assert not container.streams.video
        (audio,) = container.streams.audio
        assert audio.codec_context.name == "aac"
        seconds = sum(frame.samples for frame in container.decode(audio=0)) / audio.rate
    assert 0.9 < seconds < 1.2


def test_wrong_frame_count_in_the_avi_header(broken, videos) -> None:
    folder, truth = broken[0], videos[1]
    true_count = len(truth["real/real_003.avi"]["times"])
    with av.open(str(folder / "wrong_count.avi")) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "mjpeg"
        assert stream.frames == 10 * true_count
        assert sum(1 for _ in container.decode(stream)) == true_count


def test_corrupt_packets_open_and_decode_damaged(broken, videos) -> None:
    folder, out = broken[0], videos[0]
    good, _ = decode(out / "real" / "real_000.mp4")
    frames, errors = [], 0
    with av.open(str(folder / "corrupt_packets.mp4")) as container:
        stream = container.streams.video[0]
        for packet in container.demux(stream):
            try:
                frames.extend(f.to_ndarray(format="rgb24") for f in packet.decode())
            except av.error.FFmpegError:
                errors += 1
    damaged = sum(np.abs(a.astype(np.float32) - b.astype(np.float32)).mean() > 5
                  for a, b in zip(good, frames))
    assert frames and errors + damaged > 0
