"""``Store``: the files of one folder (a cache) on local disk or in object storage, read and
written through one pyarrow filesystem. Every write is atomic: a rename of a finished file on
local disk, one upload of a finished file on an object store."""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from precache.storage.durable import atomic_write_bytes
from precache.storage.locations import (ChecksumError, StorageError, explained, is_remote,
                                        local_path, resolve)

__all__ = ["Store"]

_BLOCK = 4 << 20
"""Bytes per read when hashing a download as it arrives."""


class Store:
    """The files of one folder (a cache) on local disk or in object storage.

    Args:
        location: a local path, a ``file://`` URL, or an ``s3://``/``gs://`` URL of a folder.

    Raises:
        StorageError: an unknown scheme (see ``resolve``).
    """

    def __init__(self, location: str | os.PathLike[str]) -> None:
        self.remote = is_remote(location)
        self.url = str(location).rstrip("/") if self.remote else str(local_path(location))
        self._fs, self.base = resolve(location)
        self._pid = os.getpid()

    @property
    def fs(self) -> pafs.FileSystem:
        """This process's client: a forked DataLoader worker must not share the parent's
        connections (two processes on one socket stalled reads for ~9 s here)."""
        if self._pid != os.getpid():
            self._fs, self._pid = resolve(self.url)[0], os.getpid()
        return self._fs

    def __getstate__(self) -> dict[str, object]:
        return {"url": self.url}  # clients are made per process

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["url"])  # type: ignore[misc]

    def uri(self, rel: str = "") -> str:
        """The full location of ``rel`` in this folder, for messages."""
        return f"{self.url}/{rel}" if rel else self.url

    def _path(self, rel: str) -> str:
        return f"{self.base}/{rel}" if rel else self.base

    def size(self, rel: str) -> int:
        """Size of the file ``rel`` in bytes, -1 if there is none."""
        with explained(self.uri(rel)):
            info = self.fs.get_file_info(self._path(rel))
        return info.size if info.type == pafs.FileType.File else -1

    def exists(self, rel: str) -> bool:
        """Whether a file or folder ``rel`` exists."""
        with explained(self.uri(rel)):
            return self.fs.get_file_info(self._path(rel)).type != pafs.FileType.NotFound

    def list(self, rel: str = "", *, folders: bool = False) -> list[str]:
        """Names of the files (and with ``folders``, the folders) directly in folder ``rel``;
        empty if it does not exist."""
        selector = pafs.FileSelector(self._path(rel), allow_not_found=True)
        with explained(self.uri(rel)):
            infos = self.fs.get_file_info(selector)
        wanted = (pafs.FileType.File, pafs.FileType.Directory) if folders else (pafs.FileType.File,)
        return sorted(i.base_name for i in infos if i.type in wanted)

    def sizes(self, rel: str) -> dict[str, int]:
        """Name -> size in bytes of the files directly in folder ``rel`` (one listing: one
        request per 1,000 files on object storage); empty if it does not exist."""
        selector = pafs.FileSelector(self._path(rel), allow_not_found=True)
        with explained(self.uri(rel)):
            infos = self.fs.get_file_info(selector)
        return {i.base_name: i.size for i in infos if i.type == pafs.FileType.File}

    def total_bytes(self) -> int:
        """Bytes of all files under this folder."""
        selector = pafs.FileSelector(self.base, allow_not_found=True, recursive=True)
        with explained(self.uri()):
            return sum(i.size for i in self.fs.get_file_info(selector)
                       if i.type == pafs.FileType.File)

    def read_bytes(self, rel: str) -> bytes:
        """The bytes of file ``rel`` (``FileNotFoundError`` if missing)."""
        with explained(self.uri(rel)), self.fs.open_input_stream(self._path(rel)) as f:
            return f.read()

    def open_input(self, rel: str) -> pa.NativeFile:
        """A random-access file (for ``pyarrow.parquet.read_table``)."""
        with explained(self.uri(rel)):
            return self.fs.open_input_file(self._path(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write ``data`` as file ``rel``, atomically: readers see the old or the whole new one."""
        if not self.remote:
            path = Path(self._path(rel))
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, data)
            return
        with explained(self.uri(rel)):
            with self.fs.open_output_stream(self._path(rel)) as out:
                out.write(data)
        self._check_size(rel, len(data))

    def put_file(self, local: Path, rel: str) -> None:
        """Move the finished local file ``local`` to ``rel``: a rename on local disk, one upload
        (then the local file is deleted) on object storage."""
        if not self.remote:
            Path(self._path(rel)).parent.mkdir(parents=True, exist_ok=True)
            os.replace(local, self._path(rel))
            return
        size = local.stat().st_size
        # An error mid-upload may still leave a short object at ``rel`` (pyarrow completes an
        # upload when the stream closes): shards are named in a journal or manifest only after
        # this returns, so such a file is an orphan that the next run deletes.
        with explained(self.uri(rel)), open(local, "rb") as src:
            with self.fs.open_output_stream(self._path(rel)) as out:
                out.upload(src)
        self._check_size(rel, size)
        local.unlink()

    def _check_size(self, rel: str, size: int) -> None:
        got = self.size(rel)
        if got != size:
            raise StorageError(f"'{self.uri(rel)}' holds {got} bytes after uploading {size}; "
                               "the upload was cut short: re-run to write it again")

    def download(self, rel: str, dest: Path, *, checksum: str = "") -> None:
        """Copy file ``rel`` to the local path ``dest`` (fsynced), checking its SHA-256 against
        ``checksum`` (``sha256:<hex>``) when one is given.

        Raises:
            ChecksumError: the bytes do not match ``checksum`` (``dest`` is removed).
        """
        digest = hashlib.sha256()
        with explained(self.uri(rel)), self.fs.open_input_stream(self._path(rel)) as src, \
                open(dest, "wb") as out:
            while block := src.read(_BLOCK):
                digest.update(block)
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
        got = f"sha256:{digest.hexdigest()}"
        if checksum and got != checksum:
            dest.unlink()
            raise ChecksumError(
                f"'{self.uri(rel)}' has checksum {got}, the manifest says {checksum}: the file was "
                f"changed after the cache was written; run `precache verify {self.url}` and re-run "
                "the pipeline (with --overwrite if it does not heal) to rewrite it")

    def checksum(self, rel: str) -> str:
        """``sha256:<hex>`` of file ``rel``, as the manifest records checksums."""
        digest = hashlib.sha256()
        with explained(self.uri(rel)), self.fs.open_input_stream(self._path(rel)) as src:
            while block := src.read(_BLOCK):
                digest.update(block)
        return f"sha256:{digest.hexdigest()}"

    def delete(self, rel: str) -> None:
        """Delete file ``rel`` if it exists."""
        with contextlib.suppress(FileNotFoundError), explained(self.uri(rel)):
            self.fs.delete_file(self._path(rel))

    def delete_dir(self, rel: str) -> None:
        """Delete folder ``rel`` and everything in it, if it exists."""
        with contextlib.suppress(FileNotFoundError), explained(self.uri(rel)):
            self.fs.delete_dir(self._path(rel))

    def check_bucket(self) -> None:
        """Raise ``StorageError`` naming the fix if this folder's bucket does not exist (or the
        credentials are refused); a no-op for local folders."""
        if not self.remote:
            return
        bucket = self.base.split("/", 1)[0]
        with explained(self.url):
            found = self.fs.get_file_info(bucket).type != pafs.FileType.NotFound
        if not found:
            scheme = urlsplit(self.url).scheme.lower()
            make = (f"gcloud storage buckets create gs://{bucket}" if scheme in ("gs", "gcs")
                    else f"aws s3 mb s3://{bucket}")
            raise StorageError(f"'{self.url}': bucket '{bucket}' does not exist; create it first "
                               f"(e.g. `{make}`) or fix the URL")
