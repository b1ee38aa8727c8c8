"""Stage-1 runner: list inputs, plan what changed, run the tasks on an executor, and hand each
finished task to the cache's write transaction, which publishes index, errors table and manifest
(last, atomically).

Rules (also in docs/stage1.md, "What a re-run does"):

- **Incremental** (``plan``): an input is recomputed only if it is new, or its size or
  modification time changed *and* its content hash differs from the cached ``source_hash``. Rows
  of deleted and changed inputs are listed as deleted in their shard's manifest entry (no copy);
  a shard more than half deleted is rewritten with its live rows.
- **Fingerprint**: each op's name, version, parameters and model-file hashes, plus the shard
  format. If it differs from the cache's, every input is recomputed; the old cache stays readable
  until the new manifest replaces it.
- **Resumable**: every finished task is committed as a shard plus a journal entry; a re-run after a
  crash (even kill -9) adopts them and computes only the rest.
- **Deterministic**: tasks are fixed runs of ``shard_rows`` inputs in key order and shards are
  numbered by task, so the number of workers does not change the cache.
- **Up to date**: a run that finds nothing to do (nothing added, changed or removed, the same
  fingerprint) publishes no new generation; readers of the current one keep it.
- **Waiting** (``wait``): a run that finds the cache's lock held waits for that run to finish,
  then plans as usual: after a run of the same command that published, there is nothing left
  to compute, and it returns the summary of the cache that run published. Every rank of a job
  can call ``run(..., wait=True)``; one computes, the others wait.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

from tqdm import tqdm

from precache.processing.executors import WorkerDied, require_ray, run_tasks, run_tasks_ray
from precache.processing.executors.device_stage import device_gpus, device_ops
from precache.processing.plan import DEFAULT_SHARD_ROWS, classify, make_tasks
from precache.processing.records import escape_name
from precache.processing.sources import DEFAULT_MAX_INPUT_BYTES, check_max_input_bytes, list_inputs
from precache.processing.stage_times import StageTimes
from precache.processing.worker import TaskResult, WorkerConfig
from precache.cache.fingerprint import fingerprint
from precache.cache.formats import get_format
from precache.cache.layout import CacheLayout
from precache.cache.generations import DEFAULT_RETENTION_S
from precache.cache.lock import DEFAULT_WAIT_S
from precache.cache.transaction import WriteTransaction
from precache.errors import RunError
from precache.storage import is_remote, local_path
from precache.processing.pipeline import Pipeline, load_pipeline

__all__ = ["run", "RunSummary", "RunError", "DEFAULT_SHARD_ROWS", "stage1_workers"]

def stage1_workers() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@dataclass
class RunSummary:
    """What a run did. Counts are over all inputs of the cache after the run. ``cache`` is the
    cache's directory, or its URL (a ``str``) for a remote cache."""

    cache: Path | str
    inputs: int
    ok: int
    skipped: int
    failed: int
    rows: int
    computed: int
    reused: int
    deleted: int
    touched_shards: int
    rewritten_shards: int
    wall_s: float
    cache_bytes: int
    shard_bytes_written: int
    failures: list[dict[str, Any]] = field(default_factory=list)
    errors_table: str = ""  # the errors table's name in the cache (errors-GGGGG.parquet)
    generation: int = 0  # the cache's generation after the run
    published: bool = True  # False: nothing changed, the run published no new generation
    waited_s: float = 0.0  # how long the run waited for another run that held the cache
    stages: StageTimes = field(default_factory=StageTimes)
    """Where the computed inputs' time went: seconds per stage (read, each op, store)."""

    @property
    def samples_per_s(self) -> float:
        """Inputs computed per second of wall time."""
        return self.computed / self.wall_s if self.wall_s > 0 else 0.0


def _own_files(output: str | os.PathLike[str]) -> str | os.PathLike[str] | None:
    """What the input listing leaves out: the output and everything under it, where the cache
    is written (a cache inside its input folder must not read its own shards and tables).
    A local folder that holds files but no cache is not left out: the run refuses to write
    there, with its own message, before anything is written."""
    if is_remote(output):
        return output
    root = local_path(output)
    try:
        if root.is_dir() and any(root.iterdir()) and not CacheLayout(root).is_cache():
            return None
    except OSError:  # unreadable: the run reports it when it opens the output
        pass
    return output


def _describe_failure(record: dict[str, Any]) -> str:
    return (f"input '{record['locator']}' failed at stage '{record['stage']}': "
            f"{record['error_type']}: {record['message']}")


def run(
    pipeline: Pipeline | str,
    input: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    params: dict[str, Any] | None = None,
    workers: int | None = None,
    format: str = "parquet",
    shard_rows: int | None = None,
    overwrite: bool = False,
    fail_fast: bool = False,
    progress: bool = True,
    log: Any = print,
    executor: str = "local",
    ray_address: str | None = None,
    retention_s: float = DEFAULT_RETENTION_S,
    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES,
    wait: bool | float = False,
    device_stage: bool | None = None,
) -> RunSummary:
    """Run a stage-1 pipeline over ``input`` into the cache at ``output``.

    Args:
        pipeline: a ``Pipeline``, or a name / ``module:attr`` / path that ``load_pipeline`` finds.
        input: a folder of inputs, one input file, or a ``.txt`` list of paths. Files in
            ``output`` (a cache kept inside its input folder) are never inputs.
        output: the cache directory (created if missing), or a URL (``s3://bucket/cache``,
            ``gs://``, ``file://``): the run then keeps its lock, journal and staging in a local
            working directory (``precache.storage.work_dir_for``), uploads each finished
            shard, and publishes the manifest last.
        params: overrides of the pipeline's parameters.
        workers: worker processes (default: the cores). 1 runs in this process. With
            ``executor="ray"``: Ray actors (default: the CPUs of the Ray cluster).
        format: ``parquet`` (default) or ``hdf5``.
        shard_rows: inputs per task, and so rows per shard (one task is one shard). Default
            the pipeline's (256; ``text``: 4096), or fewer for small runs so there are at least
            32 shards (of at least 16).
        overwrite: replace a cache of another pipeline (or a corrupt one) at ``output``.
        fail_fast: stop at the first failed input (committed shards are kept for a re-run).
        progress: show a progress bar.
        log: where one-line messages go (``print`` by default).
        executor: ``local`` (processes on this machine) or ``ray`` (one Ray actor per worker;
            needs ``pip install 'precache[ray]'``).
        ray_address: with ``executor="ray"``, the address of a running Ray cluster; ``None``
            starts a local Ray for this run. On a cluster, ``output`` must be on storage
            that every node sees at the same path: the actors write the shards.
        retention_s: how long the files of the generation this run replaces are kept for
            readers that still use it (default an hour; always while a reader holds it; see
            ``precache gc``). 0 deletes them at once unless a reader holds them.
        max_input_bytes: the most bytes one input may have (default 2 GiB). A bigger input
            fails at stage ``read`` (checked before reading, and no read goes past it), as does
            an input that is not a regular file (a FIFO, a device, a socket; a symlink to a
            regular file is fine); the run goes on. Not part of the fingerprint: raising it
            retries those inputs on the next run.
        wait: when another run holds the cache (another rank of the same job, say), wait for
            it to finish instead of raising ``CacheBusyError``: ``True`` waits up to
            ``DEFAULT_WAIT_S`` (2 hours), a number up to that many seconds. The run then goes
            on as usual: after a run of the same command that published, it computes nothing
            and returns that cache's summary (``computed`` 0, ``published`` False); if the
            inputs changed meanwhile, or the other run died, it computes what is left. Works
            for local caches (a ``flock``) and remote ones (the writer lease, tried every 5 s).
        device_stage: run the ops that declare ``device_stage`` (a face detector on a GPU) in
            a device process shared by the workers, which runs their batches together while
            they decode and crop (``executors.device_stage``): one per GPU the ops may use
            (all that torch sees for ``device=cuda``/``auto``, the one of ``cuda:K``), bound
            to it, at most one per worker. ``None`` (default): when an op declares it;
            ``False``: every worker runs every op; ``True``: required (an error if no op
            declares it). On Ray: a pool of device actors, one per GPU.

    Returns:
        A ``RunSummary``.

    Raises:
        InputError, PipelineError: bad input path, pipeline or parameters.
        CacheBusyError: another run holds the cache (with ``wait``: still, when it expired).
        RunError: the run cannot go on (fail-fast error, crashed worker, refused output).
        StorageError: the output URL cannot be written (missing bucket, refused credentials).
    """
    start = time.perf_counter()
    if isinstance(pipeline, str):
        pipeline = load_pipeline(pipeline)
    if shard_rows is not None and shard_rows <= 0:
        raise ValueError(f"shard_rows must be positive, got {shard_rows}")
    if executor not in ("local", "ray"):
        raise ValueError(f"executor must be 'local' or 'ray', got {executor!r}")
    wait_s = _wait_seconds(wait)
    max_input_bytes = check_max_input_bytes(max_input_bytes)
    if executor == "ray":
        require_ray(ray_address)  # before any work
    ray_workers = None if workers is None else max(1, workers)  # None: the cluster's CPUs
    shard_format = get_format(format)
    resolved = pipeline.resolve_params(params)
    built = pipeline.build_ops(resolved)
    descriptions = [op.describe() for op in built]
    on_device = device_ops(built)  # (an op's device_stage may ask torch for a GPU: once)
    staged = _use_device_stage(device_stage, on_device)
    fp = fingerprint(descriptions, format)
    inputs = list_inputs(input, pipeline.extensions, exclude=_own_files(output))
    workers = stage1_workers() if workers is None else max(1, workers)
    # the local run's device processes: the GPU each is bound to (torch is asked here, once)
    gpus = (device_gpus([built[i] for i in on_device], workers)
            if staged and executor == "local" else [None])
    transaction = WriteTransaction(output, pipeline=pipeline.name, fingerprint=fp,
                                   overwrite=overwrite, log=log, retention_s=retention_s,
                                   wait_s=wait_s)
    with transaction as tx:
        if tx.waited_s:  # the run waited for wrote its files: list again, leaving them out
            inputs = list_inputs(input, pipeline.extensions, exclude=_own_files(output))
        todo, kept = classify(inputs, tx.records, max_input_bytes)
        todo = tx.recompute_damaged(inputs, todo, kept)  # rows of a damaged shard: again
        deleted = len(set(tx.records) - {item.key for item in inputs})
        log(f"precache: {len(inputs)} inputs: {len(kept)} unchanged, {len(todo)} to compute"
            + (f", {deleted} deleted" if deleted else ""))

        first_seq = tx.next_seq
        tasks = make_tasks(todo, first_seq, shard_rows, pipeline.shard_rows or DEFAULT_SHARD_ROWS)
        layout = tx.layout
        config = WorkerConfig(pipeline=pipeline.ref or pipeline, params=resolved,
                              cache_root=str(layout.root), cache_url=layout.url,
                              format=format, fingerprint=fp,
                              pipeline_name=pipeline.name, fail_fast=fail_fast,
                              max_input_bytes=max_input_bytes,
                              device_ops=tuple(on_device) if staged else ())
        results = (run_tasks_ray(tasks, config, ray_workers, address=ray_address,
                                 device_stage=staged)
                   if executor == "ray" else run_tasks(tasks, config, workers, staged, gpus))
        stages = StageTimes()
        written = commit_results(tx, results, kept, len(todo), progress, again="command",
                                 stages=stages)

        touched, rewritten = tx.drop_stale_rows(kept, shard_format, first_seq + len(tasks))
        manifest = tx.publish(kept, pipeline_ref=pipeline.ref, params=resolved, ops=descriptions,
                              shard_format=format, source=escape_name(str(input)))
        if not tx.published:
            log(f"precache: cache '{tx.location}' is up to date (generation "
                f"{manifest.generation}): nothing changed, nothing published")
    return summarize(layout, manifest, tx, kept, computed=len(todo), reused=len(inputs) - len(todo),
                     deleted=deleted, touched=touched, rewritten=rewritten, written=written,
                     start=start, stages=stages)


def commit_results(tx: WriteTransaction, results: Iterator[TaskResult],
                   kept: dict[str, dict[str, Any]], total: int, progress: bool, *,
                   again: str, locate: Callable[[str], str] | None = None,
                   stages: StageTimes | None = None) -> int:
    """Hand each finished task's shard to the transaction and its records to ``kept``, with a
    progress bar; the bytes of the shards written. ``locate(key)``: a record's locator, where
    the workers cannot know it. ``again`` names what the user re-runs ("command", "call").
    ``stages`` collects where the tasks' time went; the bar names the stage that takes most.

    Raises:
        RunError: a task failed with fail-fast, a worker died, or writing failed; the shards
            finished so far are kept (a re-run resumes). ``results`` is closed first, which
            stops the workers at once (not when the traceback is freed, after the lock is
            released).
    """
    written = 0
    bar = tqdm(total=total, unit="sample", desc="precache", disable=not progress or not total,
               dynamic_ncols=True)
    try:
        for result in results:
            if locate is not None:
                for record in [*result.records, *([result.failure] if result.failure else [])]:
                    record["locator"] = locate(record["key"])
            if result.failure is not None:
                flag = "--fail-fast" if again == "command" else "fail_fast"
                raise RunError(_describe_failure(result.failure) + f" ({flag}); shards "
                               "finished so far are kept: re-run to resume")
            tx.add(result.seq, result.shard, result.schema, journal=result.journal)
            for record in result.records:
                kept[record["key"]] = record
            if result.shard is not None:
                written += result.shard.bytes
            if stages is not None:
                stages.add(result.stage_seconds, len(result.records), result.device_stats)
                bar.set_postfix_str(stages.slowest(), refresh=False)
            bar.update(len(result.records))
    except WorkerDied as e:
        raise RunError(f"{e}\nfinished shards are kept: re-run the same {again} to resume "
                       "(a worker killed, out of memory, or crashing in native code)") from None
    except OSError as e:
        raise RunError(f"writing the cache failed ({e}); finished shards are kept: fix the "
                       f"cause and re-run the same {again} to resume") from None
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()
        bar.close()
    return written


def summarize(layout: CacheLayout, manifest: Any, tx: WriteTransaction,
              kept: dict[str, dict[str, Any]], *, computed: int, reused: int, deleted: int,
              touched: int, rewritten: int, written: int, start: float,
              stages: StageTimes | None = None) -> RunSummary:
    """A finished run's ``RunSummary``, from what it published."""
    failures = [r for r in kept.values() if r["status"] == "failed"]
    return RunSummary(
        cache=layout.root if layout.url is None else layout.url,
        inputs=manifest.counts["inputs"], ok=manifest.counts["ok"],
        skipped=manifest.counts["skipped"], failed=manifest.counts["failed"], rows=manifest.rows,
        computed=computed, reused=reused, deleted=deleted, touched_shards=touched,
        rewritten_shards=rewritten, wall_s=time.perf_counter() - start,
        cache_bytes=layout.store.total_bytes(), shard_bytes_written=written,
        failures=sorted(failures, key=lambda r: r["key"]), errors_table=manifest.errors["path"],
        generation=manifest.generation, published=tx.published, waited_s=tx.waited_s,
        stages=stages or StageTimes(),
    )


def _use_device_stage(asked: bool | None, declared: list[int]) -> bool:
    """Whether the run has a device stage (see ``run``'s ``device_stage``), given the
    positions of the ops that declare one.

    Raises:
        ValueError: one was asked for where it cannot be."""
    if asked and not declared:
        raise ValueError("device_stage=True, but no op of this pipeline runs on a device (an "
                         "op declares device_stage, e.g. detect_faces with device=cuda)")
    return bool(declared) and asked is not False


def _wait_seconds(wait: bool | float | None) -> float | None:
    """``run``'s ``wait`` as seconds (``None``: do not wait)."""
    if wait is None or wait is False:
        return None
    if wait is True:
        return DEFAULT_WAIT_S
    seconds = float(wait)
    if not seconds >= 0:
        raise ValueError(f"wait must be True, False or seconds >= 0, got {wait!r}")
    return seconds
