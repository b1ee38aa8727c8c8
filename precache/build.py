"""Stage-1 runner: list inputs, work out what changed, run the ops in worker processes, write
shards, then publish the index, errors table and manifest (last, atomically).

Rules (also in the README):

- **Incremental**: an input is recomputed only if it is new, or its size or modification time
  changed *and* its content hash differs from the cached ``source_hash``. Rows of deleted and
  changed inputs are listed as deleted in their shard's manifest entry (no copy); a shard more
  than half deleted is rewritten with its live rows.
- **Fingerprint**: each op's name, version, parameters and model-file hashes, plus the shard
  format. If it differs from the cache's, every input is recomputed; the old cache stays readable
  until the new manifest replaces it.
- **Resumable**: every finished task is committed as a shard plus a journal entry; a re-run after a
  crash (even kill -9) adopts them and computes only the rest.
- **Deterministic**: tasks are fixed runs of ``shard_rows`` inputs in key order and shards are
  numbered by task, so the number of workers does not change the cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from precache.cache import (ERRORS_SCHEMA, INDEX_SCHEMA, MARKER, CacheLayout, CacheLock,
                            fsync_dir, load_manifest, read_table)
from precache.executor import WorkerDied, run_tasks
from precache.executor_ray import require_ray, run_tasks_ray
from precache.formats import ShardInfo, get_format
from precache.hashing import file_checksum, hash_bytes
from precache.lease import LEASE_FILE
from precache.manifest import Manifest, ManifestError
from precache.pipeline import Pipeline, fingerprint, load_pipeline
from precache.schema import schema_from_json, schema_to_json
from precache.sources import Input, list_inputs, read_bytes
from precache.worker import Task, WorkerConfig, write_journal_entry

__all__ = ["run", "RunSummary", "RunError", "DEFAULT_SHARD_ROWS", "default_workers"]

DEFAULT_SHARD_ROWS = 256
MIN_TASKS = 32
"""With the default shard size, small runs are split into at least this many shards (of at least
16 inputs), fine enough that workers finish together."""


class RunError(RuntimeError):
    """The run cannot continue; the message says what happened, where, and what to do."""


def default_workers() -> int:
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

    @property
    def samples_per_s(self) -> float:
        """Inputs computed per second of wall time."""
        return self.computed / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class _State:
    """What the cache already holds for the current fingerprint."""

    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    shards: dict[int, ShardInfo] = field(default_factory=dict)
    schemas: dict[int, dict[str, Any]] = field(default_factory=dict)
    referenced: set[str] = field(default_factory=set)  # shard files that must not be deleted
    max_seq: int = 0


def _prepare_output(layout: CacheLayout, pipeline: Pipeline, overwrite: bool) -> Manifest | None:
    """Check the output may be written; clear precache's files from it with ``overwrite``;
    return the old manifest."""
    store = layout.store  # the published files: in the directory, or at the URL
    old: Manifest | None = None
    if store.exists("manifest.json"):
        try:
            old = load_manifest(store)
        except ManifestError as e:
            if not overwrite:
                hint = "" if "--overwrite" in str(e) else "; use --overwrite to replace it"
                raise RunError(f"{e}{hint}") from None
    if old is not None and old.pipeline != pipeline.name and not overwrite:
        raise RunError(f"output '{layout.location}' holds a cache of pipeline '{old.pipeline}', "
                       f"not '{pipeline.name}'; use --overwrite to replace it, or another --output")
    if overwrite:
        store.delete("manifest.json")  # first: from here on it is not a finished cache
        for name in store.list("shards"):
            layout.delete_own("shards", name)
        for name in store.list():
            if layout.is_table(name):
                layout.delete_own("", name)
        layout.clear_local(layout.journal)
        layout.clear_local(layout.staging)
        old = None
    return old


def _load_state(layout: CacheLayout, old: Manifest | None, fp: str, name: str) -> _State:
    """Collect records and shards from the old manifest (same fingerprint) and the journal of an
    interrupted run; delete journal entries of other fingerprints and orphan shard files."""
    state = _State()
    if old is not None:
        state.referenced |= {Path(s.path).name for s in old.shards}
        state.max_seq = max((layout.shard_seq(s.path) for s in old.shards), default=0)
        if old.fingerprint == fp:
            try:
                index = read_table(layout.store, old.index["path"]).to_pylist()
            except (OSError, pa.ArrowInvalid) as e:
                raise RunError(f"the index of cache '{layout.location}' is unreadable ({e}); "
                               "use --overwrite to rebuild the cache") from None
            state.records = {r["key"]: r for r in index}
            for info in old.shards:
                seq = layout.shard_seq(info.path)
                state.shards[seq] = info
                state.schemas[seq] = schema_to_json(old.schema)
    for entry_path in sorted(layout.journal.glob("part-*.json")):
        try:
            entry = json.loads(entry_path.read_text())
        except (OSError, json.JSONDecodeError):
            entry = {}
        try:
            shard = ShardInfo.from_json(entry["shard"]) if entry.get("shard") else None
        except (KeyError, TypeError, ValueError):
            entry, shard = {}, None  # not an entry precache wrote: dropped below as unusable
        usable = (entry.get("fingerprint") == fp and entry.get("pipeline") == name
                  and (shard is None or layout.store.size(shard.path) == shard.bytes))
        if not usable:
            entry_path.unlink()
            continue
        seq = int(entry["seq"])
        state.max_seq = max(state.max_seq, seq)
        if shard is not None:
            state.shards[seq] = shard
            state.schemas[seq] = entry["schema"]
            state.referenced.add(Path(shard.path).name)
        for record in entry["records"]:
            state.records[record["key"]] = record
    for shard_name in layout.store.list("shards"):
        if shard_name not in state.referenced:
            # an orphan: written by a run that died before journaling it (only precache's
            # own shard names are deleted; anything else is reported and left alone)
            layout.delete_own("shards", shard_name)
    return state


def _classify(inputs: list[Input], state: _State) -> tuple[list[Input], dict[str, dict[str, Any]]]:
    """Split inputs into those to compute and the records of those unchanged."""
    todo: list[Input] = []
    kept: dict[str, dict[str, Any]] = {}
    for item in inputs:
        record = state.records.get(item.key)
        unchanged = False
        if record is not None and item.size >= 0 and record["source_hash"]:
            if record["size"] == item.size and record["mtime_ns"] == item.mtime_ns:
                unchanged = True
            elif record["size"] == item.size:
                try:
                    unchanged = hash_bytes(read_bytes(item.locator)) == record["source_hash"]
                except OSError:
                    unchanged = False
        if unchanged:
            kept[item.key] = dict(record, locator=item.locator, size=item.size,
                                  mtime_ns=item.mtime_ns)
        else:
            todo.append(item)
    return todo, kept


COMPACT_FRACTION = 0.5
"""A shard more than this fraction deleted is rewritten with only its live rows."""


def _drop_stale_rows(layout: CacheLayout, state: _State, kept: dict[str, dict[str, Any]],
                     shard_format: Any, next_seq: int) -> tuple[int, int]:
    """Mark rows of changed and deleted inputs as deleted in their shards (a manifest change, no
    copy); rewrite a shard once most of it is deleted. Returns (shards touched, rewritten)."""
    owned_rows: dict[int, int] = {}
    for record in kept.values():
        if record["shard"] >= 0:
            owned_rows[record["shard"]] = owned_rows.get(record["shard"], 0) + record["rows"]
    touched = rewritten = 0
    for seq in sorted(state.shards):
        info = state.shards[seq]
        owned = owned_rows.get(seq, 0)
        if owned in (0, info.live_rows):
            continue  # untouched, or no live rows left (the manifest will not list it)
        schema = schema_from_json(state.schemas[seq])
        reader = shard_format.open(layout.local_shard(info), schema)
        try:
            keys = reader.read(columns=["source_key"])["source_key"]
            live = [i for i, k in enumerate(keys) if kept.get(k, {}).get("shard") == seq]
            touched += 1
            if len(live) >= (1 - COMPACT_FRACTION) * info.rows:
                dead = sorted(set(range(info.rows)) - set(live))
                state.shards[seq] = dataclasses.replace(info, deleted=tuple(dead))
                continue
            columns = reader.read(indices=live)
        finally:
            reader.close()
        state.shards[next_seq] = layout.commit_shard(next_seq, shard_format, columns, schema)
        state.schemas[next_seq] = state.schemas[seq]
        for record in kept.values():
            if record["shard"] == seq:
                record["shard"] = next_seq
        next_seq += 1
        rewritten += 1
    return touched, rewritten


def _write_table(layout: CacheLayout, name: str, rows: list[dict[str, Any]],
                 schema: pa.Schema) -> str:
    """Write a table under staging, then move it to ``name`` in the cache (rename or upload)."""
    tmp = layout.staging / f"{name}.tmp"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp, compression="zstd")
    checksum = file_checksum(tmp)
    layout.publish_file(tmp, name)
    return checksum


def _publish(layout: CacheLayout, old: Manifest | None, state: _State,
             records: dict[str, dict[str, Any]], pipeline: Pipeline, params: dict[str, Any],
             descriptions: list[dict[str, Any]], fp: str, shard_format: str,
             source: str) -> Manifest:
    """Write index, errors and then the manifest; delete what the new manifest no longer uses."""
    ordered = [records[k] for k in sorted(records)]
    used = sorted({r["shard"] for r in ordered if r["shard"] >= 0})
    schemas = {json.dumps(state.schemas[seq], sort_keys=True) for seq in used}
    if len(schemas) > 1:
        raise RunError(f"shards of '{layout.location}' disagree on their columns "
                       f"({sorted(schemas)}); "
                       "the pipeline's ops emit different columns for different inputs")
    schema = schema_from_json(state.schemas[used[0]]) if used else (
        old.schema if old is not None and old.fingerprint == fp else {})
    generation = (old.generation if old is not None else 0) + 1
    index_name = layout.index(generation).name
    index_sum = _write_table(layout, index_name, ordered, INDEX_SCHEMA)
    errors = [{k: r[k] for k in ERRORS_SCHEMA.names} for r in ordered if r["status"] == "failed"]
    errors_name = layout.errors(generation).name
    errors_sum = _write_table(layout, errors_name, errors, ERRORS_SCHEMA)
    counts = {status: sum(r["status"] == status for r in ordered)
              for status in ("ok", "skipped", "failed")}
    shards = [state.shards[seq] for seq in used]
    counts.update(inputs=len(ordered), rows=sum(s.live_rows for s in shards))
    from precache import __version__

    manifest = Manifest(
        pipeline=pipeline.name, pipeline_ref=pipeline.ref, params=params, ops=descriptions,
        fingerprint=fp, format=shard_format, schema=schema, shards=shards, counts=counts,
        index={"path": index_name, "checksum": index_sum},
        errors={"path": errors_name, "checksum": errors_sum}, source=source,
        generation=generation, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        precache_version=__version__,
    )
    layout.store.write_bytes("manifest.json", manifest.to_bytes())  # last: now it is the cache
    if layout.url is None:
        fsync_dir(layout.root)  # the manifest's rename, too, survives a power cut
    keep_files = {Path(s.path).name for s in shards}
    for name in layout.store.list("shards"):
        if name not in keep_files:
            layout.delete_own("shards", name)
    for name in layout.store.list():
        if layout.is_table(name) and name not in (index_name, errors_name):
            layout.delete_own("", name)
    layout.clear_local(layout.journal)
    layout.clear_local(layout.staging)
    return manifest


def _check_output(layout: CacheLayout) -> None:
    """Refuse an output that is a file, or a non-empty folder (or URL prefix) holding no cache;
    for a URL, check that its bucket exists and the credentials are accepted."""
    if layout.url is None:
        root = layout.root
        if root.exists() and not root.is_dir():
            raise RunError(f"output '{root}' exists and is not a directory")
        names = [p.name for p in root.iterdir()] if root.exists() else []
    else:
        layout.store.check_bucket()
        if layout.store.size("") >= 0:
            raise RunError(f"output '{layout.url}' is a file, not a folder of a cache")
        names = layout.store.list(folders=True)
    # a run that died between taking its lock and writing the marker left only the lock
    holds_files = any(name not in (".lock", LEASE_FILE) for name in names)
    if holds_files and not layout.is_cache():
        raise RunError(f"output '{layout.location}' is not empty and holds no precache cache "
                       f"(no manifest.json or {MARKER}); choose a new or empty directory")


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
) -> RunSummary:
    """Run a stage-1 pipeline over ``input`` into the cache at ``output``.

    Args:
        pipeline: a ``Pipeline``, or a name / ``module:attr`` / path that ``load_pipeline`` finds.
        input: a folder of inputs, one input file, or a ``.txt`` list of paths.
        output: the cache directory (created if missing), or a URL (``s3://bucket/cache``,
            ``gs://``, ``file://``): the run then keeps its lock, journal and staging in a local
            working directory (``precache.storage.work_dir_for``), uploads each finished
            shard, and publishes the manifest last.
        params: overrides of the pipeline's parameters.
        workers: worker processes (default: the cores). 1 runs in this process. With
            ``executor="ray"``: Ray actors (default: the CPUs of the Ray cluster).
        format: ``parquet`` (default) or ``hdf5``.
        shard_rows: inputs per task, and so rows per shard (one task is one shard). Default
            256, or fewer for small runs so there are at least 32 shards (of at least 16).
        overwrite: replace a cache of another pipeline (or a corrupt one) at ``output``.
        fail_fast: stop at the first failed input (committed shards are kept for a re-run).
        progress: show a progress bar.
        log: where one-line messages go (``print`` by default).
        executor: ``local`` (processes on this machine) or ``ray`` (one Ray actor per worker;
            needs ``pip install 'precache[ray]'``).
        ray_address: with ``executor="ray"``, the address of a running Ray cluster; ``None``
            starts a local Ray for this run. On a cluster, ``output`` must be on storage
            that every node sees at the same path: the actors write the shards.

    Returns:
        A ``RunSummary``.

    Raises:
        InputError, PipelineError: bad input path, pipeline or parameters.
        CacheBusyError: another run holds the cache.
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
    if executor == "ray":
        require_ray(ray_address)  # before any work
    ray_workers = None if workers is None else max(1, workers)  # None: the cluster's CPUs
    shard_format = get_format(format)
    resolved = pipeline.resolve_params(params)
    descriptions = [op.describe() for op in pipeline.build_ops(resolved)]
    fp = fingerprint(descriptions, format)
    inputs = list_inputs(input, pipeline.extensions)
    workers = default_workers() if workers is None else max(1, workers)
    layout = CacheLayout.for_output(output)  # a URL: work locally, publish to the URL
    _check_output(layout)
    with CacheLock(layout) as lock:
        old = _prepare_output(layout, pipeline, overwrite)
        layout.mark()  # before the first shard: from here on the folder is precache's
        for path in (layout.shards, layout.journal):
            path.mkdir(parents=True, exist_ok=True)
        layout.forget_stale_journal(old.generation if old is not None else 0)
        layout.clear_local(layout.staging)
        layout.staging.mkdir(exist_ok=True)
        foreign = layout.foreign_files()
        if foreign:
            log(f"precache: left alone in '{layout.location}', not written by precache: "
                + ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5
                                            else ""))
        state = _load_state(layout, old, fp, pipeline.name)
        todo, kept = _classify(inputs, state)
        deleted = len(set(state.records) - {item.key for item in inputs})
        log(f"precache: {len(inputs)} inputs: {len(kept)} unchanged, {len(todo)} to compute"
            + (f", {deleted} deleted" if deleted else ""))

        first_seq = state.max_seq + 1
        if shard_rows is None:
            shard_rows = min(DEFAULT_SHARD_ROWS, max(16, -(-len(todo) // MIN_TASKS)))
        tasks = [Task(first_seq + i, tuple(todo[s:s + shard_rows]))
                 for i, s in enumerate(range(0, len(todo), shard_rows))]
        config = WorkerConfig(pipeline=pipeline.ref or pipeline, params=resolved,
                              cache_root=str(layout.root), cache_url=layout.url,
                              format=format, fingerprint=fp,
                              pipeline_name=pipeline.name, fail_fast=fail_fast)
        written = 0
        bar = tqdm(total=len(todo), unit="sample", desc="precache", disable=not progress or not todo,
                   dynamic_ncols=True)
        try:
            # No name for the generator: an exception must close it (stopping the workers)
            # at once, not when its traceback is freed, after the lock is released.
            for result in (run_tasks_ray(tasks, config, ray_workers, address=ray_address)
                           if executor == "ray" else run_tasks(tasks, config, workers)):
                if result.failure is not None:
                    raise RunError(_describe_failure(result.failure) + " (--fail-fast); shards "
                                   "finished so far are kept: re-run to resume")
                if result.journal is not None:  # a remote cache: journaled here, not by the worker
                    write_journal_entry(layout, result.journal)
                for record in result.records:
                    kept[record["key"]] = record
                if result.shard is not None:
                    state.shards[result.seq] = result.shard
                    state.schemas[result.seq] = result.schema or {}
                    written += result.shard.bytes
                bar.update(len(result.records))
        except WorkerDied as e:
            raise RunError(f"{e}\nfinished shards are kept: re-run the same command to resume "
                           "(a worker killed, out of memory, or crashing in native code)") from None
        except OSError as e:
            raise RunError(f"writing the cache failed ({e}); finished shards are kept: fix the "
                           "cause and re-run the same command to resume") from None
        finally:
            bar.close()

        touched, rewritten = _drop_stale_rows(layout, state, kept, shard_format,
                                              first_seq + len(tasks))
        lock.check()  # a remote cache: still this run's lease
        manifest = _publish(layout, old, state, kept, pipeline, resolved, descriptions, fp,
                            format, str(input))
    wall = time.perf_counter() - start
    cache_bytes = layout.store.total_bytes()
    failures = [r for r in kept.values() if r["status"] == "failed"]
    return RunSummary(
        cache=layout.root if layout.url is None else layout.url,
        inputs=manifest.counts["inputs"], ok=manifest.counts["ok"],
        skipped=manifest.counts["skipped"], failed=manifest.counts["failed"], rows=manifest.rows,
        computed=len(todo), reused=len(inputs) - len(todo),
        deleted=deleted, touched_shards=touched, rewritten_shards=rewritten, wall_s=wall,
        cache_bytes=cache_bytes,
        shard_bytes_written=written, failures=sorted(failures, key=lambda r: r["key"]),
        errors_table=manifest.errors["path"],
    )
