"""Make the bundled sample set from the real photos that scikit-image ships (no download).

    python data/make_samples.py            # writes data/samples/ (about 200 JPEG/PNG files)

Each photo is cut, scaled, rotated, flipped and re-lit in a few ways, saved as JPEG or PNG at
varied sizes, so the set has the variety of a real folder of pictures. The output is the same on
every run (fixed seed), so caches built from it are comparable.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image
from skimage import data

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "motorcycle_left", "immunohistochemistry",
          "camera", "moon", "coins", "page", "horse", "hubble_deep_field", "retina",
          "cat", "colorwheel", "brick", "grass", "gravel", "clock", "text")


def load_photos() -> dict[str, np.ndarray]:
    """The photos scikit-image bundles, as RGB uint8 (grayscale ones expanded)."""
    photos = {}
    for name in PHOTOS:
        loader = getattr(data, name, None)
        if loader is None:
            continue
        try:
            image = loader()
        except Exception:  # noqa: BLE001 - a few loaders need an optional download; skip them
            continue
        if isinstance(image, tuple):
            image = image[0]
        image = np.asarray(image)
        if image.dtype == bool:
            image = image.astype(np.uint8) * 255
        if image.dtype != np.uint8:
            image = (255 * (image - image.min()) / max(1e-9, np.ptp(image))).astype(np.uint8)
        if image.ndim == 2:
            image = np.stack([image] * 3, axis=-1)
        photos[name] = image[..., :3]
    return photos


def variant(image: np.ndarray, rng: np.random.Generator) -> Image.Image:
    """A random crop / scale / rotation / flip / brightness change of ``image``."""
    h, w = image.shape[:2]
    ch, cw = int(h * rng.uniform(0.5, 1.0)), int(w * rng.uniform(0.5, 1.0))
    y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
    pil = Image.fromarray(image[y:y + ch, x:x + cw])
    scale = rng.uniform(0.4, 1.3)
    pil = pil.resize((max(32, int(cw * scale)), max(32, int(ch * scale))), Image.BILINEAR)
    if rng.random() < 0.3:
        pil = pil.rotate(float(rng.uniform(-30, 30)), resample=Image.BILINEAR, expand=True)
    if rng.random() < 0.5:
        pil = pil.transpose(Image.FLIP_LEFT_RIGHT)
    gain = rng.uniform(0.6, 1.3)
    return Image.fromarray(np.clip(np.asarray(pil, dtype=np.float32) * gain, 0, 255).astype(np.uint8))


def make_samples(out: Path, count: int = 200, seed: int = 0) -> int:
    """Write ``count`` images to ``out``; return how many were written."""
    rng = np.random.default_rng(seed)
    photos = load_photos()
    names = sorted(photos)
    out.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        name = names[i % len(names)]
        pil = variant(photos[name], rng)
        folder = out / name
        folder.mkdir(exist_ok=True)
        if rng.random() < 0.7:
            pil.save(folder / f"{i:04d}.jpg", quality=int(rng.integers(70, 95)))
        else:
            pil.save(folder / f"{i:04d}.png")
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "samples")
    parser.add_argument("--count", type=int, default=200)
    args = parser.parse_args()
    n = make_samples(args.out, args.count)
    print(f"wrote {n} sample images to {args.out}")


if __name__ == "__main__":
    main()
