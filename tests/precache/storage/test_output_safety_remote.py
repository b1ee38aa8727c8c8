"""On object storage too, a run deletes only what precache wrote: a prefix without precache's
manifest or marker is refused untouched, and a user's objects beside a cache survive re-runs and
--overwrite (against a real S3 server on 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path

import pytest

import precache
from precache import RunError
from precache.cache import MARKER
from tests.helpers import COUNTING_PIPELINE, precache_cli, write_photos
from tests.helpers import build_counting as build
from tests.helpers.remote import S3Server, remote_files, upload_folder


def test_a_prefix_without_precache_marker_is_refused_untouched(s3: S3Server, bucket: str,
                                                               tmp_path: Path) -> None:
    write_photos(tmp_path / "photos", 4)
    mine = tmp_path / "mine"
    (mine / "shards").mkdir(parents=True)
    (mine / "shards" / "train-000.tar").write_bytes(b"webdataset shard")
    (mine / "journal").mkdir()
    (mine / "journal" / "jan.txt").write_bytes(b"notes")
    url = f"s3://{bucket}/data"
    upload_folder(s3, mine, url)
    before = remote_files(s3, url)
    with pytest.raises(RunError, match="not empty and holds no precache cache"):
        build(tmp_path / "photos", url)
    done = precache_cli("run", COUNTING_PIPELINE, "-i", str(tmp_path / "photos"), "-o", url,
                        "-q", "--overwrite")
    assert done.returncode == 1 and "holds no precache cache" in done.stderr
    assert remote_files(s3, url) == before


def test_user_objects_beside_a_remote_cache_survive_reruns_and_overwrite(
        s3: S3Server, bucket: str, tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    write_photos(photos, 12)
    url = f"s3://{bucket}/cache"
    build(photos, url)
    assert MARKER in remote_files(s3, url)
    mine = tmp_path / "mine"
    (mine / "shards").mkdir(parents=True)
    (mine / "shards" / "notes.txt").write_bytes(b"mine")
    (mine / "README.md").write_bytes(b"mine too")
    upload_folder(s3, mine, url)
    build(photos, url, params={"size": 8})  # a new fingerprint: every shard replaced
    build(photos, url, overwrite=True)
    files = remote_files(s3, url)
    assert files["shards/notes.txt"] == 4 and files["README.md"] == 8
    manifest = precache.Cache(url).manifest
    assert sorted(files) == sorted(["manifest.json", MARKER, manifest.index["path"],
                                    f"generations/manifest-{manifest.generation:05d}.json",
                                    manifest.errors["path"], "shards/notes.txt", "README.md",
                                    *(s.path for s in manifest.shards)])
