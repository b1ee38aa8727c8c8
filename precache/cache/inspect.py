"""Summarise a cache for people and scripts: schema, shards, fingerprints, errors, skip reasons,
and the length histogram of ragged (token) columns."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import numpy as np

from precache.cache import Cache
from precache.cache.fingerprint import op_fingerprint

__all__ = ["describe_cache", "format_description"]


def describe_cache(path: str | os.PathLike[str], *, examples: int = 5) -> dict[str, Any]:
    """A JSON-ready description of the cache at ``path``.

    Raises:
        ManifestError: there is no readable manifest.
    """
    cache = Cache(path)
    m = cache.manifest
    index = cache.read_index().to_pylist()
    failed = [r for r in index if r["status"] == "failed"]
    skipped = [r for r in index if r["status"] == "skipped"]
    return {
        "path": str(path),
        "pipeline": m.pipeline,
        "params": m.params,
        "format": m.format,
        "fingerprint": m.fingerprint,
        "ops": [dict(op, fingerprint=op_fingerprint(op)) for op in m.ops],
        "schema": {name: spec.to_json() for name, spec in m.schema.items()},
        "counts": m.counts,
        "shards": [s.to_json() for s in m.shards],
        "bytes": sum(s.bytes for s in m.shards),
        "errors": {
            "count": len(failed),
            "by_stage": dict(Counter(f"{r['stage']}: {r['error_type']}" for r in failed)),
            "examples": [{k: r[k] for k in ("key", "stage", "error_type", "message")}
                         for r in failed[:examples]],
        },
        "skipped": {"count": len(skipped),
                    "by_reason": dict(Counter(f"{r['stage']}: {r['message']}" for r in skipped))},
        "lengths": _ragged_lengths(cache),
        "generation": m.generation,
        "created": m.created,
        "precache_version": m.precache_version,
    }


def _ragged_lengths(cache: Cache, bins: int = 10) -> dict[str, Any]:
    """Per ragged column (token ids): length statistics and a histogram, over the live rows."""
    out: dict[str, Any] = {}
    names = [n for n, spec in cache.manifest.schema.items() if spec.kind == "ragged"]
    for name in names:
        parts = []
        for i, info in enumerate(cache.manifest.shards):
            reader = cache.reader(i)
            try:
                rows = reader.read(info.live_indices() if info.deleted else None, [name])[name]
            finally:
                reader.close()
            parts.append(np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows)))
        lengths = np.concatenate(parts) if parts else np.empty(0, np.int64)
        if not len(lengths):
            continue
        counts, edges = np.histogram(lengths, bins=bins)
        out[name] = {"min": int(lengths.min()), "median": float(np.median(lengths)),
                     "p95": float(np.percentile(lengths, 95)), "max": int(lengths.max()),
                     "mean": float(lengths.mean()), "total": int(lengths.sum()),
                     "histogram": [{"from": float(a), "to": float(b), "rows": int(n)}
                                   for a, b, n in zip(edges[:-1], edges[1:], counts)]}
    return out


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def format_description(d: dict[str, Any], *, max_shards: int = 10) -> str:
    """Human-readable text of ``describe_cache``'s result."""
    c = d["counts"]
    lines = [
        f"cache       {d['path']}",
        f"pipeline    {d['pipeline']}  params {d['params']}",
        f"format      {d['format']}  fingerprint {d['fingerprint']}  generation {d['generation']}",
        f"inputs      {c['inputs']}: {c['ok']} ok, {c['skipped']} skipped, {c['failed']} failed",
        f"rows        {c['rows']} in {len(d['shards'])} shards, {_size(d['bytes'])}",
        "ops",
    ]
    for op in d["ops"]:
        weights = f"  weights {op['weights']}" if op["weights"] else ""
        lines.append(f"  {op['name']} v{op['version']}  {op['fingerprint']}  {op['params']}{weights}")
    lines.append("schema")
    for name, spec in d["schema"].items():
        shape = (f"{spec['dtype']}{spec['shape']}" if spec["kind"] == "ndarray"
                 else f"{spec['dtype']}[*]" if spec["kind"] == "ragged" else spec["dtype"])
        lines.append(f"  {name:<16} {spec['kind']:<8} {shape}")
    lines.append("shards")
    for s in d["shards"][:max_shards]:
        lines.append(f"  {s['path']}  {s['rows']} rows  {_size(s['bytes'])}  {s['checksum'][:23]}")
    if len(d["shards"]) > max_shards:
        lines.append(f"  ... {len(d['shards']) - max_shards} more (--json lists all)")
    for name, st in d.get("lengths", {}).items():
        lines.append(f"lengths     {name}: min {st['min']}, median {st['median']:.0f}, "
                     f"p95 {st['p95']:.0f}, max {st['max']}, {st['total']:,} in all")
        peak = max(b["rows"] for b in st["histogram"]) or 1
        for b in st["histogram"]:
            bar = "#" * round(40 * b["rows"] / peak)
            lines.append(f"  {b['from']:>8.0f} - {b['to']:<8.0f} {b['rows']:>7}  {bar}")
    if d["skipped"]["count"]:
        lines.append("skipped")
        lines += [f"  {n:>6}  {reason}" for reason, n in d["skipped"]["by_reason"].items()]
    lines.append(f"errors      {d['errors']['count']}")
    lines += [f"  {n:>6}  {stage}" for stage, n in d["errors"]["by_stage"].items()]
    for e in d["errors"]["examples"]:
        lines.append(f"  e.g. {e['key']}: [{e['stage']}] {e['error_type']}: {e['message']}")
    return "\n".join(lines)
