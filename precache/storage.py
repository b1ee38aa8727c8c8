"""Where caches and inputs live: local paths, ``file://``, ``s3://`` and ``gs://`` URLs.

A location resolves to a pyarrow ``FileSystem`` and a path in it. ``Store`` reads and writes the
files of one folder there (a cache's manifest, shards and tables). Every write is atomic: on a
local disk a rename of a finished file, on an object store one upload of a finished file (S3 shows
an object only when its upload completes). So a reader never sees half a file.

S3 settings come from the standard environment, read by pyarrow itself: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and ``~/.aws``. pyarrow 26
ignores ``AWS_ENDPOINT_URL``, so the endpoint of an S3-compatible server (MinIO, SeaweedFS, ...)
is read here: ``PRECACHE_S3_ENDPOINT``, else ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``;
the region from ``AWS_REGION`` or ``AWS_DEFAULT_REGION``.

GCS credentials are found by pyarrow (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's default
credentials, the metadata server). ``STORAGE_EMULATOR_HOST`` (the variable Google's own clients
read) points ``gs://`` at a GCS emulator instead, without credentials.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import os
import re
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator
from urllib.parse import unquote, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from precache.manifest import atomic_write_bytes

if TYPE_CHECKING:
    from precache.sources import Input

__all__ = ["StorageError", "ChecksumError", "UnsafeFolderError", "Store", "is_remote",
           "local_path", "resolve", "precache_home", "private_dir", "work_dir_for",
           "list_remote_inputs", "read_remote_bytes", "open_input_file", "ENDPOINT_VARIABLES",
           "GCS_EMULATOR_VARIABLE"]

ENDPOINT_VARIABLES = ("PRECACHE_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""Where the endpoint of an S3-compatible server is read from, first set wins."""

GCS_EMULATOR_VARIABLE = "STORAGE_EMULATOR_HOST"
"""``http://HOST:PORT`` of a GCS emulator to use for ``gs://`` URLs, as Google's clients read it."""

_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+)://")
_BLOCK = 4 << 20


class StorageError(OSError):
    """A location cannot be used: unknown scheme, missing bucket, refused credentials, no network.
    The message names the URL and the fix."""


class ChecksumError(StorageError):
    """A downloaded file's bytes do not match the checksum the manifest records."""


class UnsafeFolderError(StorageError):
    """A local folder whose files precache trusts (the disk cache) could be written by another
    user. The message names the folder and the fix."""


def is_remote(location: str | os.PathLike[str]) -> bool:
    """True for a URL other than ``file://`` (a ``Path`` or a plain path is local)."""
    match = _URL.match(location) if isinstance(location, str) else None
    return match is not None and match["scheme"].lower() != "file"


def local_path(location: str | os.PathLike[str]) -> Path:
    """The local path of a plain path or a ``file://`` URL."""
    if isinstance(location, str) and location.lower().startswith("file://"):
        parts = urlsplit(location)
        if parts.netloc not in ("", "localhost"):
            raise StorageError(f"'{location}': a file:// URL names a local path "
                               "(file:///abs/path); use s3:// or gs:// for remote storage")
        return Path(unquote(parts.path))
    return Path(location)


def _s3_options(bucket: str) -> dict[str, str]:
    """S3FileSystem arguments that pyarrow does not take from the environment itself."""
    options: dict[str, str] = {}
    endpoint = next((os.environ[v] for v in ENDPOINT_VARIABLES if os.environ.get(v)), "")
    if endpoint:
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        options.update(endpoint_override=parts.netloc, scheme=parts.scheme)
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    elif endpoint:
        options["region"] = "us-east-1"  # S3-compatible servers ignore it
    else:
        options["region"] = _bucket_region(bucket)  # as pyarrow's from_uri does
    return options


def _gcs_options() -> dict[str, str]:
    """GcsFileSystem arguments for an emulator named by ``STORAGE_EMULATOR_HOST`` (else none)."""
    host = os.environ.get(GCS_EMULATOR_VARIABLE, "")
    if not host:
        return {}
    parts = urlsplit(host if "://" in host else f"http://{host}")
    return {"endpoint_override": parts.netloc, "scheme": parts.scheme}


@functools.lru_cache(maxsize=64)
def _bucket_region(bucket: str) -> str:
    try:
        return pafs.resolve_s3_region(bucket)
    except (OSError, ValueError):
        return "us-east-1"  # let the request itself report what is wrong


@functools.lru_cache(maxsize=16)
def _filesystem(scheme: str, options: tuple[tuple[str, str], ...], pid: int) -> pafs.FileSystem:
    """One filesystem per scheme, settings and process (a forked worker makes its own)."""
    if scheme == "s3":
        # allow_delayed_open: a file smaller than one part (5 MiB) is one PutObject, not a
        # multipart upload of three requests.
        return pafs.S3FileSystem(allow_delayed_open=True, **dict(options))
    if scheme == "gs" and options:  # an emulator: no credentials; a wrong port fails in seconds
        return pafs.GcsFileSystem(anonymous=True, retry_time_limit=datetime.timedelta(seconds=5),
                                  **dict(options))
    if scheme == "gs":
        return pafs.GcsFileSystem()  # credentials: GOOGLE_APPLICATION_CREDENTIALS or gcloud's
    return pafs.LocalFileSystem()


def resolve(location: str | os.PathLike[str]) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and the path in it of a local path or URL.

    Raises:
        StorageError: an unknown or unsupported scheme.
    """
    if not is_remote(location):
        return _filesystem("file", (), os.getpid()), str(local_path(location).absolute())
    url = str(location)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    path = f"{parts.netloc}{parts.path}".rstrip("/")
    if not parts.netloc:
        raise StorageError(f"'{url}' names no bucket; write {scheme}://BUCKET/PATH")
    if scheme in ("s3", "s3a"):
        options = tuple(sorted(_s3_options(parts.netloc).items()))
        return _filesystem("s3", options, os.getpid()), path
    if scheme in ("gs", "gcs"):
        return _filesystem("gs", tuple(sorted(_gcs_options().items())), os.getpid()), path
    raise StorageError(f"'{url}': unknown storage scheme '{scheme}://'; precache reads and writes "
                       "local paths, file://, s3:// (and S3-compatible servers) and gs://")


def _hint(text: str, url: str) -> str:
    if any(s in text for s in ("ACCESS_DENIED", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                               "AccessDenied", "Forbidden", "PERMISSION_DENIED")):
        if url.startswith(("gs://", "gcs://")):
            return ("the credentials were refused: point GOOGLE_APPLICATION_CREDENTIALS at a "
                    "service-account key allowed to use this bucket")
        return ("the credentials were refused: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE) to keys allowed to use this bucket")
    if any(s in text for s in ("NO_SUCH_BUCKET", "NoSuchBucket")):
        return "the bucket does not exist: create it first or fix the URL"
    if any(s in text for s in ("NETWORK_CONNECTION", "resolve host", "connect", "Connection")):
        if url.startswith(("gs://", "gcs://")):
            return (f"the storage server cannot be reached: check the network (and "
                    f"{GCS_EMULATOR_VARIABLE}, which points gs:// at an emulator)")
        return ("the storage server cannot be reached: check the network and, for an "
                f"S3-compatible server, the endpoint ({' or '.join(ENDPOINT_VARIABLES)})")
    return "check the URL, the credentials and the network"


@contextlib.contextmanager
def _explained(url: str) -> Iterator[None]:
    """Turn the storage service's errors into ``StorageError``s that name ``url`` and the fix.
    Errors of the local system (they carry an ``errno``: a missing file, a full disk) pass."""
    try:
        yield
    except StorageError:
        raise
    except OSError as e:
        if e.errno is not None:
            raise
        text = str(e).strip()
        raise StorageError(f"'{url}': {text}; {_hint(text, url)}") from None


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
        with _explained(self.uri(rel)):
            info = self.fs.get_file_info(self._path(rel))
        return info.size if info.type == pafs.FileType.File else -1

    def exists(self, rel: str) -> bool:
        """Whether a file or folder ``rel`` exists."""
        with _explained(self.uri(rel)):
            return self.fs.get_file_info(self._path(rel)).type != pafs.FileType.NotFound

    def list(self, rel: str = "", *, folders: bool = False) -> list[str]:
        """Names of the files (and with ``folders``, the folders) directly in folder ``rel``;
        empty if it does not exist."""
        selector = pafs.FileSelector(self._path(rel), allow_not_found=True)
        with _explained(self.uri(rel)):
            infos = self.fs.get_file_info(selector)
        wanted = (pafs.FileType.File, pafs.FileType.Directory) if folders else (pafs.FileType.File,)
        return sorted(i.base_name for i in infos if i.type in wanted)

    def total_bytes(self) -> int:
        """Bytes of all files under this folder."""
        selector = pafs.FileSelector(self.base, allow_not_found=True, recursive=True)
        with _explained(self.uri()):
            return sum(i.size for i in self.fs.get_file_info(selector)
                       if i.type == pafs.FileType.File)

    def read_bytes(self, rel: str) -> bytes:
        """The bytes of file ``rel`` (``FileNotFoundError`` if missing)."""
        with _explained(self.uri(rel)), self.fs.open_input_stream(self._path(rel)) as f:
            return f.read()

    def open_input(self, rel: str) -> pa.NativeFile:
        """A random-access file (for ``pyarrow.parquet.read_table``)."""
        with _explained(self.uri(rel)):
            return self.fs.open_input_file(self._path(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write ``data`` as file ``rel``, atomically: readers see the old or the whole new one."""
        if not self.remote:
            path = Path(self._path(rel))
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, data)
            return
        with _explained(self.uri(rel)):
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
        with _explained(self.uri(rel)), open(local, "rb") as src:
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
        with _explained(self.uri(rel)), self.fs.open_input_stream(self._path(rel)) as src, \
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
        with _explained(self.uri(rel)), self.fs.open_input_stream(self._path(rel)) as src:
            while block := src.read(_BLOCK):
                digest.update(block)
        return f"sha256:{digest.hexdigest()}"

    def delete(self, rel: str) -> None:
        """Delete file ``rel`` if it exists."""
        with contextlib.suppress(FileNotFoundError), _explained(self.uri(rel)):
            self.fs.delete_file(self._path(rel))

    def delete_dir(self, rel: str) -> None:
        """Delete folder ``rel`` and everything in it, if it exists."""
        with contextlib.suppress(FileNotFoundError), _explained(self.uri(rel)):
            self.fs.delete_dir(self._path(rel))

    def check_bucket(self) -> None:
        """Raise ``StorageError`` naming the fix if this folder's bucket does not exist (or the
        credentials are refused); a no-op for local folders."""
        if not self.remote:
            return
        bucket = self.base.split("/", 1)[0]
        with _explained(self.url):
            found = self.fs.get_file_info(bucket).type != pafs.FileType.NotFound
        if not found:
            scheme = urlsplit(self.url).scheme.lower()
            make = (f"gcloud storage buckets create gs://{bucket}" if scheme in ("gs", "gcs")
                    else f"aws s3 mb s3://{bucket}")
            raise StorageError(f"'{self.url}': bucket '{bucket}' does not exist; create it first "
                               f"(e.g. `{make}`) or fix the URL")


def precache_home() -> Path:
    """Where precache keeps local state: ``$PRECACHE_HOME``, else ``$XDG_CACHE_HOME/precache``,
    else ``~/.cache/precache``; as an absolute path. A relative ``$XDG_CACHE_HOME`` is ignored,
    as the XDG specification says. What precache trusts there (the disk cache) is checked to be
    private when it is used: see ``private_dir``."""
    if os.environ.get("PRECACHE_HOME"):
        return Path(os.environ["PRECACHE_HOME"]).absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "precache"


def private_dir(path: str | os.PathLike[str], what: str = "folder", instead: str = "") -> Path:
    """The local folder ``path``, made (mode 0700) if missing, and checked to be writable by this
    user alone, since precache trusts what it finds there; returns its real path (symbolic links
    resolved), which callers then use, so a link swapped later cannot redirect them.

    Checked: the folder belongs to this user and is not group- or world-writable (one only
    readable by others is made 0700); every folder above it belongs to this user or root and is
    not world-writable unless sticky (like ``/tmp``), so nobody else can rename it away and put
    their own in its place. A group-writable folder above is accepted: systems with a private
    group per user make home folders group-writable.

    Args:
        what: what the folder is, for messages (``"disk cache folder"``).
        instead: how to name another folder, for messages (default: ``$PRECACHE_HOME``).

    Raises:
        UnsafeFolderError: another user could write there; names the folder and the fix.
        StorageError: the folder cannot be made.
    """
    path = Path(path).absolute()
    instead = instead or "use a folder of your own instead: PRECACHE_HOME=/a/folder/on/local/disk"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        pass  # a file: reported below
    except OSError as e:
        raise StorageError(f"cannot make {what} '{path}' ({e.strerror}); {instead}") from None
    real = Path(os.path.realpath(path))
    uid = os.geteuid()
    info = os.stat(real)
    named = f"{what} '{path}'" + (f" (really '{real}')" if real != path else "")
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolderError(f"{named} is not a folder; {instead}")
    if info.st_uid != uid:
        raise UnsafeFolderError(
            f"{named} belongs to user {info.st_uid}, not to you (user {uid}): its owner could "
            f"put files there that precache would take for its own; {instead}")
    if info.st_mode & 0o022:
        raise UnsafeFolderError(
            f"{named} is writable by other users (mode {stat.S_IMODE(info.st_mode):04o}), who "
            "could have put files there that precache would take for its own; delete it "
            f"(precache then makes a private one), or {instead}")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(real, 0o700)  # ours, and only we could write to it: keep it so, and unread
    for parent in real.parents:
        info = os.stat(parent)
        if info.st_uid not in (uid, 0):
            raise UnsafeFolderError(
                f"'{parent}', a folder above {named}, belongs to user {info.st_uid}, who could "
                f"replace the folder with one of their own; {instead}")
        if info.st_mode & 0o002 and not info.st_mode & stat.S_ISVTX:
            raise UnsafeFolderError(
                f"'{parent}', a folder above {named}, is writable by every user and not sticky "
                f"(mode {stat.S_IMODE(info.st_mode):04o}), so anyone could replace the folder "
                f"with one of their own; {instead}")
    return real


def work_dir_for(url: str) -> Path:
    """The local working directory of a run writing the remote cache ``url`` (its lock, journal
    and staging): ``precache_home()/work/<hash of the URL and endpoint>``."""
    endpoint = next((os.environ[v] for v in ENDPOINT_VARIABLES if os.environ.get(v)), "")
    key = hashlib.sha256(f"{url.rstrip('/')}\n{endpoint}".encode()).hexdigest()[:16]
    return precache_home() / "work" / key


# ---- inputs on object storage ------------------------------------------------------------------


def _mtime_ns(info: pafs.FileInfo) -> int:
    # Unknown modification time: "now", which never matches the cache's record, so the input's
    # content hash decides whether it changed.
    return info.mtime_ns if info.mtime_ns is not None else time.time_ns()


def _hidden(key: str) -> bool:
    return any(part.startswith(".") for part in key.split("/"))


def list_remote_inputs(url: str, extensions: tuple[str, ...]) -> list[Input]:
    """The inputs at the remote ``url``, as ``sources.list_inputs`` finds them at a local path
    (which then expands record files, sorts, and checks for none and for duplicates): a folder
    (prefix, searched recursively; hidden names skipped), a single matching file, or a
    ``.txt``/``.lst`` list of URLs or paths relative to the list's folder. Locators are full
    URLs; keys are paths relative to ``url``.

    Raises:
        InputError: the URL does not exist or is a file of another kind.
        StorageError: unknown scheme, refused credentials, unreachable server.
    """
    from precache.sources import LIST_SUFFIXES, Input, InputError

    store = Store(url)
    with _explained(url):
        info = store.fs.get_file_info(store.base)
    if info.type == pafs.FileType.NotFound:
        store.check_bucket()
        raise InputError(f"input '{url}' does not exist")
    if info.type == pafs.FileType.Directory:
        selector = pafs.FileSelector(store.base, recursive=True)
        with _explained(url):
            found = store.fs.get_file_info(selector)
        inputs = []
        for item in found:
            key = item.path[len(store.base) + 1:]
            if (item.type == pafs.FileType.File and not _hidden(key)
                    and key.lower().endswith(extensions)):
                inputs.append(Input(key, f"{store.url}/{key}", item.size, _mtime_ns(item)))
    elif info.base_name.lower().endswith(extensions):
        inputs = [Input(info.base_name, store.url, info.size, _mtime_ns(info))]
    elif Path(info.base_name).suffix.lower() in LIST_SUFFIXES:
        inputs = _read_remote_list(store)
    else:
        raise InputError(f"input '{url}' is neither a folder, a file ending in "
                         f"{', '.join(extensions)}, nor a list of paths "
                         f"({', '.join(LIST_SUFFIXES)})")
    return inputs


def _read_remote_list(store: Store) -> list[Input]:
    """The entries of a remote list file, each a URL or a path relative to the list's folder."""
    from precache.sources import Input

    folder = store.url.rsplit("/", 1)[0]
    entries = [line.strip() for line in store.read_bytes("").decode("utf-8").splitlines()]
    inputs = []
    for entry in (e for e in entries if e and not e.startswith("#")):
        locator = entry if _URL.match(entry) else f"{folder}/{entry.lstrip('/')}"
        fs, path = resolve(locator)
        with _explained(locator):
            info = fs.get_file_info(path)
        if info.type == pafs.FileType.File:
            inputs.append(Input(entry, locator, info.size, _mtime_ns(info)))
        else:
            inputs.append(Input(entry, locator, -1, -1))  # listed; reading it fails with the reason
    return inputs


def read_remote_bytes(url: str) -> bytes:
    """The bytes of the remote input ``url`` (a whole object).

    Raises:
        OSError: it cannot be read (``FileNotFoundError``, ``StorageError``), with the reason.
    """
    fs, path = resolve(url)
    with _explained(url), fs.open_input_stream(path) as f:
        return f.read()


def open_input_file(location: str | os.PathLike[str]) -> pa.NativeFile:
    """A random-access file at a local path or URL: ``seek``/``read``/``read_at``, and what
    ``pyarrow.parquet.ParquetFile`` takes (for record files on object storage).

    Raises:
        OSError: it cannot be opened (``FileNotFoundError``, ``StorageError``), with the reason.
    """
    fs, path = resolve(location)
    with _explained(str(location)):
        return fs.open_input_file(path)
