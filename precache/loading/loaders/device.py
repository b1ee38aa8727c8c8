"""Copy batches to the training device ahead of time.

On CUDA, ``DevicePrefetcher`` issues the copy of batch i+1 on a side stream (``non_blocking``,
from pinned memory) while the model trains on batch i, so the step never waits for a host-to-
device copy. On CPU it passes batches through. Cached images arrive as NHWC uint8; ``as_nchw``
turns them into an NCHW view that is already ``channels_last`` in memory, with no copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["to_device", "DevicePrefetcher", "as_nchw"]


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """``batch`` (tensors inside dicts, lists, tuples) moved to ``device``; other values as is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


def as_nchw(images: torch.Tensor) -> torch.Tensor:
    """NHWC -> NCHW as a view: the result is ``channels_last`` in memory (the fast layout for
    convolutions with AMP on tensor cores), and nothing is copied."""
    return images.permute(0, 3, 1, 2)


class DevicePrefetcher:
    """Iterate ``batches`` with each one already on ``device``; the next copy overlaps this step.

    Args:
        batches: an iterable of batches (e.g. a ``CacheLoader``); iterated afresh each time.
        device: where the model lives.
    """

    def __init__(self, batches: Iterable[Any], device: torch.device | str) -> None:
        self.batches = batches
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if not self.cuda:
            yield from self.batches
            return
        stream = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        source = iter(self.batches)

        def start_copy() -> Any:
            batch = next(source, _END)
            if batch is _END:
                return _END
            with torch.cuda.stream(stream):
                return to_device(batch, self.device, non_blocking=True)

        upcoming = start_copy()
        while upcoming is not _END:
            main.wait_stream(stream)  # this batch's copy is done before the step uses it
            current = upcoming
            _record(current, main)
            upcoming = start_copy()  # the next copy runs while the caller trains on this one
            yield current


_END = object()


def _record(batch: Any, stream: Any) -> None:
    """Tell the caching allocator that tensors made on the side stream are used on ``stream``."""
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, dict):
        for value in batch.values():
            _record(value, stream)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            _record(value, stream)
