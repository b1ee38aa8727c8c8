"""Integer targets from a label column, one rule for every dataset and ``to_hf_dataset``: the
classes are the column's distinct values, sorted (integers stay integers, so a cache whose
stage 1 stored ``0, 1, 2`` has ``classes == [0, 1, 2]`` and targets equal to the labels), and a
row's target is its value's index in them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["class_targets"]


def class_targets(values: Sequence[Any] | np.ndarray) -> tuple[list[Any], np.ndarray]:
    """``(classes, targets)`` for a label column's values: the sorted distinct values (as
    Python ``int`` for an integer column, else ``str``) and each row's index in them (int64).

    Raises:
        ValueError: the column holds values that are neither all integers nor all strings.
    """
    array = np.asarray(values)
    if array.size == 0:
        return [], np.empty(0, np.int64)
    if array.dtype.kind in "iub":
        kind: type = int
    elif array.dtype.kind in "UO" and all(isinstance(v, str) for v in array.tolist()):
        kind, array = str, array.astype(str)
    else:
        raise ValueError(f"a label column of {array.dtype} values cannot be a class target; "
                         "give integers or strings")
    classes, targets = np.unique(array, return_inverse=True)
    return [kind(c) for c in classes.tolist()], targets.astype(np.int64).reshape(-1)


def targets_in(values: Sequence[Any] | np.ndarray, classes: Sequence[Any] | None,
               where: str) -> tuple[list[Any], np.ndarray]:
    """``class_targets``, or with ``classes`` given (a user's order, e.g. a checkpoint's) each
    row's index in them, matching a value and a class by their text (a class given as ``"1"``
    names the integer label 1). ``where`` names the cache in the error.

    Raises:
        ValueError: a value is not among ``classes``.
    """
    if classes is None:
        return class_targets(values)
    names = list(classes)
    index = {str(name): i for i, name in enumerate(names)}
    text = [str(v) for v in np.asarray(values).tolist()]
    unknown = sorted(set(text) - set(index))
    if unknown:
        raise ValueError(f"{where}: labels {unknown} are not in classes {names}")
    return names, np.array([index[t] for t in text], dtype=np.int64)
