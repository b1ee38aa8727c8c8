"""precache: run expensive per-sample work once (stage 1), then train from compact shards (stage 2).

Data flow: ``sources`` -> ``ops`` -> ``build`` (workers) -> ``formats`` writers -> ``manifest``
-> ``formats`` readers -> training.
"""

from __future__ import annotations

__version__ = "0.1.0"

from precache.build import DEFAULT_SHARD_ROWS, RunError, RunSummary, run
from precache.cache import Cache, CacheBusyError
from precache.formats import FORMATS
from precache.manifest import Manifest, ManifestError
from precache.ops import FunctionOp, Op, Skip
from precache.pipeline import Pipeline, PipelineError, load_pipeline
from precache.schema import ragged
from precache.sources import InputError
from precache.storage import StorageError
from precache.verify import verify

__all__ = [
    "__version__", "run", "RunSummary", "RunError", "DEFAULT_SHARD_ROWS", "Cache",
    "CacheBusyError", "FORMATS", "Manifest", "ManifestError", "Op", "FunctionOp", "Skip",
    "Pipeline", "PipelineError", "load_pipeline", "InputError", "StorageError", "verify", "ragged",
]
