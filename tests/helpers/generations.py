"""Cache generations in the tests: a cache of ``ROWS`` photos whose re-run changes most inputs, a
reader process holding generation 1, and what reading a removed generation says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import precache
from precache.cache import GenerationError
from tests.helpers.files import REPO, write_photos

ROWS = 40


def change_most_inputs(photos: Path) -> None:
    """Rewrite 80% of the inputs with other pixels (32 of 40)."""
    changed = write_photos(photos.parent / "changed", ROWS, seed=99)
    for old, new in zip(sorted(photos.iterdir())[:32], sorted(changed)[:32]):
        old.write_bytes(new.read_bytes())


HOLDER = """
import sys
from precache import Cache
cache = Cache(sys.argv[1], hold=True)
print(cache.generation, flush=True)
sys.stdin.readline()  # until the test says go
for i in range(len(cache.manifest.shards)):
    reader = cache.reader(i)
    print(len(reader.read(columns=["key"])["key"]), flush=True)
"""


def start_holder(cache: Path | str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(cache)], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "1", proc.stderr.read()
    return proc


def assert_generation_1_removed(cache: Path | str, unheld: precache.Cache, shard: int) -> None:
    """Generation 1 of ``cache`` (current: 2) is gone: reading shard ``shard`` through a reader
    that held nothing, and opening generation 1, are one-line ``GenerationError``s."""
    with pytest.raises(GenerationError) as caught:
        unheld.reader(shard)
    assert str(caught.value) == (
        f"generation 1 of '{cache}' was removed (by `precache gc`, --overwrite, or a re-run "
        f"after the retention period): {unheld.manifest.shards[shard].path} is gone; reopen "
        "the cache to read generation 2")
    with pytest.raises(GenerationError, match=r"^'.*' has no generation 1 any more \(kept: 2; "
                                              r"current: 2\); read the current one"):
        precache.Cache(cache, generation=1)
