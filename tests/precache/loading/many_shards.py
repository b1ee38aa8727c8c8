"""A cache of one row a shard, hundreds of shards, made in about a second: stage 1 writes one
shard of all rows (the synthetic pipeline: no decoding), then each row is written to a shard
of its own with the format's writer and the manifest lists those (stage 1 with one row a shard
syncs every file: seconds for a few hundred)."""

from __future__ import annotations

import json
from pathlib import Path

import precache
from precache.cache.formats import get_format
from precache.storage.hashing import file_checksum
from tests.helpers import build_cache
from tests.precache.loading.synthetic_pipeline import pipeline


def many_shard_cache(root: Path, rows: int, format: str) -> Path:
    """``root/cache``: ``rows`` rows (``key``, a 4x4x3 ``image``), one a shard."""
    (root / "in").mkdir(parents=True)
    for i in range(rows):
        (root / "in" / f"{i:05d}.bin").write_bytes(bytes([i % 256]))
    cache = root / "cache"
    build_cache(root / "in", cache, pipeline=pipeline, workers=1, shard_rows=rows, format=format)
    opened = precache.Cache(cache)
    schema, whole = opened.manifest.schema, opened.read_all()
    writer = get_format(opened.manifest.format)
    manifest = json.loads((cache / "manifest.json").read_text())
    old = [cache / shard["path"] for shard in manifest["shards"]]
    suffix = Path(manifest["shards"][0]["path"]).suffix
    shards = []
    for i in range(rows):
        rel = f"shards/part-{i + 1:05d}-{i:016x}{suffix}"
        writer.write(cache / rel, {name: values[i:i + 1] for name, values in whole.items()}, schema)
        shards.append({"path": rel, "rows": 1, "bytes": (cache / rel).stat().st_size,
                       "checksum": file_checksum(cache / rel), "deleted": []})
    manifest["shards"] = shards
    (cache / "manifest.json").write_text(json.dumps(manifest))
    for path in old:
        path.unlink()
    return cache
