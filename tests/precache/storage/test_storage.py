"""URLs to filesystems, errors that name the URL and the fix, and inputs listed and read from S3."""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs
import pytest

import precache
from precache.cache import ManifestError
from precache.processing.sources import InputError, list_inputs
from precache.cache import CacheLayout
from precache.storage import (StorageError, Store, is_remote, local_path, open_input_file,
                              read_remote_bytes, resolve)
from tests.helpers import build_cache, write_photos
from tests.helpers.remote import upload_folder


@pytest.fixture
def offline_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """An S3-compatible endpoint that is never contacted (so no region lookup at AWS either)."""
    monkeypatch.setenv("PRECACHE_S3_ENDPOINT", "http://127.0.0.1:9")


def test_paths_and_urls_resolve_to_their_filesystems(tmp_path: Path, offline_endpoint) -> None:
    fs, path = resolve(f"file://{tmp_path}/cache")
    assert isinstance(fs, pafs.LocalFileSystem) and path == f"{tmp_path}/cache"
    assert local_path(f"file://{tmp_path}/a%20b") == tmp_path / "a b"
    assert not is_remote(tmp_path) and not is_remote(f"file://{tmp_path}") and is_remote("s3://b/c")
    fs, path = resolve("s3://bucket/some/cache/")
    assert isinstance(fs, pafs.S3FileSystem) and path == "bucket/some/cache"
    with pytest.raises(StorageError,
                       match=r"'ftp://host/cache': unknown storage scheme 'ftp://'.*s3://"):
        resolve("ftp://host/cache")
    with pytest.raises(StorageError, match="names no bucket"):
        resolve("s3:///cache")


def test_a_missing_bucket_and_refused_credentials_name_the_url_and_the_fix(
        s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(StorageError, match=r"'s3://no-such-bucket/c': bucket 'no-such-bucket' "
                                           r"does not exist; create it first"):
        precache.Cache("s3://no-such-bucket/c")
    write_photos(tmp_path / "photos", 2)
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist"):
        build_cache(tmp_path / "photos", "s3://no-such-bucket/c", pipeline="images", workers=1)
    bucket = s3.new_bucket()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    refused = (rf"'s3://{bucket}/c/manifest.json'.*credentials were refused: "
               "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StorageError, match=refused):
        precache.Cache(f"s3://{bucket}/c")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
    with pytest.raises(ManifestError, match="no manifest.json"):
        precache.Cache(f"s3://{bucket}/c")


def test_remote_inputs_are_listed_and_read_like_local_ones(s3, bucket: str, tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    write_photos(photos / "sub", 3)
    write_photos(photos, 2)
    (photos / ".hidden.jpg").write_bytes(b"x")
    (photos / "notes.md").write_text("not an input")
    listed = f"img0001.jpg\ns3://{bucket}/photos/sub/img0002.jpg\nnope.jpg\n"
    (photos / "list.txt").write_text(listed)
    upload_folder(s3, photos, f"s3://{bucket}/photos")
    extensions = (".jpg", ".png")

    remote = list_inputs(f"s3://{bucket}/photos", extensions)
    local = list_inputs(photos, extensions)
    assert [(i.key, i.size) for i in remote] == [(i.key, i.size) for i in local]
    assert [i.locator for i in remote][:1] == [f"s3://{bucket}/photos/img0000.png"]
    assert all(read_remote_bytes(r.locator) == Path(here.locator).read_bytes()
               for r, here in zip(remote, local))
    with open_input_file(remote[1].locator) as f:  # random access, as record files need
        assert f.read_at(5, 2) == Path(local[1].locator).read_bytes()[2:7]

    listed = list_inputs(f"s3://{bucket}/photos/list.txt", extensions)
    assert [(i.key, i.size >= 0) for i in listed] == [
        ("img0001.jpg", True), ("nope.jpg", False), (f"s3://{bucket}/photos/sub/img0002.jpg", True)]
    with pytest.raises(FileNotFoundError):
        read_remote_bytes(listed[1].locator)  # a listed input that fails to read, as locally
    with pytest.raises(InputError, match="does not exist"):
        list_inputs(f"s3://{bucket}/elsewhere", extensions)
    with pytest.raises(InputError, match="no inputs ending in"):
        list_inputs(f"s3://{bucket}/photos", (".webp",))


def test_a_store_writes_whole_files_and_lists_them(s3, bucket: str, tmp_path: Path) -> None:
    store = Store(f"s3://{bucket}/cache")
    store.write_bytes("manifest.json", b"{}")
    local = tmp_path / "part.bin"
    local.write_bytes(b"abc" * 1000)
    store.put_file(local, "shards/part-00001.bin")
    assert not local.exists()  # moved, as a rename would
    assert store.list() == ["manifest.json"] and store.list(folders=True) == ["manifest.json",
                                                                               "shards"]
    assert store.size("shards/part-00001.bin") == 3000 and store.size("nothing") == -1
    assert store.total_bytes() == 3002
    store.delete_dir("shards")
    assert store.list("shards") == [] and store.exists("manifest.json")


def test_a_stale_journal_is_forgotten_when_the_cache_was_published_elsewhere(
        tmp_path: Path, offline_endpoint) -> None:
    layout = CacheLayout(tmp_path / "work", url="s3://b/c")
    layout.forget_stale_journal(3)
    (layout.journal / "part-00007.json").write_text("{}")
    layout.forget_stale_journal(3)  # the same published generation: the entries are this run's
    assert (layout.journal / "part-00007.json").exists()
    layout.forget_stale_journal(4)  # another machine published since: its shards may be gone
    assert not (layout.journal / "part-00007.json").exists()
