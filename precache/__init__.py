"""precache: run expensive per-sample work once (stage 1), then train from compact shards (stage 2).

Data flow, one folder per part::

    processing/              stage 1: what a user writes (pipeline.py: a named list of ops/,
      |                      records.py) and what runs it: sources -> plan -> executors ->
      |                      worker (ops -> one shard); each finished task is handed to the
      v                      cache's write transaction
    cache/                   the contract: layout, manifest (written last), schema, formats/,
      |                      index and errors tables, lock, transaction, Cache (read access)
      v
    storage/                 where bytes live: local disk, s3://, gs://; disk cache; lease
      ^
    loading/                 stage 2: CachedDataset, exact-once DDP sampler, make_loader
    training/                process groups, mixed precision and optimizer step, checkpoints
    augment/                 train-time FaceAugment over the cached landmarks and regions
    faces/                   face models and geometry both stages share: MTCNN, the mesh topology
    cli/                     the ``precache`` command: one module per subcommand

Each layer imports only the layers below it. The names a user writes in the first hour are
importable from here; every other public name lives in its layer (``precache.processing``,
``precache.cache``, ``precache.loading``, ``precache.training``). They are loaded on first use
(PEP 562), so ``import precache`` (and ``precache --version``) stays light and never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    # stage 1
    "run": "precache.processing", "Pipeline": "precache.processing.pipeline",
    "Op": "precache.processing.ops", "FunctionOp": "precache.processing.ops",
    "Skip": "precache.processing.ops", "ragged": "precache.cache.schema",
    # the cache
    "Cache": "precache.cache", "verify": "precache.cache.verify",
    # stage 2 (these import torch)
    "CachedDataset": "precache.loading", "make_loader": "precache.loading",
    "FaceAugment": "precache.augment",
    # errors a caller catches
    "RunError": "precache.errors", "InputError": "precache.processing.sources",
    "PipelineError": "precache.processing.pipeline", "CacheBusyError": "precache.cache",
}
"""Public name -> the module that defines it."""

__all__ = list(_EXPORTS)


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
    from precache.cache import Cache, CacheBusyError
    from precache.cache.schema import ragged
    from precache.cache.verify import verify
    from precache.errors import RunError
    from precache.loading import CachedDataset, make_loader
    from precache.processing import run
    from precache.processing.ops import FunctionOp, Op, Skip
    from precache.processing.pipeline import Pipeline, PipelineError
    from precache.processing.sources import InputError
