"""Stage-1 worker: run the ops over one task's inputs and commit its shard and journal entry.

A task is ``shard_rows`` consecutive inputs (in key order) and becomes exactly one shard, so the
cache is the same whatever the number of workers. Commit order makes crashes safe: the shard is
written under ``.staging/`` and renamed into ``shards/`` (or uploaded whole to a remote cache's
``shards/``), then the journal entry naming it is renamed into ``journal/``. A shard without a
journal entry is an orphan and is deleted on the next run; a journal entry means the task's
inputs are done and are never computed again.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from precache.processing.sources import DEFAULT_MAX_INPUT_BYTES, Input, read_bytes
from precache.cache import CacheLayout
from precache.cache.formats import ShardInfo, get_format
from precache.cache.schema import ColumnSpec, infer_spec, rows_to_columns, schema_to_json
from precache.processing.ops.base import Op, Sample, Skip
from precache.processing.pipeline import Pipeline, load_pipeline
from precache.processing.stage_times import READ, STORE, stage_names
from precache.storage.hashing import hash_bytes
from precache.threads import pin_threads

__all__ = ["Task", "WorkerConfig", "TaskResult", "init_worker", "run_task", "NOT_STORED", "new_record",
           "config_ops", "WorkerDied"]

NOT_STORED = ("data", "locator")
"""Sample fields the runner provides to ops but does not store in shards."""


class WorkerDied(RuntimeError):
    """A worker process died or failed outside any one input (the message says which). Raised
    inside an op (by a device part's call, when the device stage died), it stops the run: it
    is no error of the op's input."""


@dataclass(frozen=True)
class Task:
    """Inputs that become one shard, numbered ``seq``."""

    seq: int
    inputs: tuple[Input, ...]


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker process needs: the pipeline (or how to load it) and where to write:
    ``cache_root`` (the cache directory, or the local working directory of the remote cache
    ``cache_url``, where shards are uploaded). ``max_input_bytes``: inputs bigger than this are
    failed at stage ``read`` without being read whole (see ``precache.processing.sources``)."""

    pipeline: Pipeline | str
    params: dict[str, Any]
    cache_root: str
    format: str
    fingerprint: str
    pipeline_name: str
    fail_fast: bool = False
    batch_size: int = 8
    cache_url: str | None = None
    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES
    device_ops: tuple[int, ...] = ()
    """Positions of the ops the run's device stage runs, where it has one: decided once by the
    run (an op's ``device_stage`` may ask torch for a GPU), not by every worker."""


@dataclass
class TaskResult:
    """A finished task: one record per input; its shard (``None`` if it has no rows)."""

    seq: int
    records: list[dict[str, Any]]
    shard: ShardInfo | None = None
    schema: dict[str, Any] | None = None
    failure: dict[str, Any] | None = None  # the first failed record, when fail-fast stopped it
    journal: dict[str, Any] | None = None  # a remote cache's entry, for the driver to write
    device_stats: Any = None  # the device stage's counters (``DeviceStats``), where it runs
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds this task spent in each stage, in pipeline order: ``read`` (the inputs' bytes
    and their hash), each op by position (``stage_times.stage_names``: its name, with ``#2``
    where a name repeats), ``store`` (checking rows and writing the shard)."""


def new_record(item: Input) -> dict[str, Any]:
    """An index record for an input, before any work (see ``precache.cache.INDEX_SCHEMA``)."""
    return {"key": item.key, "locator": item.locator, "size": item.size,
            "mtime_ns": item.mtime_ns, "source_hash": "", "status": "ok", "stage": "",
            "error_type": "", "message": "", "shard": -1, "rows": 0}


_ops: list[Op] = []
_config: WorkerConfig | None = None
_device: Any = None  # a DeviceClient where the run has a device stage
_delegated: frozenset[int] = frozenset()  # positions of the ops the device stage runs


def config_ops(config: WorkerConfig) -> list[Op]:
    """The ops of ``config``'s pipeline (loaded by name where it is one), not set up."""
    pipeline = config.pipeline if isinstance(config.pipeline, Pipeline) else load_pipeline(
        config.pipeline)
    return pipeline.build_ops(config.params)


def init_worker(config: WorkerConfig, device: Any = None) -> None:
    """Load the pipeline and set up its ops once in this process (models load here). With
    ``device`` (a ``DeviceClient``), the ops at ``config.device_ops`` run in the device
    worker instead, and are not set up here; those that declare ``device_parts`` run here,
    their parts in the device worker (``device_stage.attach_parts``)."""
    global _ops, _config, _device, _delegated
    pin_threads()
    _ops = config_ops(config)
    _device = device
    _delegated = frozenset()
    if device is not None and config.device_ops:
        from precache.processing.executors.device_stage import attach_parts

        _delegated = attach_parts(_ops, config.device_ops, device)
    for i, op in enumerate(_ops):
        if i not in _delegated:
            op.setup()
    _config = config


def _fail(record: dict[str, Any], stage: str, error: BaseException) -> None:
    record.update(status="failed", stage=stage, error_type=type(error).__name__,
                  message=str(error) or repr(error), rows=0)


def _call_op(op: Op, samples: list[Sample]) -> list[Any]:
    """Results of ``op`` on ``samples``: a sample, a list of samples, a ``Skip`` or an exception."""
    if op.batched:
        try:
            results = op.call_batch(samples)
            if len(results) != len(samples):
                raise RuntimeError(f"op {op.name!r} returned {len(results)} results for "
                                   f"{len(samples)} samples")
            return results
        except WorkerDied:
            raise
        except Exception:
            if len(samples) == 1:
                return [sys.exc_info()[1]]
            return [_call_op(op, [s])[0] for s in samples]  # find the sample that fails
    results: list[Any] = []
    for sample in samples:
        try:
            results.append(op(sample))
        except Skip as skip:
            results.append(skip)
        except WorkerDied:
            raise
        except Exception as error:  # noqa: BLE001 - any op error is this sample's error
            results.append(error)
    return results


def _run_ops(samples: list[tuple[int, Sample]], records: list[dict[str, Any]],
             ops: list[Op], stages: list[str], seconds: dict[str, float],
             ) -> list[tuple[int, Sample]]:
    """Pass samples through the ops, updating ``records`` and each op's ``seconds`` (under its
    stage, ``stages[position]``: ``stage_names``); return the surviving rows."""
    live = samples
    skipped: dict[int, tuple[str, str]] = {}
    for position, op in enumerate(ops):
        if not live:
            break
        started = time.perf_counter()
        batch = [s for _, s in live]
        results = (_device.call(position, batch) if position in _delegated
                   else _call_op(op, batch))
        _add_time(seconds, stages[position], started)
        next_live: list[tuple[int, Sample]] = []
        for (i, sample), result in zip(live, results):
            if records[i]["status"] == "failed":
                continue
            if isinstance(result, Skip):
                skipped[i] = (op.name, result.reason)
            elif isinstance(result, BaseException):
                _fail(records[i], op.name, result)
            elif isinstance(result, list):
                for j, child in enumerate(result):
                    if child.get("key", sample["key"]) == sample["key"]:  # else the op named it
                        child["key"] = f"{sample['key']}#{j}"
                    next_live.append((i, child))
                if not result:
                    skipped[i] = (op.name, "no rows")
            elif isinstance(result, dict):
                next_live.append((i, result))
            else:
                _fail(records[i], op.name, TypeError(
                    f"op returned {type(result).__name__}; return the sample dict, a list of "
                    "sample dicts, or raise Skip(reason)"))
        live = [(i, s) for i, s in next_live if records[i]["status"] != "failed"]
    has_rows = {i for i, _ in live}
    for i, (stage, reason) in skipped.items():
        if records[i]["status"] == "ok" and i not in has_rows:
            records[i].update(status="skipped", stage=stage, message=reason)
    return live


def _add_time(seconds: dict[str, float], stage: str, started: float) -> None:
    """Add the time since ``started`` to ``stage``'s seconds."""
    seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - started


def _check_row(row: Sample, schema: dict[str, ColumnSpec]) -> None:
    if row.keys() != schema.keys():
        raise ValueError(f"row has columns {sorted(row)}, the other rows {sorted(schema)}")
    for name, spec in schema.items():
        value = row[name]
        if spec.kind == "ndarray" and isinstance(value, np.ndarray):
            if value.shape == spec.shape and value.dtype.name == spec.dtype:
                continue  # the common case, checked without building a spec
        if spec.kind == "ragged" and isinstance(value, np.ndarray) and value.ndim == 1:
            if value.dtype.name == spec.dtype:
                continue
        got = infer_spec(name, value)
        if got != spec:
            raise ValueError(f"column {name!r} is {got}, the other rows' is {spec}")


def _validate(rows: list[Sample], records: list[dict[str, Any]], index: dict[str, int],
              schema: dict[str, ColumnSpec] | None) -> tuple[list[Sample], dict[str, ColumnSpec] | None]:
    """Check every row against the task's schema (inferred from its first storable row); an input
    with a row that does not fit fails at stage ``store`` and loses all its rows."""
    for row in rows:
        record = records[index[row["source_key"]]]
        try:
            if schema is None:
                schema = {name: infer_spec(name, value) for name, value in row.items()}
            else:
                _check_row(row, schema)
        except (TypeError, ValueError) as error:
            _fail(record, "store", error)
    return [r for r in rows if records[index[r["source_key"]]]["status"] != "failed"], schema


def _commit(task: Task, rows: list[Sample], schema: dict[str, ColumnSpec] | None,
            records: list[dict[str, Any]], index: dict[str, int],
            config: WorkerConfig) -> TaskResult:
    layout = CacheLayout(config.cache_root, url=config.cache_url)
    shard_format = get_format(config.format)
    result = TaskResult(seq=task.seq, records=records)
    if rows and schema is not None:
        info = layout.commit_shard(task.seq, shard_format, rows_to_columns(rows, schema), schema)
        result.shard, result.schema = info, schema_to_json(schema)
        for row in rows:
            record = records[index[row["source_key"]]]
            record["rows"] += 1
            record["shard"] = task.seq
    entry = {"fingerprint": config.fingerprint, "pipeline": config.pipeline_name,
             "format": config.format, "seq": task.seq,
             "shard": result.shard.to_json() if result.shard else None,
             "schema": result.schema, "records": records}
    if config.cache_url is None:
        layout.write_journal_entry(entry)
    else:  # this worker may run on another machine (Ray) than the run's working directory
        result.journal = entry
    return result


def run_task(task: Task) -> TaskResult:
    """Process one task in this worker (after ``init_worker``) and commit it."""
    if _config is None:
        raise RuntimeError("run_task called before init_worker")
    config = _config
    records = [new_record(item) for item in task.inputs]
    index = {item.key: i for i, item in enumerate(task.inputs)}
    rows: list[Sample] = []
    schema: dict[str, ColumnSpec] | None = None
    stages = stage_names([op.name for op in _ops])
    seconds: dict[str, float] = {READ: 0.0, **{stage: 0.0 for stage in stages}, STORE: 0.0}
    for start in range(0, len(task.inputs), config.batch_size):
        batch: list[tuple[int, Sample]] = []
        started = time.perf_counter()
        for i in range(start, min(start + config.batch_size, len(task.inputs))):
            item = task.inputs[i]
            try:
                data = read_bytes(item.locator, config.max_input_bytes)
            except OSError as error:
                _fail(records[i], "read", error)
            else:
                records[i]["source_hash"] = hash_bytes(data)
                batch.append((i, {"key": item.key, "source_key": item.key,
                                  "source_hash": records[i]["source_hash"],
                                  "locator": item.locator, "data": data}))
        _add_time(seconds, READ, started)
        produced = [{k: v for k, v in row.items() if k not in NOT_STORED}
                    for _, row in _run_ops(batch, records, _ops, stages, seconds)]
        started = time.perf_counter()
        valid, schema = _validate(produced, records, index, schema)
        _add_time(seconds, STORE, started)
        rows.extend(valid)
        if config.fail_fast:
            failed = next((r for r in records if r["status"] == "failed"), None)
            if failed is not None:
                return TaskResult(seq=task.seq, records=records, failure=failed,
                                  stage_seconds=seconds)
    started = time.perf_counter()
    result = _commit(task, rows, schema, records, index, config)
    _add_time(seconds, STORE, started)
    result.stage_seconds = seconds
    return result
