"""Batches of token ids: pad each batch only to its own longest sequence and build the mask.

Token ids are cached without padding (a ``ragged`` column), so a batch of short documents costs
short tensors. ``TokenCollate`` pads to the batch's longest sequence, rounded up to a multiple of
``multiple_of`` (8 suits tensor cores), and adds ``attention_mask`` (1 on tokens, 0 on padding).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from precache.loading.datasets.batches import CachedBatch

__all__ = ["TokenCollate", "pad_sequences"]


def pad_sequences(sequences: list[np.ndarray], pad_id: int = 0,
                  multiple_of: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)``: int64 ``(batch, length)`` padded with ``pad_id``, and its 0/1 mask."""
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    width = int(lengths.max()) if len(lengths) else 0
    width = -(-width // multiple_of) * multiple_of
    ids = np.full((len(sequences), width), pad_id, dtype=np.int64)
    mask = np.arange(width)[None, :] < lengths[:, None]
    if len(sequences):
        ids[mask] = np.concatenate(sequences)  # row-major order matches the concatenation
    return torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))


class TokenCollate:
    """Collate for caches with a ragged token column: ``input_ids`` and ``attention_mask`` from
    ``column``, every other column as ``collate_samples`` would.

    Args:
        column: the ragged column of token ids.
        pad_id: the tokenizer's padding id (0 for BERT WordPiece).
        multiple_of: round the padded length up to a multiple of this.
    """

    thread_safe = True
    """Nothing changes per call and the padding is a few NumPy calls: ``make_loader`` keeps
    its worker threads for it."""

    def __init__(self, column: str = "ids", pad_id: int = 0, multiple_of: int = 8) -> None:
        if multiple_of < 1:
            raise ValueError(f"multiple_of must be >= 1, not {multiple_of}")
        self.column, self.pad_id, self.multiple_of = column, pad_id, multiple_of

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        if isinstance(samples, CachedBatch):
            columns = dict(samples.columns)
        else:
            columns = {name: [s[name] for s in samples] for name in samples[0]}
        sequences = [np.asarray(s) for s in columns.pop(self.column)]
        ids, mask = pad_sequences(sequences, self.pad_id, self.multiple_of)
        out: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
        for name, values in columns.items():
            if isinstance(values, np.ndarray):
                out[name] = torch.from_numpy(values)
            elif values and isinstance(values[0], str):
                out[name] = list(values)
            else:
                out[name] = default_collate(list(values))
        return out
