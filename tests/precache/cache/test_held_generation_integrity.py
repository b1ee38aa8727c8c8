"""A held generation is never changed under its reader, and nothing is served that the manifest
does not describe: re-runs and ``--overwrite`` never reuse a file name, a reader checks each shard
against its manifest entry, ``verify`` checks every kept generation, and owned folders that are
links are refused instead of followed."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import numpy as np
import pytest

import precache
from precache.cache import ManifestError
from precache.cache import GenerationError, ShardMismatchError
from precache.errors import RunError
from precache.loading import make_loader
from tests.helpers import COUNTING_PIPELINE, build_counting, precache_cli, write_photos

ROWS = 40


build = partial(build_counting, shard_rows=4)


def rows_of(cache: Path, generation: int | None = None) -> dict[str, np.ndarray]:
    """key -> image of every row of the generation."""
    dataset = precache.CachedDataset(cache, columns=["key", "image"], generation=generation)
    try:
        batch = dataset.read_batch(range(len(dataset)))
    finally:
        dataset.close()
    return dict(zip(batch["key"], batch["image"]))


def test_reruns_never_reuse_a_name_so_a_held_reader_reads_exactly_its_generation(
        tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, ROWS)
    build(photos, cache)  # 10 shards of 4
    expected = rows_of(cache)
    first = {s.path: s.checksum for s in precache.Cache(cache).manifest.shards}
    held = precache.CachedDataset(cache, columns=["key", "image"])  # a lease, nothing read yet
    for path in sorted(photos.iterdir())[-4:]:  # the last shard's inputs
        path.unlink()
    build(photos, cache)
    for i, path in enumerate(write_photos(tmp_path / "new", 2, seed=7)):
        path.rename(photos / f"new{i}{path.suffix}")
    build(photos, cache)
    assert precache.Cache(cache).generation == 3
    for shard in precache.Cache(cache).manifest.shards:  # a name generation 1 lists: its bytes
        assert first.get(shard.path, shard.checksum) == shard.checksum, shard.path
    try:
        got = held.read_batch(range(len(held)))
    finally:
        held.close()
    assert sorted(got["key"]) == sorted(expected)  # each row of generation 1, once
    for key, image in zip(got["key"], got["image"]):
        np.testing.assert_array_equal(image, expected[key])
    verified = precache_cli("verify", str(cache))
    assert verified.returncode == 0, verified.stderr
    assert "generations 1, 3:" in verified.stdout  # 2 had no reader and no retention


def test_overwrite_goes_on_numbering_and_an_old_reader_fails_in_one_line(tmp_path: Path) -> None:
    photos, other, cache = tmp_path / "photos", tmp_path / "other", tmp_path / "cache"
    write_photos(photos, 16)
    write_photos(other, 16, seed=5)
    build(photos, cache)
    expected = rows_of(cache)
    held = precache.CachedDataset(cache, columns=["key", "image"])
    early = held.read_batch([0, 1])  # shard 1 is open (mapped) from here on
    build(other, cache, overwrite=True)
    assert precache.Cache(cache).generation == 2  # not 1 again: the reader's number is not reused
    again = held.read_batch([0, 1])  # an open shard still reads its own bytes
    np.testing.assert_array_equal(again["image"], early["image"])
    assert again["key"] == early["key"] and early["key"][0] in expected
    loader = make_loader(held, batch_size=4, num_workers=2, shuffle=False)
    with pytest.raises(GenerationError, match=r"generation 1 of .* was removed .*reopen the "
                                              r"cache to read generation 2"):
        for _ in loader:
            pass
    with pytest.raises(GenerationError) as caught:
        held.read_batch(range(len(held)))
    assert "\n" not in str(caught.value)
    held.close()
    assert rows_of(cache).keys() == rows_of(cache, generation=2).keys()


def edit_manifest(cache: Path, change) -> None:
    for path in (cache / "manifest.json", *sorted((cache / "generations").iterdir())[-1:]):
        manifest = json.loads(path.read_text())
        change(manifest)
        path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("shard_format", ["parquet", "hdf5"])
@pytest.mark.parametrize("edit, said", [
    (lambda m: m["schema"]["image"].update(shape=[16, 48, 1]),
     "column 'image'"),  # the same bytes per row: only the file's own schema tells
    (lambda m: m["schema"]["image"].update(shape=[8, 16, 3]), "column 'image'"),
    (lambda m: m["shards"][0].update(rows=5), "the file holds 4 rows, the manifest says 5"),
])
def test_a_hand_edited_manifest_serves_no_row_and_fails_verify(tmp_path: Path, shard_format: str,
                                                               edit, said: str) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, 8)
    build(photos, cache, format=shard_format)
    edit_manifest(cache, edit)
    with pytest.raises(ShardMismatchError, match="does not match generation 1's manifest") as e:
        dataset = precache.CachedDataset(cache, columns=["image"])  # it opens the first shard
        dataset.read_batch(range(len(dataset)))
    assert said in str(e.value) and "precache verify" in str(e.value) and "\n" not in str(e.value)
    verified = precache_cli("verify", str(cache))
    assert verified.returncode == 1 and said in verified.stderr, verified.stderr


@pytest.mark.parametrize("folder", [".staging", "journal", "shards"])
def test_owned_folders_that_are_links_are_refused_and_nothing_outside_is_touched(
        tmp_path: Path, folder: str) -> None:
    photos, cache, outside = tmp_path / "photos", tmp_path / "cache", tmp_path / "outside"
    write_photos(photos, 8)
    build(photos, cache)
    outside.mkdir()
    if (cache / folder).exists():
        for path in (cache / folder).iterdir():
            path.rename(outside / path.name)
        (cache / folder).rmdir()
    mine = outside / "part-00001.parquet"  # a user's file named like precache's
    if not mine.exists():
        mine.write_bytes(b"mine")
    (outside / "part-00002.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    (cache / folder).symlink_to(outside, target_is_directory=True)
    with pytest.raises(RunError, match=f"'{cache / folder}' is a symbolic link; precache owns"):
        build(photos, cache)
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    if folder == ".staging":  # the command line says it in one line, exit 1
        result = precache_cli("run", COUNTING_PIPELINE, "-i", str(photos), "-o", str(cache))
        assert result.returncode == 1 and "symbolic link" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    if folder == "shards":  # gc deletes there too
        result = precache_cli("gc", str(cache), "--older-than", "0")
        assert result.returncode == 1 and "symbolic link" in result.stderr, result.stderr
        assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    (cache / folder).unlink()


def test_a_manifest_with_a_created_that_is_not_a_time_is_refused(tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, 4)
    build(photos, cache)
    edit_manifest(cache, lambda m: m.update(created=12345))
    for args in (("gc", str(cache)), ("run", COUNTING_PIPELINE, "-i", str(photos), "-o",
                                      str(cache))):
        result = precache_cli(*args)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert "created is 12345, expected an ISO 8601 time" in result.stderr


def test_a_mistyped_cache_path_is_not_called_an_interrupted_run(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="does not exist; check the path"):
        precache.Cache(tmp_path / "cahce")
    (tmp_path / "folder").mkdir()
    with pytest.raises(ManifestError, match="is not a precache cache") as e:
        precache.Cache(tmp_path / "folder")
    assert "interrupted" not in str(e.value)
    assert os.path.exists(tmp_path / "folder")
