"""The arrays a batch is gathered into: on a cache line, and a large one off the main thread (a
thread worker's) made from the memory of an earlier one only once nothing refers to that any
more (an array, a view, a tensor)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from precache.loading._engine.batch_arrays import REUSED_BYTES, batch_empty

SHAPE = (4, REUSED_BYTES // 4)  # uint8: exactly REUSED_BYTES


def test_memory_is_reused_only_once_nothing_refers_to_it():
    with ThreadPoolExecutor(1) as worker:  # (a thread worker's arrays)
        worker.submit(reused_only_once_free).result()


def reused_only_once_free() -> None:
    first = batch_empty(SHAPE, np.uint8)
    first[:] = 1
    address = first.ctypes.data
    assert address % 64 == 0 and first.flags.c_contiguous and first.flags.writeable

    second = batch_empty(SHAPE, np.uint8)  # the first is held: new memory
    second[:] = 2
    assert second.ctypes.data != address and (first == 1).all()

    tensor = torch.from_numpy(first[1:3])  # a tensor of a view holds the memory too
    del first
    third = batch_empty(SHAPE, np.uint8)
    third[:] = 3
    assert third.ctypes.data != address and (tensor == 1).all()

    del tensor
    fourth = batch_empty(SHAPE, np.uint8)  # nothing refers to the first's memory now
    assert fourth.ctypes.data == address
    assert batch_empty((2, *SHAPE), np.uint8).ctypes.data != address  # (another size)
    del second, third, fourth


def test_other_dtypes_and_shapes_are_made_as_asked():
    for shape, dtype in [((REUSED_BYTES // 8,), np.float64), ((3, 5), np.int16),
                         ((0, 7), np.uint8), ((2, 2), object)]:
        array = batch_empty(shape, dtype)
        assert array.shape == shape and array.dtype == np.dtype(dtype)
        assert array.flags.c_contiguous and (array.size == 0 or dtype is object
                                             or array.ctypes.data % 64 == 0)
    assert batch_empty((2, 2), object).tolist() == [[None, None]] * 2
