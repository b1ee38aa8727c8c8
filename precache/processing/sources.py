"""Stage-1 inputs: list a folder (or a list file) as sorted ``Input``s; read and hash their bytes.

A JSON Lines, CSV, Parquet or Arrow file (where the pipeline accepts the suffix) holds many
inputs, one per record, keyed ``<file>:<n>`` (see ``precache.processing.records``): one bad record is one
failed input, and a re-run recomputes only the records whose bytes changed. A ``datasets.Dataset``
is read from the Arrow files behind it.

Only regular files are read (a symlink to one is fine): a FIFO, a device or a socket named like an
input is a failed input, checked with ``stat`` before it is opened, so it can neither block the run
nor feed it without end. Every read is bounded by ``max_input_bytes`` (default 2 GiB): a bigger
input is a failed input, not a worker killed for memory.

The output folder and everything under it are never inputs (``exclude``; compared by resolved
path), so a cache kept inside its input folder does not read its own shards and tables. A file
name that is not UTF-8 is an input like any other: its key and locator write each byte that is
not UTF-8 as ``\\xHH`` (``records.escape_name``), and reading undoes that.

A pipeline whose ``extensions`` include ``DICOM_SERIES_FOLDERS`` (volumes) also takes DICOM series
kept on disk as folders: a local folder holding DICOM files directly (``*.dcm``, ``*.dicom``,
``*.ima``, or files without a suffix that start as DICOM files do) is one input, keyed by its
path; its size is its DICOM files' bytes and its time the newest of theirs and its own, and
``read_bytes`` packs those files (sorted by name, under the folder's name) into one uncompressed
``.zip`` in memory, the bytes a ``.zip`` of the folder would hold, so the plan hashes a series as
one input and the readers take the folder as they take its ``.zip``.
"""

from __future__ import annotations

import io
import os
import stat
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import pyarrow.fs as pafs

from precache.processing.records import (RECORD_SUFFIXES, escape_name, natural_key, read_record,
                                         real_name, records_of)
from precache.storage import (Store, explained, is_remote, is_url, local_path, read_remote_bytes,
                              resolve)

__all__ = ["Input", "InputError", "list_inputs", "read_bytes", "LIST_SUFFIXES", "RECORD_SUFFIXES",
           "DEFAULT_MAX_INPUT_BYTES", "NotRegularFileError", "InputTooLargeError",
           "check_max_input_bytes", "format_bytes", "DICOM_SERIES_FOLDERS"]

DEFAULT_MAX_INPUT_BYTES = 2 * 1024**3
"""The most bytes one input may have (2 GiB): far above any photo, text record or short video, and
small enough that a runaway read (a link to ``/dev/zero``) fails its input, not the machine."""


LIST_SUFFIXES = (".txt", ".lst")
"""An ``--input`` file with one of these suffixes is a list of input paths, one per line."""

DICOM_SERIES_FOLDERS = "<DICOM series folders>/"
"""Put among a pipeline's ``extensions`` (no file name ends in it: it holds a ``/``), it says
that the pipeline takes a local folder of DICOM files as one input (a ``.zip`` of them, as
``read_bytes`` gives it); other pipelines list a folder's files one by one."""

_DICOM_SUFFIXES = (".dcm", ".dicom", ".ima")
"""Files of a series folder that are DICOM slices by name (``volume_read.DICOM_SUFFIXES``); a
file without a suffix is one if it starts as a DICOM file does (``DICM`` at byte 128)."""

_ZIP_TIME = (1980, 1, 1, 0, 0, 0)
"""Every member of a packed series folder has this time, so its bytes (and hash) depend only on
the files' names and bytes."""


class InputError(ValueError):
    """The ``--input`` path cannot be listed (missing, empty, or of an unknown kind)."""


class NotRegularFileError(OSError):
    """An input is not a regular file (a FIFO, a device, a socket, a folder): it is not read."""


class InputTooLargeError(OSError):
    """An input has more than ``max_input_bytes`` bytes: it is not read (or read no further)."""


def format_bytes(n: int) -> str:
    """``n`` bytes for a message: ``2 GiB``, ``1.5 MiB``, ``1,000 bytes``."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n:,} bytes"


def check_max_input_bytes(value: Any) -> int:
    """``value`` as a byte limit; ``ValueError`` unless it is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"max_input_bytes must be a positive number of bytes, got {value!r}")
    return value


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a file")


def _not_regular(mode: int) -> NotRegularFileError:
    return NotRegularFileError(
        f"not a regular file ({_kind(mode)}): only regular files are read; put the file itself "
        "there (a symlink to a regular file is fine)")


def _too_large(size: int | None, max_bytes: int) -> InputTooLargeError:
    what = f"{size:,} bytes," if size is not None else "grew while being read and is"
    return InputTooLargeError(
        f"{what} larger than max_input_bytes ({format_bytes(max_bytes)}); raise "
        "--max-input-bytes (or precache.run(max_input_bytes=...)) to read it")


def _is_regular(path: str | os.PathLike[str]) -> bool:
    """True for a regular file or a link to one (following links; never opening the file)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return True  # missing or unreadable: reading it fails with the reason


@dataclass(frozen=True)
class Input:
    """One input file: ``key`` (stable id: the path relative to the input root, POSIX style),
    ``locator`` (where to read it), and its size and modification time (-1 if ``stat`` failed).
    ``key`` and ``locator`` are valid UTF-8 (``escape_name``); ``real_name(locator)`` is the
    local path to open."""

    key: str
    locator: str
    size: int
    mtime_ns: int


def _stat_input(key: str, path: Path) -> Input:
    try:
        st = path.stat()
        return Input(escape_name(key), escape_name(str(path)), st.st_size, st.st_mtime_ns)
    except OSError:  # listed, but reading it will fail with the reason
        return Input(escape_name(key), escape_name(str(path)), -1, -1)


def _inside(path: str, folder: str) -> bool:
    """True if the resolved ``path`` is the resolved ``folder`` or under it."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


class _Output:
    """The resolved output folder, and whether a path resolves into it (links followed).

    A path's folder is resolved once (cached), so a long list costs one ``lstat`` per entry."""

    def __init__(self, output: str | os.PathLike[str] | None) -> None:
        local = output is not None and not is_remote(output)
        self.real = os.path.realpath(local_path(output)) if local else None
        self._folders: dict[str, str] = {}

    def holds(self, path: str) -> bool:
        """True if ``path`` (as the OS names it) resolves into the output folder."""
        if self.real is None:
            return False
        return _inside(self._resolve(path), self.real)

    def _resolve(self, path: str) -> str:
        if os.path.islink(path):
            return os.path.realpath(path)
        folder, name = os.path.split(os.path.abspath(path))
        real = self._folders.get(folder)
        if real is None:
            real = self._folders[folder] = os.path.realpath(folder)
        return os.path.join(real, name)


def _walk(root: Path, extensions: tuple[str, ...], output: _Output,
          series: bool = False) -> Iterable[Input]:
    """Files under ``root`` ending in ``extensions`` (and, with ``series``, each folder holding
    DICOM files as one input: ``_series_input``); hidden entries, links to folders and the
    output folder skipped."""
    folders = [("", str(root))]
    while folders:
        prefix, folder = folders.pop()
        dicom: list[os.DirEntry[str]] = []
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    if not output.holds(entry.path):
                        folders.append((f"{prefix}{entry.name}/", entry.path))
                elif series and _is_dicom_file(entry):
                    dicom.append(entry)
                elif entry.name.lower().endswith(extensions) and not output.holds(entry.path):
                    key, locator = escape_name(prefix + entry.name), escape_name(entry.path)
                    try:
                        st = entry.stat()
                        yield Input(key, locator, st.st_size, st.st_mtime_ns)
                    except OSError:  # a broken link: listed, and reading it fails with the reason
                        yield Input(key, locator, -1, -1)
        if dicom:
            key = prefix.rstrip("/") or os.path.basename(os.path.abspath(folder))
            yield _series_input(key, folder, dicom)


def _is_dicom_file(entry: os.DirEntry[str]) -> bool:
    """True for a slice of a series folder: a visible non-folder named ``*.dcm``, ``*.dicom``,
    ``*.ima`` (reading a FIFO or a broken link so named fails the series with the reason), or a
    regular file without a suffix that starts as DICOM files do (a README is not one)."""
    name = entry.name
    if name.startswith(".") or name.upper() == "DICOMDIR" or entry.is_dir():
        return False
    if "." in name:
        return name[name.rfind("."):].lower() in _DICOM_SUFFIXES
    if not entry.is_file():  # a FIFO or a device is never opened to look inside
        return False
    try:
        fd = os.open(entry.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with open(fd, "rb") as f:
            return f.read(132)[128:] == b"DICM"
    except OSError:
        return False


def _dicom_files(folder: str) -> list[os.DirEntry[str]]:
    """The DICOM files directly in ``folder`` (``_is_dicom_file``), sorted by name."""
    with os.scandir(folder) as entries:
        return sorted((e for e in entries if _is_dicom_file(e)), key=lambda e: e.name)


def _series_input(key: str, folder: str, files: list[os.DirEntry[str]]) -> Input:
    """The series folder ``folder`` as one input (locator: its path and a ``/``): its files'
    bytes, and the newest time of theirs and its own (a file added, removed or renamed changes
    the folder's), so the plan's size-and-time check sees a changed slice."""
    key, locator = escape_name(key), escape_name(folder.rstrip(os.sep)) + "/"
    try:
        stats = [entry.stat() for entry in files]
        newest = max([os.stat(folder).st_mtime_ns] + [st.st_mtime_ns for st in stats])
        return Input(key, locator, sum(st.st_size for st in stats), newest)
    except OSError:  # a broken link: listed, and reading it fails with the reason
        return Input(key, locator, -1, -1)


def _records(item: Input) -> Iterable[Input]:
    """The records of a record file, each an input of its own (a FIFO or device named like a
    record file is not opened: it is one input, whose read fails with the reason)."""
    if not is_remote(item.locator) and not _is_regular(real_name(item.locator)):
        yield item
        return
    try:
        found = [Input(f"{item.key}:{n}", locator, size, item.mtime_ns)
                 for n, locator, size in records_of(item.locator)]
    except OSError:
        found = [item]  # reading it fails again, with the reason, as one input
    yield from found


def _expand_records(inputs: list[Input], extensions: tuple[str, ...]) -> list[Input]:
    suffixes = tuple(s for s in RECORD_SUFFIXES if s in extensions)
    if not suffixes:
        return inputs
    out: list[Input] = []
    for item in inputs:
        out.extend(_records(item) if item.key.lower().endswith(suffixes) else [item])
    return out


def _read_list(list_file: Path, output: _Output, series: bool = False) -> Iterable[Input]:
    """The entries of a list file (bytes that are not UTF-8 name files as the OS does), but
    those in the output folder; with ``series``, an entry naming a folder of DICOM files is
    that series."""
    if not _is_regular(list_file):
        raise InputError(f"input list '{escape_name(str(list_file))}' is not a regular file "
                         f"({_kind(list_file.stat().st_mode)}); pass a file, or a folder")
    base = list_file.parent
    for line in list_file.read_bytes().decode("utf-8", "surrogateescape").splitlines():
        entry = line.strip()
        if entry and not entry.startswith("#"):
            path = Path(entry) if Path(entry).is_absolute() else base / entry
            if output.holds(str(path)):
                continue
            files = _dicom_files(str(path)) if series and path.is_dir() else []
            yield _series_input(entry.rstrip("/"), str(path), files) if files \
                else _stat_input(entry, path)


def _list_local(root: Path, extensions: tuple[str, ...], output: _Output,
                series: bool = False) -> list[Input]:
    """The inputs at a local path (before record files are expanded); ``series``: folders of
    DICOM files are inputs too (``_walk``)."""
    shown = escape_name(str(root))
    if not root.exists():
        raise InputError(f"input path '{shown}' does not exist")
    if output.holds(str(root)):
        raise InputError(f"input '{shown}' is inside the output folder '{output.real}', where "
                         "precache writes its cache: put the inputs elsewhere, or choose "
                         "another --output")
    if root.is_dir():
        inputs = list(_walk(root, extensions, output, series))
    elif root.name.lower().endswith(extensions):
        inputs = [_stat_input(root.name, root)]
    elif root.suffix.lower() in LIST_SUFFIXES:
        inputs = list(_read_list(root, output, series))
    else:
        raise InputError(
            f"input '{shown}' is neither a folder, a file ending in {', '.join(extensions)}, "
            f"nor a list of paths ({', '.join(LIST_SUFFIXES)})"
        )
    return inputs


def _mtime_ns(info: pafs.FileInfo) -> int:
    # Unknown modification time: "now", which never matches the cache's record, so the input's
    # content hash decides whether it changed.
    return info.mtime_ns if info.mtime_ns is not None else time.time_ns()


def _hidden(key: str) -> bool:
    return any(part.startswith(".") for part in key.split("/"))


def list_remote_inputs(url: str, extensions: tuple[str, ...]) -> list[Input]:
    """The inputs at the remote ``url``, as ``list_inputs`` finds them at a local path
    (which then expands record files, sorts, and checks for none and for duplicates): a folder
    (prefix, searched recursively; hidden names skipped), a single matching file, or a
    ``.txt``/``.lst`` list of URLs or paths relative to the list's folder. Locators are full
    URLs; keys are paths relative to ``url``.

    Raises:
        InputError: the URL does not exist or is a file of another kind.
        StorageError: unknown scheme, refused credentials, unreachable server.
    """
    store = Store(url)
    with explained(url):
        info = store.fs.get_file_info(store.base)
    if info.type == pafs.FileType.NotFound:
        store.check_bucket()
        raise InputError(f"input '{url}' does not exist")
    if info.type == pafs.FileType.Directory:
        selector = pafs.FileSelector(store.base, recursive=True)
        with explained(url):
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
    folder = store.url.rsplit("/", 1)[0]
    entries = [line.strip() for line in store.read_bytes("").decode("utf-8").splitlines()]
    inputs = []
    for entry in (e for e in entries if e and not e.startswith("#")):
        locator = entry if is_url(entry) else f"{folder}/{entry.lstrip('/')}"
        fs, path = resolve(locator)
        with explained(locator):
            info = fs.get_file_info(path)
        if info.type == pafs.FileType.File:
            inputs.append(Input(entry, locator, info.size, _mtime_ns(info)))
        else:
            inputs.append(Input(entry, locator, -1, -1))  # listed; reading it fails with the reason
    return inputs


def _dataset_files(dataset: Any, output: _Output) -> list[Input]:
    """The Arrow files behind a ``datasets.Dataset`` (each keyed by its file name, as in the
    ``save_to_disk`` folder it was loaded from), when they hold exactly its rows."""
    if getattr(dataset, "_indices", None) is not None:
        raise InputError("this datasets.Dataset selects rows of its files through an indices "
                         "mapping (shuffle, select, filter, train_test_split): pass "
                         "dataset.flatten_indices(), or save_to_disk(folder) and pass the folder")
    files = [Path(f["filename"]) for f in dataset.cache_files]
    if not files:
        raise InputError("this datasets.Dataset is in memory, with no files to read: "
                         "dataset.save_to_disk(folder) and pass the folder")
    return [_stat_input(file.name, file) for file in files if not output.holds(str(file))]


def list_inputs(path: str | os.PathLike[str] | Any, extensions: tuple[str, ...],
                exclude: str | os.PathLike[str] | None = None) -> list[Input]:
    """List the inputs under ``path``, sorted by key.

    ``path`` is a folder (searched recursively for files ending in ``extensions``; hidden files
    and folders are ignored), a single matching file, or a ``.txt``/``.lst`` file listing paths
    (relative to the list file's folder); a local path or a URL (``s3://``, ``gs://``,
    ``file://``; see ``precache.storage``). Record files expand to one input per record.
    ``path`` may also be a ``datasets.Dataset`` backed by Arrow files (loaded, mapped or saved
    with ``datasets``; where ``.arrow`` is among ``extensions``): its rows are the records of
    those files, read as they are on disk (a ``set_transform`` or ``set_format`` is not applied).

    With ``DICOM_SERIES_FOLDERS`` among ``extensions``, a local folder holding DICOM files is
    one input too (the folder ``path`` itself, one in the folder searched, or one a list names).

    ``exclude`` (the run's output) and everything under it are never inputs: a local folder by
    resolved path (links followed), a URL by prefix.

    Raises:
        InputError: the path does not exist, matches nothing, is a file of another kind, or is
            inside ``exclude``; a dataset is in memory, selects rows through an indices
            mapping, or has rows that are not in its files.
    """
    dataset = path if hasattr(path, "cache_files") and hasattr(path, "num_rows") else None
    root = "datasets.Dataset" if dataset is not None else os.fspath(path)
    output = _Output(exclude)
    series = DICOM_SERIES_FOLDERS in extensions
    extensions = tuple(e for e in extensions if e != DICOM_SERIES_FOLDERS)
    if dataset is not None:
        if ".arrow" not in extensions:
            raise InputError(f"this pipeline reads {', '.join(extensions)} files, not the Arrow "
                             "files of a datasets.Dataset")
        inputs = _dataset_files(dataset, output)
    elif is_remote(root):
        inputs = _outside_url(root, list_remote_inputs(root, extensions), exclude)
    else:
        inputs = _list_local(Path(root), extensions, output, series)
    root = escape_name(root)
    inputs = _expand_records(inputs, extensions)
    if dataset is not None and len(inputs) != dataset.num_rows:
        raise InputError(f"this datasets.Dataset has {dataset.num_rows} rows but its files hold "
                         f"{len(inputs)} (part of it is in memory): save_to_disk(folder) and "
                         "pass the folder")
    if not inputs:
        folders = " (or folders of DICOM files)" if series else ""
        raise InputError(f"no inputs ending in {', '.join(extensions)}{folders} found under "
                         f"'{root}'")
    inputs.sort(key=lambda item: natural_key(item.key))
    keys = [item.key for item in inputs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise InputError(f"input '{root}' lists '{dup}' more than once")
    return inputs


def _outside_url(root: str, inputs: list[Input], exclude: str | os.PathLike[str] | None
                 ) -> list[Input]:
    """``inputs`` listed at the URL ``root`` but those under the output URL ``exclude``."""
    if not isinstance(exclude, str) or not is_remote(exclude):
        return inputs
    out = exclude.rstrip("/")
    if root.rstrip("/") == out or root.startswith(out + "/"):
        raise InputError(f"input '{root}' is inside the output '{out}', where precache writes "
                         "its cache: put the inputs elsewhere, or choose another --output")
    return [item for item in inputs
            if item.locator != out and not item.locator.startswith(out + "/")]


def _read_local(path: str, max_bytes: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``max_bytes`` of them.

    ``stat`` (following links) refuses a FIFO, device or socket before anything opens it (opening
    one can block, or have effects); the file is then opened non-blocking and checked again on the
    descriptor (the path may have changed in between), and read for at most ``max_bytes + 1``
    bytes whatever its size said (a file may grow, or report 0 like those in ``/proc``).
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(st.st_mode)
    if st.st_size > max_bytes:
        raise _too_large(st.st_size, max_bytes)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with open(fd, "rb") as f:  # owns fd from here
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(st.st_mode)
        if st.st_size > max_bytes:
            raise _too_large(st.st_size, max_bytes)
        data = f.read(st.st_size + 1)  # the whole file, in one allocation of its size
        if len(data) > st.st_size:  # it grew since stat: read on, bounded
            data += f.read(max_bytes + 1 - len(data))
            if len(data) > max_bytes:
                raise _too_large(None, max_bytes)
    return data


def read_bytes(locator: str, max_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> bytes:
    """Read an input's bytes: a file, one record of a record file (see
    ``precache.processing.records``), or a DICOM series folder (its locator ends in ``/``) packed
    as a ``.zip``.

    Only a regular file (or a link to one) is read, and at most ``max_bytes`` of it.

    Raises:
        NotRegularFileError: a FIFO, device, socket or folder (never opened, so never a hang).
        InputTooLargeError: more than ``max_bytes`` bytes (checked before reading, and bounded
            while reading).
        OSError: it cannot be read, with the reason.
    """
    if locator.endswith("/") and not is_remote(locator):
        return _read_series_folder(real_name(locator[:-1]), max_bytes)
    record = read_record(locator)
    if record is not None:
        if len(record) > max_bytes:
            raise _too_large(len(record), max_bytes)
        return record
    if is_remote(locator):
        data = read_remote_bytes(locator, limit=max_bytes)
        if len(data) > max_bytes:
            raise _too_large(None, max_bytes)
        return data
    return _read_local(real_name(locator), max_bytes)


def _read_series_folder(folder: str, max_bytes: int) -> bytes:
    """The DICOM files directly in ``folder`` (``_dicom_files``: those its listing counted) in
    one uncompressed ``.zip``, each named ``<folder name>/<file name>`` in name order, as
    ``zip -0 -r`` of the folder holds them; each file read as ``_read_local`` reads one, and
    ``max_bytes`` bounding them all together."""
    try:
        files = _dicom_files(folder)
    except NotADirectoryError:
        raise NotRegularFileError(f"'{escape_name(folder)}' is no longer a folder; re-run to "
                                  "list the inputs again") from None
    if not files:
        raise FileNotFoundError(f"'{escape_name(folder)}' holds no DICOM files any more; "
                                "re-run to list the inputs again")
    name = escape_name(os.path.basename(folder))
    buffer, total = io.BytesIO(), 0
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for entry in files:
            try:
                data = _read_local(entry.path, max_bytes)
            except OSError as e:  # the series fails, naming the slice
                raise type(e)(f"'{name}/{escape_name(entry.name)}': {e}") from None
            total += len(data)
            if total > max_bytes:
                raise _too_large(total, max_bytes)
            archive.writestr(zipfile.ZipInfo(f"{name}/{escape_name(entry.name)}", _ZIP_TIME),
                             data)
    return buffer.getvalue()
