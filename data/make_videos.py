"""Make short labelled face videos (real and crudely face-swapped) from sample photos, no download.

    python data/make_videos.py             # writes data/videos/{real,fake}/ (16 videos, 2 s each),
                                           # data/videos_truth.json (frame times, face boxes),
                                           # data/videos_metadata.json and data/videos_labels.csv

It is the input of the video-faces pipeline's quick start and tests, so the videos must look like
a small DFDC-style data set to a video decoder and a face detector (MTCNN, ``min_face`` 20) and
be cheap to make (well under 30 s for the default set on two CPU cores). The faces are the ones
``data/make_samples.py`` uses (scikit-image's astronaut, matplotlib's Grace Hopper portrait, cut
around their measured ``FACE_BOXES`` with some hair and neck, feathered at the edge) pasted on its
background photos, 50-110 px wide at 320x240. Four kinds of scene, one after the other by index
(shifted by one every four videos, so the MJPEG and variable-frame-rate slots vary in kind):

* ``moving``: one face gliding across a background, bouncing off the frame's edges;
* ``zoom``: one face growing and shrinking (50-110 px wide) about a fixed point;
* ``crossing``: two faces, one above the other, moving in opposite directions so that they pass
  each other horizontally at mid-video (their boxes never overlap);
* ``cut``: a hard cut at mid-video to a different face at a different place on another background.

A face box moves at most ~12 % of its width from one frame to the next; every frame gets a slight
change of light and a little noise. ``fake/fake_K`` is the scene of ``real/real_K`` (same seed,
same frames) with each face manipulated like a crude face swap: inside an ellipse over the inner
face (eyes, nose, mouth: the central ~70 % of the face box) the pixels are replaced by a strongly
smoothed (Gaussian, sigma ~4.5 % of the face width) and colour-shifted copy, blended in through a
feathered mask. Outside the faces a fake's frames are the real ones.

Encoding is PyAV's (no system FFmpeg): H.264 (``libx264``, yuv420p, crf 20, GOP 15) in ``.mp4``,
except every fourth video (index % 4 == 3), which is MJPEG (yuvj420p) in ``.avi``; video 1 has a
variable frame rate (time base 1/1000 s, frame gaps alternating 0.75 and 1.35 of the nominal
gap: 50 and 90 ms at 15 fps). Written beside (not inside) the output folder:

* ``<output>_truth.json``: ``"real/real_000.mp4"`` -> ``{"kind": "moving", "fps": 15.0,
  "times": [pts in seconds of every frame], "boxes": [per frame: [[x0, y0, x1, y1], ...]]}``,
  the boxes in frame pixels, tight like a face detector's box;
* ``<output>_metadata.json`` in DFDC style: ``{"real_000.mp4": {"label": "REAL", "split":
  "train"}, "fake_000.mp4": {"label": "FAKE", "original": "real_000.mp4", "split": "train"}}``
  (file names are unique across both folders, so joining on the bare name works);
* ``<output>_labels.csv``: ``file,label`` rows such as ``real/real_000.mp4,real``.

Every video has its own seeded random generator: the frames are the same on every run (the H.264
bytes need not be) and the first N videos do not depend on ``--per-label``.

``write_broken_videos`` (used by the tests) writes damaged files next to good ones: empty,
truncated, not a video, audio only, wrong frame count in the AVI header, corrupt packets.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import struct
from fractions import Fraction
from pathlib import Path
from typing import Callable

import av
import cv2
import numpy as np
from PIL import Image


def _load_make_samples():
    """``data/make_samples.py`` as a module (``data/`` is not a package)."""
    path = Path(__file__).resolve().with_name("make_samples.py")
    spec = importlib.util.spec_from_file_location("precache_data_make_samples", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"make_videos: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


samples = _load_make_samples()

KINDS = ("moving", "zoom", "crossing", "cut")
FACES = ("astronaut", "grace_hopper")  # frontal faces only (the cameraman is a profile)
VFR_INDEX = 1  # this video (real and fake) has a variable frame rate
VFR_GAPS = (0.75, 1.35)  # its frame gaps, alternating, as shares of the nominal gap
MJPEG_EVERY = 4  # index % MJPEG_EVERY == MJPEG_EVERY - 1: MJPEG in AVI, else H.264 in MP4
SEED = 0

# A track: time in seconds -> (centre x, centre y, width) of the face box, in frame pixels.
Track = Callable[[float], tuple[float, float, float]]


# --- scene pieces -----------------------------------------------------------------------------

def oval(size: tuple[int, int]) -> Image.Image:
    """An L mask of ``size``: an ellipse touching the edges, opaque to 3/4 of its radius and
    fading to 0 at the rim. A face box 2/3 of the patch's size, centred, is covered up to its
    inscribed ellipse (the face) and a little beyond."""
    w, h = size
    x = (np.arange(w) + 0.5) / w * 2 - 1
    y = (np.arange(h) + 0.5) / h * 2 - 1
    r = np.sqrt(x[None, :] ** 2 + y[:, None] ** 2)
    return Image.fromarray((255 * np.clip((1 - r) / 0.25, 0, 1)).astype(np.uint8))


class Face:
    """A face photo cut around its box with some context, feathered, ready to paste at any size.

    ``patch`` is RGBA, already scaled so the face box is ``width`` px wide (the largest size it
    is pasted at); ``box`` is the face box in patch pixels.
    """

    def __init__(self, photo: Image.Image, box: tuple[float, float, float, float], width: float,
                 rng: np.random.Generator) -> None:
        bw = box[2] - box[0]
        # the patch: the face box grown by 50 % (some hair, ears and neck), cut to the photo
        cut, box = samples.cut_face(photo, box, 0.25, rng)
        crop = samples.relight(samples.resize(cut, width / bw), rng, strength=0.5)
        sx, sy = crop.width / cut.width, crop.height / cut.height
        self.box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
        crop.putalpha(oval(crop.size))
        self.patch = crop
        self.aspect = (self.box[3] - self.box[1]) / (self.box[2] - self.box[0])  # height / width

    def paste(self, canvas: Image.Image, cx: float, cy: float, width: float) -> list[float]:
        """Paste the face onto ``canvas`` with its box ``width`` px wide and centred near (cx, cy)
        (to the pixel); return the box where it landed."""
        patch, box = self.patch, self.box
        scale = width / (box[2] - box[0])
        size = (max(1, round(patch.width * scale)), max(1, round(patch.height * scale)))
        if size != patch.size:
            sx, sy = size[0] / patch.width, size[1] / patch.height
            patch = patch.resize(size, Image.BILINEAR)
            box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
        x = round(cx - (box[0] + box[2]) / 2)
        y = round(cy - (box[1] + box[3]) / 2)
        canvas.paste(patch, (x, y), patch)
        return [box[0] + x, box[1] + y, box[2] + x, box[3] + y]


class Shot:
    """A background and the faces on it, each with its track; shown from ``start`` seconds on."""

    def __init__(self, start: float, background: Image.Image,
                 faces: list[tuple[Face, Track]]) -> None:
        self.start, self.background, self.faces = start, background, faces


def bounce(x: float, lo: float, hi: float) -> float:
    """``x`` folded into [lo, hi] as if it bounced off both ends (a triangle wave)."""
    if hi <= lo:
        return lo
    period = 2 * (hi - lo)
    x = (x - lo) % period
    return lo + (x if x <= hi - lo else period - x)


def pick_background(backgrounds: dict[str, Image.Image], rng: np.random.Generator,
                    size: tuple[int, int], avoid: str = "") -> tuple[str, Image.Image]:
    """A random cut of a random background photo (not ``avoid``), re-lit."""
    names = [name for name in sorted(backgrounds) if name != avoid]
    name = names[int(rng.integers(len(names)))]
    image = samples.background({name: backgrounds[name]}, rng, size)
    return name, samples.relight(image, rng, strength=0.6)


def gliding(rng: np.random.Generator, size: tuple[int, int], width: float, aspect: float,
            fps: float, speed: tuple[float, float], x_range: tuple[float, float] = (0.0, 1.0)
            ) -> Track:
    """A face ``width`` px wide moving in a straight line (mostly sideways) at ``speed`` (face
    widths per nominal frame), bouncing off the frame's edges; it starts with its centre in
    ``x_range`` (shares of the frame width)."""
    w, h = size
    margin = 2.0
    lo_x, hi_x = width / 2 + margin, w - width / 2 - margin
    lo_y, hi_y = width * aspect / 2 + margin, h - width * aspect / 2 - margin
    x0 = rng.uniform(max(lo_x, x_range[0] * w), max(lo_x, min(hi_x, x_range[1] * w)))
    y0 = rng.uniform(lo_y, max(lo_y, hi_y))
    angle = rng.uniform(-0.5, 0.5) + (np.pi if rng.random() < 0.5 else 0.0)
    v = width * rng.uniform(*speed) * fps  # px per second
    vx, vy = v * np.cos(angle), v * np.sin(angle)
    return lambda t: (bounce(x0 + vx * t, lo_x, hi_x), bounce(y0 + vy * t, lo_y, hi_y), width)


# --- the four kinds of scene --------------------------------------------------------------------

def make_scene(kind: str, faces: dict[str, Image.Image], backgrounds: dict[str, Image.Image],
               rng: np.random.Generator, size: tuple[int, int], seconds: float,
               fps: float) -> list[Shot]:
    """The shots of one scene of ``kind``."""
    w, h = size
    k = min(w / 320, h / 240)  # face sizes are given for 320x240
    order = [FACES[i] for i in rng.permutation(len(FACES))]

    def face(name: str, width: float) -> Face:
        return Face(faces[name], samples.FACE_BOXES[name], width, rng)

    if kind == "moving":
        one = face(order[0], rng.uniform(55, 100) * k)
        width = one.box[2] - one.box[0]
        track = gliding(rng, size, width, one.aspect, fps, (0.04, 0.08))
        return [Shot(0.0, pick_background(backgrounds, rng, size)[1], [(one, track)])]

    if kind == "zoom":
        low, high = 50 * k, 110 * k
        one = face(order[0], high)
        mid, amp = (np.log(low) + np.log(high)) / 2, (np.log(high) - np.log(low)) / 2
        amp *= rng.uniform(0.8, 1.0)
        period, phase = rng.uniform(2.0, 3.0), rng.uniform(0, 2 * np.pi)
        margin = 2.0
        half_w, half_h = high / 2 + margin, high * one.aspect / 2 + margin
        cx = rng.uniform(half_w, max(half_w, w - half_w))
        cy = rng.uniform(half_h, max(half_h, h - half_h))

        def zoom(t: float) -> tuple[float, float, float]:
            return cx, cy, float(np.exp(mid + amp * np.sin(2 * np.pi * t / period + phase)))

        return [Shot(0.0, pick_background(backgrounds, rng, size)[1], [(one, zoom)])]

    if kind == "crossing":
        tracks = []
        flip = -1.0 if rng.random() < 0.5 else 1.0
        for row, name in zip((0.27, 0.73), order):
            # small enough that the two rows' boxes stay apart (height at most 26 % of the frame)
            aspect = (samples.FACE_BOXES[name][3] - samples.FACE_BOXES[name][1]) / (
                samples.FACE_BOXES[name][2] - samples.FACE_BOXES[name][0])
            width = min(rng.uniform(50, 62) * k, 0.26 * h / aspect)
            one = face(name, width)
            width = one.box[2] - one.box[0]
            direction = flip if row < 0.5 else -flip  # opposite directions
            v = direction * width * rng.uniform(0.06, 0.08) * fps  # px per second
            lo, hi = width / 2 + 2, w - width / 2 - 2
            bob = rng.uniform(0.5, 1.5)  # a slight up and down, px

            def cross(t: float, v=v, lo=lo, hi=hi, row=row, bob=bob, width=width
                      ) -> tuple[float, float, float]:
                # both centres pass the middle of the frame at mid-video
                x = bounce(w / 2 + v * (t - seconds / 2), lo, hi)
                return x, row * h + bob * np.sin(2 * np.pi * t), width

            tracks.append((one, cross))
        return [Shot(0.0, pick_background(backgrounds, rng, size)[1], tracks)]

    if kind == "cut":
        shots = []
        avoid, left = "", rng.random() < 0.5
        for start, name in zip((0.0, seconds / 2), order):
            one = face(name, rng.uniform(55, 100) * k)
            width = one.box[2] - one.box[0]
            # the two shots' faces start in different halves of the frame
            half = (0.0, 0.5) if left else (0.5, 1.0)
            track = gliding(rng, size, width, one.aspect, fps, (0.02, 0.05), half)
            avoid, background = pick_background(backgrounds, rng, size, avoid)
            shots.append(Shot(start, background, [(one, track)]))
            left = not left
        return shots

    raise ValueError(f"unknown scene kind {kind!r}")


# --- frames ----------------------------------------------------------------------------------

def fake_look(rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """The colour change of one fake video: a gain per channel (warm or cool) and an offset."""
    sign = 1.0 if rng.random() < 0.5 else -1.0
    gains = 1 + sign * np.array([0.14, 0.02, -0.12]) * rng.uniform(0.9, 1.2)
    return gains.astype(np.float32), float(rng.uniform(-8, 8))


def swap_face(frame: np.ndarray, box: list[float], gains: np.ndarray, offset: float) -> None:
    """In place: blend a smoothed, colour-shifted copy into the ellipse over the inner face."""
    x0, y0, x1, y1 = box
    bw, bh = x1 - x0, y1 - y0
    cx, cy = (x0 + x1) / 2, y0 + 0.52 * bh  # eyes to mouth: a little below the box's centre
    ax, ay = 0.35 * bw, 0.36 * bh
    sigma = max(1.5, 0.045 * bw)
    reach = 1.2  # the mask fades out between 0.85 and 1.15 of the ellipse's radius
    rx0, ry0 = max(0, int(cx - reach * ax - 3 * sigma)), max(0, int(cy - reach * ay - 3 * sigma))
    rx1 = min(frame.shape[1], int(np.ceil(cx + reach * ax + 3 * sigma)))
    ry1 = min(frame.shape[0], int(np.ceil(cy + reach * ay + 3 * sigma)))
    if rx1 <= rx0 or ry1 <= ry0:
        return
    region = frame[ry0:ry1, rx0:rx1]
    changed = cv2.GaussianBlur(region, (0, 0), sigma) * gains + offset
    yy, xx = np.mgrid[ry0:ry1, rx0:rx1].astype(np.float32) + 0.5
    r = np.sqrt(((xx - cx) / ax) ** 2 + ((yy - cy) / ay) ** 2)
    alpha = np.clip((1.15 - r) / 0.3, 0, 1)[..., None]
    region[...] = region * (1 - alpha) + changed * alpha


def frame_times(index: int, seconds: float, fps: float) -> list[float]:
    """The pts (seconds) of every frame: ``i / fps``, or for video ``VFR_INDEX`` gaps that
    alternate between two lengths (whole milliseconds)."""
    if index != VFR_INDEX:
        return [i / fps for i in range(max(1, round(seconds * fps)))]
    gaps = [max(1, round(1000 * g / fps)) for g in VFR_GAPS]
    times, ms = [], 0
    while ms < 1000 * seconds or not times:
        times.append(ms / 1000)
        ms += gaps[(len(times) - 1) % 2]
    return times


def render(shots: list[Shot], t: float, rng: np.random.Generator,
           fake: tuple[np.ndarray, float] | None) -> tuple[np.ndarray, list[list[float]]]:
    """The RGB frame at ``t`` seconds and its face boxes. The random draws (light, noise) are the
    same with and without ``fake``, so a fake frame equals the real one outside the faces."""
    shot = [s for s in shots if s.start <= t][-1]
    canvas = shot.background.copy()
    boxes = [one.paste(canvas, *track(t)) for one, track in shot.faces]
    frame = np.array(canvas, dtype=np.float32)
    if fake is not None:
        for box in boxes:
            swap_face(frame, box, *fake)
    gain = 1 + rng.normal(0, 0.015)  # flicker
    noise = rng.standard_normal(frame.shape[:2] + (1,), dtype=np.float32) * 1.5
    frame = frame * gain + noise
    return np.clip(frame + 0.5, 0, 255).astype(np.uint8), boxes


# --- encoding ----------------------------------------------------------------------------------

def open_stream(path: Path, size: tuple[int, int], fps: float, vfr: bool
                ) -> tuple[av.container.OutputContainer, av.video.stream.VideoStream]:
    """An output container and its video stream: MJPEG for ``.avi``, else H.264; ``vfr``: pts in
    milliseconds."""
    container = av.open(str(path), "w")
    rate = Fraction(fps).limit_denominator(1001)
    if path.suffix == ".avi":
        stream = container.add_stream("mjpeg", rate=rate)
        stream.pix_fmt = "yuvj420p"
        stream.codec_context.qscale = True  # a fixed quality (like ffmpeg's -q:v 4)
        stream.codec_context.global_quality = 4 * 118  # FF_QP2LAMBDA
    else:
        stream = container.add_stream("libx264", rate=rate, options={"crf": "20", "g": "15"})
        stream.pix_fmt = "yuv420p"
    stream.width, stream.height = size
    # frame.pts counts frames, or with vfr milliseconds
    stream.codec_context.time_base = Fraction(1, 1000) if vfr else 1 / rate
    if vfr:
        stream.time_base = Fraction(1, 1000)
    return container, stream


def write_video(path: Path, shots: list[Shot], times: list[float], fps: float,
                rng: np.random.Generator, fake: tuple[np.ndarray, float] | None,
                vfr: bool) -> list[list[list[float]]]:
    """Render and encode every frame; return the face boxes per frame."""
    size = shots[0].background.size
    container, stream = open_stream(path, size, fps, vfr)
    boxes = []
    try:
        for i, t in enumerate(times):
            rgb, frame_boxes = render(shots, t, rng, fake)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = round(t * 1000) if vfr else i
            frame.time_base = stream.codec_context.time_base
            for packet in stream.encode(frame):
                container.mux(packet)
            boxes.append(frame_boxes)
        for packet in stream.encode(None):
            container.mux(packet)
    finally:
        container.close()
    return boxes


def scene_kind(index: int) -> str:
    """The scene of video ``index``: the kinds in turn, shifted by one every len(KINDS) videos
    (so the MJPEG and variable-frame-rate slots get every kind in turn)."""
    return KINDS[(index + index // len(KINDS)) % len(KINDS)]


def video_name(label: str, index: int) -> str:
    """``real_000.mp4``, ``fake_003.avi``: unique across both folders."""
    suffix = ".avi" if index % MJPEG_EVERY == MJPEG_EVERY - 1 else ".mp4"
    return f"{label}_{index:03d}{suffix}"


def beside(out: Path, suffix: str) -> Path:
    """``<out><suffix>`` beside (not inside) ``out``."""
    return out.parent / (out.name + suffix)


def write_videos(output: Path, per_label: int = 8, seconds: float = 2.0, fps: float = 15,
                 width: int = 320, height: int = 240) -> dict:
    """Write ``per_label`` real and as many fake videos under ``output``, and beside it the truth,
    metadata and labels files; return the truth (relative path -> kind, fps, times, boxes)."""
    if width % 2 or height % 2:
        raise ValueError(f"width and height must be even (yuv420p), not {width}x{height}")
    output = Path(output)
    faces, backgrounds = samples.load_photos()
    missing = [name for name in FACES if name not in faces]
    if missing:
        raise SystemExit(f"make_videos: face photos missing: {missing} (scikit-image, matplotlib)")
    for label in ("real", "fake"):  # videos of an earlier run, so the folders match the truth
        folder = output / label
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob(f"{label}_*.*"):
            if old.suffix in (".mp4", ".avi") and old.stem[len(label) + 1:].isdigit():
                old.unlink()
    truth, metadata, labels = {}, {}, []
    size = (width, height)
    for index in range(per_label):
        kind = scene_kind(index)
        times = frame_times(index, seconds, fps)
        real, fake = video_name("real", index), video_name("fake", index)
        for label, name in (("real", real), ("fake", fake)):
            rng = np.random.default_rng([SEED, index])  # the same scene and draws for both
            shots = make_scene(kind, faces, backgrounds, rng, size, seconds, fps)
            look = fake_look(np.random.default_rng([SEED, index, 1])) if label == "fake" else None
            boxes = write_video(output / label / name, shots, times, fps, rng, look,
                                vfr=index == VFR_INDEX)
            truth[f"{label}/{name}"] = {
                "kind": kind, "fps": float(fps), "times": [round(t, 6) for t in times],
                "boxes": [[[round(min(max(v, 0), width if j % 2 == 0 else height), 1)
                            for j, v in enumerate(box)] for box in frame_boxes]
                          for frame_boxes in boxes]}
            labels.append((f"{label}/{name}", label))
        metadata[real] = {"label": "REAL", "split": "train"}
        metadata[fake] = {"label": "FAKE", "original": real, "split": "train"}
    truth = dict(sorted(truth.items()))
    beside(output, "_truth.json").write_text(json.dumps(truth, indent=1) + "\n")
    beside(output, "_metadata.json").write_text(
        json.dumps(dict(sorted(metadata.items())), indent=1) + "\n")
    with beside(output, "_labels.csv").open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["file", "label"])
        writer.writerows(sorted(labels))
    return truth


# --- broken videos -----------------------------------------------------------------------------

def riff_chunks(data: bytes, start: int, end: int):
    """RIFF chunks in ``data[start:end]``: (tag, data start, data end)."""
    pos = start
    while pos + 8 <= end:
        tag, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        yield tag, pos + 8, pos + 8 + size
        pos += 8 + size + (size & 1)  # chunks are padded to an even size


def riff_offsets(data: bytes) -> dict[str, int]:
    """Byte offsets of the AVI header's frame counts: ``avih`` dwTotalFrames and the (first)
    video ``strh`` dwLength."""
    found = {}

    def walk(start: int, end: int) -> None:
        for tag, lo, hi in riff_chunks(data, start, end):
            if tag in (b"RIFF", b"LIST"):
                walk(lo + 4, hi)  # after the list's own type: AVI , hdrl, strl, movi, ...
            elif tag == b"avih":
                found["avih"] = lo + 16
            elif tag == b"strh" and data[lo:lo + 4] == b"vids" and "strh" not in found:
                found["strh"] = lo + 32

    walk(0, len(data))
    if set(found) != {"avih", "strh"}:
        raise ValueError(f"not an AVI with a video stream header (found {sorted(found)})")
    return found


def mdat_range(data: bytes) -> tuple[int, int]:
    """Where the ``mdat`` box's data lies in an MP4 file (top-level boxes: size, tag)."""
    pos = 0
    while pos + 8 <= len(data):
        size, tag = struct.unpack(">I4s", data[pos:pos + 8])
        header = 8
        if size == 1:  # a 64-bit size follows
            size, header = struct.unpack(">Q", data[pos + 8:pos + 16])[0], 16
        elif size == 0:  # to the end of the file
            size = len(data) - pos
        if tag == b"mdat":
            return pos + header, pos + size
        pos += size
    raise ValueError("no mdat box")


def count_frames(path: Path) -> int:
    """Frames decoded from ``path``'s first video stream."""
    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(video=0))


def write_broken_videos(folder: Path, good_mp4: Path, good_avi: Path) -> dict[str, str]:
    """Write damaged videos into ``folder``, made from a good H.264 MP4 and a good MJPEG AVI;
    return file name -> what is wrong with it (and what PyAV does with it)."""
    folder, good_mp4, good_avi = Path(folder), Path(good_mp4), Path(good_avi)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}

    (folder / "empty.mp4").write_bytes(b"")
    written["empty.mp4"] = ("zero bytes: probed as MP4 by its name alone, 'moov atom not found'; "
                            "av.open raises av.error.InvalidDataError")

    mp4 = good_mp4.read_bytes()
    (folder / "truncated.mp4").write_bytes(mp4[:int(0.55 * len(mp4))])
    written["truncated.mp4"] = ("the first 55 % of an H.264 MP4 whose moov atom is at the end: "
                                "'moov atom not found'; av.open raises "
                                "av.error.InvalidDataError")

    (folder / "not_a_video.mp4").write_text(
        "This is not a video. It is a UTF-8 text file named like one: ünïcödé, 日本語.\n" * 20,
        encoding="utf-8")
    written["not_a_video.mp4"] = ("UTF-8 text: probed as MP4 by its name alone, 'moov atom not "
                                  "found'; av.open raises av.error.InvalidDataError")

    with av.open(str(folder / "audio_only.mp4"), "w") as container:
        rate = 44100
        stream = container.add_stream("aac", rate=rate, layout="mono")
        stream.bit_rate = 96_000
        tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)).astype(np.float32)
        step = 1024
        for start in range(0, rate, step):
            frame = av.AudioFrame.from_ndarray(tone[None, start:start + step], format="fltp",
                                               layout="mono")
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    written["audio_only.mp4"] = ("1 s of a 440 Hz AAC tone: opens, but has no video stream "
                                 "(container.streams.video is empty)")

    avi = bytearray(good_avi.read_bytes())
    frames = count_frames(good_avi)
    offsets = riff_offsets(bytes(avi))
    for offset in offsets.values():
        struct.pack_into("<I", avi, offset, 10 * frames)
    (folder / "wrong_count.avi").write_bytes(bytes(avi))
    written["wrong_count.avi"] = (f"an MJPEG AVI whose header claims {10 * frames} frames (avih "
                                  f"dwTotalFrames, strh dwLength): stream.frames says "
                                  f"{10 * frames}, decoding yields the true {frames}")

    data = bytearray(mp4)
    lo, hi = mdat_range(mp4)
    rng = np.random.default_rng([SEED, 99])
    runs = 4
    for i in range(runs):  # one run in each quarter of the mdat after its first 20 %
        span = (hi - lo) * 0.8 / runs
        length = int(min(rng.integers(24, 97), span / 2))
        start = int(lo + (hi - lo) * 0.2 + i * span + rng.uniform(0, span - length))
        data[start:start + length] = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
    (folder / "corrupt_packets.mp4").write_bytes(bytes(data))
    written["corrupt_packets.mp4"] = (f"an H.264 MP4 with {runs} runs of random bytes inside its "
                                      "mdat (after the first 20 %): opens and decodes every "
                                      "frame, but frames from the first damaged packet to the "
                                      "next keyframe are garbled (FFmpeg logs 'error while "
                                      "decoding MB'; a packet may raise av.error.InvalidDataError)")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", "--out", type=Path, default=Path(__file__).parent / "videos")
    parser.add_argument("--per-label", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--fps", type=float, default=15)
    parser.add_argument("--width", type=int, default=320)
    parser.add_argument("--height", type=int, default=240)
    args = parser.parse_args()
    truth = write_videos(args.output, args.per_label, args.seconds, args.fps, args.width,
                         args.height)
    frames = sum(len(entry["times"]) for entry in truth.values())
    others = ", ".join(beside(args.output, suffix).name
                       for suffix in ("_metadata.json", "_labels.csv"))
    print(f"wrote {len(truth)} videos ({frames} frames) to {args.output}/{{real,fake}}; truth, "
          f"metadata and labels in {beside(args.output, '_truth.json')}, {others}")


if __name__ == "__main__":
    main()
