"""A remote cache is read from storage others may write: a manifest crafted to reach outside the
cache (a checksum or a path with ``..``, an absolute path) is refused by ``Cache``,
``CachedDataset`` and ``precache verify`` before any file is read, downloaded or deleted, against
a real S3 server (SeaweedFS) and the GCS emulator; and a disk cache folder others may write is
refused with a one-line error."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from precache import Cache
from precache.cache import ManifestError
from precache.loading import CachedDataset
from tests.helpers import precache_cli, write_photos
from tests.helpers import build_counting as build
from tests.helpers.remote import GcsServer, S3Server, upload_folder

VICTIM_TEXT = b"a file outside the disk cache folder"


@pytest.fixture(scope="module")
def local_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real cache (2 Parquet shards), built once, uploaded by each test with its manifest
    changed."""
    root = tmp_path_factory.mktemp("untrusted")
    write_photos(root / "photos", 12)
    return build(root / "photos", root / "cache").cache


def plant(server: S3Server | GcsServer, cache: Path, url: str,
          change: Callable[[dict[str, Any]], None]) -> None:
    """Upload ``cache`` to ``url`` with its manifest changed by ``change``, as someone who may
    write to the bucket could."""
    upload_folder(server, cache, url)
    manifest = json.loads((cache / "manifest.json").read_text())
    change(manifest)
    with server.filesystem().open_output_stream(f"{url.split('://', 1)[1]}/manifest.json") as f:
        f.write(json.dumps(manifest).encode())


def victim_beside(folder: Path) -> Path:
    """The file a checksum ``sha256:../victim`` of a ``.parquet`` shard named for the disk cache
    ``folder`` before this was fixed (and which it then deleted)."""
    victim = folder.parent / "victim.parquet"
    victim.parent.mkdir(parents=True, exist_ok=True)
    victim.write_bytes(VICTIM_TEXT)
    return victim


def set_shard(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda manifest: manifest["shards"][0].__setitem__(field, value)


ATTACKS = {
    "checksum ../victim": ("shards[0].checksum", set_shard("checksum", "sha256:../victim")),
    "path ../../victim": ("shards[0].path", set_shard("path", "../../victim.parquet")),
    "absolute path": ("shards[0].path", None),  # the victim's own path, set in the test
    "absolute index": ("index.path", None),
}


def attack(name: str, victim: Path) -> tuple[str, Callable[[dict[str, Any]], None]]:
    entry, change = ATTACKS[name]
    if name == "absolute path":
        change = set_shard("path", str(victim))
    elif name == "absolute index":
        change = lambda manifest: manifest["index"].__setitem__("path", str(victim))  # noqa: E731
    return entry, change


def refusals(url: str, entry: str) -> None:
    """``Cache`` (and a read through it) and ``CachedDataset`` refuse the cache at ``url``."""
    expected = re.escape(f"'{url}/manifest.json' is not a valid precache manifest: {entry} is ")
    with pytest.raises(ManifestError, match=expected):
        Cache(url).reader(0)
    with pytest.raises(ManifestError, match=expected):
        CachedDataset(url, columns=["key"])[0]


@pytest.mark.parametrize("name", list(ATTACKS))
def test_a_crafted_s3_manifest_is_refused_and_nothing_is_read_or_deleted(
        s3: S3Server, bucket: str, local_cache: Path, precache_home: Path, name: str) -> None:
    url = f"s3://{bucket}/evil"
    victim = victim_beside(precache_home / "shards")  # the default disk cache: Cache and the CLI
    entry, change = attack(name, victim)
    plant(s3, local_cache, url, change)

    refusals(url, entry)
    if name != "absolute index":  # (the command reads the manifest as Cache does; 3 s a run)
        done = precache_cli("verify", url)
        assert done.returncode == 1 and done.stdout == ""
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert lines[0].startswith(f"precache: error: '{url}/manifest.json' is not a valid "
                                   f"precache manifest: {entry} is ")
        assert "expected" in lines[0]
    assert victim.read_bytes() == VICTIM_TEXT
    assert not (precache_home / "shards").exists()  # not even made: nothing was downloaded


def test_a_crafted_gcs_manifest_is_refused_and_nothing_is_read_or_deleted(
        gcs: GcsServer, local_cache: Path, tmp_path: Path, precache_home: Path) -> None:
    url = f"gs://{gcs.new_bucket()}/evil"
    disk = tmp_path / "disk"
    victim = victim_beside(disk)
    plant(gcs, local_cache, url, set_shard("checksum", "sha256:../victim"))
    with pytest.raises(ManifestError, match=r"shards\[0\]\.checksum is 'sha256:../victim', "
                                            r"expected sha256:<64 lowercase hex digits>"):
        CachedDataset(url, columns=["key"], disk_cache_dir=disk)[0]
    done = precache_cli("verify", url)
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "shards[0].checksum is 'sha256:../victim'" in done.stderr
    assert victim.read_bytes() == VICTIM_TEXT and not disk.exists()


def test_a_local_cache_whose_manifest_names_a_file_outside_it_is_refused(
        local_cache: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.parquet"
    victim.write_bytes(VICTIM_TEXT)
    cache = tmp_path / "cache"
    cache.mkdir()
    for path in local_cache.rglob("*"):
        if path.is_file():
            (cache / path.relative_to(local_cache)).parent.mkdir(parents=True, exist_ok=True)
            (cache / path.relative_to(local_cache)).write_bytes(path.read_bytes())
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["shards"][1]["path"] = str(victim)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    # the value is shortened past 80 characters (a long temporary folder): its start is enough
    with pytest.raises(ManifestError, match=r"shards\[1\]\.path is '/.*, expected "
                                            r"shards/part-NNNNN-<16 hex digits>\.parquet"):
        Cache(cache)
    done = precache_cli("verify", str(cache))
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert victim.read_bytes() == VICTIM_TEXT


def test_a_disk_cache_folder_others_may_write_is_a_one_line_error(
        s3: S3Server, bucket: str, local_cache: Path, precache_home: Path) -> None:
    url = f"s3://{bucket}/cache"
    upload_folder(s3, local_cache, url)
    (precache_home / "shards").mkdir(parents=True)
    (precache_home / "shards").chmod(0o777)
    done = precache_cli("verify", url)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"precache: error: disk cache folder '{precache_home / 'shards'}' is writable by other "
        "users (mode 0777), who could have put files there that precache would take for its "
        "own; delete it (precache then makes a private one), or use a folder of your own "
        "instead: PRECACHE_HOME=/a/folder/on/local/disk (or disk_cache_dir= of CachedDataset)"]
    (precache_home / "shards").rmdir()
    done = precache_cli("verify", url)
    assert done.returncode == 0, done.stderr
    assert (precache_home / "shards").stat().st_mode & 0o777 == 0o700
