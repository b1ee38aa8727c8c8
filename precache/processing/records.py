"""Record files: a JSON Lines, CSV, Parquet or Arrow file holds many inputs, one per record.

Each record is an input of its own, keyed ``<file>:<n>``, so one bad record is one failed input
and a re-run recomputes only the records whose bytes changed:

- **JSON Lines** (``.jsonl``): each non-empty line; ``n`` is its line number. Its bytes are the
  line, read by byte range.
- **CSV** (``.csv``, RFC 4180, a header row first): each record; ``n`` is the line it starts on
  (a quoted field may span lines). Its bytes are the header and the record, read by two byte
  ranges: a two-row CSV that parses alone, and renaming a column changes every record's hash.
- **Parquet** (``.parquet``): each row; ``n`` is its row index, from 0. Its bytes are the row
  rendered as a JSON object (read from its row group; the last row group read is kept, so rows
  read in order cost one read per row group).
- **Arrow** (``.arrow``, IPC stream or file; the ``data-*.arrow`` of a ``datasets.Dataset``
  ``save_to_disk`` folder, or a dataset's cache files): each row, as Parquet (read from its
  record batch, memory-mapped). A ``ClassLabel`` column that ``datasets`` recorded in the
  file's schema is rendered as its class name, not its index.

``parse_record`` turns a record's bytes back into a dict; errors name the line or row.

A file name that is not UTF-8 (``café.jpg`` written in Latin-1) is an input like any other: its
key and locator hold each byte that is not UTF-8 as ``\\xHH`` (``escape_name``), so they can be
stored and printed, and ``real_name`` turns a locator back into the name on disk to read it.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from precache.storage import is_remote, open_input_file

__all__ = ["RECORD_SUFFIXES", "is_record_key", "record_name", "records_of", "read_record",
           "parse_record", "natural_key", "escape_name", "real_name"]

RECORD_SUFFIXES = (".jsonl", ".csv", ".parquet", ".arrow")
"""Files whose records are separate inputs (when the pipeline's extensions include the suffix)."""

_RECORD_KEY = re.compile(r"^(?P<file>.*\.(?:jsonl|csv|parquet|arrow)):(?P<n>\d+)$", re.IGNORECASE)
_RANGES = re.compile(r"^(?P<path>.*)#(?P<ranges>\d+\+\d+(?:,\d+\+\d+)*)$")
_ROW = re.compile(r"^(?P<path>.*)#row=(?P<row>\d+)$")
_CSV_FIELD_LIMIT = 1 << 30  # the csv module's default (128 KiB) is shorter than many documents
_ESCAPED_BYTE = re.compile(rb"\\x([0-9a-f]{2})")


def escape_name(name: str) -> str:
    """``name`` (a path from the OS) as valid UTF-8: each byte that is not UTF-8 (held by Python
    as a surrogate escape) becomes ``\\xHH``. Names that are UTF-8 come back unchanged, so keys
    stay those of caches built before. Keys and locators must be UTF-8 to be stored (Parquet,
    JSON) and printed; ``real_name`` undoes this to read the file."""
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:
        pass
    try:
        raw = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that is not an escaped byte: show it as \udXXX
        return name.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def real_name(locator: str) -> str:
    """The name on disk of a local ``locator`` made by ``escape_name``: ``\\xHH`` back to the
    byte, unless a file of that very name exists (a name that merely looks escaped)."""
    if "\\x" not in locator or os.path.lexists(locator):
        return locator
    raw = _ESCAPED_BYTE.sub(lambda m: bytes([int(m[1], 16)]), locator.encode("utf-8"))
    return os.fsdecode(raw)


def is_record_key(key: str) -> bool:
    """True for the key of one record of a record file (``reviews.csv:12``)."""
    return _RECORD_KEY.match(key) is not None


def record_name(key: str) -> str:
    """How errors name a record: ``line 12`` (JSON Lines, CSV) or ``row 12`` (Parquet, Arrow)."""
    match = _RECORD_KEY.match(key)
    if match is None:
        return key
    kind = "row" if match["file"].lower().endswith((".parquet", ".arrow")) else "line"
    return f"{kind} {match['n']}"


def natural_key(key: str) -> tuple[str, int]:
    """Sort key that keeps a file's records in file order (``a.jsonl:9`` before ``a.jsonl:10``)."""
    match = _RECORD_KEY.match(key)
    return (match["file"], int(match["n"])) if match else (key, -1)


def records_of(path: str) -> Iterator[tuple[int, str, int]]:
    """``(n, locator, size)`` of each record of the record file ``path`` (size 0: unknown).

    Raises:
        OSError: the file cannot be read (or, for Parquet, is not a readable Parquet file).
    """
    lower = path.lower()
    if lower.endswith((".parquet", ".arrow")):
        yield from _table_rows(path)
        return
    with _open(path) as f:
        data = f.read()
    if lower.endswith(".csv"):
        yield from _csv_records(path, data)
    else:
        yield from _jsonl_lines(path, data)


def _open(path: str) -> Any:
    """A local file (``path`` as ``escape_name`` wrote it), or a random-access file on object
    storage (``s3://...``)."""
    return open_input_file(path) if is_remote(path) else open(real_name(path), "rb")


def _jsonl_lines(path: str, data: bytes) -> Iterator[tuple[int, str, int]]:
    start = 0
    for number, line in enumerate(data.split(b"\n"), start=1):
        if line.strip():
            yield number, f"{path}#{start}+{len(line)}", len(line)
        start += len(line) + 1


def _csv_records(path: str, data: bytes) -> Iterator[tuple[int, str, int]]:
    """Records end at a newline outside quotes: where the record's count of ``"`` is even
    (an escaped quote is ``""``, so it keeps the count even)."""
    header: tuple[int, int] | None = None
    start, first, quotes, pos = -1, 0, 0, 0
    for number, line in enumerate(data.split(b"\n"), start=1):
        if start < 0:
            if not line.strip():
                pos += len(line) + 1
                continue
            start, first, quotes = pos, number, 0
        quotes += line.count(b'"')
        pos += len(line) + 1
        if quotes % 2 == 0:
            end = min(pos - 1, len(data))
            if header is None:
                header = (start, end - start)
            else:
                yield _csv_record(path, header, first, start, end)
            start = -1
    if start >= 0 and header is not None:  # an unclosed quote: the rest is one record, which
        yield _csv_record(path, header, first, start, len(data))  # fails with its line number


def _csv_record(path: str, header: tuple[int, int], line: int, start: int,
                end: int) -> tuple[int, str, int]:
    """``(line, locator, size)`` of the record at bytes ``[start, end)``: header and record."""
    return line, f"{path}#{header[0]}+{header[1]},{start}+{end - start}", header[1] + 1 + end - start


def _arrow_batches(path: str) -> Iterator[pa.RecordBatch]:
    """The record batches of an Arrow IPC file or stream (local files memory-mapped)."""
    with (_open(path) if is_remote(path) else pa.memory_map(real_name(path))) as f:
        try:
            reader = pa.ipc.open_file(f)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
            return
        except pa.ArrowInvalid:  # not the file format: the stream format (datasets writes it)
            f.seek(0)
        yield from pa.ipc.open_stream(f)


def _table_rows(path: str) -> Iterator[tuple[int, str, int]]:
    """The rows of a Parquet or Arrow file."""
    try:
        if path.lower().endswith(".arrow"):
            rows = sum(batch.num_rows for batch in _arrow_batches(path))
        else:
            with _open(path) as f:
                rows = pq.ParquetFile(f).metadata.num_rows
    except OSError:
        raise
    except Exception:  # noqa: BLE001 - not Parquet/Arrow: one input; its read fails with why
        rows = 1
    for row in range(rows):
        yield row, f"{path}#row={row}", 0


_row_group: tuple[tuple[str, int, int], int, list[dict[str, Any]]] | None = None


def _groups(path: str) -> Iterator[tuple[int, Any]]:
    """``(rows, read)`` of each row group (Parquet) or record batch (Arrow) of ``path``;
    ``read()`` gives its rows as dicts."""
    if path.lower().endswith(".arrow"):
        for batch in _arrow_batches(path):
            yield batch.num_rows, lambda batch=batch: _class_names(batch).to_pylist()
        return
    with _open(path) as f:
        parquet = pq.ParquetFile(f)
        for group in range(parquet.metadata.num_row_groups):
            yield (parquet.metadata.row_group(group).num_rows,
                   lambda group=group: parquet.read_row_group(group).to_pylist())


def _class_names(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` with each ``ClassLabel`` column that ``datasets`` recorded in the schema's
    metadata as its class names (index -1, no label, as null)."""
    meta = (batch.schema.metadata or {}).get(b"huggingface")
    features = json.loads(meta).get("info", {}).get("features", {}) if meta else {}
    for name, feature in features.items():
        if (isinstance(feature, dict) and feature.get("_type") == "ClassLabel"
                and name in batch.schema.names):
            names = pa.array(feature["names"] + [None], pa.string())
            i = batch.schema.get_field_index(name)
            index = batch.column(i).cast(pa.int64())
            index = pc.if_else(pc.less(index, 0), len(names) - 1, index)  # -1: the null
            batch = batch.set_column(i, name, names.take(index))
    return batch


def _table_row(path: str, row: int) -> bytes:
    """Row ``row`` of a Parquet or Arrow file, as a JSON object."""
    global _row_group
    try:
        if is_remote(path):  # one request per row would be slow: assume it does not change
            stamp = (path, 0, 0)
        else:
            st = os.stat(real_name(path))
            stamp = (path, st.st_mtime_ns, st.st_size)
        if _row_group is None or _row_group[0] != stamp or not (
                _row_group[1] <= row < _row_group[1] + len(_row_group[2])):
            first = 0
            for count, read in _groups(path):
                if row < first + count:
                    _row_group = (stamp, first, read())
                    break
                first += count
            else:
                raise OSError(f"{path} has no row {row} (it has {first}); it changed since "
                              "it was listed: re-run")
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a file that is not Parquet/Arrow
        kind = "Arrow" if path.lower().endswith(".arrow") else "Parquet"
        raise OSError(f"{path} is not a readable {kind} file ({e})") from None
    record = _row_group[2][row - _row_group[1]]
    return json.dumps(record, ensure_ascii=False, default=str).encode("utf-8")


def read_record(locator: str) -> bytes | None:
    """The bytes of the record at ``locator``, or None if it locates a whole file.

    Raises:
        OSError: the file is unreadable, or shorter than when it was listed.
    """
    if not is_remote(locator) and os.path.exists(real_name(locator)):  # a file whose name
        return None                                                     # looks like a locator
    if match := _RANGES.match(locator):
        parts = []
        with _open(match["path"]) as f:
            for span in match["ranges"].split(","):
                start, length = (int(v) for v in span.split("+"))
                f.seek(start)
                data = f.read(length)
                if len(data) != length:
                    raise OSError(f"{match['path']} is shorter than when it was listed; re-run")
                parts.append(data)
        return b"\n".join(parts)
    if match := _ROW.match(locator):
        return _table_row(match["path"], int(match["row"]))
    return None


def parse_record(key: str, data: bytes) -> dict[str, Any]:
    """The fields of record ``key`` from its bytes (a JSON object, or a CSV header and row).

    Raises:
        ValueError: the record is not UTF-8, not a JSON object, or not one CSV row that matches
            the header; the message names the line or row.
    """
    where = record_name(key)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8: byte {e.start} is {data[e.start:e.start + 1]!r}; "
                         "convert the file to UTF-8") from None
    if key.lower().rsplit(":", 1)[0].endswith(".csv"):
        return _parse_csv(where, text)
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a JSON {type(record).__name__}, not an object with fields")
    return record


def _parse_csv(where: str, text: str) -> dict[str, Any]:
    if csv.field_size_limit() < _CSV_FIELD_LIMIT:
        csv.field_size_limit(_CSV_FIELD_LIMIT)
    try:
        rows = list(csv.reader(io.StringIO(text, newline=""), strict=True))
    except csv.Error as e:
        raise ValueError(f"{where} is not valid CSV ({e})") from None
    if len(rows) != 2:
        raise ValueError(f"{where} is not one CSV record ({len(rows) - 1} found)")
    header, values = rows
    if len(values) != len(header):
        raise ValueError(f"{where} has {len(values)} fields but the header has {len(header)}; "
                         "quote fields that contain commas")
    return dict(zip(header, values))
