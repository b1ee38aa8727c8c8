"""A test pipeline: the images ops plus an op that logs every call, to count recomputation.

Every call appends ``<pid> <key>`` to the file named by ``PRECACHE_CALL_LOG`` (O_APPEND writes
of one short line are atomic, so worker processes can share it). ``delay`` slows each sample so a
test can kill a run part-way.
"""

from __future__ import annotations

import os
import time
from typing import Any

from precache.processing.ops import IMAGE_EXTENSIONS, DecodeImage, Op, ResizeCenterCrop, Sample
from precache.processing.pipeline import Pipeline


def append_line(log: str, line: str) -> None:
    """Append ``line`` to the file ``log`` in one O_APPEND write, which processes may share."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


class CountCalls(Op):
    """Log the sample's key to ``$PRECACHE_CALL_LOG`` and sleep ``delay`` seconds."""

    name = "count_calls"
    version = "1"

    def __init__(self, *, delay: float = 0.0) -> None:
        self.delay = delay

    @property
    def params(self) -> dict[str, Any]:
        return {"delay": self.delay}

    def __call__(self, sample: Sample) -> Sample:
        log = os.environ.get("PRECACHE_CALL_LOG")
        if log:
            append_line(log, f"{os.getpid()} {sample['key']}")
        if self.delay:
            time.sleep(self.delay)
        return sample


def make_ops(size: int = 16, delay: float = 0.0, version: str = "1") -> list[Op]:
    counter = CountCalls(delay=delay)
    counter.version = version  # type: ignore[misc]  # lets a test bump an op's version
    return [counter, DecodeImage(), ResizeCenterCrop(size=size)]


pipeline = Pipeline(name="counting", make_ops=make_ops, extensions=IMAGE_EXTENSIONS,
                    description="images at 16 px, logging every op call")
