"""The manifest: the contract between stage 1 and stage 2, written last and atomically.

A directory without ``manifest.json`` is not a cache (a run is in progress or was interrupted).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from precache.formats.base import ShardInfo
from precache.schema import ColumnSpec, schema_from_json, schema_to_json

__all__ = ["Manifest", "ManifestError", "FORMAT_VERSION", "atomic_write_bytes"]

FORMAT_VERSION = 1


class ManifestError(ValueError):
    """``manifest.json`` is missing, unreadable or of an unknown format version."""


def atomic_write_bytes(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    ``fsync`` also makes it survive a power cut, not only a crash of the process."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


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
    def from_json(cls, obj: dict[str, Any]) -> Manifest:
        version = obj.get("format_version")
        if version != FORMAT_VERSION:
            raise ManifestError(
                f"manifest format version {version!r} is not supported (this precache reads "
                f"version {FORMAT_VERSION}); rebuild the cache with this version"
            )
        return cls(
            pipeline=obj["pipeline"],
            pipeline_ref=obj.get("pipeline_ref", obj["pipeline"]),
            params=obj["params"],
            ops=obj["ops"],
            fingerprint=obj["fingerprint"],
            format=obj["format"],
            schema=schema_from_json(obj["schema"]),
            shards=[ShardInfo.from_json(s) for s in obj["shards"]],
            counts={k: int(v) for k, v in obj["counts"].items()},
            index=obj["index"],
            errors=obj["errors"],
            source=obj.get("source", ""),
            generation=int(obj["generation"]),
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
            ManifestError: not JSON, missing fields, or an unknown format version.
        """
        try:
            return cls.from_json(json.loads(data.decode("utf-8")))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ManifestError(f"'{where}' is corrupt ({type(e).__name__}: {e})") from None

    def save(self, path: Path) -> None:
        """Write atomically (temporary file, fsync, rename)."""
        atomic_write_bytes(path, self.to_bytes())

    @classmethod
    def load(cls, path: Path) -> Manifest:
        """Read ``manifest.json``.

        Raises:
            ManifestError: missing, not JSON, or missing fields.
        """
        if not path.is_file():
            raise ManifestError(
                f"'{path.parent}' is not a precache cache (no manifest.json); a run that was "
                "interrupted leaves none: re-run it to finish the cache"
            )
        return cls.from_bytes(path.read_bytes(), str(path))
