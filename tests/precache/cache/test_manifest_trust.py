"""A manifest is checked as it is parsed: every value that names a file or drives a file
operation must be one precache writes, else a one-line ``ManifestError`` names the manifest, the
entry and what was expected. One case per rule, each breaking a manifest that is otherwise
valid."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from precache.cache.formats.base import ShardInfo
from precache.cache.manifest import Manifest, ManifestError
from precache.cache.schema import ColumnSpec

WHERE = "s3://bucket/cache/manifest.json"
HEX = "0123456789abcdef" * 4


def valid() -> dict[str, Any]:
    """A manifest as precache writes it: two Parquet shards, one with deleted rows."""
    return Manifest(
        pipeline="p", pipeline_ref="p", params={}, ops=[], fingerprint="f", format="parquet",
        schema={"key": ColumnSpec("str")},
        shards=[ShardInfo("shards/part-00001.parquet", 4, 100, f"sha256:{HEX}", (1, 3)),
                ShardInfo("shards/part-100000.parquet", 2, 50, f"sha256:{'f' * 64}")],
        counts={"ok": 6, "skipped": 0, "failed": 0, "inputs": 6, "rows": 4},
        index={"path": "index-00002.parquet", "checksum": f"sha256:{'1' * 64}"},
        errors={"path": "errors-00002.parquet", "checksum": f"sha256:{'2' * 64}"},
        source="in", generation=2, created="2025-01-01T00:00:00+00:00", precache_version="0",
    ).to_json()


def parse(obj: Any) -> Manifest:
    return Manifest.from_bytes(json.dumps(obj).encode(), WHERE)


def setter(*keys: str | int, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(manifest: dict[str, Any]) -> None:
        target: Any = manifest
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return change


SHARD0 = ("shards", 0)
SHARD_FORM = "shards/part-NNNNN-<16 hex digits>.parquet"
BROKEN = [  # (what is changed, the entry named, part of what is expected)
    (setter(*SHARD0, "checksum", value="sha256:../victim"), "shards[0].checksum",
     "sha256:<64 lowercase hex digits>"),
    (setter(*SHARD0, "checksum", value=f"sha256:{HEX.upper()}"), "shards[0].checksum", "sha256:"),
    (setter(*SHARD0, "checksum", value=f"sha256:{HEX}0"), "shards[0].checksum", "sha256:"),
    (setter(*SHARD0, "checksum", value=f"md5:{HEX}"), "shards[0].checksum", "sha256:"),
    (setter(*SHARD0, "checksum", value=None), "shards[0].checksum", "sha256:"),
    (setter(*SHARD0, "path", value="../../victim"), "shards[0].path", SHARD_FORM),
    (setter(*SHARD0, "path", value="/etc/passwd"), "shards[0].path", SHARD_FORM),
    (setter(*SHARD0, "path", value="shards/../../part-00001.parquet"), "shards[0].path",
     SHARD_FORM),
    (setter(*SHARD0, "path", value="shards/sub/part-00001.parquet"), "shards[0].path", "shards/"),
    (setter(*SHARD0, "path", value="shards\\part-00001.parquet"), "shards[0].path", "shards/"),
    (setter(*SHARD0, "path", value="shards/part-00001.parquet\x00"), "shards[0].path", "shards/"),
    (setter(*SHARD0, "path", value="./shards/part-00001.parquet"), "shards[0].path", "shards/"),
    (setter(*SHARD0, "path", value="shards/part-00001.h5"), "shards[0].path",
     SHARD_FORM),  # not this cache's format
    (setter(*SHARD0, "path", value=["shards/part-00001.parquet"]), "shards[0].path", "shards/"),
    (setter("shards", 1, "path", value="shards/part-00001.parquet"), "shards[1].path",
     "each shard once"),
    (setter(*SHARD0, "rows", value=-1), "shards[0].rows", "non-negative integer"),
    (setter(*SHARD0, "rows", value="4"), "shards[0].rows", "non-negative integer"),
    (setter(*SHARD0, "rows", value=4.5), "shards[0].rows", "non-negative integer"),
    (setter(*SHARD0, "rows", value=True), "shards[0].rows", "non-negative integer"),
    (setter(*SHARD0, "bytes", value=-100), "shards[0].bytes", "non-negative integer"),
    (setter(*SHARD0, "deleted", value=[1, 4]), "shards[0].deleted", "from 0 to 3"),
    (setter(*SHARD0, "deleted", value=[-1]), "shards[0].deleted", "from 0 to 3"),
    (setter(*SHARD0, "deleted", value=[3, 1]), "shards[0].deleted", "ascending"),
    (setter(*SHARD0, "deleted", value=[1, 1]), "shards[0].deleted", "each once"),
    (setter(*SHARD0, "deleted", value=["1"]), "shards[0].deleted", "row indices"),
    (setter("shards", 0, value="shards/part-00001.parquet"), "shards[0]", "an object"),
    (setter("shards", value={"0": {}}), "shards", "a list"),
    (setter("index", "path", value="../index-00002.parquet"), "index.path", "index-NNNNN.parquet"),
    (setter("index", "path", value="/tmp/index-00002.parquet"), "index.path", "index-NNNNN"),
    (setter("index", "path", value="shards/part-00001.parquet"), "index.path", "index-NNNNN"),
    (setter("index", "path", value="errors-00002.parquet"), "index.path", "index-NNNNN"),
    (setter("index", "checksum", value="sha256:../x"), "index.checksum", "sha256:"),
    (setter("errors", "path", value="errors-00002.parquet/../../x"), "errors.path",
     "errors-NNNNN.parquet or errors.parquet"),
    (setter("errors", "path", value="sub/errors.parquet"), "errors.path", "errors-NNNNN"),
    (setter("errors", "checksum", value=""), "errors.checksum", "sha256:"),
    (setter("errors", value="errors-00002.parquet"), "errors", "path and checksum"),
    (setter("counts", "ok", value=-1), "counts.ok", "non-negative integer"),
    (setter("generation", value="2"), "generation", "non-negative integer"),
    (setter("generation", value=-1), "generation", "non-negative integer"),
    (setter("format", value="../parquet"), "format", "one of ['hdf5', 'parquet']"),
]


@pytest.mark.parametrize("change, entry, expected", BROKEN,
                         ids=[f"{i}-{case[1]}" for i, case in enumerate(BROKEN)])
def test_a_value_precache_does_not_write_is_a_one_line_error_naming_it(
        change: Callable[[dict[str, Any]], None], entry: str, expected: str) -> None:
    manifest = valid()
    parse(manifest)  # valid as it is
    change(manifest)
    with pytest.raises(ManifestError) as refused:
        parse(manifest)
    message = str(refused.value)
    assert message.startswith(f"'{WHERE}' is not a valid precache manifest: {entry} ")
    assert expected in message.split("expected", 1)[1]
    assert "\n" not in message and "\x00" not in message and len(message) < 400


def test_what_precache_writes_is_accepted() -> None:
    manifest = parse(valid())
    assert [s.path for s in manifest.shards] == ["shards/part-00001.parquet",
                                                 "shards/part-100000.parquet"]
    assert manifest.shards[0].deleted == (1, 3) and manifest.rows == 4
    legacy = valid()
    legacy["errors"]["path"] = "errors.parquet"  # as versions before table generations wrote it
    assert parse(legacy).errors["path"] == "errors.parquet"
    hdf5 = valid()
    hdf5["format"] = "hdf5"
    for shard in hdf5["shards"]:
        shard["path"] = shard["path"].replace(".parquet", ".h5")
    assert parse(hdf5).shards[1].path == "shards/part-100000.h5"
    no_deleted = copy.deepcopy(valid())
    del no_deleted["shards"][1]["deleted"]
    assert parse(no_deleted).shards[1].deleted == ()


@pytest.mark.parametrize("data", [b"[]", b'"manifest"', b"null", b"{", b"\xff"])
def test_something_other_than_a_manifest_object_is_a_manifest_error(data: bytes) -> None:
    with pytest.raises(ManifestError, match=f"^'{WHERE}' is "):
        Manifest.from_bytes(data, WHERE)
