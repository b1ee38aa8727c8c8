"""Make the bundled text sample corpus from Debian's ``fortunes`` package (no download).

    sudo apt-get install fortunes          # real text, ~17,000 quotes in ~40 categories
    python data/make_corpus.py             # writes data/corpus/<category>/<category>_NNNN.txt

Each quote of a chosen category becomes one UTF-8 ``.txt`` document (from the package's ``.u8``
files, with typewriter overstriking such as ``_\\bA`` removed); its label is its category,
which the ``text`` pipeline reads from the folder name. The default categories give about 3,000
documents with four labels. The output is the same on every run.
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

FORTUNES = Path("/usr/share/games/fortunes")
CATEGORIES = ("computers", "politics", "science", "work")
_OVERSTRIKE = re.compile(".\b")


def quotes(category: str) -> list[str]:
    """The quotes of one category, overstriking removed, empty ones dropped."""
    path = FORTUNES / f"{category}.u8"
    if not path.exists():
        path = FORTUNES / category
    text = _OVERSTRIKE.sub("", path.read_text(encoding="utf-8", errors="replace")).replace("\b", "")
    return [q.strip("\n") for q in re.split(r"^%\n", text, flags=re.MULTILINE) if q.strip()]


def make_corpus(output: Path, categories: tuple[str, ...] = CATEGORIES) -> int:
    """Write one file per quote under ``output/<category>/``; return how many were written.

    Raises:
        SystemExit: the ``fortunes`` package is not installed.
    """
    if not FORTUNES.is_dir():
        raise SystemExit(f"{FORTUNES} not found: install Debian's fortunes package "
                         "(sudo apt-get install fortunes)")
    if output.exists():
        shutil.rmtree(output)
    count = 0
    for category in categories:
        folder = output / category
        folder.mkdir(parents=True)
        for i, quote in enumerate(quotes(category)):
            (folder / f"{category}_{i:04d}.txt").write_text(quote + "\n", encoding="utf-8")
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("corpus"))
    parser.add_argument("--categories", default=",".join(CATEGORIES),
                        help=f"comma-separated fortune files (default {','.join(CATEGORIES)})")
    args = parser.parse_args()
    categories = tuple(c.strip() for c in args.categories.split(",") if c.strip())
    count = make_corpus(args.output, categories)
    print(f"wrote {count} documents in {len(categories)} categories to {args.output}")


if __name__ == "__main__":
    main()
