"""The stage-1 op interface: a named, versioned step that maps a sample to named columns.

An op's name, version, parameters and the hashes of any model files it loads form its part of the
pipeline fingerprint; change any of them and the cache is rebuilt. ``setup()`` runs once in each
worker process, before the first sample, and is where models load.
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import Any, Callable, ClassVar, Union

from precache.storage.hashing import file_sha256

__all__ = ["Op", "Skip", "FunctionOp", "OpResult", "Sample", "file_sha256"]

Sample = dict[str, Any]
"""A sample: column name -> value. The runner sets ``key``, ``source_key``, ``source_hash``,
``locator`` (where the input lives) and ``data`` (its bytes); ``data`` and ``locator`` are not
stored in the cache, every other column is."""

OpResult = Union[Sample, list[Sample], "Skip"]


class Skip(Exception):
    """Raise (or, from ``call_batch``, return) to skip a sample with a reason, e.g. ``no_face``.

    A skipped sample is not an error: it is counted and listed with its reason, and not retried
    until its input or the pipeline changes.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Op:
    """Base class of stage-1 ops.

    Subclasses set ``name`` and ``version``, take their parameters as keyword-only ``__init__``
    arguments and return them from ``params``, and implement ``__call__`` (one sample) or, with
    ``batched = True``, ``call_batch`` (a list of samples, e.g. for a model that runs on a batch).
    A call returns the updated sample, a list of samples (one input giving several rows, such as
    one per face; each keyed ``<key>#<i>`` unless the op gave it a ``key`` of its own, as
    ``<video>#t<track>#f<frame>``), or raises ``Skip``. Any other exception marks the input as failed.
    """

    name: ClassVar[str] = ""
    version: ClassVar[str] = "1"
    batched: ClassVar[bool] = False

    @property
    def params(self) -> dict[str, Any]:
        """The parameters that change this op's output (JSON-serialisable)."""
        return {}

    def weight_files(self) -> list[Path]:
        """Model files this op loads; their hashes join the fingerprint."""
        return []

    def setup(self) -> None:
        """Load models and pin thread pools; runs once per worker process."""

    def __call__(self, sample: Sample) -> Sample | list[Sample]:
        raise NotImplementedError(f"op {self.name!r} implements neither __call__ nor call_batch")

    def call_batch(self, samples: list[Sample]) -> list[OpResult]:
        """Process several samples at once; return one result (or ``Skip``) per sample."""
        results: list[OpResult] = []
        for sample in samples:
            try:
                results.append(self(sample))
            except Skip as skip:
                results.append(skip)
        return results

    def describe(self) -> dict[str, Any]:
        """What the manifest records of this op, and what its fingerprint is made of."""
        return {
            "name": self.name,
            "version": str(self.version),
            "params": self.params,
            "weights": {Path(p).name: file_sha256(p) for p in self.weight_files()},
        }

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}({args})"


class FunctionOp(Op):
    """Wrap a plain function ``fn(sample) -> sample`` as an op.

    Args:
        fn: a module-level function (it must be importable in worker processes).
        name (str, optional): defaults to the function's name.
        version (str, optional): defaults to a hash of the function's source code, so editing the
            function rebuilds the cache.
        params (dict, optional): keyword arguments passed to ``fn`` and recorded in the manifest.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        version: str | None = None,
        params: dict[str, Any] | None = None,
    ) -> None:
        self.fn = fn
        self.name = name or fn.__name__  # type: ignore[misc]
        if version is None:
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                source = f"{fn.__module__}.{fn.__qualname__}"
            version = "src-" + hashlib.sha256(source.encode()).hexdigest()[:12]
        self.version = version  # type: ignore[misc]
        self._params = dict(params or {})

    @property
    def params(self) -> dict[str, Any]:
        return dict(self._params)

    def __call__(self, sample: Sample) -> Sample | list[Sample]:
        return self.fn(sample, **self._params)
