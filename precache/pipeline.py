"""Pipelines: a named list of ops with typed parameters, found by name, module or file path."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable

from precache.cache.fingerprint import fingerprint, op_fingerprint
from precache.ops.base import Op

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
    """

    name: str
    make_ops: Callable[..., list[Op]]
    extensions: tuple[str, ...]
    description: str = ""
    ref: str = field(default="", compare=False)

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


def _parse_value(pair: str, text: str, default: Any) -> Any:
    text = text.strip()
    kind = type(default)
    try:
        if kind is bool:
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind in (int, float):
            return kind(text)
        if kind is str or default is None:
            return text
        return kind(json.loads(text))
    except (ValueError, TypeError, json.JSONDecodeError):
        raise PipelineError(
            f"--set '{pair}': expected a value of type {kind.__name__} (default {default!r})"
        ) from None


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
    spec.loader.exec_module(module)
    if not hasattr(module, "pipeline"):
        raise PipelineError(f"pipeline file '{path}' defines no variable named 'pipeline'")
    return module.pipeline


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
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
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
    return Pipeline(obj.name, obj.make_ops, obj.extensions, obj.description, ref=resolved)
