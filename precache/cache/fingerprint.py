"""The cache fingerprint, stored in the manifest: what the cache was computed with. A run whose
fingerprint differs from the cache's recomputes every input."""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["fingerprint", "op_fingerprint"]


def op_fingerprint(description: dict[str, Any]) -> str:
    """A short hash of one op's name, version, parameters and weight hashes."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:12]


def fingerprint(descriptions: list[dict[str, Any]], shard_format: str) -> str:
    """The cache fingerprint: a hash of every op's name, version, parameters and weight hashes,
    and of the shard format. Any change means the cache is rebuilt."""
    blob = json.dumps({"ops": descriptions, "format": shard_format}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
