"""Fixed-length blocks of a token cache, for language-model pre-training.

The text pipeline stores each document's ids without padding, in cache order, so the whole cache
is already one token stream. ``PackedBlocks`` cuts that stream every ``block_size`` tokens at
read time: a block may hold the end of one document and the start of the next, and no token is
padding. Packing is a view, not a second copy, so trying another block size needs no rebuild.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from precache.loading.datasets.cache_backed import CacheBackedByRows
from precache.loading.datasets.cached import CachedDataset

__all__ = ["PackedBlocks"]


class PackedBlocks(CacheBackedByRows):
    """Map-style dataset of ``{"input_ids": int64 tensor (block_size,)}`` cut from a token cache.

    Args:
        cache: a cache with a ragged column of token ids (the ``text`` pipeline's ``ids``) and
            their ``length``.
        block_size: tokens per block. The tail of the stream shorter than a block is dropped.
        sep_id: appended after every document (e.g. an end-of-text id) when the tokenizer does
            not already end documents with one; BERT WordPiece ends each with ``[SEP]`` (102).
        column: the column of token ids.
        generation: the generation of the cache to read (default: the current one; under
            ``torch.distributed``, rank 0's). The ids and the lengths are read from that one
            generation, held while the blocks are open, even if stage 1 publishes another.

    Blocks are numbered in stream order; shuffle them with any sampler (``DistributedSampler``
    gives each rank its share). ``CacheBacked`` is declared through ``rows``, the dataset of
    the token ids (token ids are never images: ``encoded_columns`` is empty), with
    ``shard_ids`` per block; ``close()`` lets go of the generation (dropping the blocks does
    too).
    """

    def __init__(self, cache: str | os.PathLike[str], block_size: int, *,
                 sep_id: int | None = None, column: str = "ids",
                 generation: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, not {block_size}")
        self.block_size, self.sep_id = int(block_size), sep_id
        self.rows = CachedDataset(cache, columns=[column], generation=generation)
        self.column = column
        # the lengths of the generation the ids come from (a re-run may have published another
        # since: its lengths would cut blocks of another stream)
        lengths = CachedDataset(cache, columns=["length"], generation=self.rows.generation)
        try:
            per_doc = lengths.read_column("length").astype(np.int64) + (sep_id is not None)
        finally:
            lengths.close()
        self._starts = np.concatenate([[0], np.cumsum(per_doc)])  # stream offset of each document
        self.tokens = int(self._starts[-1])

    def __len__(self) -> int:
        return self.tokens // self.block_size

    @property
    def shard_ids(self) -> np.ndarray:
        """The shard of each block's first document (one entry per block), for
        ``make_loader(shard_window=...)``; a block may run on into the next shard."""
        offsets = np.arange(len(self), dtype=np.int64) * self.block_size
        first_docs = np.searchsorted(self._starts, offsets, side="right") - 1
        return self.rows.shard_ids[first_docs]

    def block(self, index: int) -> np.ndarray:
        """Tokens ``[index * block_size, (index + 1) * block_size)`` of the stream, as int64."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"block {index} out of range for {len(self)} blocks")
        index %= len(self)
        start, stop = index * self.block_size, (index + 1) * self.block_size
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        last = int(np.searchsorted(self._starts, stop, side="left"))  # one past the last doc
        docs = self.rows.read_batch(np.arange(first, last))[self.column]
        if self.sep_id is not None:
            sep = np.array([self.sep_id], dtype=np.int64)
            docs = [part for doc in docs for part in (doc, sep)]
        stream = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs])
        offset = start - int(self._starts[first])
        return stream[offset:offset + self.block_size]

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": torch.from_numpy(self.block(index))}

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        return [self[int(i)] for i in indices]
