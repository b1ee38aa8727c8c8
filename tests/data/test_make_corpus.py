"""data/make_corpus.py turns Debian's fortunes into a labelled UTF-8 corpus, the same every run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "data" / "make_corpus.py"
FORTUNES = Path("/usr/share/games/fortunes")


@pytest.mark.skipif(not FORTUNES.is_dir(), reason="Debian's fortunes package is not installed "
                    "(.ci/setup installs it: apt-get install fortunes)")
def test_the_corpus_is_labelled_utf8_text_and_repeatable(tmp_path):
    def make(out: Path) -> dict[str, bytes]:
        subprocess.run([sys.executable, str(SCRIPT), "--output", str(out), "--categories",
                        "science,work"], check=True, capture_output=True)
        return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.txt"))}

    first, second = make(tmp_path / "a"), make(tmp_path / "b")
    assert first == second and len(first) > 1000
    assert {name.split("/")[0] for name in first} == {"science", "work"}
    for data in first.values():
        text = data.decode("utf-8")
        assert text.strip() and "\b" not in text and "\n%\n" not in text
