"""``import_mediapipe``: MediaPipe imported without loading its drawing helpers, for the face mesh
(``precache.processing.ops.face_mesh``) and BlazeFace (``precache.faces.blazeface``).

``import mediapipe`` runs ``mediapipe.python.solutions``, whose ``drawing_utils`` imports
``matplotlib.pyplot``: about half a second of every stage-1 worker's start (0.49 s of 1.05 s on
the project's 2-core machine), paid by each worker of each run, for helpers stage 1 never calls.
Here the two drawing modules are registered first as empty modules that run their file, and so
import matplotlib, on the first access to a name in them (a module ``__getattr__``, and ``dir``),
so code that uses them still works, and everything else MediaPipe does is unchanged.
(``importlib.util.LazyLoader`` does not do: the import system's own ``__spec__`` check would run
the file.)
"""

from __future__ import annotations

import importlib.util
import sys
from importlib.abc import Loader
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["LAZY_MODULES", "import_mediapipe"]

LAZY_MODULES = ("drawing_utils", "drawing_styles")
"""Modules of ``mediapipe.python.solutions`` loaded on first use instead of at import."""


def _defer(module: ModuleType, loader: Loader) -> None:
    """Give ``module`` a ``__getattr__`` and a ``__dir__`` that run its file on first use, then
    answer from it: on the first name asked for (not on dunder names, which the import system
    probes, but on ``__all__``, which ``import *`` reads before the module's namespace) or on
    ``dir()``."""

    def run() -> None:
        del module.__dict__["__getattr__"], module.__dict__["__dir__"]
        loader.exec_module(module)

    def load(attr: str) -> Any:
        if attr.startswith("__") and attr != "__all__":
            raise AttributeError(f"module {module.__name__!r} has no attribute {attr!r}")
        run()
        return getattr(module, attr)

    def listing() -> list[str]:
        run()
        return dir(module)

    module.__getattr__, module.__dir__ = load, listing  # type: ignore[method-assign]


def import_mediapipe() -> ModuleType:
    """``mediapipe``, imported (once) with ``LAZY_MODULES`` deferred. Where MediaPipe is already
    imported, or its files are not where the wheel puts them, a plain import.

    Raises:
        ModuleNotFoundError: MediaPipe is not installed.
    """
    if "mediapipe" in sys.modules:
        return sys.modules["mediapipe"]
    spec = importlib.util.find_spec("mediapipe")  # a top-level lookup: imports nothing
    folders = list(spec.submodule_search_locations or []) if spec else []
    deferred = []
    for name in LAZY_MODULES:
        path = Path(folders[0]) / "python" / "solutions" / f"{name}.py" if folders else None
        if path is None or not path.is_file():
            continue
        full = f"mediapipe.python.solutions.{name}"
        child = importlib.util.spec_from_file_location(full, path)
        if child is None or child.loader is None:
            continue
        module = importlib.util.module_from_spec(child)
        _defer(module, child.loader)
        sys.modules[full] = module
        deferred.append((name, module))
    import mediapipe

    solutions = sys.modules.get("mediapipe.python.solutions")
    for name, module in deferred:  # the import found them in sys.modules and bound no attribute
        if solutions is not None and not hasattr(solutions, name):
            setattr(solutions, name, module)
    return mediapipe
