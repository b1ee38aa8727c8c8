"""Pipelines: a named list of ops with typed parameters, found by name, module or file path."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
import traceback
from dataclasses import dataclass, field, replace
from importlib.metadata import entry_points
from pathlib import Path, PurePath
from typing import Any, Callable

from precache.cache.fingerprint import fingerprint, op_fingerprint
from precache.processing.ops.base import Op

__all__ = ["Pipeline", "PipelineError", "load_pipeline", "available_pipelines", "fingerprint",
           "op_fingerprint"]

ENTRY_POINT_GROUP = "precache.pipelines"


class PipelineError(ValueError):
    """A pipeline cannot be found or loaded, or a parameter override is wrong."""


@dataclass(frozen=True)
class Pipeline:
    """A stage-1 pipeline.

    Args:
        name (str): the pipeline's name; a cache remembers it and refuses another pipeline.
        make_ops (Callable[..., list[Op]]): builds the ops from keyword parameters; its defaults
            are the pipeline's parameters, which ``--set key=value`` overrides.
        extensions (tuple[str, ...]): file endings the input folder is searched for.
        description (str): one line for ``--help`` and ``precache run --list``.
        ref (str): how worker processes load this pipeline again (set by ``load_pipeline``).
        shard_rows (int | None): inputs per shard when the run does not say (default: 256).
            Small rows (token ids) read faster from larger shards: a batch costs a little per
            shard it touches.
    """

    name: str
    make_ops: Callable[..., list[Op]]
    extensions: tuple[str, ...]
    description: str = ""
    ref: str = field(default="", compare=False)
    shard_rows: int | None = None

    def defaults(self) -> dict[str, Any]:
        """The pipeline's parameters and their default values."""
        signature = inspect.signature(self.make_ops)
        return {
            name: p.default
            for name, p in signature.parameters.items()
            if p.default is not inspect.Parameter.empty
        }

    def resolve_params(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """Defaults updated by ``overrides`` (values already typed).

        Raises:
            PipelineError: an override names no parameter of this pipeline.
        """
        params = self.defaults()
        for key, value in (overrides or {}).items():
            if key not in params:
                raise PipelineError(
                    f"pipeline '{self.name}' has no parameter '{key}'; "
                    f"its parameters: {', '.join(sorted(params)) or 'none'}"
                )
            params[key] = value
        return params

    def parse_overrides(self, pairs: list[str]) -> dict[str, Any]:
        """Parse ``key=value`` strings, typing each value like the parameter's default.

        Raises:
            PipelineError: malformed pair, unknown key, or a value of the wrong type.
        """
        defaults = self.defaults()
        overrides: dict[str, Any] = {}
        for pair in pairs:
            key, sep, text = pair.partition("=")
            key = key.strip()
            if not sep or not key:
                raise PipelineError(f"--set '{pair}': expected key=value")
            if key not in defaults:
                raise PipelineError(
                    f"--set '{pair}': pipeline '{self.name}' has no parameter '{key}'; "
                    f"its parameters: {', '.join(sorted(defaults)) or 'none'}"
                )
            overrides[key] = _parse_value(pair, text, defaults[key])
        return overrides

    def build_ops(self, params: dict[str, Any]) -> list[Op]:
        """Build the op list; a ``ValueError`` from an op's checks becomes a ``PipelineError``."""
        try:
            return list(self.make_ops(**params))
        except ValueError as e:
            raise PipelineError(f"pipeline '{self.name}': {e}") from None


def _parse_scalar(text: str, kind: type) -> Any:
    """``text`` as a ``kind`` of bool (true/false, yes/no, on/off, 1/0), int, float or str;
    ``ValueError`` if it is not one."""
    if kind is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError
    return kind(text)


def _parse_value(pair: str, text: str, default: Any) -> Any:
    text = text.strip()
    kind = type(default)
    try:
        if kind in (bool, int, float):
            return _parse_scalar(text, kind)
        if kind is str or default is None:
            return text
        if isinstance(default, PurePath):
            return kind(text)
        if isinstance(default, (tuple, list)):
            return _parse_sequence(text, default)
        return kind(json.loads(text))
    except (ValueError, TypeError, json.JSONDecodeError):
        raise PipelineError(f"--set '{pair}': {_expected(pair, default)}") from None


def _parse_sequence(text: str, default: tuple | list) -> tuple | list:
    """``0.5,0.6,0.7``, ``(0.5,0.6,0.7)`` or JSON ``[0.5, 0.6, 0.7]``; each item typed like
    the default's items when they all share one of bool, int, float, str."""
    if text.startswith("(") and text.endswith(")"):  # Python's tuple syntax, also accepted
        text = text[1:-1].strip().rstrip(",")
    if text.startswith("["):
        items = json.loads(text)
        if not isinstance(items, list):
            raise ValueError
    else:
        items = [part.strip() for part in text.split(",")] if text else []
    item_kinds = {type(item) for item in default}
    if len(item_kinds) == 1 and next(iter(item_kinds)) in (bool, int, float, str):
        sample = default[0]
        items = [_parse_item(item, sample) for item in items]
    elif not text.startswith("["):
        items = [_json_or_text(item) for item in items]
    return type(default)(items)


def _parse_item(item: Any, sample: Any) -> Any:
    kind = type(sample)
    if isinstance(item, str):
        return _parse_scalar(item, kind)
    if kind is float and type(item) in (int, float):
        return float(item)
    if type(item) is not kind:
        raise ValueError
    return item


def _json_or_text(item: str) -> Any:
    try:
        return json.loads(item)
    except json.JSONDecodeError:
        return item


def _expected(pair: str, default: Any) -> str:
    """What a ``--set`` value of this parameter looks like, with an example that works."""
    key = pair.partition("=")[0].strip()
    kind = type(default)
    if kind is bool:
        return f"expected true or false (also yes/no, on/off, 1/0), e.g. --set {key}=true"
    if isinstance(default, (tuple, list)):
        kinds = {type(item).__name__ for item in default}
        of = f" of {kinds.pop()}" if len(kinds) == 1 else ""
        example = ",".join(str(item) for item in default) or "a,b"
        return (f"expected a {kind.__name__}{of} as comma-separated items, e.g. "
                f"--set {key}={example} (or JSON: --set '{key}={json.dumps(list(default))}'); "
                f"default {default!r}")
    if kind is dict:
        return (f"expected a JSON object, e.g. --set '{key}={json.dumps(default)}' "
                f"(default {default!r})")
    return f"expected a value of type {kind.__name__} (default {default!r})"


def available_pipelines() -> dict[str, str]:
    """Names of installed pipelines (entry point group ``precache.pipelines``) -> their target."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _load_file(path: Path) -> Any:
    if path.is_dir():
        path = path / "pipeline.py"
    if not path.is_file():
        raise PipelineError(f"pipeline file '{path}' does not exist")
    module_name = "precache_user_pipeline_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise PipelineError(f"cannot load pipeline file '{path}'")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the user's code: one line naming where, not a traceback
        raise _load_error(f"pipeline file '{path}'", error, path) from None
    if not hasattr(module, "pipeline"):
        raise PipelineError(f"pipeline file '{path}' defines no variable named 'pipeline'")
    return module.pipeline


def _load_error(what: str, error: Exception, path: Path | None, *,
                is_file: bool = True) -> PipelineError:
    """One line for a pipeline whose code fails to load: the file and line, the error, the fix.

    ``what`` names the pipeline (``pipeline file 'x.py'``, ``is_file``; or ``pipeline
    'mod:attr'``); ``path`` is its file, whose own line is named when the error comes from deeper
    (a module it imports, a library it calls); without it, the innermost line of the traceback
    that is not Python's own."""
    if isinstance(error, SyntaxError):  # where the parser stopped, in whichever file
        filename, line = error.filename, error.lineno
    else:
        frames = [f for f in traceback.extract_tb(error.__traceback__)
                  if not f.filename.startswith("<")]
        own = [f for f in frames if path is not None and Path(f.filename) == path]
        frame = (own or frames or [None])[-1]
        filename, line = (frame.filename, frame.lineno) if frame is not None else (None, None)
    if filename is None:
        where = what
    elif is_file and path is not None and Path(filename) == path:
        where = f"{what}, line {line}"
    else:
        where = f"{what}: {filename}, line {line}"
    if isinstance(error, ModuleNotFoundError) and error.name:
        top = error.name.partition(".")[0]
        if is_file and path is not None and ((path.parent / f"{top}.py").is_file()
                                             or (path.parent / top / "__init__.py").is_file()):
            fix = (f"'{top}' is beside the pipeline file, but a pipeline file is loaded without "
                   f"its folder on the import path: add {path.parent} to PYTHONPATH")
        elif top != error.name and _installed(top):
            fix = f"'{top}' is installed but has no module '{error.name}': fix the import"
        else:
            fix = (f"install the package that provides '{top}' into this Python "
                   f"({sys.executable}), or fix the import")
        return PipelineError(f"{where}: no module named '{error.name}'; {fix}")
    detail = error.msg if isinstance(error, SyntaxError) else str(error).strip()
    detail = detail.splitlines()[0] if detail else ""
    return PipelineError(f"{where}: {type(error).__name__}" + (f": {detail}" if detail else "")
                         + "; fix the code there and re-run")


def _module_file(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def load_pipeline(ref: str) -> Pipeline:
    """Find a pipeline by installed name (``images``), ``module:attribute``, or file/folder path.

    Installed names win: ``ref`` is read as a path only if it looks like one (``./x``, ``x/``,
    ``a/b``, ``x.py``, ``.``), so a folder in the current directory that shares a pipeline's name
    (say the input folder ``images``) neither shadows it nor has its ``pipeline.py`` run.

    Raises:
        PipelineError: nothing of that name, or the target is not a ``Pipeline``.
    """
    looks_like_path = ref.endswith(".py") or "/" in ref or ref in (".", "..")
    if looks_like_path:
        resolved = str(Path(ref).resolve())
        obj = _load_file(Path(resolved))
    elif ":" in ref:
        module_name, _, attr = ref.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
                raise PipelineError(f"cannot import pipeline '{ref}': {e}") from None
            raise _load_error(f"pipeline '{ref}'", e, _module_file(module_name),
                              is_file=False) from None  # a module it imports is missing
        except Exception as e:  # its code fails: one line naming the file and line
            raise _load_error(f"pipeline '{ref}'", e, _module_file(module_name),
                              is_file=False) from None
        try:
            obj = getattr(module, attr)
        except AttributeError as e:
            raise PipelineError(f"cannot import pipeline '{ref}': {e}") from None
        resolved = ref
    else:
        installed = available_pipelines()
        if ref not in installed:
            names = ", ".join(sorted(installed)) or "none installed"
            local = (f"; to run the folder '{ref}' as a pipeline, write './{ref}'"
                     if (Path(ref) / "pipeline.py").is_file() else "")
            raise PipelineError(
                f"unknown pipeline '{ref}'; available: {names} (or give a path to a pipeline "
                f"file){local}"
            )
        return load_pipeline(installed[ref])
    if not isinstance(obj, Pipeline):
        raise PipelineError(f"'{ref}' is a {type(obj).__name__}, not a precache Pipeline")
    return replace(obj, ref=resolved)
