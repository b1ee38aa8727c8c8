"""Map-style datasets of the user's own, for ``cache_dataset``'s tests: importable, so spawned
stage-1 workers can unpickle them. ``log``: a file each ``__getitem__`` call appends its index
to (in every process), to count what a run computed."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _note(log: str, index: int) -> None:
    if log:
        with open(log, "a") as f:
            f.write(f"{index} {os.getpid()}\n")


class MixedDataset:
    """Dict samples of every kind ``cache_dataset`` stores; ``dataset[fail_at]`` raises.

    ``child_after``: in the process that made the dataset, every call after that many (the
    probes) waits until a spawned worker has read a sample (a file beside ``log`` says so), so
    a run with 2 workers surely hands samples to the spawned one."""

    def __init__(self, n: int = 24, fail_at: int = -1, log: str = "",
                 child_after: int = -1) -> None:
        self.n, self.fail_at, self.log, self.child_after = n, fail_at, log, child_after
        self._calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        _note(self.log, i)
        self._wait_for_a_child()
        if i == self.fail_at:
            raise ValueError(f"sample {i} is corrupt")
        rng = np.random.default_rng(i)
        return {
            "image": torch.from_numpy(rng.random((3, 8, 8), dtype=np.float32)),  # fixed tensor
            "ids": rng.integers(0, 1000, size=1 + i % 5).astype(np.int32),  # varying 1-D
            "patch": rng.random((2, 1 + i % 3)).astype(np.float32),  # varying 2-D
            "feat": rng.standard_normal(4),  # fixed float64
            "label": i % 3,
            "weight": i / 2,
            "flag": i % 2 == 0,
            "np_label": np.int16(i),
            "t0": torch.tensor(i * 1.5),  # a 0-d tensor
            "name": f"sample-{i}",
            "raw": bytes([i, 255 - i]),
            "key": f"k{i}",  # a field named like precache's own column
            "meta": {"size": [i, i + 1], "source": {"path": f"/data/{i}.png"}},
        }

    def _wait_for_a_child(self) -> None:
        if self.child_after < 0:
            return
        marker = Path(self.log + ".child")
        if multiprocessing.parent_process() is not None:  # a spawned worker
            marker.touch()
            return
        self._calls += 1
        deadline = time.monotonic() + 60
        while self._calls > self.child_after and not marker.exists():
            if time.monotonic() > deadline:
                return  # the test then finds no sample read by a spawned worker
            time.sleep(0.01)


class TupleDataset:
    """``(features, label)`` tuples, as ``TensorDataset`` gives."""

    def __init__(self, n: int = 10) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.arange(4, dtype=torch.int64) * i, i % 2


def same(a: Any, b: Any) -> bool:
    """True when two samples are equal in structure, types, dtypes and values."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    return a == b


def tuples() -> TupleDataset:
    """A Dataset factory, for ``precache run tests.precache.processing.byo_datasets:tuples``."""
    return TupleDataset(n=6)


class FilesDataset:
    """One sample a text file, named by ``files`` (as a folder dataset keeps its list): the
    file's bytes as a uint8 tensor."""

    def __init__(self, files: list[str]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        with open(self.files[i], "rb") as f:
            return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
