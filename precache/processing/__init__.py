"""Stage 1: run a pipeline's ops over the inputs, once, in parallel, into a cache.

``runner.run`` lists the inputs (``sources``; record files through ``precache.processing.records``), plans
what changed against the cache (``plan``), runs the tasks on ``executors`` (local processes or
Ray actors; each task is one ``worker.run_task``: one shard plus a journal entry), and hands the
results to the cache's write transaction (``precache.cache.transaction``), which publishes them.
Data flows down: build -> cache -> storage.
"""

from precache.processing.runner import DEFAULT_SHARD_ROWS, RunSummary, stage1_workers, run
from precache.errors import RunError

__all__ = ["run", "RunSummary", "RunError", "DEFAULT_SHARD_ROWS", "stage1_workers"]
