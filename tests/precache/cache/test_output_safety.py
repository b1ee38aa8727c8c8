"""A run deletes only files precache wrote: a folder is a cache only by precache's manifest or
marker, a user's files beside the cache survive every run (and --overwrite) and are reported,
and every published file is on disk (fsynced, and its folder) before the manifest names it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import precache
from precache.processing import RunSummary
from precache import RunError
from precache.cache import MARKER, CacheLayout
from tests.helpers import COUNTING_PIPELINE, build_cache, precache_cli, write_photos


def build(photos: Path, out: Path, **options: object) -> tuple[RunSummary, list[str]]:
    lines: list[str] = []
    summary = build_cache(photos, out, workers=1, log=lines.append, **options)
    return summary, lines


def plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def contents(root: Path, files: dict[str, str]) -> dict[str, str | None]:
    return {rel: (root / rel).read_text() if (root / rel).exists() else None for rel in files}


USER_FILES = {"shards/thesis.tex": "chapter 1", "shards/train-000.tar": "webdataset",
              "journal/2024/jan.txt": "notes", "journal/todo.md": "todo", "README.md": "mine",
              "shards/part-00001.parquet.bak": "a backup of mine"}


@pytest.mark.parametrize("user_files", [
    {"shards/thesis.tex": "chapter 1"},
    {"journal/2024/jan.txt": "notes"},
    {"shards/train-000.tar": "webdataset", "shards/train-001.tar": "webdataset"},
    {".lock.txt": "x"},
])
def test_a_folder_without_precache_marker_is_refused_and_untouched(tmp_path, user_files):
    write_photos(tmp_path / "photos", 4)
    out = tmp_path / "out"
    plant(out, user_files)
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    with pytest.raises(RunError, match="not empty and holds no precache cache"):
        build(tmp_path / "photos", out)
    assert contents(out, user_files) == user_files
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
    for flag in ([], ["--overwrite"]):  # the CLI too, with and without --overwrite: exit 1
        done = precache_cli("run", COUNTING_PIPELINE, "-i", str(tmp_path / "photos"), "-o",
                            str(out), "-q", *flag)
        assert done.returncode == 1, done.stderr
        assert "not empty and holds no precache cache" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        assert contents(out, user_files) == user_files


def test_user_files_inside_a_cache_survive_every_kind_of_run_and_are_reported(tmp_path):
    write_photos(tmp_path / "photos", 20)
    out = tmp_path / "out"
    build(tmp_path / "photos", out)
    assert (out / MARKER).is_file()
    plant(out, USER_FILES)

    _, lines = build(tmp_path / "photos", out)  # nothing to do
    report = next(line for line in lines if "left alone" in line)
    for rel in ("shards/thesis.tex", "journal/2024/", "README.md"):
        assert rel in report
    _, _ = build(tmp_path / "photos", out, params={"size": 8})  # new fingerprint: all rebuilt
    (tmp_path / "photos" / "img0000.png").unlink()  # a deleted input, and so a compaction
    _, _ = build(tmp_path / "photos", out, params={"size": 8})
    summary, _ = build(tmp_path / "photos", out, overwrite=True)
    assert summary.computed == 19
    assert contents(out, USER_FILES) == USER_FILES
    # and precache's own files are what the manifest names, nothing more
    manifest = precache.Cache(out).manifest
    shards = {p.name for p in (out / "shards").iterdir()} - {Path(r).name for r in USER_FILES}
    assert shards == {Path(s.path).name for s in manifest.shards}
    tables = {p.name for p in out.iterdir() if p.name.endswith(".parquet")}
    assert tables == {manifest.index["path"], manifest.errors["path"]}
    assert not (out / ".staging").exists()
    assert sorted(p.name for p in (out / "journal").iterdir()) == ["2024", "todo.md"]


def test_only_precache_named_orphans_of_a_crashed_run_are_deleted(tmp_path):
    write_photos(tmp_path / "photos", 20)
    out = tmp_path / "out"
    build(tmp_path / "photos", out)
    # what a run killed before journaling leaves: a shard of precache's name and staging files
    (out / "shards" / "part-00077.parquet").write_bytes(b"orphan")
    plant(out, {".staging/part-00078.parquet.tmp-123": "torn", ".staging/mine.txt": "mine",
                "shards/part-77.txt": "mine"})
    (tmp_path / "photos" / "img0001.jpg").unlink()
    build(tmp_path / "photos", out)
    assert not (out / "shards" / "part-00077.parquet").exists()
    assert not (out / ".staging" / "part-00078.parquet.tmp-123").exists()
    assert (out / ".staging" / "mine.txt").read_text() == "mine"
    assert (out / "shards" / "part-77.txt").read_text() == "mine"
    assert precache.Cache(out).manifest.counts["inputs"] == 19


def test_a_folder_holding_only_a_dead_runs_lock_is_taken(tmp_path):
    write_photos(tmp_path / "photos", 4)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").write_text("12345")  # a run killed between its lock and its marker
    summary, _ = build(tmp_path / "photos", out)
    assert summary.ok == 4


def test_overwrite_of_another_pipelines_cache_removes_only_precache_files(tmp_path):
    write_photos(tmp_path / "photos", 6)
    out = tmp_path / "out"
    build_cache(tmp_path / "photos", out, pipeline="images", workers=1)
    old_shards = {p.name for p in (out / "shards").iterdir()}
    plant(out, USER_FILES)
    with pytest.raises(RunError, match="holds a cache of pipeline 'images'"):
        build(tmp_path / "photos", out)
    build(tmp_path / "photos", out, overwrite=True)
    assert precache.Cache(out).manifest.pipeline == "counting"
    assert contents(out, USER_FILES) == USER_FILES
    left = {p.name for p in (out / "shards").iterdir()}
    assert not (left & old_shards) - {Path(s.path).name for s in
                                      precache.Cache(out).manifest.shards}


def test_own_names_are_only_the_ones_precache_writes():
    own = CacheLayout.is_own
    assert own("shards", "part-00012.parquet") and own("shards", "part-00003.h5")
    assert own("", "index-00002.parquet") and own("", "manifest.json") and own("", MARKER)
    assert own("journal", "part-00001.json") and own("journal", ".part-00001.json.tmp-77")
    for folder, name in [("shards", "thesis.tex"), ("shards", "part-1.parquet"),
                         ("shards", "part-00001.parquet.bak"), ("shards", "../part-00001.parquet"),
                         ("journal", "jan.txt"), ("", "data.parquet"), ("", "index.parquet"),
                         (".staging", "notes"), ("elsewhere", "part-00001.parquet")]:
        assert not own(folder, name), (folder, name)


def test_published_files_are_fsynced_with_their_folder_before_the_manifest(tmp_path, monkeypatch):
    """Order of durable steps in a real run: each shard and table file's data is fsynced before
    its rename, its folder after, and all of it before the manifest's rename."""
    write_photos(tmp_path / "photos", 20)
    out = tmp_path / "out"
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst, **kw) -> None:
        events.append(("replace", f"{os.fspath(src)} -> {os.path.abspath(dst)}"))
        real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    build(tmp_path / "photos", out)
    manifest = precache.Cache(out).manifest
    root = str(out.resolve())
    renames = {e[1].split(" -> ")[1]: i for i, e in enumerate(events) if e[0] == "replace"}
    published = renames[f"{root}/manifest.json"]
    files = [s.path for s in manifest.shards] + [manifest.index["path"], manifest.errors["path"]]
    for rel in files:
        final = f"{root}/{rel}"
        at = renames[final]
        src = events[at][1].split(" -> ")[0]
        assert ("fsync", os.path.abspath(src)) in events[:at], f"{rel} not fsynced before rename"
        folder = os.path.dirname(final)
        assert ("fsync", folder) in events[at:published], f"{rel}'s folder not fsynced"
    assert ("fsync", root) in events[published:]  # the manifest's own rename
