"""The repository's paths, inputs the tests cache, scripts loaded as modules, the call log."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
COUNTING_PIPELINE = str(REPO / "tests" / "counting_pipeline.py")


def load_script(path: Path, name: str) -> ModuleType:
    """A Python file outside any package (``data/make_videos.py``, a training entry point) as a
    module called ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@functools.lru_cache(maxsize=1)
def _real_photos() -> tuple[np.ndarray, ...]:
    """scikit-image's astronaut, coffee and chelsea, decoded once per process (read-only)."""
    from skimage import data

    photos = (data.astronaut(), data.coffee(), data.chelsea())
    for photo in photos:
        photo.setflags(write=False)
    return photos


def write_photos(folder: Path, count: int, seed: int = 0, size: int = 48) -> list[Path]:
    """Write ``count`` small JPEG/PNG crops of real photos (astronaut, coffee, chelsea)."""
    rng = np.random.default_rng(seed)
    photos = _real_photos()
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        photo = photos[i % len(photos)]
        y = int(rng.integers(0, photo.shape[0] - 2 * size))
        x = int(rng.integers(0, photo.shape[1] - 2 * size))
        crop = photo[y:y + size + int(rng.integers(0, size)), x:x + size + int(rng.integers(0, size))]
        path = folder / f"img{i:04d}.{'jpg' if i % 3 else 'png'}"
        Image.fromarray(np.ascontiguousarray(crop)).save(path)
        paths.append(path)
    return paths


def read_calls(path: Path) -> list[str]:
    """Keys logged by the counting pipeline (``PRECACHE_CALL_LOG``), in call order."""
    if not path.exists():
        return []
    return [line.split(" ", 1)[1] for line in path.read_text().splitlines() if line]
