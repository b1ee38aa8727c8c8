"""Real photos with faces for the detector tests: scikit-image's astronaut, matplotlib's Grace
Hopper, and a group of both pasted on a face-less photo, with boxes read off them by eye; and
``data/make_samples.py``'s pictures, made in memory."""

from __future__ import annotations

from pathlib import Path

import cv2
import matplotlib.cbook
import numpy as np
from PIL import Image
from skimage import data

from tests.helpers import REPO, load_script

HOPPER = Path(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))
# Face boxes read off the photos by eye (forehead to chin, cheek to cheek), x0, y0, x1, y1.
ASTRONAUT_FACE = (180, 70, 262, 178)
HOPPER_FACE = (175, 125, 350, 340)


def iou(a: np.ndarray, b: tuple[float, ...]) -> float:
    """Intersection over union of two x0, y0, x1, y1 boxes."""
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def hopper() -> np.ndarray:
    return np.asarray(Image.open(HOPPER).convert("RGB"))


def group_photo() -> np.ndarray:
    """Two faces pasted on the coffee photo, side by side."""
    canvas = cv2.resize(data.coffee(), (800, 400))
    canvas[40:340, 30:330] = cv2.resize(data.astronaut()[20:240, 110:330], (300, 300))
    canvas[60:360, 450:750] = cv2.resize(hopper()[80:380, 110:410], (300, 300))
    return canvas


def sample_pictures(count: int) -> dict[str, np.ndarray]:
    """The first ``count`` pictures ``data/make_samples.py`` makes (faces, groups, none), in
    memory at their own sizes (not encoded), by name (``face_0001``...)."""
    samples = load_script(REPO / "data" / "make_samples.py", "make_samples")
    faces, backgrounds = samples.load_photos()
    makers = {"face": lambda rng: samples.make_face(faces, backgrounds, rng)[0],
              "group": lambda rng: samples.make_group(faces, backgrounds, rng)[0],
              "noface": lambda rng: samples.make_noface(backgrounds, rng)}
    return {f"{kind}_{i + 1:04d}": np.asarray(makers[kind](np.random.default_rng([0, i])))
            for i, kind in enumerate(samples.kinds(max(count, 300))[:count])}
