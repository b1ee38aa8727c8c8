"""Make the bundled face sample set from real photos that installed packages ship (no download).

    python data/make_samples.py            # writes data/samples/ (300 JPEG/PNG files)
                                           # and data/samples_truth.json (the face boxes)

It is the input of the quick start (``precache run faces --input data/samples --output
data/cache``) and of the benchmarks, so it must look like a real folder of pictures for a face
detector (MTCNN) and be cheap to make. Three kinds of picture, the kind in the file name:

* ``face_NNNN``: one face (scikit-image's astronaut, matplotlib's Grace Hopper portrait, a few of
  scikit-image's cameraman), cut so the face is 10-70 % of the width, anywhere in the frame,
  rotated up to 25 degrees, flipped, re-lit, sometimes blurred or noisy, 240-800 px on the long
  side. Where the cut would reach past the photo, the photo is extended by reflecting its edge
  (when the mirrored strip holds no face) or laid with a soft edge on a background photo.
* ``group_NNNN``: a background photo with 2-4 faces pasted at different sizes (at least 40 px
  wide), each with some context around it and a feathered edge, tilted and re-lit one by one.
* ``noface_NNNN``: background photos only (coffee, the cat, rocket, brick, text, ...), cut,
  scaled, rotated and re-lit: the negatives, the cat among them.

The face boxes go to ``<output>_truth.json`` beside (not inside) the output folder: file name ->
list of ``[x0, y0, x1, y1]`` in that picture's pixels. Every picture has its own seeded random
generator, so the output is the same bytes on every run and the first N pictures do not depend on
``--count``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter
from skimage import data

# Face boxes (x0, y0, x1, y1) in source pixels, tight from mid-forehead to chin and ear to ear
# like a face detector's box. Found by drawing each box on a 3x enlarged crop with a 10 px ruler,
# looking at it and moving the edges until they sat on the forehead, chin and cheeks/ears.
FACE_BOXES = {
    "astronaut": (176, 80, 272, 178),      # skimage.data.astronaut(), 512x512, frontal
    "grace_hopper": (161, 146, 372, 335),  # matplotlib sample_data/grace_hopper.jpg, 512x600
    "camera": (182, 125, 256, 194),        # skimage.data.camera(), 512x512, profile, ear to nose
}
# How often each face photo is drawn (the cameraman only now and then: small, turned, gray).
FACE_WEIGHTS = {"astronaut": 0.45, "grace_hopper": 0.45, "camera": 0.10}

# Photos with no human face: backgrounds for the groups and the no-face pictures.
BACKGROUNDS = ("coffee", "chelsea", "rocket", "brick", "grass", "gravel", "page", "text",
               "hubble_deep_field", "moon", "coins", "clock", "immunohistochemistry")

KINDS = {"face": 0.45, "group": 0.35, "noface": 0.20}  # share of each kind of picture


def to_rgb(image: np.ndarray) -> Image.Image:
    """``image`` (gray, RGB or RGBA, any dtype) as an RGB PIL image."""
    image = np.asarray(image)
    if image.dtype == bool:
        image = image.astype(np.uint8) * 255
    if image.dtype != np.uint8:
        image = (255 * (image - image.min()) / max(1e-9, np.ptp(image))).astype(np.uint8)
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    return Image.fromarray(np.ascontiguousarray(image[..., :3]))


def load_skimage(name: str) -> Image.Image | None:
    """``skimage.data.<name>()`` as RGB, or None where this install cannot load it."""
    loader = getattr(data, name, None)
    if loader is None:
        return None
    try:
        image = loader()
    except Exception:  # noqa: BLE001 - a few loaders need an optional download; skip them
        return None
    return to_rgb(image[0] if isinstance(image, tuple) else image)


def load_grace_hopper() -> Image.Image | None:
    """matplotlib's Grace Hopper portrait, or None without matplotlib."""
    try:
        from matplotlib import cbook
        path = cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)
        return Image.open(path).convert("RGB")
    except Exception:  # noqa: BLE001 - matplotlib is optional here
        return None


def load_photos() -> tuple[dict[str, Image.Image], dict[str, Image.Image]]:
    """The face photos and the background photos, name -> image (names as in FACE_BOXES)."""
    faces = {"astronaut": load_skimage("astronaut"), "grace_hopper": load_grace_hopper(),
             "camera": load_skimage("camera")}
    faces = {name: image for name, image in faces.items() if image is not None}
    backgrounds = {name: load_skimage(name) for name in BACKGROUNDS}
    backgrounds = {name: image for name, image in backgrounds.items() if image is not None}
    if not faces or not backgrounds:
        raise SystemExit("make_samples: scikit-image's photos are missing (pip install "
                         "scikit-image)")
    return faces, backgrounds


# --- geometry: 2x3 affine matrices that map source pixels to output pixels -------------------

def affine(angle: float = 0.0, scale: float = 1.0, src: tuple[float, float] = (0, 0),
           dst: tuple[float, float] = (0, 0)) -> np.ndarray:
    """Rotate by ``angle`` degrees (counter-clockwise on screen) and scale about ``src``, move it
    to ``dst``."""
    a = np.deg2rad(angle)
    c, s = np.cos(a) * scale, np.sin(a) * scale
    rot = np.array([[c, s], [-s, c]])  # y points down, so this turns counter-clockwise on screen
    return np.hstack([rot, (np.asarray(dst) - rot @ np.asarray(src))[:, None]])


def apply(m: np.ndarray, points: np.ndarray) -> np.ndarray:
    """``points`` (N x 2) mapped by ``m``."""
    return points @ m[:, :2].T + m[:, 2]


def warp(image: Image.Image, m: np.ndarray, size: tuple[int, int]) -> Image.Image:
    """``image`` mapped by ``m`` onto a ``size`` canvas (outside the image: 0, transparent)."""
    inverse = np.linalg.inv(np.vstack([m, [0, 0, 1]]))[:2]
    return image.transform(size, Image.AFFINE, tuple(inverse.ravel()), resample=Image.BILINEAR)


def corners(box: tuple[float, float, float, float]) -> np.ndarray:
    """The four corners of ``box`` as a 4 x 2 array."""
    x0, y0, x1, y1 = box
    return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], dtype=float)


def face_box(m: np.ndarray, box: tuple[float, float, float, float]) -> list[float]:
    """``box`` mapped by ``m``, as an axis-aligned box.

    For a tilted face the box around the turned corners is too loose (it takes in neck and
    background), so this is the box around the turned ellipse inscribed in ``box``: about the
    face's own size, where a detector puts its box.
    """
    centre = apply(m, np.array([[(box[0] + box[2]) / 2, (box[1] + box[3]) / 2]]))[0]
    # the ellipse's half axes, mapped: x(t) = centre + cos(t) * u + sin(t) * v
    u = m[:, 0] * (box[2] - box[0]) / 2
    v = m[:, 1] * (box[3] - box[1]) / 2
    half = np.hypot(u, v)
    return [centre[0] - half[0], centre[1] - half[1], centre[0] + half[0], centre[1] + half[1]]


# --- pixels --------------------------------------------------------------------------------------

def resize(image: Image.Image, scale: float) -> Image.Image:
    """``image`` scaled by ``scale`` (at least 1 px a side)."""
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image.resize(size, Image.BILINEAR, reducing_gap=2.0 if scale < 0.5 else None)


def feather(size: tuple[int, int], width: float) -> Image.Image:
    """An L mask of ``size``, opaque inside and fading to 0 over ``width`` px at every edge."""
    w, h = size
    ramp_x = np.minimum(np.arange(w) + 0.5, w - np.arange(w) - 0.5) / max(width, 1e-6)
    ramp_y = np.minimum(np.arange(h) + 0.5, h - np.arange(h) - 0.5) / max(width, 1e-6)
    alpha = np.clip(ramp_y, 0, 1)[:, None] * np.clip(ramp_x, 0, 1)[None, :]
    return Image.fromarray((255 * alpha).astype(np.uint8))


def relight(image: Image.Image, rng: np.random.Generator, strength: float = 1.0) -> Image.Image:
    """Brightness, contrast, gamma and a colour cast, as one lookup table per channel."""
    gamma = np.exp(rng.uniform(-0.35, 0.35) * strength)
    contrast = 1 + rng.uniform(-0.3, 0.3) * strength
    brightness = rng.uniform(-0.15, 0.15) * strength
    cast = 1 + rng.uniform(-0.08, 0.08, size=3) * strength
    v = (np.arange(256) / 255.0) ** gamma
    v = (v - 0.5) * contrast + 0.5 + brightness
    lut = np.clip(np.outer(cast, v) * 255 + 0.5, 0, 255).astype(np.uint8)
    return image.point(lut.ravel().tolist())


def degrade(image: Image.Image, rng: np.random.Generator) -> Image.Image:
    """Now and then: gray, blurred, noisy (like a real folder of pictures)."""
    if rng.random() < 0.08:
        image = image.convert("L").convert("RGB")
    if rng.random() < 0.15:
        image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.6, 1.6)))
    if rng.random() < 0.15:
        noise = rng.standard_normal((image.height, image.width, 1), dtype=np.float32)
        pixels = np.asarray(image, dtype=np.float32) + noise * rng.uniform(3, 9)
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    return image


def out_size(rng: np.random.Generator, low: int, high: int) -> tuple[int, int]:
    """A picture size: long side in [low, high], a common aspect, landscape or portrait."""
    long = int(rng.integers(low, high + 1))
    short = round(long / float(rng.choice([1.0, 4 / 3, 3 / 2, 16 / 9])))
    return (long, short) if rng.random() < 0.6 else (short, long)


def background(photos: dict[str, Image.Image], rng: np.random.Generator, size: tuple[int, int],
               max_angle: float = 0.0) -> Image.Image:
    """A random cut of a random background photo filling ``size``, maybe flipped and tilted."""
    name = sorted(photos)[int(rng.integers(len(photos)))]
    photo = photos[name]
    if rng.random() < 0.5 and name not in ("page", "text"):  # no mirror writing
        photo = photo.transpose(Image.FLIP_LEFT_RIGHT)
    w, h = size
    angle = rng.uniform(-max_angle, max_angle) if rng.random() < 0.4 else 0.0
    # the rotated output must fit inside the photo: scale so the turned frame's extent fits
    a = np.deg2rad(abs(angle))
    ext_w, ext_h = w * np.cos(a) + h * np.sin(a), w * np.sin(a) + h * np.cos(a)
    fit = min(photo.width / ext_w, photo.height / ext_h)  # source px per output px, at most
    # output px per source px; small photos are enlarged anyway, so they are cut less
    scale = 1 / (fit * rng.uniform(0.55 if fit > 1 else 0.85, 1.0))
    half_x, half_y = ext_w / 2 / scale, ext_h / 2 / scale
    cx = rng.uniform(half_x, max(half_x, photo.width - half_x))
    cy = rng.uniform(half_y, max(half_y, photo.height - half_y))
    if angle == 0:  # a plain cut and resize: cheaper than a warp
        cut = (cx - half_x, cy - half_y, cx + half_x, cy + half_y)
        gap = 2.0 if scale < 0.5 else None
        return photo.resize(size, Image.BILINEAR, box=cut, reducing_gap=gap)
    if scale < 1:
        photo = resize(photo, scale)
        cx, cy, scale = cx * scale, cy * scale, 1.0
    return warp(photo, affine(angle, scale, (cx, cy), (w / 2, h / 2)), size)


# --- the three kinds of picture -----------------------------------------------------------------

def make_face(faces: dict[str, Image.Image], backgrounds: dict[str, Image.Image],
              rng: np.random.Generator) -> tuple[Image.Image, list[list[float]]]:
    """One face, 10-70 % of the width, anywhere, tilted, flipped, re-lit."""
    names = sorted(faces)
    weights = np.array([FACE_WEIGHTS[n] for n in names])
    name = names[int(rng.choice(len(names), p=weights / weights.sum()))]
    photo, box = faces[name], FACE_BOXES[name]
    if rng.random() < 0.5:
        photo = photo.transpose(Image.FLIP_LEFT_RIGHT)
        box = (photo.width - box[2], box[1], photo.width - box[0], box[3])
    w, h = out_size(rng, 240, 800)
    bw, bh = box[2] - box[0], box[3] - box[1]
    angle = rng.uniform(-25, 25) if rng.random() < 0.7 else 0.0
    a = np.deg2rad(abs(angle))
    turn_w, turn_h = bw * np.cos(a) + bh * np.sin(a), bw * np.sin(a) + bh * np.cos(a)
    # face width as a share of the picture width; the face is at least 32 px and fits the height
    high = min(0.7, 0.85 * h / turn_h * bw / w)
    low = min(high, max(0.10, 32 / w))
    if rng.random() < 0.75:  # mostly a frame that the photo fills (the rest: laid on a background)
        low = min(high, max(low, max(w / photo.width, h / photo.height) * bw / w))
    frac = float(np.exp(rng.uniform(np.log(low), np.log(high))))
    if frac * w / bw > 3:  # enlarging the photo more than 3x looks soft: make the picture smaller
        shrink = max(3 * bw / (frac * w), 240 / max(w, h))
        w, h = round(w * shrink), round(h * shrink)
    scale = frac * w / bw  # output px per photo px
    if scale < 1:  # shrink first (a warp does not smooth); enlarging is left to the warp
        photo = resize(photo, scale)
        box = tuple(v * photo.width / faces[name].width if i % 2 == 0
                    else v * photo.height / faces[name].height for i, v in enumerate(box))
        scale = frac * w / (box[2] - box[0])
    src = ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)
    # where the face centre goes: the turned face inside the frame with a small margin, and
    # where possible a frame that stays inside the photo (then nothing needs filling in)
    half_w, half_h = frac * w * turn_w / bw / 2 + 2, frac * w * turn_h / bw / 2 + 2
    dst = []
    for c, half, size, extent in ((src[0] * scale, half_w, w, photo.width * scale),
                                  (src[1] * scale, half_h, h, photo.height * scale)):
        lo, hi = half, max(half, size - half)
        inside_lo, inside_hi = max(lo, c + size - extent), min(hi, c)
        if inside_lo <= inside_hi and rng.random() < 0.85:
            lo, hi = inside_lo, inside_hi
        dst.append(rng.uniform(lo, hi))
    m = affine(angle, scale, src, tuple(dst))
    # how far the frame reaches past the photo on each side
    reach = apply(np.linalg.inv(np.vstack([m, [0, 0, 1]]))[:2], corners((0, 0, w, h)))
    left, top = (int(np.ceil(max(0.0, -v))) for v in reach.min(axis=0))
    right = int(np.ceil(max(0.0, reach[:, 0].max() - photo.width)))
    bottom = int(np.ceil(max(0.0, reach[:, 1].max() - photo.height)))
    if left or top or right or bottom:
        # reflecting the edge is safe while the mirrored strip stops short of the face
        margin_x, margin_y = 0.15 * (box[2] - box[0]), 0.15 * (box[3] - box[1])
        safe = (left < box[0] - margin_x and right < photo.width - box[2] - margin_x
                and top < box[1] - margin_y and bottom < photo.height - box[3] - margin_y)
        if safe:
            pad = ((top, bottom), (left, right), (0, 0))
            canvas = Image.fromarray(np.pad(np.asarray(photo), pad, mode="reflect"))
        else:
            size = (photo.width + left + right, photo.height + top + bottom)
            canvas = background(backgrounds, rng, size)
            edge = 0.05 * min(photo.size)
            canvas.paste(photo, (left, top), feather(photo.size, edge))
        photo = canvas
    truth = [face_box(m, box)]
    # canvas px = photo px + (left, top): fold that shift into m
    m = np.hstack([m[:, :2], (m[:, 2] - m[:, :2] @ [left, top])[:, None]])
    image = warp(photo, m, (w, h))
    return degrade(relight(image, rng), rng), truth



def cut_face(photo: Image.Image, box: tuple[float, float, float, float], grow: float,
             rng: np.random.Generator) -> tuple[Image.Image, tuple[float, float, float, float]]:
    """The face ``box`` grown by ``grow`` of its size on every side, cut to the photo and
    flipped half the time; returns the cut and the face box in its pixels."""
    bw, bh = box[2] - box[0], box[3] - box[1]
    cut = (max(0, round(box[0] - grow * bw)), max(0, round(box[1] - grow * bh)),
           min(photo.width, round(box[2] + grow * bw)), min(photo.height, round(box[3] + grow * bh)))
    crop = photo.crop(cut)
    box = (box[0] - cut[0], box[1] - cut[1], box[2] - cut[0], box[3] - cut[1])
    if rng.random() < 0.5:
        crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        box = (crop.width - box[2], box[1], crop.width - box[0], box[3])
    return crop, box

def make_group(faces: dict[str, Image.Image], backgrounds: dict[str, Image.Image],
               rng: np.random.Generator) -> tuple[Image.Image, list[list[float]]]:
    """A background photo with 2-4 faces pasted apart, each with a soft edge and its own light."""
    w, h = out_size(rng, 480, 800)
    image = relight(background(backgrounds, rng, (w, h), max_angle=15), rng)
    names = sorted(faces)
    weights = np.array([FACE_WEIGHTS[n] for n in names])
    wanted = int(rng.integers(2, 5))
    placed: list[tuple[float, float, float, float]] = []  # pasted patches, output px
    truth = []
    for _ in range(40 * wanted):  # tries; a failed one draws a new face, place and size
        if len(truth) == wanted:
            break
        name = names[int(rng.choice(len(names), p=weights / weights.sum()))]
        photo, box = faces[name], FACE_BOXES[name]
        bw, bh = box[2] - box[0], box[3] - box[1]
        # the patch: the face box grown by 60 % (context: hair, neck)
        cut, box = cut_face(photo, box, 0.3, rng)
        face_w = np.exp(rng.uniform(np.log(40), np.log(max(41, 0.32 * min(w, h) * bw / bh))))
        scale = face_w / bw
        crop = resize(cut, scale)
        box = tuple(v * crop.width / cut.width if i % 2 == 0 else v * crop.height / cut.height
                    for i, v in enumerate(box))
        crop = relight(crop, rng, strength=0.6)
        crop.putalpha(feather(crop.size, 0.15 * min(crop.size)))  # face stays opaque
        angle = rng.uniform(-15, 15) if rng.random() < 0.6 else 0.0
        a = np.deg2rad(abs(angle))
        pw = int(np.ceil(crop.width * np.cos(a) + crop.height * np.sin(a)))
        ph = int(np.ceil(crop.width * np.sin(a) + crop.height * np.cos(a)))
        if pw >= w or ph >= h:
            continue
        x, y = int(rng.integers(0, w - pw + 1)), int(rng.integers(0, h - ph + 1))
        # patches may touch at their faded rims, not more
        rim = 0.1 * min(pw, ph)
        if any(x + rim < px1 and px0 < x + pw - rim and y + rim < py1 and py0 < y + ph - rim
               for px0, py0, px1, py1 in placed):
            continue
        m = affine(angle, 1.0, (crop.width / 2, crop.height / 2), (x + pw / 2, y + ph / 2))
        moved = warp(crop, affine(angle, 1.0, (crop.width / 2, crop.height / 2), (pw / 2, ph / 2)),
                     (pw, ph))
        image.paste(moved, (x, y), moved)
        placed.append((x, y, x + pw, y + ph))
        truth.append(face_box(m, box))
    return degrade(image, rng), truth


def make_noface(backgrounds: dict[str, Image.Image], rng: np.random.Generator) -> Image.Image:
    """A background photo, cut, scaled, tilted and re-lit; the cat comes up often."""
    size = out_size(rng, 240, 800)
    pool = backgrounds
    if rng.random() < 0.3 and "chelsea" in backgrounds:  # the best hard negative: not a human face
        pool = {"chelsea": backgrounds["chelsea"]}
    return degrade(relight(background(pool, rng, size, max_angle=20), rng), rng)


def kinds(count: int) -> list[str]:
    """The kind of each picture: shares as in KINDS, spread evenly through the set."""
    made = dict.fromkeys(KINDS, 0)
    out = []
    for i in range(count):
        kind = max(KINDS, key=lambda k: KINDS[k] * (i + 1) - made[k])  # the kind most behind
        made[kind] += 1
        out.append(kind)
    return out


def truth_path(out: Path) -> Path:
    """Where the face boxes of the pictures in ``out`` go: beside it, ``<out>_truth.json``."""
    return out.parent / (out.name + "_truth.json")


def make_samples(out: Path, count: int = 300, seed: int = 0) -> int:
    """Write ``count`` pictures to ``out`` and their face boxes to ``truth_path(out)``; return
    how many were written."""
    faces, backgrounds = load_photos()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*_*.*"):  # pictures of an earlier run, so the folder matches the truth
        kind, _, number = old.stem.partition("_")
        if kind in KINDS and number.isdigit() and old.suffix in (".jpg", ".png"):
            old.unlink()
    truth = {}
    for i, kind in enumerate(kinds(count)):
        rng = np.random.default_rng([seed, i])  # one generator a picture: same bytes every run
        if kind == "face":
            image, boxes = make_face(faces, backgrounds, rng)
        elif kind == "group":
            image, boxes = make_group(faces, backgrounds, rng)
        else:
            image, boxes = make_noface(backgrounds, rng), []
        if rng.random() < 0.8:
            name = f"{kind}_{i + 1:04d}.jpg"
            image.save(out / name, quality=int(rng.integers(70, 96)))
        else:
            name = f"{kind}_{i + 1:04d}.png"
            image.save(out / name, compress_level=1)
        w, h = image.size
        truth[name] = [[round(min(max(v, 0), w if j % 2 == 0 else h), 1) for j, v in enumerate(box)]
                       for box in boxes]
    truth_path(out).write_text(json.dumps(truth, indent=1) + "\n")
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", "--out", type=Path, default=Path(__file__).parent / "samples")
    parser.add_argument("--count", type=int, default=300)
    args = parser.parse_args()
    n = make_samples(args.output, args.count)
    made = ", ".join(f"{kinds(n).count(kind)} {kind}" for kind in KINDS)
    print(f"wrote {n} sample images to {args.output} ({made}), face boxes in "
          f"{truth_path(args.output)}")


if __name__ == "__main__":
    main()
