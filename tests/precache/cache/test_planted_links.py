"""A symbolic link planted at a name precache writes in a cache is refused in one line, and nothing
is written where it points: the lock (``run``, ``gc``, ``gc --dry-run``), the staging names of the
index and of a shard, a journal entry's and a manifest's temporary names, also when the link
appears after the run has started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from precache.cache.formats import get_format
from precache.cache.layout import CacheLayout
from precache.cache.schema import infer_spec
from precache.cache.transaction import WriteTransaction
from precache.cli import main
from precache.storage.durable import LinkRefusedError
from tests.helpers import COUNTING_PIPELINE, build_counting, write_photos

PRECIOUS = b"not precache's\n"


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A cache of 4 photos (one shard), its inputs in ``tmp_path / "photos"``."""
    write_photos(tmp_path / "photos", 4)
    build_counting(tmp_path / "photos", tmp_path / "cache")
    return tmp_path / "cache"


def plant(link: Path, victim: Path, *, dangling: bool = False) -> None:
    """A link at ``link`` to ``victim``, a file outside the cache (or nothing, ``dangling``)."""
    if not dangling:
        victim.write_bytes(PRECIOUS)
    link.unlink(missing_ok=True)
    link.symlink_to(victim)


def assert_untouched(link: Path, victim: Path, *, dangling: bool = False) -> None:
    assert link.is_symlink(), f"{link} was removed"
    if dangling:
        assert not victim.exists(), f"{victim} was created through the link"
    else:
        assert victim.read_bytes() == PRECIOUS, f"{victim} was written through the link"


def refused_line(link: Path, capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err == (f"precache: error: '{link}' is a symbolic link; precache writes this file of "
                   "the cache itself and never writes through a link or into another file: "
                   f"remove '{link}' (rm) and re-run\n"), err
    return err


@pytest.mark.parametrize("command, dangling", [("run", False), ("run", True), ("gc", False),
                                               ("gc --dry-run", True)])
def test_a_lock_that_is_a_link_is_refused_by_run_and_gc(
        cache: Path, command: str, dangling: bool, capsys: pytest.CaptureFixture[str]) -> None:
    link, victim = cache / ".lock", cache.parent / "victim"
    plant(link, victim, dangling=dangling)
    (cache.parent / "photos" / "img0000.png").unlink()  # a run has work to do
    args = (["run", COUNTING_PIPELINE, "-i", str(cache.parent / "photos"), "-o", str(cache),
             "-j", "1", "-q"] if command == "run" else [*command.split(), str(cache)])
    capsys.readouterr()
    assert main(args) == 1
    refused_line(link, capsys)
    assert_untouched(link, victim, dangling=dangling)


@pytest.mark.parametrize("name", ["index-00002.parquet.tmp", "part-00002.parquet.tmp-4242"])
def test_a_link_at_a_staging_name_is_refused_before_anything_is_written(
        cache: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    link, victim = cache / ".staging" / name, cache.parent / "victim"
    link.parent.mkdir()
    plant(link, victim)
    (cache.parent / "photos" / "img0000.png").unlink()
    capsys.readouterr()
    assert main(["run", COUNTING_PIPELINE, "-i", str(cache.parent / "photos"), "-o", str(cache),
                 "-j", "1", "-q"]) == 1
    refused_line(link, capsys)
    assert_untouched(link, victim)


def test_links_planted_while_a_run_writes_are_refused_where_it_writes(
        cache: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    with WriteTransaction(cache, pipeline="counting", fingerprint="f", log=print) as tx:
        layout, pid = tx.layout, os.getpid()
        links = [layout.staging / f"part-00009.parquet.tmp-{pid}",
                 layout.journal / f".part-00009.json.tmp-{pid}",
                 layout.staging / "index-00002.parquet.tmp",
                 cache / f".manifest.json.tmp-{pid}"]
        image = write_photos(tmp_path / "one", 1)[0].read_bytes()
        columns = {"key": ["a"], "value": [image]}
        schema = {name: infer_spec(name, values[0]) for name, values in columns.items()}
        for link in links:
            plant(link, victim)
        with pytest.raises(LinkRefusedError, match=r"part-00009\.parquet\.tmp-\d+' is a symbolic"):
            layout.commit_shard(9, get_format("parquet"), columns, schema)
        with pytest.raises(LinkRefusedError, match=r"\.part-00009\.json\.tmp-\d+' is a symbolic"):
            layout.write_journal_entry({"seq": 9})
        with pytest.raises(LinkRefusedError, match=r"index-00002\.parquet\.tmp' is a symbolic"):
            tx.publish({}, pipeline_ref="", params={}, ops=[], shard_format="parquet", source="")
        links[2].unlink()  # the index goes through now; the manifest's temporary name does not
        with pytest.raises(LinkRefusedError, match=r"\.manifest\.json\.tmp-\d+' is a symbolic"):
            tx.publish({}, pipeline_ref="", params={}, ops=[], shard_format="parquet", source="")
    assert victim.read_bytes() == PRECIOUS
    assert all(link.is_symlink() for link in links[:2] + links[3:])
    assert CacheLayout(cache).is_cache()
