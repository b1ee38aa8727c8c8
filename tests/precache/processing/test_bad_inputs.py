"""Inputs that are not regular files, or are too big: error rows, never a hang or a runaway read.

A FIFO named ``x.jpg`` used to block the run for ever; a symlink to ``/dev/zero`` named ``.jpg``
was read until ``MemoryError``. The runs here are real ``precache run`` commands in a subprocess
with a timeout and an address-space limit, so a regression fails the test instead of hanging it
or eating the machine's memory; the in-process checks run under an alarm and a memory cap for
the same reason.
"""

from __future__ import annotations

import io
import os
import resource
import signal
import socket
from pathlib import Path
from typing import Iterator

import pyarrow.fs as pafs
import pytest
from PIL import Image
from skimage import data as skdata

from precache import Cache
from precache.processing import sources
from precache.storage import locations
from precache.processing.sources import (InputError, InputTooLargeError, NotRegularFileError,
                                    list_inputs, read_bytes)
from tests.helpers import build_cache, memory_cap, precache_cli, write_photos

ADDRESS_SPACE = 3 * 1024**3  # a run needs well under this; reading /dev/zero whole does not


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@pytest.fixture
def alarm() -> Iterator[None]:
    """Fail (not hang) if the test blocks for 10 s, e.g. opening a FIFO that has no writer."""
    def timeout(signum, frame):
        raise TimeoutError("blocked for 10 s (opened a FIFO?)")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(10)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(name="memory_cap")
def capped_memory() -> Iterator[None]:
    """This process may map at most 1 GiB more while the test runs (a read of /dev/zero raises
    MemoryError instead of filling the machine's memory)."""
    with memory_cap():
        yield


def big_jpeg() -> bytes:
    """A real photo as a JPEG of about 100 KB."""
    buf = io.BytesIO()
    Image.fromarray(skdata.coffee()).save(buf, "JPEG", quality=95)
    assert len(buf.getvalue()) > 64 * 1024
    return buf.getvalue()


def make_inputs(tmp_path: Path) -> Path:
    """4 small photos, a symlink to a photo, a FIFO, a symlink to /dev/zero and a 100 KB photo,
    all named .jpg (or .png)."""
    folder = tmp_path / "in"
    write_photos(folder, 4)
    outside = tmp_path / "elsewhere.jpg"
    write_photos(tmp_path / "other", 2)
    (tmp_path / "other" / "img0001.jpg").rename(outside)
    (folder / "link.jpg").symlink_to(outside)
    os.mkfifo(folder / "fifo.jpg")
    (folder / "zero.jpg").symlink_to("/dev/zero")
    (folder / "big.jpg").write_bytes(big_jpeg())
    assert all(p.stat().st_size < 64 * 1024 for p in folder.glob("img*"))
    return folder


@pytest.mark.parametrize("limit", [None, "64K"])
def test_fifo_device_and_oversized_inputs_are_error_rows_and_the_run_finishes(
        tmp_path: Path, limit: str | None) -> None:
    folder = make_inputs(tmp_path)
    args = ["run", "images", "-i", str(folder), "-o", str(tmp_path / "c"), "-j", "2", "-q"]
    if limit:
        args += ["--max-input-bytes", limit]
    result = precache_cli(*args, timeout=60, preexec_fn=limit_memory)
    assert result.returncode == 0, result.stdout + result.stderr

    errors = {r["key"]: r for r in Cache(tmp_path / "c").read_errors().to_pylist()}
    expected = {"fifo.jpg", "zero.jpg"} | ({"big.jpg"} if limit else set())
    assert set(errors) == expected, errors
    assert all(r["stage"] == "read" for r in errors.values())
    assert errors["fifo.jpg"]["error_type"] == "NotRegularFileError"
    assert "not a regular file (a FIFO)" in errors["fifo.jpg"]["message"]
    assert "not a regular file (a character device)" in errors["zero.jpg"]["message"]
    if limit:
        assert errors["big.jpg"]["error_type"] == "InputTooLargeError"
        assert "larger than max_input_bytes (64 KiB)" in errors["big.jpg"]["message"]
        assert "--max-input-bytes" in errors["big.jpg"]["message"]
    counts = Cache(tmp_path / "c").manifest.counts
    assert counts["ok"] == 8 - len(expected) and counts["failed"] == len(expected)  # link.jpg ok
    assert f"{8 - len(expected)} ok, 0 skipped, {len(expected)} failed" in result.stdout


def test_read_bytes_refuses_what_is_not_a_regular_file_without_opening_it(
        tmp_path: Path, alarm: None, memory_cap: None) -> None:
    os.mkfifo(tmp_path / "fifo.jpg")
    with pytest.raises(NotRegularFileError, match=r"not a regular file \(a FIFO\)"):
        read_bytes(str(tmp_path / "fifo.jpg"))
    (tmp_path / "zero.jpg").symlink_to("/dev/zero")
    for limit in (sources.DEFAULT_MAX_INPUT_BYTES, 1000):
        with pytest.raises(NotRegularFileError, match="character device"):
            read_bytes(str(tmp_path / "zero.jpg"), limit)
    with pytest.raises(NotRegularFileError, match="folder"):
        read_bytes(str(tmp_path))
    (tmp_path / "photo.jpg").write_bytes(b"x" * 10)
    (tmp_path / "link.jpg").symlink_to(tmp_path / "photo.jpg")
    assert read_bytes(str(tmp_path / "link.jpg")) == b"x" * 10


def test_read_bytes_refuses_a_socket(tmp_path: Path) -> None:
    path = tmp_path / "s.jpg"
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(path))
    except OSError:  # a tmp path longer than a socket address takes
        pytest.skip("cannot bind a Unix socket here")
    with server, pytest.raises(NotRegularFileError, match="a socket"):
        read_bytes(str(path))


def test_read_bytes_is_bounded_by_max_bytes_whatever_stat_says(tmp_path: Path) -> None:
    path = tmp_path / "photo.jpg"
    path.write_bytes(b"y" * 1000)
    assert read_bytes(str(path), 1000) == b"y" * 1000
    with pytest.raises(InputTooLargeError, match=r"1,000 bytes, larger than max_input_bytes "
                                                 r"\(999 bytes\)"):
        read_bytes(str(path), 999)
    if Path("/proc/self/maps").exists():  # a regular file whose size says 0
        assert Path("/proc/self/maps").stat().st_size == 0
        with pytest.raises(InputTooLargeError, match="grew while being read"):
            read_bytes("/proc/self/maps", 100)
        assert len(read_bytes("/proc/self/maps", 1 << 24)) > 100


def test_remote_reads_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An object-storage input is read in chunks and never past the limit (a local file stands
    in for the object here; tests/precache/storage runs real S3 and GCS servers)."""
    path = tmp_path / "object.jpg"
    payload = os.urandom(3 * 1024 * 1024 + 5)
    path.write_bytes(payload)
    monkeypatch.setattr(locations, "resolve", lambda url: (pafs.LocalFileSystem(), str(path)))
    assert read_bytes("s3://bucket/object.jpg", 4 * 1024 * 1024) == payload
    assert read_bytes("s3://bucket/object.jpg", len(payload)) == payload
    with pytest.raises(InputTooLargeError, match=r"larger than max_input_bytes \(3 MiB\)"):
        read_bytes("s3://bucket/object.jpg", 3 * 1024 * 1024)


def test_listing_does_not_open_fifos_or_devices(tmp_path: Path, alarm: None,
                                                memory_cap: None) -> None:
    """A FIFO or a device named like a record file is one input (that fails when read), and a
    FIFO named like a list file is refused: listing opens neither."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    os.mkfifo(folder / "fifo.jsonl")
    (folder / "zero.jsonl").symlink_to("/dev/zero")
    inputs = list_inputs(folder, (".jsonl",))
    assert [i.key for i in inputs] == ["a.jsonl:1", "a.jsonl:2", "fifo.jsonl", "zero.jsonl"]
    for item in inputs[2:]:
        with pytest.raises(NotRegularFileError):
            read_bytes(item.locator)
    os.mkfifo(tmp_path / "list.txt")
    with pytest.raises(InputError, match="not a regular file"):
        list_inputs(tmp_path / "list.txt", (".jpg",))


def test_max_input_bytes_must_be_positive(tmp_path: Path) -> None:
    write_photos(tmp_path / "in", 1)
    with pytest.raises(ValueError, match="max_input_bytes"):
        build_cache(tmp_path / "in", tmp_path / "c", pipeline="images", max_input_bytes=0)
    result = precache_cli("run", "images", "-i", str(tmp_path / "in"), "-o", str(tmp_path / "c"),
                          "--max-input-bytes", "lots")
    assert result.returncode == 2 and "--max-input-bytes" in result.stderr
