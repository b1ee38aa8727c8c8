"""Batches read by threads of the training process: no process hop per batch.

A DataLoader worker process gathers a batch, copies it into shared memory, hands it over by
file descriptor, and the training process copies it again to pin it. For a cache's own columns
that hand-over, not the read, sets the ceiling: 128 px crops, batch 256, 2 workers delivered
0.13-0.26 of a NumPy memmap gather in the training process (issue 25). The work a cached batch
needs releases the GIL (NumPy's gather into the batch, libjpeg-turbo's decode, OpenCV and torch
ops), so threads of the training process do it in parallel with the step, and the batch is
handed over as a reference.

``ThreadedBatches`` runs ``dataset.__getitems__`` + ``collate_fn`` (+ an optional
``batch_transform``, e.g. a batched ``FaceAugment``) for the batches of a batch sampler on a
small pool of threads, keeps up to ``threads x prefetch`` batches in flight, and yields them in
the sampler's order, so ``CacheLoader`` counts and resumes exactly as with worker processes.
Worker processes stay the choice for per-sample Python transforms, which hold the GIL
(``make_loader(worker_kind="auto")`` decides). With no threads (``num_workers=0``) the loop's
own thread reads each batch when it asks: the same calls without torch's single-process
DataLoader around them, which cost ~20 us a batch (a warm batch of 256 token rows takes ~80).

With ``pin_memory`` the threads gather and decode each batch straight into page-locked memory:
the dataset makes its arrays with ``pinned_empty`` (torch's caching host allocator), so no
second copy pins them, and a batch of 256 crops of 224 px (38.5 MB, past glibc's largest mmap
threshold) is not a fresh mmap that page-faults every time. The allocator keeps freed blocks
and reuses one only once the copies to the GPU that read it are done: a small ring of batch
buffers that never overwrites a batch still in use. ``_pin`` then copies only the tensors that
are not pinned (other datasets', a ``batch_transform``'s new ones).
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.utils.data import Subset

__all__ = ["ThreadedBatches", "pinned_empty", "declares_thread_safe"]


def declares_thread_safe(function: Any) -> bool:
    """Whether a collate or batch transform says it may run in several threads at once: an
    attribute ``thread_safe = True`` (precache's ``TokenCollate``, ``HFTokenCollate``,
    ``collate_clips``, ``FaceAugment``, ``VolumeAugment`` have it; a user's callable may too).
    It promises no state changed per call that another thread could see half-done, and work
    that mostly releases the GIL (NumPy, OpenCV, torch); ``make_loader(worker_kind="auto")``
    keeps threads only for callables that declare it."""
    return getattr(function, "thread_safe", False) is True


def _torch_dtypes() -> dict[np.dtype, torch.dtype]:
    """The NumPy dtypes of fixed-shape columns that this torch has a tensor dtype for."""
    found = {}
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32",
                 "uint64", "float16", "float32", "float64", "complex64", "complex128"):
        try:
            found[np.dtype(name)] = torch.from_numpy(np.empty(0, name)).dtype
        except TypeError:  # e.g. unsigned 16-64 bit before torch 2.3
            pass
    return found


_TORCH_DTYPES = _torch_dtypes()


def pinned_empty(shape: tuple[int, ...], dtype: Any, pin_memory: bool = True) -> np.ndarray:
    """An uninitialised array in page-locked memory from torch's caching host allocator, for a
    batch to be read into where the copy to the GPU will read it (``pin_memory=False``: the
    same tensor-backed array, unpinned). Dtypes torch has no tensor for (strings, byte orders
    not native): ``np.empty``."""
    torch_dtype = _TORCH_DTYPES.get(np.dtype(dtype))
    if torch_dtype is None:
        return np.empty(shape, dtype)
    return torch.empty(shape, dtype=torch_dtype, pin_memory=pin_memory).numpy()


class _Indices(list):
    """A batch's indices as a list that takes attributes (a plain list takes none): the hints an
    ``IndexBatch`` carries, for indices that came as a plain list or were mapped through a
    ``Subset``."""

    # (declared only: an attribute not set stays absent, as readers' getattr defaults expect)
    array: np.ndarray
    storage_order: bool
    ahead: list[int] | None
    empty: Callable[..., np.ndarray] | None


def _allocating(indices: Any, empty: Callable[..., np.ndarray]) -> Any:
    """``indices`` with ``empty`` attached, as ``make_loader``'s ``IndexBatch`` carries
    ``ahead`` (``CachedDataset.__getitems__`` makes its arrays with it)."""
    try:
        indices.empty = empty
    except AttributeError:  # a list or tuple of a plain BatchSampler
        indices = _Indices(indices)
        indices.empty = empty
    return indices


def _through_subsets(dataset: Any, indices: Any) -> tuple[Any, Any]:
    """The dataset beneath ``dataset``'s ``Subset``s, and ``indices`` mapped onto it with the
    batch's hints kept (``IndexBatch``: ``ahead``, mapped too, ``storage_order``, ``empty``).
    torch's ``Subset.__getitems__`` hands a plain list on, which drops them: the trainers'
    training rows (a ``Subset``) were read without read-ahead, storage order or pinned arrays.
    A ``Subset`` subclass with its own ``__getitems__`` is left to do as it says."""
    while (isinstance(dataset, Subset) and type(dataset).__getitems__ is Subset.__getitems__
           and callable(getattr(dataset.dataset, "__getitems__", None))):
        rows = dataset.indices
        mapped = _Indices(int(rows[i]) for i in indices)
        mapped.array = np.asarray(mapped, dtype=np.int64)
        mapped.storage_order = getattr(indices, "storage_order", False)
        ahead = getattr(indices, "ahead", None)
        mapped.ahead = None if ahead is None else [int(rows[i]) for i in ahead]
        mapped.empty = getattr(indices, "empty", None)
        dataset, indices = dataset.dataset, mapped
    return dataset, indices


def _pin(batch: Any) -> Any:
    """The batch with its tensors in page-locked memory (a thread may pin: the copy to the GPU
    is then asynchronous), leaving other values, and tensors already pinned, as they are."""
    if isinstance(batch, torch.Tensor):  # one a batch_transform put on the GPU stays there
        keep = batch.device.type != "cpu" or batch.is_pinned()
        return batch if keep else batch.pin_memory()
    if isinstance(batch, dict):
        return {name: _pin(value) for name, value in batch.items()}
    if isinstance(batch, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in batch):
        return type(batch)(_pin(value) for value in batch)
    return batch


class ThreadedBatches:
    """The batches of ``batch_sampler`` read by ``threads`` threads of this process, in order.

    Args:
        dataset: a map-style dataset whose ``__getitems__`` (else ``__getitem__`` per index)
            may run in several threads at once (``CachedDataset`` guards its own state and
            decodes outside its lock).
        batch_sampler: yields each batch's indices (``ReadAheadBatches``).
        collate_fn: turns what ``__getitems__`` returns into the batch.
        threads: threads reading batches; 0: each batch is read by the thread iterating,
            when it asks for it (nothing is read ahead).
        prefetch: batches in flight per thread (at least 1).
        pin_memory: pin every tensor of each batch (CUDA only: pinning fails without it); with
            threads the dataset reads each batch straight into pinned memory
            (``pinned_empty``); the loop's own thread (``threads=0``) pins after reading.
        batch_transform: applied to each collated batch in the reading thread (a batched
            augmentation); it must be safe to call from several threads at once.
    """

    def __init__(self, dataset: Any, batch_sampler: Iterable[Any],
                 collate_fn: Callable[[Any], Any], threads: int, prefetch: int = 2,
                 pin_memory: bool = False,
                 batch_transform: Callable[[Any], Any] | None = None) -> None:
        if threads < 0 or prefetch < 1:
            raise ValueError(f"threads must be at least 0 and prefetch at least 1, not "
                             f"{threads} and {prefetch}")
        self.dataset, self.batch_sampler, self.collate_fn = dataset, batch_sampler, collate_fn
        self.threads, self.prefetch, self.pin_memory = threads, prefetch, pin_memory
        self.batch_transform = batch_transform
        # the arrays each batch is read into: pinned by the dataset itself (looked up here, so a
        # test can stand in for pinned_empty)
        self._empty = pinned_empty if pin_memory and threads > 0 else None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @property
    def batch_size(self) -> int | None:
        return getattr(self.batch_sampler, "batch_size", None)

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def _load(self, indices: Any) -> Any:
        dataset, indices = _through_subsets(self.dataset, indices)
        if self._empty is not None:
            indices = _allocating(indices, self._empty)
        getitems = getattr(dataset, "__getitems__", None)
        samples = getitems(indices) if getitems else [dataset[i] for i in indices]
        batch = self.collate_fn(samples)
        if self.batch_transform is not None:
            batch = self.batch_transform(batch)
        return _pin(batch) if self.pin_memory else batch

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:  # one pool for every epoch (threads started once, as persistent workers)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="precache-loader")
            return self._pool

    def __iter__(self) -> Iterator[Any]:
        if self.threads == 0:
            return map(self._load, self.batch_sampler)
        return _Epoch(self, self._executor())

    def close(self) -> None:
        """Stop the threads (after the batches they are reading). Iterating again restarts them."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        # not while the interpreter exits: the modules shutdown uses may be gone (a traceback at
        # the end of every script that did not close its loader), and concurrent.futures joins
        # its threads itself then
        if pool is not None and not sys.is_finalizing():
            pool.shutdown(wait=False, cancel_futures=True)


class _Epoch:
    """One pass over the batch sampler: its first batches are submitted when it is created (so
    ``CacheLoader.start_epoch`` starts reading before the loop asks), the rest as earlier ones
    are taken."""

    def __init__(self, owner: ThreadedBatches, pool: ThreadPoolExecutor) -> None:
        self._owner, self._pool = owner, pool
        self._indices = iter(owner.batch_sampler)
        self._pending: deque[Future[Any]] = deque()
        for _ in range(owner.threads * owner.prefetch):
            if not self._submit():
                break

    def _submit(self) -> bool:
        indices = next(self._indices, None)
        if indices is None:
            return False
        self._pending.append(self._pool.submit(self._owner._load, indices))
        return True

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if not self._pending:
            raise StopIteration
        future = self._pending.popleft()
        self._submit()
        try:
            return future.result()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Drop the batches not yet taken (those being read finish and are discarded)."""
        for future in self._pending:
            future.cancel()
        self._pending.clear()

    def __del__(self) -> None:
        self.close()
