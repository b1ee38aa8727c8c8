"""Stage 1 over a user's map-style ``Dataset``: ``dataset[i]`` once per index, in stage 1's workers.

``run_dataset`` makes one input per index, keyed ``key(i)`` (default: the index), and runs them
through the local executor like any pipeline: each input is a small JSON record (its index and
key) in a temporary file, and the one op, ``GetItem``, calls ``dataset[i]`` and flattens what it
returns into columns. The dataset itself travels to the spawned workers pickled, at run time, as
part of the pipeline object; never into the shards.

- **Schema**: inferred from the first samples (``PROBE`` of them, spread over the dataset) before
  the run: ``SampleLayout`` records the sample's structure (a dict, nested dicts, a tuple or list,
  or one value) and each leaf's type (tensor, NumPy array, NumPy or Python scalar, str, bytes),
  so that ``restore`` rebuilds the very sample. An array whose shape differs between the probed
  samples is stored as a variable-length (``ragged``) column, with its shape in a column beside
  it when it has more than one dimension.
- **Incremental**: a sample is computed again only if its key at its index (or its
  ``sample_hash``) changed; the fingerprint is ``version``, or the dataset's class source and
  constructor arguments; a changed fingerprint recomputes every sample and the run says why.
- **Bad samples**: an exception from ``dataset[i]`` fails that input (stage ``getitem``) with its
  type and message, in the errors table, as an op's failure does; the run goes on.
"""

from __future__ import annotations

import hashlib
import inspect
from importlib import import_module
import json
import os
import pickle
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path, PurePath
from typing import Any

import numpy as np

from precache.cache.fingerprint import fingerprint
from precache.cache.formats import get_format
from precache.cache.generations import DEFAULT_RETENTION_S
from precache.cache.layout import CacheLayout
from precache.cache.manifest import Manifest, ManifestError
from precache.cache.reader import load_manifest
from precache.cache.schema import ragged as as_ragged
from precache.cache.transaction import WriteTransaction
from precache.errors import RunError
from precache.processing.executors import require_ray, run_tasks, run_tasks_ray
from precache.processing.ops.base import Op, Sample
from precache.processing.pipeline import Pipeline, PipelineError
from precache.processing.plan import DEFAULT_SHARD_ROWS, make_tasks
from precache.processing.stage_times import StageTimes
from precache.processing.runner import (RunSummary, _wait_seconds, commit_results,
                                        stage1_workers, summarize)
from precache.processing.sources import Input
from precache.processing.worker import WorkerConfig
from precache.storage import is_remote, local_path
from precache.storage.hashing import hash_bytes

__all__ = ["run_dataset", "GetItem", "SampleLayout", "PIPELINE_NAME", "PROBE", "RESERVED",
           "dataset_fingerprint", "layout_of", "dataset_from_ref"]

PIPELINE_NAME = "cache_dataset"
"""The pipeline name a dataset cache records (a cache of another pipeline is refused)."""

PROBE = 4
"""Samples read before the run (spread over the dataset) to infer the columns from."""

RESERVED = ("key", "source_key", "source_hash", "data", "locator", "target")
"""Column names precache uses itself; a sample's field of that name is stored as ``_name``."""

_MAX_ITEMS = 64  # a tuple or list with more items than this is not a structure of columns


# ---- the sample's structure ----------------------------------------------------------------------


def _leaf(value: Any) -> dict[str, Any]:
    """The type of one value of a sample, as the layout records it (not yet its storage)."""
    torch = _torch_if_loaded()
    if torch is not None and isinstance(value, torch.Tensor):
        array = _tensor_array(value)
        return {"type": "tensor", "dtype": array.dtype.name, "shape": list(array.shape)}
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"a NumPy array of dtype {value.dtype} cannot be stored; return "
                            "numbers")
        return {"type": "ndarray", "dtype": value.dtype.name, "shape": list(value.shape)}
    if isinstance(value, (bool, np.bool_)):
        return {"type": "bool" if isinstance(value, bool) else "npscalar", "dtype": "bool",
                "shape": []}
    if isinstance(value, np.generic) and value.dtype.kind in "iuf":
        return {"type": "npscalar", "dtype": value.dtype.name, "shape": []}
    if isinstance(value, int):
        return {"type": "int", "dtype": "int64", "shape": []}
    if isinstance(value, float):
        return {"type": "float", "dtype": "float64", "shape": []}
    if isinstance(value, str):
        return {"type": "str", "dtype": "", "shape": []}
    if isinstance(value, (bytes, bytearray)):
        return {"type": "bytes", "dtype": "", "shape": []}
    raise TypeError(f"values of type {type(value).__name__} cannot be stored; return tensors, "
                    "NumPy arrays, numbers, str, bytes, or dicts, tuples and lists of these")


def _torch_if_loaded() -> Any:
    """``torch`` if something imported it (a sample can hold a tensor only then)."""
    import sys

    return sys.modules.get("torch")


def _tensor_array(value: Any) -> np.ndarray:
    try:
        return value.detach().cpu().numpy()
    except TypeError as e:  # bfloat16 and other dtypes NumPy lacks
        raise TypeError(f"a {value.dtype} tensor cannot be stored ({e}); convert it, e.g. "
                        ".float()") from None


def _tree(value: Any, path: tuple[str, ...], leaves: dict[tuple[str, ...], Any]) -> Any:
    """The structure of ``value`` as JSON (``{"dict": [[k, sub], ...]}``, ``{"tuple": [...]}``,
    ``{"list": [...]}`` or ``{"leaf": [path...]}``); fills ``leaves``: path -> value."""
    if isinstance(value, dict):
        items = []
        for k, sub in value.items():
            if not isinstance(k, str):
                raise TypeError(f"dict keys must be str, not {type(k).__name__} ({k!r})")
            items.append([k, _tree(sub, (*path, k), leaves)])
        return {"dict": items}
    if isinstance(value, (tuple, list)) and len(value) <= _MAX_ITEMS:
        kind = "tuple" if isinstance(value, tuple) else "list"
        return {kind: [_tree(sub, (*path, str(i)), leaves) for i, sub in enumerate(value)]}
    if isinstance(value, (tuple, list)):
        raise TypeError(f"a {type(value).__name__} of {len(value)} items cannot be stored as "
                        f"columns; return it as a NumPy array or a tensor")
    leaves[path] = value
    return {"leaf": list(path)}


def _column_name(path: tuple[str, ...], taken: set[str]) -> str:
    name = ".".join(path) if path else "value"
    while name in RESERVED or name in taken:
        name = "_" + name
    return name


class SampleLayout:
    """How a sample of the dataset is stored and rebuilt: ``tree`` (its structure, see
    ``_tree``) and ``columns``: column name -> ``path`` (where in the sample), ``type``
    (tensor, ndarray, npscalar, int, float, bool, str, bytes), ``dtype``, ``store`` (``fixed``:
    one column of that shape or a scalar; ``ragged``: a 1-D array whose length varies;
    ``ragged_nd``: the flattened values, and the shape in column ``<name>#shape``) and
    ``shape`` (for ``fixed``). JSON (``to_json``), so the manifest holds it."""

    def __init__(self, tree: Any, columns: dict[str, dict[str, Any]]) -> None:
        self.tree, self.columns = tree, columns
        self._by_path = {tuple(spec["path"]): name for name, spec in columns.items()}

    def to_json(self) -> dict[str, Any]:
        return {"tree": self.tree, "columns": self.columns}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SampleLayout:
        return cls(obj["tree"], obj["columns"])

    def stored_columns(self) -> list[str]:
        """The cache's columns that hold the samples (with ``#shape`` columns)."""
        names = []
        for name, spec in self.columns.items():
            names.append(name)
            if spec["store"] == "ragged_nd":
                names.append(name + "#shape")
        return names

    def to_columns(self, value: Any) -> dict[str, Any]:
        """The sample ``value`` as column values to store.

        Raises:
            ValueError, TypeError: it does not have the structure, types or fixed shapes of
                the first samples (the message names the field and the fix).
        """
        leaves: dict[tuple[str, ...], Any] = {}
        tree = _tree(value, (), leaves)
        if tree != self.tree:
            raise ValueError(f"the sample's structure {_show_tree(tree)} differs from the first "
                             f"samples' {_show_tree(self.tree)}; return the same fields for "
                             "every index")
        out: dict[str, Any] = {}
        for path, leaf in leaves.items():
            name = self._by_path[path]
            spec = self.columns[name]
            got = _leaf(leaf)
            field = ".".join(path) or "the sample"
            if got["type"] != spec["type"] or got["dtype"] != spec["dtype"]:
                raise TypeError(f"{field} is {got['type']} {got['dtype']}, the first samples' "
                                f"{spec['type']} {spec['dtype']}; return the same types for "
                                "every index")
            array = _tensor_array(leaf) if spec["type"] == "tensor" else leaf
            store = spec["store"]
            if store == "fixed":
                if list(got["shape"]) != spec["shape"]:
                    raise ValueError(f"{field} has shape {tuple(got['shape'])}, the first "
                                     f"samples' {tuple(spec['shape'])}; pass ragged="
                                     f"[{name!r}] to store it with varying length")
                out[name] = (np.ascontiguousarray(array) if spec["shape"]
                             else _scalar(array, spec))
            elif store == "ragged":
                if len(got["shape"]) != 1:
                    raise ValueError(f"{field} has shape {tuple(got['shape'])}; the first "
                                     "samples' were 1-D")
                out[name] = as_ragged(array)
            else:
                if len(got["shape"]) != spec["ndim"]:
                    raise ValueError(f"{field} has {len(got['shape'])} dimensions, the first "
                                     f"samples' {spec['ndim']}")
                out[name] = as_ragged(np.asarray(array).reshape(-1))
                out[name + "#shape"] = np.asarray(got["shape"], dtype=np.int64)
        return out


def _scalar(value: Any, spec: dict[str, Any]) -> Any:
    """A scalar leaf as the value to store (0-d arrays and tensors as NumPy scalars)."""
    if spec["type"] in ("str", "bytes", "int", "float", "bool"):
        return bytes(value) if spec["type"] == "bytes" else value
    return np.asarray(value).reshape(()).astype(spec["dtype"])  # 0-d: keeps its dtype


def _show_tree(tree: Any) -> str:
    (kind, body), = tree.items()
    if kind == "leaf":
        return "a value"
    if kind == "dict":
        return "{" + ", ".join(repr(k) for k, _ in body) + "}"
    return f"a {kind} of {len(body)}"


def layout_of(samples: Sequence[Any], ragged: Sequence[str] = ()) -> SampleLayout:
    """The layout of the dataset from some of its samples: the first one's structure; an array
    whose shape differs between them, or named in ``ragged``, has varying length.

    Raises:
        TypeError, ValueError: a value cannot be stored, or the samples differ in structure.
    """
    first_leaves: dict[tuple[str, ...], Any] = {}
    tree = _tree(samples[0], (), first_leaves)
    shapes: dict[tuple[str, ...], set[tuple[int, ...]]] = {}
    types: dict[tuple[str, ...], dict[str, Any]] = {}
    for sample in samples:
        leaves: dict[tuple[str, ...], Any] = {}
        if _tree(sample, (), leaves) != tree:
            raise ValueError(f"samples differ in structure ({_show_tree(tree)} and "
                             f"{_show_tree(_tree(sample, (), {}))}); return the same fields "
                             "for every index")
        for path, value in leaves.items():
            try:
                got = _leaf(value)
            except TypeError as e:
                raise TypeError(f"{'.'.join(path) or 'the sample'}: {e}") from None
            types.setdefault(path, got)
            shapes.setdefault(path, set()).add(tuple(got["shape"]))
    columns: dict[str, dict[str, Any]] = {}
    wanted = set(ragged)
    for path, got in types.items():
        name = _column_name(path, set(columns))
        spec = {"path": list(path), "type": got["type"], "dtype": got["dtype"]}
        ndims = {len(s) for s in shapes[path]}
        varies = len(shapes[path]) > 1 or ".".join(path) in wanted or name in wanted
        if varies and (got["type"] not in ("tensor", "ndarray") or 0 in ndims):
            raise ValueError(f"{'.'.join(path) or 'the sample'} is a scalar and cannot vary "
                             "in length")
        if varies and len(ndims) > 1:
            raise ValueError(f"{'.'.join(path) or 'the sample'} has a varying number of "
                             f"dimensions ({sorted(ndims)}); return a fixed number")
        if not varies:
            spec.update(store="fixed", shape=list(got["shape"]))
        elif ndims == {1}:
            spec.update(store="ragged")
        else:
            spec.update(store="ragged_nd", ndim=ndims.pop())
        columns[name] = spec
    unknown = wanted - {".".join(p) for p in types} - set(columns)
    if unknown:
        raise ValueError(f"ragged names {sorted(unknown)}, which are not fields of the samples "
                         f"({', '.join(sorted(columns))})")
    return SampleLayout(tree, columns)


# ---- the op and its pipeline -----------------------------------------------------------------------


class GetItem(Op):
    """``dataset[i]`` for the input's index, as the layout's columns."""

    name = "getitem"
    version = "1"

    def __init__(self, dataset: Any, layout: SampleLayout, params: dict[str, Any],
                 prepare: Callable[[Any], Any] | None = None) -> None:
        self.dataset, self.layout, self._params = dataset, layout, params
        self.prepare = prepare

    @property
    def params(self) -> dict[str, Any]:
        return dict(self._params)

    def __call__(self, sample: Sample) -> Sample:
        index = json.loads(sample["data"])["index"]
        value = self.dataset[index]
        sample.update(self.layout.to_columns(value if self.prepare is None else self.prepare(value)))
        return sample


class _DatasetOps:
    """``make_ops`` of the dataset's pipeline: pickled to each worker with the dataset in it."""

    def __init__(self, dataset: Any, layout: SampleLayout, params: dict[str, Any],
                 prepare: Callable[[Any], Any] | None = None) -> None:
        self.dataset, self.layout, self.params, self.prepare = dataset, layout, params, prepare

    def __call__(self) -> list[Op]:
        return [GetItem(self.dataset, self.layout, self.params, self.prepare)]


# ---- the fingerprint -------------------------------------------------------------------------------


def _simple(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON when it is made of numbers, strings, paths, None and small containers
    of these; else ``None`` (it is then named by its type only)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    if depth < 3 and isinstance(value, (list, tuple)) and len(value) <= 100_000:
        items = [_simple(v, depth + 1) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    if depth < 3 and isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items_d = {k: _simple(v, depth + 1) for k, v in value.items()}
        return None if any(items_d[k] is None and value[k] is not None for k in value) else items_d
    return None


def dataset_fingerprint(dataset: Any, version: str | None) -> dict[str, Any]:
    """What identifies the dataset's samples: ``version`` when given; else a hash of its class's
    source and its constructor arguments (attributes named like ``__init__``'s parameters,
    ``_name`` too: their values when simple, else their type)."""
    cls = type(dataset)
    described: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}"}
    if version is not None:
        described["version"] = str(version)
        return described
    try:
        source = inspect.getsource(cls)
    except Exception:  # noqa: BLE001 - no source kept (an interactive session, a run script)
        source = described["class"]
    described["source"] = hashlib.sha256(source.encode()).hexdigest()[:16]
    try:
        names = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
    except (TypeError, ValueError):
        names = []
    attrs = getattr(dataset, "__dict__", {})
    arguments: dict[str, Any] = {}
    for name in names:
        for attr in (name, "_" + name):
            if attr in attrs:
                value = attrs[attr]
                simple = _simple(value)
                arguments[name] = (simple if simple is not None or value is None
                                   else f"<{type(value).__name__}>")
                break
    described["arguments"] = hashlib.sha256(
        json.dumps(arguments, sort_keys=True).encode()).hexdigest()[:16]
    described["argument_values"] = {k: _short(v) for k, v in arguments.items()}
    return described


def _short(value: Any) -> Any:
    """A value for the manifest and messages: long lists as their length and hash."""
    text = json.dumps(value, sort_keys=True)
    if len(text) <= 200:
        return value
    return f"<{type(value).__name__} of {len(value) if hasattr(value, '__len__') else '?'}, " \
           f"sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]}>"


def _why(old: dict[str, Any], new: dict[str, Any], old_format: str, new_format: str) -> str:
    """One phrase: what changed between the old cache's op parameters and this run's."""
    if old_format != new_format:
        return f"format {old_format} -> {new_format}"
    a, b = old.get("dataset", {}), new.get("dataset", {})
    if a.get("class") != b.get("class"):
        return f"dataset class {a.get('class')} -> {b.get('class')}"
    if a.get("version") != b.get("version"):
        return f"version {a.get('version')!r} -> {b.get('version')!r}"
    if a.get("source") != b.get("source"):
        return f"the source of class {b.get('class')} changed"
    if a.get("arguments") != b.get("arguments"):
        va, vb = a.get("argument_values", {}), b.get("argument_values", {})
        changed = [f"{k} {va.get(k)!r} -> {vb.get(k)!r}" for k in sorted(set(va) | set(vb))
                   if va.get(k) != vb.get(k)]
        return "constructor arguments changed: " + ("; ".join(changed) or "(values)")
    if old.get("ragged") != new.get("ragged"):
        return f"ragged {old.get('ragged')} -> {new.get('ragged')}"
    if old.get("layout") != new.get("layout"):
        return "the samples' fields or types changed"
    return "the pipeline changed"


# ---- the run ---------------------------------------------------------------------------------------


def _old_manifest(output: str | os.PathLike[str]) -> Manifest | None:
    """The cache's manifest at ``output`` if it is a dataset cache (read before the run's lock,
    only to reuse its layout and to say why it is rebuilt)."""
    try:
        layout = CacheLayout.for_output(output)
        if not layout.store.exists("manifest.json"):
            return None
        manifest = load_manifest(layout.store)
    except (ManifestError, OSError):
        return None
    ok = (manifest.pipeline == PIPELINE_NAME and len(manifest.ops) == 1
          and isinstance(manifest.ops[0].get("params", {}).get("layout"), dict))
    return manifest if ok else None


def _probe(dataset: Any, n: int, prepare: Callable[[Any], Any] | None = None) -> list[Any]:
    """Up to ``PROBE`` samples spread over the dataset (the first that do not raise), each
    through ``prepare`` where given."""
    wanted = sorted({0, 1, n // 2, n - 1} & set(range(n)))[:PROBE]
    tried: list[int] = []
    found: list[Any] = []
    last: tuple[int, BaseException] | None = None
    for i in [*wanted, *range(2, min(n, 2 + 4 * PROBE))]:
        if i in tried or len(found) >= len(wanted):
            continue
        tried.append(i)
        try:
            value = dataset[i]
            found.append(value if prepare is None else prepare(value))
        except Exception as e:  # noqa: BLE001 - a bad sample: another one is probed
            last = (i, e)
    if not found:
        assert last is not None
        i, e = last
        raise RunError(f"dataset[{i}] raised {type(e).__name__}: {e}; no sample of the first "
                       f"{len(tried)} tried could be read, so no columns could be inferred")
    return found


def _lines(keys: list[str], sample_hash: Callable[[int], str] | None) -> list[bytes]:
    """Each index's input record: its index and key (and content hash), one JSON line."""
    out = []
    for i, k in enumerate(keys):
        record: dict[str, Any] = {"index": i, "key": k}
        if sample_hash is not None:
            record["hash"] = str(sample_hash(i))
        out.append(json.dumps(record, ensure_ascii=False).encode("utf-8"))
    return out


def run_dataset(
    dataset: Any,
    output: str | os.PathLike[str],
    *,
    key: Callable[[int], Any] | None = None,
    version: str | None = None,
    sample_hash: Callable[[int], str] | None = None,
    ragged: Sequence[str] = (),
    workers: int | None = None,
    format: str = "parquet",
    shard_rows: int | None = None,
    overwrite: bool = False,
    fail_fast: bool = False,
    progress: bool = True,
    log: Any = print,
    retention_s: float = DEFAULT_RETENTION_S,
    wait: bool | float = False,
    executor: str = "local",
    ray_address: str | None = None,
    prepare: Callable[[Any], Any] | None = None,
) -> RunSummary:
    """Run ``dataset[i]`` for every index into the cache at ``output`` (see the module's
    docstring); ``precache.bring_your_own.cache_dataset`` returns the cached dataset.

    Args:
        dataset: a map-style dataset (``len`` and ``[i]``), picklable when ``workers > 1``.
        key: ``key(i)`` names sample ``i`` (default: ``str(i)``); keys must be unique.
        version: names what the samples are computed with; default: the class's source and
            constructor arguments.
        sample_hash: ``sample_hash(i)`` a content hash of sample ``i`` (say of its file): a
            sample whose hash changed is computed again, alone.
        ragged: fields (``a.b`` for nested dicts, ``0`` for a tuple's first) stored with varying
            length even when the first samples agree.
        workers, format, shard_rows, overwrite, fail_fast, progress, log, retention_s, wait,
            executor, ray_address: as ``precache.run``. On Ray the dataset is pickled to the
            actors, and the list of indices they read is written beside ``output`` (a local
            or shared folder: every node must see it, as the shards).
        prepare: applied to each sample before it is stored (a module-level function: it is
            pickled to the workers), e.g. ``MetaTensor``s into tensors and their metadata.

    Raises:
        RunError: no sample could be read, the dataset cannot be pickled to the workers, keys
            repeat, or the run cannot go on.
        TypeError, ValueError: the samples hold values that cannot be stored.
    """
    start = time.perf_counter()
    n = len(dataset)
    if n == 0:
        raise RunError("the dataset is empty: nothing to cache")
    keys = [str(i) if key is None else str(key(i)) for i in range(n)]
    if len(set(keys)) != n:
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise RunError(f"key() gives {dup!r} to more than one index; keys must be unique")
    if executor not in ("local", "ray"):
        raise ValueError(f"executor must be 'local' or 'ray', got {executor!r}")
    if executor == "ray":
        require_ray(ray_address)  # before any work
    ray_workers = None if workers is None else max(1, workers)  # None: the cluster's CPUs
    workers = stage1_workers() if workers is None else max(1, workers)
    described = dataset_fingerprint(dataset, version)
    wanted_ragged = sorted(set(ragged))
    old = _old_manifest(output)
    old_params = old.ops[0]["params"] if old is not None else None
    if (old_params is not None and old_params.get("dataset") == described
            and old_params.get("ragged") == wanted_ragged):
        layout = SampleLayout.from_json(old_params["layout"])  # nothing to read to know it
    else:
        layout = layout_of(_probe(dataset, n, prepare), wanted_ragged)
    params = {"dataset": described, "ragged": wanted_ragged, "layout": layout.to_json()}
    pipeline = Pipeline(PIPELINE_NAME, _DatasetOps(dataset, layout, params, prepare), ())
    descriptions = [op.describe() for op in pipeline.build_ops({})]
    fp = fingerprint(descriptions, format)
    get_format(format)
    if old is not None and old.fingerprint != fp and old_params is not None:
        log(f"precache: the dataset's fingerprint changed ({_why(old_params, params, old.format, format)}): "
            "every sample is computed again")
    if workers > 1 or executor == "ray":
        try:
            pickle.dumps(dataset)
        except Exception as e:  # noqa: BLE001 - any pickling failure
            raise RunError(f"the dataset ({described['class']}) cannot be pickled to worker "
                           f"processes ({type(e).__name__}: {e}); make it picklable (no open "
                           "files, lambdas or local classes), or pass workers=1") from None
    lines = _lines(keys, sample_hash)
    beside = None if executor == "local" or is_remote(output) else _parent_folder(output)
    with tempfile.TemporaryDirectory(prefix=".precache-dataset-", dir=beside) as tmp:
        records_file = Path(tmp) / "indices.jsonl"
        records_file.write_bytes(b"\n".join(lines))
        inputs, offset = [], 0
        for k, line in zip(keys, lines):
            inputs.append(Input(k, f"{records_file}#{offset}+{len(line)}", len(line), 0))
            offset += len(line) + 1
        executed = ((lambda tasks, config: run_tasks_ray(tasks, config, ray_workers,
                                                         address=ray_address))
                    if executor == "ray" else
                    (lambda tasks, config: run_tasks(tasks, config, workers)))
        return _run(output, pipeline, descriptions, fp, inputs, lines, keys, executed,
                    format, shard_rows, overwrite, fail_fast, progress, log, retention_s,
                    _wait_seconds(wait), described["class"], start)


def _parent_folder(output: Any) -> str:
    """The local folder ``output`` (a cache folder, maybe not made yet) is in, made if missing:
    where Ray's actors, which may run on other nodes, find the run's list of indices."""
    parent = local_path(output).resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    return str(parent)


def _run(output: Any, pipeline: Pipeline, descriptions: list[dict[str, Any]],
         fp: str, inputs: list[Input], lines: list[bytes], keys: list[str],
         executed: Callable[[list[Any], WorkerConfig], Any],
         format: str, shard_rows: int | None, overwrite: bool, fail_fast: bool, progress: bool,
         log: Any, retention_s: float, wait_s: float | None, source: str,
         start: float) -> RunSummary:
    """The run itself, as ``precache.run`` does it for files (``runner.run``); ``executed(tasks,
    config)`` runs the tasks (locally or on Ray) and yields their results."""
    index_of = {k: i for i, k in enumerate(keys)}
    locator = [f"dataset[{i}]" for i in range(len(keys))]
    hashes = [hash_bytes(line) for line in lines]
    transaction = WriteTransaction(output, pipeline=PIPELINE_NAME, fingerprint=fp,
                                   overwrite=overwrite, log=log, retention_s=retention_s,
                                   wait_s=wait_s)
    with transaction as tx:
        todo: list[Input] = []
        kept: dict[str, dict[str, Any]] = {}
        for item in inputs:
            i = index_of[item.key]
            record = tx.records.get(item.key)
            if record is not None and record["source_hash"] == hashes[i]:
                kept[item.key] = dict(record, locator=locator[i], size=item.size, mtime_ns=0)
            else:
                todo.append(item)
        todo = tx.recompute_damaged(inputs, todo, kept)
        deleted = len(set(tx.records) - set(index_of))
        log(f"precache: {len(inputs)} samples of {source}: {len(kept)} unchanged, "
            f"{len(todo)} to compute" + (f", {deleted} deleted" if deleted else ""))
        first_seq = tx.next_seq
        tasks = make_tasks(todo, first_seq, shard_rows, DEFAULT_SHARD_ROWS)
        layout = tx.layout
        config = WorkerConfig(pipeline=pipeline, params={}, cache_root=str(layout.root),
                              cache_url=layout.url, format=format, fingerprint=fp,
                              pipeline_name=PIPELINE_NAME, fail_fast=fail_fast)
        stages = StageTimes()
        written = commit_results(tx, executed(tasks, config), kept, len(todo),
                                 progress, again="call",
                                 locate=lambda key: locator[index_of[key]], stages=stages)
        touched, rewritten = tx.drop_stale_rows(kept, get_format(format),
                                                first_seq + len(tasks))
        manifest = tx.publish(kept, pipeline_ref="", params={}, ops=descriptions,
                              shard_format=format, source=source)
        if not tx.published:
            log(f"precache: cache '{tx.location}' is up to date (generation "
                f"{manifest.generation}): nothing changed, nothing published")
    return summarize(layout, manifest, tx, kept, computed=len(todo),
                     reused=len(inputs) - len(todo), deleted=deleted, touched=touched,
                     rewritten=rewritten, written=written, start=start, stages=stages)


def dataset_from_ref(ref: str) -> Any | None:
    """The dataset a ``module:attr`` names when ``attr`` is not a ``Pipeline`` but a factory
    (a function or a class called with no arguments) of a map-style dataset, for ``precache run
    module:attr``; ``None`` for anything else (``load_pipeline`` then finds it, or says why not).

    Raises:
        PipelineError: the factory fails, or gives no ``len`` and ``[i]``.
    """
    if ":" not in ref or ref.endswith(".py") or "/" in ref:
        return None
    module_name, _, attr = ref.partition(":")
    try:
        target = getattr(import_module(module_name), attr)
    except Exception:  # noqa: BLE001 - load_pipeline reports it in one line
        return None
    if isinstance(target, Pipeline) or not callable(target):
        return None
    try:
        dataset = target()
    except Exception as e:  # noqa: BLE001 - the user's code: one line
        raise PipelineError(f"'{ref}' is not a Pipeline, so it was called as a Dataset factory "
                            f"with no arguments, which raised {type(e).__name__}: {e}") from None
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise PipelineError(f"'{ref}' is neither a Pipeline nor a factory of a map-style "
                            f"dataset: calling it gave a {type(dataset).__name__}, without "
                            "__len__ and __getitem__")
    return dataset
