"""A re-run never carries damage forward: an old shard whose rows it keeps (copied by compaction,
or left in place with the rest marked deleted) is checked against its checksum first, and a
damaged one's rows are computed again from their inputs, with one line saying so; a kept
generation whose manifest cannot be read keeps its shards."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest

import precache
from precache.cache.formats.variable import row_ends
from precache.cli import main
from precache.cache.verify import verify
from tests.helpers import COUNTING_PIPELINE, build_counting, write_photos

build = partial(build_counting, shard_rows=8)  # 16 photos: 2 shards of 8


def rows_of(cache: Path) -> dict[str, np.ndarray]:
    """key -> image of every row of the cache's current generation."""
    dataset = precache.CachedDataset(cache, columns=["key", "image"])
    try:
        batch = dataset.read_batch(range(len(dataset)))
    finally:
        dataset.close()
    return dict(zip(batch["key"], batch["image"]))


def flip(path: Path, needle: bytes, offset: int) -> None:
    """Flip the bits of one byte, ``offset`` bytes into the first place ``needle`` is in the
    file (a row's value, or an offsets column, as written)."""
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at >= 0, f"{needle[:16]!r}... is not in {path}"
    data[at + offset] ^= 0xFF
    path.write_bytes(bytes(data))


def change_inputs(photos: Path, first: int, count: int) -> None:
    """Give ``count`` photos from the ``first`` (in name order) other pixels."""
    changed = write_photos(photos.parent / "changed", 16, seed=99)
    for old, new in list(zip(sorted(photos.iterdir()), sorted(changed)))[first:first + count]:
        old.write_bytes(new.read_bytes())


@pytest.mark.parametrize("shard_format", ["parquet", "hdf5"])
def test_compaction_recomputes_the_rows_of_a_damaged_shard_instead_of_copying_them(
        tmp_path: Path, shard_format: str) -> None:
    photos, cache, fresh = tmp_path / "photos", tmp_path / "cache", tmp_path / "fresh"
    write_photos(photos, 16)
    build(photos, cache, format=shard_format)
    first = precache.Cache(cache).manifest.shards[0]
    kept_row = precache.Cache(cache).reader(0).read(indices=[0], columns=["image"])["image"][0]
    flip(cache / first.path, kept_row.tobytes(), 100)  # img0000's row, which the re-run keeps
    change_inputs(photos, 3, 5)  # 5 of the shard's 8 rows: the 3 others are compacted
    lines: list[str] = []
    build(photos, cache, format=shard_format, log=lines.append)
    damaged = [line for line in lines if "damaged" in line]
    assert damaged == [f"precache: shard {first.path} of '{cache}' is damaged (its checksum does "
                       f"not match the manifest's {first.checksum}): its 3 unchanged input(s) "
                       "are computed again; `precache verify` names the older generations that "
                       "still list it"], lines
    assert main(["gc", str(cache), "--older-than", "0"]) == 0
    assert verify(cache) == []
    build(photos, fresh, format=shard_format)
    got, expected = rows_of(cache), rows_of(fresh)
    assert sorted(got) == sorted(expected)
    for key, image in expected.items():
        np.testing.assert_array_equal(got[key], image, err_msg=key)


@pytest.mark.parametrize("shard_format", ["parquet", "hdf5"])
def test_a_rerun_over_a_shard_with_damaged_offsets_recomputes_its_rows_in_one_line(
        tmp_path: Path, shard_format: str, capsys: pytest.CaptureFixture[str]) -> None:
    photos, cache, fresh = tmp_path / "photos", tmp_path / "cache", tmp_path / "fresh"
    write_photos(photos, 16)
    build(photos, cache, format=shard_format)
    first = precache.Cache(cache).manifest.shards[0]
    keys = precache.Cache(cache).reader(0).read(columns=["key"])["key"]
    ends = row_ends(np.array([len(key.encode()) for key in keys]))
    flip(cache / first.path, ends.astype("<i8").tobytes(), 8)  # the 'key' column's offsets
    change_inputs(photos, 3, 1)  # one row of the shard marked deleted, 7 kept in place
    run = ["run", COUNTING_PIPELINE, "-i", str(photos), "-o", str(cache), "--shard-rows", "8",
           "-j", "1", "--format", shard_format, "-q"]
    assert main(run) == 0  # not a traceback (a ValueError from the offsets' checksum)
    out = capsys.readouterr()
    damaged = [line for line in (out.out + out.err).splitlines() if "damaged" in line]
    assert len(damaged) == 1 and f"shard {first.path} of" in damaged[0], out
    assert "its 7 unchanged input(s) are computed again" in damaged[0]
    build(photos, fresh, format=shard_format)
    got, expected = rows_of(cache), rows_of(fresh)
    assert sorted(got) == sorted(expected)
    for key, image in expected.items():
        np.testing.assert_array_equal(got[key], image, err_msg=key)
    assert main(run) == 0  # not stuck: the next run is a plain one
    out = capsys.readouterr()
    assert "damaged" not in out.out + out.err, out


def test_a_rerun_keeps_the_shards_of_a_held_generation_whose_manifest_is_unreadable(
        tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, 16)
    build(photos, cache)
    held = precache.Cache(cache, hold=True)  # a reader of generation 1
    try:
        change_inputs(photos, 0, 8)  # every row of shard 1: generation 2 does not list it
        build(photos, cache)
        only_held = {s.path for s in held.manifest.shards} - {
            s.path for s in precache.Cache(cache).manifest.shards}
        assert only_held
        (cache / "generations" / "manifest-00001.json").write_text("{torn")
        change_inputs(photos, 8, 1)
        lines: list[str] = []
        build(photos, cache, log=lines.append)
        assert precache.Cache(cache).generation == 3
        for path in only_held:
            assert (cache / path).is_file(), path
        assert any("kept generation 1 of" in line and "no shard was deleted" in line
                   for line in lines), lines
        batch = held.reader(0).read(columns=["key"])["key"]  # the reader still reads its rows
        assert len(batch) == 8
    finally:
        held.close()
