"""Labels for image and video inputs: from the input's first folder, or from a metadata file.

* ``labels="folder"``: ``real/clip.mp4`` -> ``real``; a file at the top level of the input has
  no folder and gets the explicit label ``""``.
* ``labels="none"``: no label column.
* ``labels=path/to/meta.csv``: a CSV with a header row, a ``file`` column (also ``filename``,
  ``name`` or ``path``) and a ``label`` column, and optionally ``original``.
* ``labels=path/to/metadata.json``: DFDC style, ``{"name.mp4": {"label": "FAKE", "original":
  "x.mp4", ...}}``.

A metadata entry is found by the input's key (its path under the input folder) or else by its
bare file name. An input the file does not list is an error row naming the file: never a silent
default. With a metadata file the rows also get ``original`` (``""`` where none is given), the
source video of a fake, which pairs fakes with their real video. The file's hash joins the
pipeline fingerprint, so editing it recomputes the cache.

Labels of a metadata file that are all integers as written (``0``, ``1``, ``12``; no sign but
``-``, no leading zero) are stored as integers (an ``int64`` column), so a class index stays a
number (``CachedDataset(target="label").classes == [0, 1, 2]``); if any label is not, every label
of the file is a string. Folder labels are folder names: always strings.

The file is read when the op is built, so a bad one stops the run before any work, in one line:
it must be UTF-8 (a leading byte-order mark, as Excel's "CSV UTF-8" writes, is fine; another
encoding is named by the offset and line of its first bad byte), and a CSV may list a file twice
only with the same label and original (two different rows: both line numbers are named).
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

from precache.processing.ops.base import Op, Sample

__all__ = ["Labels", "LabelMissing", "read_label_file", "LABEL_SOURCES"]

LABEL_SOURCES = ("folder", "none")
"""Label sources that are not a file."""

_FILE_COLUMNS = ("file", "filename", "name", "path")

_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
"""An integer as written, with no other way to write it (``07`` and ``+7`` are names)."""


class LabelMissing(LookupError):
    """The metadata file has no entry for an input."""


def _read_text(path: Path) -> str:
    """The file as text: UTF-8, with or without the byte-order mark Excel writes.

    Raises:
        ValueError: it is not UTF-8; names the first bad byte's offset and line, and the fix.
    """
    data = path.read_bytes()
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as error:
        offset = skip + error.start  # in the file, BOM included
        line = data.count(b"\n", 0, offset) + 1
        raise ValueError(
            f"labels file '{path}' is not UTF-8: the byte {data[offset]:#04x} at offset "
            f"{offset} (line {line}) is not valid UTF-8 ({error.reason}); save the file as "
            "UTF-8 (in Excel: Save As 'CSV UTF-8') and re-run") from None


def _integer_labels(entries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``entries`` with each label an ``int`` if every label is an integer as written (see the
    module docstring), else as they are (strings)."""
    if entries and all(_INTEGER.fullmatch(e["label"]) for e in entries.values()):
        for entry in entries.values():
            entry["label"] = int(entry["label"])
    return entries


def read_label_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """File name or key -> {"label": ..., "original": ...} from a CSV or DFDC-style JSON file.

    The file is UTF-8; a leading byte-order mark (Excel's "CSV UTF-8") is ignored. A CSV may
    list a file twice only with the same label and original. Labels are strings, or ``int``
    when every label of the file is an integer (see the module docstring).

    Raises:
        ValueError: the file is neither, is not UTF-8, lacks the needed columns, or gives one file
            two labels (says which lines).
        OSError: it cannot be read.
    """
    path = Path(path)
    entries: dict[str, dict[str, Any]] = {}
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(_read_text(path))
        except json.JSONDecodeError as error:
            raise ValueError(f"labels file '{path}' is not valid JSON: {error}") from None
        if not isinstance(data, dict):
            raise ValueError(f"labels file '{path}': expected an object of file name -> "
                             '{"label": ...}, DFDC style')
        for name, entry in data.items():
            if not isinstance(entry, dict) or "label" not in entry:
                raise ValueError(f"labels file '{path}': entry {name!r} has no \"label\"")
            entries[str(name)] = {"label": str(entry["label"]),
                                  "original": str(entry.get("original") or "")}
        return _integer_labels(entries)
    if path.suffix.lower() != ".csv":
        raise ValueError(f"labels file '{path}' must end in .csv or .json (or give labels=folder "
                         "or labels=none)")
    reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
    fields = reader.fieldnames or []
    name_field = next((c for c in _FILE_COLUMNS if c in fields), None)
    if name_field is None or "label" not in fields:
        raise ValueError(f"labels file '{path}' needs a header with a file column "
                         f"({'/'.join(_FILE_COLUMNS)}) and 'label'; it has {fields}")
    lines: dict[str, int] = {}
    for row in reader:
        name = (row[name_field] or "").strip()
        entry = {"label": (row["label"] or "").strip(),
                 "original": (row.get("original") or "").strip()}
        if name in entries and entries[name] != entry:
            first, then = entries[name], entry
            what = "label" if first["label"] != then["label"] else "original"
            raise ValueError(
                f"labels file '{path}' lists '{name}' twice with different {what}s: line "
                f"{lines[name]} says {first[what]!r}, line {reader.line_num} says {then[what]!r}; "
                "keep one row per file and re-run")
        entries.setdefault(name, entry)
        lines.setdefault(name, reader.line_num)
    return _integer_labels(entries)


class Labels(Op):
    """Add ``label`` (and ``original`` from a metadata file); see the module docstring.

    Args:
        labels: ``"folder"``, ``"none"``, or the path of a ``.csv`` or ``.json`` metadata file.
    """

    name = "labels"
    version = "2"  # 2: a file's integer labels are stored as integers (were strings)

    def __init__(self, *, labels: str = "folder") -> None:
        self.labels = str(labels)
        self.file = None if self.labels in LABEL_SOURCES else Path(self.labels).resolve()
        if self.file is not None and not self.file.is_file():
            raise ValueError(f"labels file '{self.labels}' does not exist; give labels=folder, "
                             "labels=none or the path of a .csv or DFDC-style .json file")
        self.entries: dict[str, dict[str, Any]] | None = None
        if self.file is not None:  # read now: a bad file is one line before any work starts
            try:
                self.entries = read_label_file(self.file)
            except OSError as error:
                raise ValueError(f"labels file '{self.labels}' cannot be read: "
                                 f"{error.strerror or error}") from None

    @property
    def params(self) -> dict[str, Any]:
        # the file's own hash is in weight_files; its path may differ between machines
        return {"labels": "file" if self.file is not None else self.labels}

    def weight_files(self) -> list[Path]:
        return [self.file] if self.file is not None else []

    def setup(self) -> None:
        if self.file is not None and self.entries is None:
            self.entries = read_label_file(self.file)

    def __call__(self, sample: Sample) -> Sample:
        key = sample["source_key"]
        if self.labels == "none":
            return sample
        if self.file is None:
            parts = key.split("/")
            return dict(sample, label=parts[0] if len(parts) > 1 else "")
        if self.entries is None:
            self.setup()
        assert self.entries is not None
        entry = self.entries.get(key) or self.entries.get(PurePosixPath(key).name)
        if entry is None:
            raise LabelMissing(f"no label for '{key}' in {self.file}; add a row for it (or its file "
                           f"name) or remove the file from the input")
        return dict(sample, label=entry["label"], original=entry["original"])
