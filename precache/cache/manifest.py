"""The manifest: the contract between stage 1 and stage 2, written last and atomically.

A directory without ``manifest.json`` is not a cache (a run is in progress or was interrupted).

A manifest is read from storage that others may write (a shared bucket), and its values name
files that are read, downloaded and deleted. So it is checked as it is parsed, before anything
else is done with the cache: every shard path is ``shards/part-NNNNN<suffix of the format>``,
the index and errors tables are plain names at the cache's top (``index-NNNNN.parquet``,
``errors-NNNNN.parquet``, or the ``errors.parquet`` of older versions), every checksum is
``sha256:<64 hex digits>``, counts, sizes and deleted rows are in range, the schema's columns
have a kind, dtype and shape precache writes, each op is an object with a ``name``, ``version``,
``params`` and ``weights``, and nothing is nested deeper than ``MAX_DEPTH`` (every command would
otherwise end in a ``RecursionError``). Anything else is a one-line ``ManifestError`` naming the
manifest, the entry and what was expected.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from precache.cache.formats import FORMATS
from precache.cache.formats.base import ShardInfo, check_count
from precache.cache.schema import ColumnSpec, schema_from_json, schema_to_json
from precache.errors import short_repr as _show
from precache.storage.durable import atomic_write_bytes
from precache.storage.hashing import CHECKSUM_FORM, is_checksum

__all__ = ["Manifest", "ManifestError", "FORMAT_VERSION", "TABLE_NAMES", "MAX_DEPTH"]

FORMAT_VERSION = 1

MAX_DEPTH = 64
"""The deepest nesting of objects and lists a manifest may have. precache writes a handful of
levels (more only where a pipeline's parameters nest); Python's JSON parser and printer
recurse, so a manifest of 100,000 nested lists would end every command in a
``RecursionError``."""


class ManifestError(ValueError):
    """``manifest.json`` is missing, unreadable, of an unknown format version, or holds values
    precache does not write (a path outside the cache, a malformed checksum)."""


TABLE_NAMES = {
    "index": (re.compile(r"index-[0-9]{5,}\.parquet"), "index-NNNNN.parquet"),
    "errors": (re.compile(r"errors-[0-9]{5,}\.parquet|errors\.parquet"),
               "errors-NNNNN.parquet or errors.parquet"),
}
"""The names the index and errors tables may have: plain file names at the cache's top (the
older single ``errors.parquet`` too). The one definition: the cache layout deletes by it."""

_FIX = ("it was not written by precache or was changed since; nothing was read from the cache "
        "(if the cache is yours, rebuild it: precache run ... --overwrite)")


_FIELDS = [("pipeline", str, "a string"), ("pipeline_ref", str, "a string"),
           ("params", dict, "an object"), ("fingerprint", str, "a string"),
           ("schema", dict, "an object of column name -> {kind, dtype, shape}"),
           ("source", str, "a string"), ("precache_version", str, "a string"),
           ("extra", dict, "an object")]
"""Top-level fields of a plain kind: (name, type, what a message says was expected)."""
_OPTIONAL = {"pipeline_ref", "source", "extra"}

_OP_FIELDS = [("name", str, "a string"), ("version", str, "a string"),
              ("params", dict, "an object"), ("weights", dict, "an object of file name -> hash")]
"""What ``Op.describe`` writes for each op (``inspect`` prints each; readers look for codecs)."""


def _check_ops(ops: Any, bad: Callable[[str], ManifestError]) -> None:
    """Raise ``bad(...)`` unless ``ops`` is a list of op descriptions (see ``_OP_FIELDS``)."""
    if not isinstance(ops, list):
        raise bad(f"ops is {_show(ops)}, expected a list of objects with name, version, params "
                  "and weights")
    for i, op in enumerate(ops):
        if not isinstance(op, dict):
            raise bad(f"ops[{i}] is {_show(op)}, expected an object with name, version, params "
                      "and weights")
        for key, kind, words in _OP_FIELDS:
            if key not in op:
                raise bad(f"ops[{i}] has no {key}, expected {words}")
            if not isinstance(op[key], kind):
                raise bad(f"ops[{i}].{key} is {_show(op[key])}, expected {words}")
        for file, digest in op["weights"].items():
            if not isinstance(digest, str):
                raise bad(f"ops[{i}].weights[{file!r}] is {_show(digest)}, expected a hash "
                          "(a string)")


def _too_deep(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``obj`` (parsed JSON) nests objects or lists more than ``limit`` levels deep;
    iterative, so that the check itself cannot overflow the stack."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _entries(obj: dict[str, Any], where: str) -> tuple[list[ShardInfo], dict[str, int]]:
    """The shards and counts of the manifest ``obj``, checked (see the module's docstring).

    Raises:
        ManifestError: one line naming ``where``, the bad entry and what was expected.
    """
    def bad(text: str) -> ManifestError:
        return ManifestError(f"'{where}' is not a valid precache manifest: {text}; {_FIX}")

    for key, kind, words in _FIELDS:
        if (key in obj or key not in _OPTIONAL) and not isinstance(obj[key], kind):
            raise bad(f"{key} is {_show(obj[key])}, expected {words}")
    _check_ops(obj["ops"], bad)
    try:
        schema_from_json(obj["schema"])
    except ValueError as e:
        raise bad(f"schema{e}") from None
    name = obj["format"]
    shard_format = FORMATS.get(name) if isinstance(name, str) else None
    if shard_format is None:
        raise bad(f"format is {_show(name)}, expected one of {sorted(FORMATS)}")
    if not isinstance(obj["shards"], list):
        raise bad(f"shards is {_show(obj['shards'])}, expected a list")
    shards: list[ShardInfo] = []
    seen: set[str] = set()
    for i, entry in enumerate(obj["shards"]):
        try:
            info = ShardInfo.from_json(entry, shard_format.suffix)
        except ValueError as e:
            raise bad(f"shards[{i}]{'.' if isinstance(entry, dict) else ' '}{e}") from None
        if info.path in seen:
            raise bad(f"shards[{i}].path {_show(info.path)} is listed twice, expected each "
                      "shard once")
        seen.add(info.path)
        shards.append(info)
    for table, (pattern, form) in TABLE_NAMES.items():
        entry = obj[table]
        if not isinstance(entry, dict):
            raise bad(f"{table} is {_show(entry)}, expected an object with path and checksum")
        if not isinstance(entry["path"], str) or pattern.fullmatch(entry["path"]) is None:
            raise bad(f"{table}.path is {_show(entry['path'])}, expected {form} (a file at the "
                      "cache's top)")
        if not is_checksum(entry["checksum"]):
            raise bad(f"{table}.checksum is {_show(entry['checksum'])}, expected {CHECKSUM_FORM}")
    counts = obj["counts"]
    if not isinstance(counts, dict):
        raise bad(f"counts is {_show(counts)}, expected an object")
    numbers = [(f"counts.{key}", value) for key, value in counts.items()]
    for entry, value in [*numbers, ("generation", obj["generation"])]:
        try:
            check_count(entry, value)
        except ValueError as e:
            raise bad(str(e)) from None
    try:
        datetime.fromisoformat(obj["created"])
    except (TypeError, ValueError):
        raise bad(f"created is {_show(obj['created'])}, expected an ISO 8601 time such as "
                  "'2026-01-31T12:00:00+00:00'") from None
    return shards, counts


@dataclass
class Manifest:
    """Everything stage 2 needs to read a cache, and stage 1 needs to update it.

    Args:
        pipeline (str): pipeline name. ``pipeline_ref``: how to load it again.
        params (dict): the pipeline parameters used. ``ops``: each op's name, version, params and
            weight hashes. ``fingerprint``: their hash (with the format).
        format (str): shard format name. ``schema``: column name -> ``ColumnSpec``.
        shards (list[ShardInfo]): in row order. ``counts``: inputs, ok, skipped, failed, rows.
        index (dict): ``path`` and ``checksum`` of the per-input index table.
        errors (dict): ``path`` and ``checksum`` of the errors table
            (``errors-GGGGG.parquet``, one per generation like the index).
        generation (int): bumped by every run that publishes a manifest.
    """

    pipeline: str
    pipeline_ref: str
    params: dict[str, Any]
    ops: list[dict[str, Any]]
    fingerprint: str
    format: str
    schema: dict[str, ColumnSpec]
    shards: list[ShardInfo]
    counts: dict[str, int]
    index: dict[str, str]
    errors: dict[str, str]
    source: str
    generation: int
    created: str
    precache_version: str
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        """Rows in the cache (over all shards, not counting deleted rows)."""
        return sum(s.live_rows for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "pipeline": self.pipeline,
            "pipeline_ref": self.pipeline_ref,
            "params": self.params,
            "ops": self.ops,
            "fingerprint": self.fingerprint,
            "format": self.format,
            "schema": schema_to_json(self.schema),
            "shards": [s.to_json() for s in self.shards],
            "counts": self.counts,
            "index": self.index,
            "errors": self.errors,
            "source": self.source,
            "generation": self.generation,
            "created": self.created,
            "precache_version": self.precache_version,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "manifest.json") -> Manifest:
        """The manifest ``obj`` (parsed JSON), checked; ``where`` names it in errors.

        Raises:
            ManifestError: an unknown format version, or a value precache does not write.
            KeyError, TypeError: a field is missing or of the wrong kind.
        """
        if not isinstance(obj, dict):
            raise ManifestError(f"'{where}' is not a valid precache manifest: it holds "
                                f"{type(obj).__name__}, expected an object; {_FIX}")
        if _too_deep(obj):
            raise ManifestError(_too_deep_message(where))
        version = obj.get("format_version")
        if version != FORMAT_VERSION:
            raise ManifestError(
                f"manifest format version {version!r} is not supported (this precache reads "
                f"version {FORMAT_VERSION}); rebuild the cache with this version"
            )
        shards, counts = _entries(obj, where)
        return cls(
            pipeline=obj["pipeline"],
            pipeline_ref=obj["pipeline_ref"] if "pipeline_ref" in obj else obj["pipeline"],
            params=obj["params"],
            ops=obj["ops"],
            fingerprint=obj["fingerprint"],
            format=obj["format"],
            schema=schema_from_json(obj["schema"]),
            shards=shards,
            counts=counts,
            index={"path": obj["index"]["path"], "checksum": obj["index"]["checksum"]},
            errors={"path": obj["errors"]["path"], "checksum": obj["errors"]["checksum"]},
            source=obj.get("source", ""),
            generation=obj["generation"],
            created=obj["created"],
            precache_version=obj["precache_version"],
            format_version=version,
            extra=obj.get("extra", {}),
        )

    def to_bytes(self) -> bytes:
        """The ``manifest.json`` file's bytes."""
        return json.dumps(self.to_json(), indent=2, sort_keys=False).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        """Parse ``manifest.json``'s bytes; ``where`` names the file in errors.

        Raises:
            ManifestError: not JSON, missing fields, an unknown format version, or values
                precache does not write (see the module's docstring).
        """
        try:
            return cls.from_json(json.loads(data.decode("utf-8")), where)
        except ManifestError:
            raise
        except RecursionError:  # the parser's own limit (about 1,000 levels)
            raise ManifestError(_too_deep_message(where)) from None
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError,
                AttributeError) as e:
            raise ManifestError(f"'{where}' is corrupt ({type(e).__name__}: {e})") from None

    def save(self, path: Path) -> None:
        """Write atomically (temporary file, fsync, rename)."""
        atomic_write_bytes(path, self.to_bytes())


def _too_deep_message(where: str) -> str:
    return (f"'{where}' is not a valid precache manifest: its values are nested more than "
            f"{MAX_DEPTH} levels deep; {_FIX}")
