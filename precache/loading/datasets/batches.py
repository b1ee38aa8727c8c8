"""What a ``CachedDataset`` batch is made of: ``CachedBatch`` (the samples, and the same rows as
batched arrays), ``RaggedRows`` (a ragged column's rows, crossing processes as one array), and
``collate_samples`` (tensors that share the batch's memory)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

__all__ = ["CachedBatch", "RaggedRows", "collate_samples"]

Sample = dict[str, Any]


class RaggedRows(list):
    """A batch's rows of a ragged column: a list of 1-D arrays (views of the mapped shards)
    that crosses to another process as one array and its row ends, not as one pickled array per
    row (a DataLoader worker hands its batch to the training process that way; 256 small
    pickles cost more than reading the rows)."""

    def __reduce__(self) -> Any:
        if not self:
            return (RaggedRows, ())
        flat = np.concatenate(self)
        return (_ragged_rows, (flat, np.cumsum([len(row) for row in self])))


def _ragged_rows(flat: np.ndarray, ends: np.ndarray) -> RaggedRows:
    """``RaggedRows`` again, each row a view of ``flat``."""
    starts = [0, *ends[:-1].tolist()]
    return RaggedRows(flat[a:b] for a, b in zip(starts, ends.tolist()))


class CachedBatch(list):
    """What ``__getitems__`` returns without a transform: the samples (so any collate works),
    plus ``columns``, the same rows as batched arrays, which ``collate_samples`` turns into
    tensors without taking them apart and stacking them again. The per-sample dicts are made
    only when something reads them as a list."""

    def __init__(self, columns: dict[str, Any], count: int) -> None:
        super().__init__()
        self.columns, self._count, self._filled = columns, count, False

    def _fill(self) -> None:
        if not self._filled:
            self._filled = True
            self.extend({name: values[i] for name, values in self.columns.items()}
                        for i in range(self._count))

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Any:
        self._fill()
        return super().__iter__()

    def __getitem__(self, index: Any) -> Any:
        self._fill()
        return super().__getitem__(index)

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickled (to a worker's parent) as samples
        self._fill()
        return (list, (list(super().__iter__()),))


def collate_samples(samples: list[Sample]) -> dict[str, Any]:
    """``default_collate``, except that a ``CachedBatch`` becomes tensors that share its arrays'
    memory (one copy fewer per batch)."""
    if isinstance(samples, CachedBatch):
        return {name: _shared_tensor(values) if isinstance(values, np.ndarray) else values
                for name, values in samples.columns.items()}
    return default_collate(samples)


def _shared_tensor(values: np.ndarray) -> torch.Tensor:
    """``values`` as a tensor with its memory: the tensor it is whole of, where it is one (a
    thread loader's ``pinned_empty`` array: a non-blocking copy to the GPU then tells the
    pinned allocator which block it reads, so the block is not reused before the copy is
    done), else ``torch.from_numpy``."""
    tensor = torch.from_numpy(values)
    base = values.base
    if (isinstance(base, torch.Tensor) and base.data_ptr() == tensor.data_ptr()
            and base.dtype == tensor.dtype and base.shape == tensor.shape
            and base.stride() == tensor.stride()):
        return base
    return tensor
