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
"""

from __future__ import annotations

import csv
import json
from pathlib import Path, PurePosixPath
from typing import Any

from precache.ops.base import Op, Sample

__all__ = ["Labels", "LabelMissing", "read_label_file", "LABEL_SOURCES"]

LABEL_SOURCES = ("folder", "none")
"""Label sources that are not a file."""

_FILE_COLUMNS = ("file", "filename", "name", "path")


class LabelMissing(LookupError):
    """The metadata file has no entry for an input."""


def read_label_file(path: str | Path) -> dict[str, dict[str, str]]:
    """File name or key -> {"label": ..., "original": ...} from a CSV or DFDC-style JSON file.

    Raises:
        ValueError: the file is neither, or lacks the needed columns (says which).
        OSError: it cannot be read.
    """
    path = Path(path)
    entries: dict[str, dict[str, str]] = {}
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
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
        return entries
    if path.suffix.lower() != ".csv":
        raise ValueError(f"labels file '{path}' must end in .csv or .json (or give labels=folder "
                         "or labels=none)")
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        fields = reader.fieldnames or []
        name_field = next((c for c in _FILE_COLUMNS if c in fields), None)
        if name_field is None or "label" not in fields:
            raise ValueError(f"labels file '{path}' needs a header with a file column "
                             f"({'/'.join(_FILE_COLUMNS)}) and 'label'; it has {fields}")
        for row in reader:
            entries[row[name_field].strip()] = {"label": (row["label"] or "").strip(),
                                                "original": (row.get("original") or "").strip()}
    return entries


class Labels(Op):
    """Add ``label`` (and ``original`` from a metadata file); see the module docstring.

    Args:
        labels: ``"folder"``, ``"none"``, or the path of a ``.csv`` or ``.json`` metadata file.
    """

    name = "labels"
    version = "1"

    def __init__(self, *, labels: str = "folder") -> None:
        self.labels = str(labels)
        self.file = None if self.labels in LABEL_SOURCES else Path(self.labels).resolve()
        if self.file is not None and not self.file.is_file():
            raise ValueError(f"labels file '{self.labels}' does not exist; give labels=folder, "
                             "labels=none or the path of a .csv or DFDC-style .json file")
        self.entries: dict[str, dict[str, str]] | None = None

    @property
    def params(self) -> dict[str, Any]:
        # the file's own hash is in weight_files; its path may differ between machines
        return {"labels": "file" if self.file is not None else self.labels}

    def weight_files(self) -> list[Path]:
        return [self.file] if self.file is not None else []

    def setup(self) -> None:
        if self.file is not None:
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
