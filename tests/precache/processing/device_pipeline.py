"""A test pipeline with a device op: ``on_device`` declares ``device_stage`` and stamps each
sample with the process that ran it (``device_pid``) and the GPU that process was bound to
(``gpu``: its ``CUDA_VISIBLE_DEVICES``, ``""`` where unset); ``on_worker`` does the same after it
(``worker_pid``). ``device`` is what the op says it runs on (``cpu`` by default: one device
process; ``cuda``: one per GPU the run sees), though it always runs on the CPU; each process
that sets it up is logged to ``$PRECACHE_DEVICE_SETUP`` as ``pid gpu``. Inputs whose text starts with ``skip`` are skipped by the device op, ``fail``
raise ``ValueError`` there, and ``die`` kill the process running it (SIGKILL, as an OOM kill)
unless the file ``marker`` exists (created first: it dies once)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import numpy as np

from precache.loading import CachedDataset
from precache.processing.ops import Op, Sample, Skip
from precache.processing.pipeline import Pipeline

PIPELINE = "tests.precache.processing.device_pipeline:pipeline"
QUIET = {"progress": False, "log": lambda *_: None}


class OnDevice(Op):
    name = "on_device"
    version = "1"
    batched = True

    @property
    def device_stage(self) -> bool:
        """True; each process that asks is logged to ``$PRECACHE_DEVICE_ASKED`` (the run must
        decide once: a real op's answer may mean asking torch for a GPU)."""
        log = os.environ.get("PRECACHE_DEVICE_ASKED")
        if log:
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\n")
        return True

    def __init__(self, *, marker: str = "", device: str = "cpu") -> None:
        self.marker, self.device = marker, device

    @property
    def params(self) -> dict[str, Any]:
        return {"marker": self.marker}

    def setup(self) -> None:
        log = os.environ.get("PRECACHE_DEVICE_SETUP")
        if log:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {_gpu()}\n")

    def call_batch(self, samples: list[Sample]) -> list[Any]:
        results: list[Any] = []
        for sample in samples:
            text = sample["text"]
            if text.startswith("die") and self.marker and not Path(self.marker).exists():
                Path(self.marker).touch()
                os.kill(os.getpid(), signal.SIGKILL)
            if text.startswith("skip"):
                results.append(Skip("told to skip"))
            elif text.startswith("fail"):
                results.append(ValueError(f"cannot take {sample['key']}"))
            elif text.startswith("lambda"):  # a result that cannot be pickled back
                results.append(dict(sample, device_pid=np.int64(os.getpid()),
                                    value=np.float32(len(text)), fn=lambda: None))
            else:
                results.append(dict(sample, device_pid=np.int64(os.getpid()),
                                    value=np.float32(len(text)), gpu=_gpu()))
        return results


def _gpu() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "")


class OnWorker(Op):
    name = "on_worker"
    version = "1"

    def __call__(self, sample: Sample) -> Sample:
        return dict(sample, worker_pid=np.int64(os.getpid()), has_data="data" in sample)


class Decode(Op):
    name = "decode"
    version = "1"

    def __call__(self, sample: Sample) -> Sample:
        text = sample["data"].decode()
        if text.startswith("unsendable"):  # a sample that cannot be pickled to the device
            return dict(sample, text=text, fn=lambda: None)
        return dict(sample, text=text)


def make_ops(marker: str = "", device: str = "cpu") -> list[Op]:
    return [Decode(), OnDevice(marker=marker, device=device), OnWorker()]


pipeline = Pipeline(name="device", make_ops=make_ops, extensions=(".txt",),
                    description="a device op between two worker ops")


def make_inputs(folder: Path) -> Path:
    """10 inputs, one the device op skips and one it fails."""
    folder.mkdir()
    for i in range(10):
        (folder / f"{i:02d}.txt").write_text("x" * (i + 1))
    (folder / "skip.txt").write_text("skip me")
    (folder / "fail.txt").write_text("fail me")
    return folder


def rows_of(cache: Path) -> dict[str, tuple]:
    """key -> (value, text, has_data, device_pid, worker_pid, gpu) of every row, in storage
    order."""
    data = CachedDataset(cache, columns=["key", "value", "text", "has_data", "device_pid",
                                         "worker_pid", "gpu"], resident=False)
    rows = data.__getitems__(list(range(len(data))))
    return {r["key"]: (float(r["value"]), r["text"], bool(r["has_data"]), int(r["device_pid"]),
                       int(r["worker_pid"]), str(r["gpu"])) for r in rows}


def setups(log: Path) -> dict[int, str]:
    """pid -> gpu of each process that set ``on_device`` up (``$PRECACHE_DEVICE_SETUP``)."""
    pairs = [line.split(" ") for line in log.read_text().splitlines()] if log.exists() else []
    return {int(pid): gpu for pid, gpu in pairs}
