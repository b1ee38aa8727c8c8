"""Issue 37 moved recipe parts to ``pipelines/``, renamed modules whose names collided, and
grouped ``precache/loading/`` by concern (datasets, samplers, loaders, interop); no page, script
or test may name a module by its old name (an import of one fails only when run)."""

from __future__ import annotations

import re

from tests.helpers import REPO

OLD = re.compile(r"precache[./]training[./](records|text|landmarks|video_eval)\b"
                 r"|precache[./]loading[./]text\b(?!_)|\bBucketLoader\b|\bAugmentForTraining\b"
                 r"|\bget_op\b|\bOPS\b"
                 r"|(precache[./])?\bloading[./](dataset|clips|video_index|patches|packing"
                 r"|cache_backed|sampler|buckets|loader|threaded|device|text_collate|image_decode"
                 r"|hf|lightning|pinned)\b")


def test_nothing_names_a_module_from_before_the_move() -> None:
    files = [*REPO.glob("*.md"), *(REPO / "docs").glob("*.md")] + [
        p for folder in ("precache", "pipelines", "tests", "data") for p in
        (REPO / folder).rglob("*.py") if p.name != "test_renamed_modules.py"]
    found = [f"{p.relative_to(REPO)}:{n}" for p in files
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if OLD.search(line)]
    assert found == []
