"""The disk cache on its own, with a local folder standing in for the remote cache: what makes a
local copy count as verified (a record only precache writes, in a folder only this user can
write), what it does when a copy changed, and which folders it refuses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from precache.cache.formats.base import ShardInfo
from precache.storage import Store, UnsafeFolderError, disk_cache
from precache.storage.disk_cache import DiskCache
from precache.storage.hashing import file_checksum

OTHER_USER = 65534  # nobody


class CountingStore(Store):
    """A local folder as the remote cache, counting downloads."""

    downloads = 0

    def download(self, rel: str, dest: Path, *, checksum: str = "") -> None:
        self.downloads += 1
        super().download(rel, dest, checksum=checksum)


def remote_shard(tmp_path: Path, name: str = "part-00001.parquet",
                 data: bytes = b"shard bytes " * 1000) -> tuple[CountingStore, ShardInfo]:
    """A shard file in a local folder standing in for a remote cache, and its manifest entry."""
    path = tmp_path / "remote" / "shards" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    info = ShardInfo(path=f"shards/{name}", rows=1, bytes=len(data), checksum=file_checksum(path))
    return CountingStore(tmp_path / "remote"), info


def tamper_in_place(path: Path) -> None:
    """Change one byte of the file in place, keeping its size, then set its times back."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(before.st_size // 2)
        byte = f.read(1)
        f.seek(before.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def give_away(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``path`` another user's: for real as root, else by making this process another
    user (as far as precache asks)."""
    if os.geteuid() == 0:
        os.chown(path, OTHER_USER, -1)
    else:
        monkeypatch.setattr(os, "geteuid", lambda: os.stat(path).st_uid + 1)


@pytest.mark.parametrize("new_process", [False, True], ids=["same process", "new process"])
def test_a_copy_changed_in_place_after_verification_is_downloaded_again(
        tmp_path: Path, new_process: bool) -> None:
    store, info = remote_shard(tmp_path)
    cache = DiskCache(tmp_path / "disk")
    path = cache.fetch(store, info)
    assert store.downloads == 1 and file_checksum(path) == info.checksum
    tamper_in_place(path)  # same size, same modification time: only the bytes differ

    reader = DiskCache(tmp_path / "disk") if new_process else cache
    again = reader.fetch(store, info)
    assert again == path and store.downloads == 2 and file_checksum(again) == info.checksum


def test_a_changed_copy_whose_remote_is_gone_is_refused_not_served(tmp_path: Path) -> None:
    store, info = remote_shard(tmp_path)
    cache = DiskCache(tmp_path / "disk")
    path = cache.fetch(store, info)
    tamper_in_place(path)
    (tmp_path / "remote" / info.path).unlink()
    with pytest.raises(FileNotFoundError, match="of the manifest is missing"):
        cache.fetch(store, info)
    assert not path.exists()


def test_an_untouched_copy_is_trusted_by_a_new_process_without_hashing_or_downloading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, info = remote_shard(tmp_path)
    path = DiskCache(tmp_path / "disk").fetch(store, info)
    (tmp_path / "remote" / info.path).unlink()  # any download would fail now

    def no_hashing(path: object) -> str:
        raise AssertionError("a recorded, untouched copy was hashed again")

    monkeypatch.setattr(disk_cache, "file_checksum", no_hashing)
    assert DiskCache(tmp_path / "disk").fetch(store, info) == path
    assert store.downloads == 1


def test_recheck_hashes_a_recorded_copy_again(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    store, info = remote_shard(tmp_path)
    cache = DiskCache(tmp_path / "disk")
    cache.fetch(store, info)
    hashed = []
    monkeypatch.setattr(disk_cache, "file_checksum",
                        lambda p: hashed.append(p) or file_checksum(p))
    cache.fetch(store, info, recheck=True)
    assert len(hashed) == 1 and store.downloads == 1


def test_a_copy_without_a_record_is_hashed_kept_if_sound_and_replaced_if_not(
        tmp_path: Path) -> None:
    """As an older precache left them: no record, modification time 2000-01-01, which anyone
    can set, so it proves nothing."""
    store, info = remote_shard(tmp_path)
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    path = DiskCache(disk).path_for(info)
    old_mark = 946_684_800 * 10**9
    path.write_bytes((tmp_path / "remote" / info.path).read_bytes())
    os.utime(path, ns=(old_mark, old_mark))
    assert DiskCache(disk).fetch(store, info) == path and store.downloads == 0  # sound: kept

    path.unlink()
    (disk / f".{path.name}.ok").unlink()
    path.write_bytes(b"x" * info.bytes)  # the right size, the wrong bytes
    os.utime(path, ns=(old_mark, old_mark))
    assert DiskCache(disk).fetch(store, info) == path and store.downloads == 1
    assert file_checksum(path) == info.checksum


@pytest.mark.parametrize("checksum, path", [
    ("sha256:../victim", "shards/part-00001.parquet"),
    ("sha256:" + "A" * 64, "shards/part-00001.parquet"),
    ("sha256:" + "a" * 64, "shards/part-00001.parquet/.."),
    ("sha256:" + "a" * 64, "shards/part-00001.par/quet"),
], ids=["dotdot checksum", "upper-case hex", "no suffix", "slash in suffix"])
def test_an_entry_that_names_no_shard_is_refused_before_any_file_is_touched(
        tmp_path: Path, checksum: str, path: str) -> None:
    """``Manifest`` refuses such entries already; the disk cache does not rely on it."""
    store, _ = remote_shard(tmp_path)
    victim = tmp_path / "victim.parquet"
    victim.write_bytes(b"keep me")
    disk = tmp_path / "disk"
    with pytest.raises(ValueError, match="expected|suffix"):
        DiskCache(disk).fetch(store, ShardInfo(path=path, rows=1, bytes=7, checksum=checksum))
    assert victim.read_bytes() == b"keep me" and not disk.exists() and store.downloads == 0


def test_eviction_deletes_only_the_copies_it_made(tmp_path: Path) -> None:
    first_store, first = remote_shard(tmp_path, "part-00001.parquet", b"a" * 1000)
    second_store, second = remote_shard(tmp_path, "part-00002.parquet", b"b" * 1000)
    disk = tmp_path / "disk"
    cache = DiskCache(disk, max_bytes=1500)
    first_path = cache.fetch(first_store, first)
    (disk / "notes.txt").write_bytes(b"n" * 5000)  # not a name the disk cache writes
    (disk / ("0" * 64)).write_bytes(b"n" * 5000)
    second_path = cache.fetch(second_store, second)
    assert not first_path.exists() and not (disk / f".{first_path.name}.ok").exists()
    assert second_path.exists() and (disk / "notes.txt").exists() and (disk / ("0" * 64)).exists()
    assert cache.usage() == 1000


# ---- the folder -------------------------------------------------------------------------------

def test_the_default_folder_is_made_private(tmp_path: Path, precache_home: Path) -> None:
    store, info = remote_shard(tmp_path)
    path = DiskCache().fetch(store, info)
    assert path.parent == precache_home / "shards"
    assert os.stat(precache_home / "shards").st_mode & 0o777 == 0o700
    assert os.stat(precache_home / "shards").st_uid == os.geteuid()


def test_a_folder_of_ours_readable_by_others_is_made_private(tmp_path: Path) -> None:
    store, info = remote_shard(tmp_path)
    disk = tmp_path / "disk"
    disk.mkdir()
    disk.chmod(0o755)
    DiskCache(disk).fetch(store, info)
    assert os.stat(disk).st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o1777], ids=oct)
def test_a_folder_others_may_write_is_refused_and_nothing_in_it_is_used(
        tmp_path: Path, mode: int) -> None:
    store, info = remote_shard(tmp_path)
    disk = tmp_path / "disk"
    disk.mkdir()
    disk.chmod(mode)
    planted = DiskCache(disk).path_for(info)
    planted.write_bytes(b"p" * info.bytes)  # as another user could have
    with pytest.raises(UnsafeFolderError) as refused:
        DiskCache(disk).fetch(store, info)
    message = str(refused.value)
    assert f"disk cache folder '{disk}' is writable by other users" in message
    assert "delete it" in message and "PRECACHE_HOME=" in message and "\n" not in message
    assert planted.read_bytes() == b"p" * info.bytes and store.downloads == 0
    assert os.stat(disk).st_mode & 0o7777 == mode  # left as it was


def test_a_folder_of_another_user_is_refused(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    store, info = remote_shard(tmp_path)
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    give_away(disk, monkeypatch)
    with pytest.raises(UnsafeFolderError, match=rf"disk cache folder '{disk}' belongs to user "
                                                rf"\d+, not to you .*PRECACHE_HOME="):
        DiskCache(disk).fetch(store, info)
    assert store.downloads == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_folder_inside_another_users_folder_is_refused(tmp_path: Path) -> None:
    """As a predictable PRECACHE_HOME under /tmp that another user made first: they could
    rename the private folder away and put their own in its place."""
    store, info = remote_shard(tmp_path)
    home = tmp_path / "precache-1000"
    home.mkdir(mode=0o777)
    home.chmod(0o777)
    os.chown(home, OTHER_USER, -1)
    with pytest.raises(UnsafeFolderError, match=rf"'{home}', a folder above disk cache folder "
                                                rf"'{home}/shards', belongs to user {OTHER_USER}"):
        DiskCache(home / "shards").fetch(store, info)
    assert store.downloads == 0


def test_a_folder_inside_a_world_writable_folder_is_refused_unless_it_is_sticky(
        tmp_path: Path) -> None:
    store, info = remote_shard(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeFolderError, match=rf"'{shared}', a folder above .* is writable "
                                                r"by every user and not sticky \(mode 0777\)"):
        DiskCache(shared / "disk").fetch(store, info)
    shared.chmod(0o1777)  # like /tmp: nobody may rename what is not theirs
    assert DiskCache(shared / "disk").fetch(store, info).parent == shared / "disk"


def test_a_linked_folder_is_checked_and_used_where_it_really_is(tmp_path: Path) -> None:
    store, info = remote_shard(tmp_path)
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert DiskCache(tmp_path / "link").fetch(store, info).parent == tmp_path / "real"
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    (tmp_path / "link2").symlink_to(tmp_path / "open")
    with pytest.raises(UnsafeFolderError, match=rf"really '{tmp_path}/open'\) is writable"):
        DiskCache(tmp_path / "link2").fetch(store, info)
