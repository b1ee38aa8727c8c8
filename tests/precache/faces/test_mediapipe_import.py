"""``precache.faces.mediapipe_import``: a stage-1 worker that builds BlazeFace and the face mesh
does not import matplotlib (MediaPipe's drawing helpers, half a second of every worker's start),
and the drawing helpers still work when asked for. In a fresh process: the test process may have
imported MediaPipe already."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import sys
import numpy as np
from precache.faces.blazeface import BlazeFace
from precache.processing.ops.face_mesh import FaceMesh

detector = BlazeFace()
mesh = FaceMesh()
mesh.setup()
detector.detect(np.zeros((64, 64, 3), np.uint8))
mesh({"image": np.zeros((64, 64, 3), np.uint8)})
print("matplotlib" in sys.modules)
import mediapipe as mp
from mediapipe.python.solutions import drawing_styles
spec = mp.solutions.drawing_utils.DrawingSpec(color=(1, 2, 3))
print("matplotlib" in sys.modules, spec.color, len(drawing_styles.get_default_face_mesh_contours_style()) > 0)
"""


def test_workers_build_blazeface_and_the_mesh_without_matplotlib_and_drawing_still_works():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["False", "True (1, 2, 3) True"], done.stdout


LISTED = """
from precache.faces.mediapipe_import import import_mediapipe
import_mediapipe()
from mediapipe.python.solutions.drawing_utils import *
from mediapipe.python.solutions import drawing_styles
print(DrawingSpec(color=(1, 2, 3)).color, "get_default_face_mesh_contours_style" in dir(drawing_styles))
"""


def test_import_star_and_dir_see_the_deferred_modules_names():
    # ``import *`` reads ``__all__`` and then the module's namespace; ``dir`` lists it
    done = subprocess.run([sys.executable, "-c", LISTED], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[0] == "(1, 2, 3) True", done.stdout
