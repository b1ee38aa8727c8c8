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
import os
import re
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

__all__ = ["StorageError", "ChecksumError", "UnsafeFolderError", "is_remote", "is_url",
           "local_path", "resolve", "explained", "read_remote_bytes", "open_input_file",
           "ENDPOINT_VARIABLES", "GCS_EMULATOR_VARIABLE"]

ENDPOINT_VARIABLES = ("PRECACHE_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""Where the endpoint of an S3-compatible server is read from, first set wins."""

GCS_EMULATOR_VARIABLE = "STORAGE_EMULATOR_HOST"
"""``http://HOST:PORT`` of a GCS emulator to use for ``gs://`` URLs, as Google's clients read it."""

_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+)://")


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


def is_url(location: str | os.PathLike[str]) -> bool:
    """True for any ``scheme://`` URL, ``file://`` included."""
    return isinstance(location, str) and _URL.match(location) is not None


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
    dots = [s for s in parts.path.split("/") if s in (".", "..")]
    if dots:
        # An object store has no folders to step out of: the client would send
        # bucket/../other/cache as other/cache, while messages (and the bucket check) name
        # the bucket in the URL.
        raise StorageError(f"'{url}': the path segment '{dots[0]}' is not supported in "
                           f"{scheme}:// URLs (object keys have no parent folders to step "
                           f"into); write the path without it, as {scheme}://BUCKET/PATH")
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
def explained(url: str) -> Iterator[None]:
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


def read_remote_bytes(url: str, limit: int | None = None) -> bytes:
    """The bytes of the remote input ``url`` (a whole object), or with ``limit`` at most
    ``limit + 1`` of them (more than ``limit`` says the object is too big), read in growing
    chunks so a small object never costs a large allocation.

    Raises:
        OSError: it cannot be read (``FileNotFoundError``, ``StorageError``), with the reason.
    """
    fs, path = resolve(url)
    with explained(url), fs.open_input_stream(path) as f:
        if limit is None:
            return f.read()
        chunks: list[bytes] = []
        total, chunk = 0, 1 << 20
        while total <= limit:
            data = f.read(min(chunk, limit + 1 - total))
            if not data:
                break
            chunks.append(data)
            total += len(data)
            chunk = min(chunk * 2, 64 << 20)
    return b"".join(chunks)


def open_input_file(location: str | os.PathLike[str]) -> pa.NativeFile:
    """A random-access file at a local path or URL: ``seek``/``read``/``read_at``, and what
    ``pyarrow.parquet.ParquetFile`` takes (for record files on object storage).

    Raises:
        OSError: it cannot be opened (``FileNotFoundError``, ``StorageError``), with the reason.
    """
    fs, path = resolve(location)
    with explained(str(location)):
        return fs.open_input_file(path)
