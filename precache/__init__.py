"""precache: run expensive per-sample work once (stage 1), then train from compact shards (stage 2).

Data flow, one folder per part::

    pipeline.py, ops/        what a user writes: a named list of ops with parameters
    build/                   stage 1: sources -> plan -> executors -> worker (ops -> one shard)
      |                      each finished task is handed to the cache's write transaction
      v
    cache/                   the contract: layout, manifest (written last), schema, formats/,
      |                      index and errors tables, lock, transaction, Cache (read access)
      v
    storage/                 where bytes live: local disk, s3://, gs://; disk cache; lease
      ^
    loading/                 stage 2: CachedDataset, exact-once DDP sampler, make_loader
    training/                process groups, mixed precision and optimizer step, checkpoints
    augment/, faces/         train-time FaceAugment over the cached landmarks and regions
    cli/                     the ``precache`` command: one module per subcommand

Each layer imports only the layers below it. The main names are importable from here; they are
loaded on first use (PEP 562), so ``import precache`` (and ``precache --version``) stays light and
never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    # stage 1
    "run": "precache.build", "RunSummary": "precache.build", "RunError": "precache.errors",
    "DEFAULT_SHARD_ROWS": "precache.build", "InputError": "precache.build.sources",
    "Pipeline": "precache.pipeline", "PipelineError": "precache.pipeline",
    "load_pipeline": "precache.pipeline", "Op": "precache.ops", "FunctionOp": "precache.ops",
    "Skip": "precache.ops", "ragged": "precache.cache.schema",
    # the cache
    "Cache": "precache.cache", "CacheBusyError": "precache.cache", "Manifest": "precache.cache",
    "ManifestError": "precache.cache", "FORMATS": "precache.cache.formats",
    "verify": "precache.cache.verify", "StorageError": "precache.storage",
    # stage 2 (these import torch)
    "CachedDataset": "precache.loading", "make_loader": "precache.loading",
    "CacheLoader": "precache.loading", "DistributedShardSampler": "precache.loading",
    "DevicePrefetcher": "precache.loading", "PackedBlocks": "precache.loading",
    "LengthBucketSampler": "precache.loading.buckets", "TokenCollate": "precache.loading.text",
    "FaceAugment": "precache.augment",
}
"""Public name -> the module that defines it."""

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'precache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from precache.augment import FaceAugment
    from precache.build import DEFAULT_SHARD_ROWS, RunSummary, run
    from precache.build.sources import InputError
    from precache.cache import Cache, CacheBusyError, Manifest, ManifestError
    from precache.cache.formats import FORMATS
    from precache.cache.schema import ragged
    from precache.cache.verify import verify
    from precache.errors import RunError
    from precache.loading import (CachedDataset, CacheLoader, DevicePrefetcher,
                                  DistributedShardSampler, PackedBlocks, make_loader)
    from precache.loading.buckets import LengthBucketSampler
    from precache.loading.text import TokenCollate
    from precache.ops import FunctionOp, Op, Skip
    from precache.pipeline import Pipeline, PipelineError, load_pipeline
    from precache.storage import StorageError
