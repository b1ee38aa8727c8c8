"""An encoded image column's rows as a batch gets them: JPEG/WebP rows (stage 1's
``image_codec``) decoded straight into one uint8 batch array, or, with ``decode_images=False``,
each row's bytes as a uint8 array viewing the mapped shard, for
``precache.loading.decode_images(rows, "cuda")`` to decode on the GPU (a batch then travels at
the size of its JPEG bytes). Decoding runs outside the dataset's lock: in parallel in thread
workers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from precache.loading._engine.read_state import ReadState
from precache.loading.loaders.image_decode import decode_into_batch

__all__ = ["batch_images"]


def batch_images(state: ReadState, name: str, values: list[Any], indices: np.ndarray,
                 empty: Callable[..., np.ndarray]) -> Any:
    """Column ``name``'s rows ``values`` (the file's bytes) as the batch gets them: decoded
    into one ``(n, h, w, 3)`` array (crops of one cache share a size), or each row's bytes.
    ``indices``: the rows, for messages."""
    if not state.decode_images:
        return [np.frombuffer(value, np.uint8) for value in values]

    def where(i: int) -> str:
        index = int(indices[i])
        return f"{state.path}: row {index} (shard {int(state.shard[index])}), column {name!r}"

    try:
        return decode_into_batch(values, where, empty)
    except ValueError as error:
        raise ValueError(f"{error}; run `precache verify {state.path}`") from None
