"""The cache: the contract between stage 1 and stage 2.

- ``layout``: a cache's folders and file names, and which files precache owns (and may delete).
- ``manifest``: the manifest, written last; checked as it is parsed (it may be untrusted).
- ``fingerprint``: what the cache was computed with (ops, parameters, model hashes, format).
- ``schema``: column kinds and shapes; ``formats/``: Parquet and HDF5 shards.
- ``tables``: the per-generation index and errors tables.
- ``lock``: one writer per cache; ``transaction``: a run's write, from lock to publish.
- ``generations``: kept generations, reader leases, and what ``precache gc`` may delete.
- ``reader``: ``Cache``, read access for stage 2 and tools; ``verify``, ``inspect``.

It stores its bytes through ``precache.storage`` and never imports ``precache.processing``.
"""

from precache.cache.generations import GenerationError
from precache.cache.layout import MARKER, OWN_NAMES, CacheLayout
from precache.cache.lock import CacheBusyError, CacheLock
from precache.cache.manifest import Manifest, ManifestError
from precache.cache.reader import Cache, ShardMismatchError, load_manifest
from precache.cache.tables import ERRORS_SCHEMA, INDEX_SCHEMA, read_table

__all__ = ["Cache", "CacheBusyError", "GenerationError", "CacheLayout", "CacheLock", "Manifest",
           "ManifestError", "ShardMismatchError",
           "load_manifest", "read_table", "INDEX_SCHEMA", "ERRORS_SCHEMA", "MARKER", "OWN_NAMES"]
