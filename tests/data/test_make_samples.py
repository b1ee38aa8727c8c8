"""data/make_samples.py: the face sample set, its truth file, and the same bytes on every run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from PIL import Image

SCRIPT = Path(__file__).resolve().parents[2] / "data" / "make_samples.py"
COUNT = 30


def make(*outs: Path) -> list[dict[str, list[list[float]]]]:
    """Run the script into each of ``outs`` (at the same time, one process each); return their
    truth files (file name -> face boxes)."""
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), "--output", str(out), "--count",
                               str(COUNT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for out in outs]
    truths = []
    for out, proc in zip(outs, procs):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        truth = out.parent / (out.name + "_truth.json")
        assert truth.is_file()
        truths.append(json.loads(truth.read_text()))
    return truths


def test_make_samples(tmp_path: Path) -> None:
    out, again = tmp_path / "samples", tmp_path / "again"
    truth, truth_again = make(out, again)  # two runs, to compare their bytes
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == COUNT
    assert not list(out.glob("*.json"))  # the truth file lies beside the folder, not in it
    assert sorted(truth) == files
    for name in files:
        with Image.open(out / name) as image:
            assert image.mode == "RGB"
            image.load()
            w, h = image.size
        kind = name.split("_")[0]
        boxes = truth[name]
        assert (kind == "noface") == (not boxes), name
        assert (kind == "group") == (len(boxes) >= 2), name
        for x0, y0, x1, y1 in boxes:
            assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h, (name, (x0, y0, x1, y1), (w, h))
    faces = [len(boxes) for boxes in truth.values()]
    assert 0 in faces and 1 in faces and max(faces) >= 2

    assert truth_again == truth
    for name in files:
        assert (out / name).read_bytes() == (again / name).read_bytes(), name
