"""A test pipeline for the Ray executor: the counting pipeline's ops plus an op that can kill the
worker process running it, and whose setup can fail.

``die_on=KEY`` sends SIGKILL to the worker's own process when it reaches input ``KEY``, mid-task,
as the kernel's OOM killer would: only the first time if ``marker`` names a file (created at that
death), every time if ``marker`` is empty. Every call appends ``<pid> <parent pid> <key>`` to
``$PRECACHE_WHERE_LOG``: a Ray worker's parent is its node's raylet, which tells which node ran it.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from precache.processing.ops import Op, Sample
from precache.processing.pipeline import Pipeline
from tests.counting_pipeline import append_line
from tests.counting_pipeline import make_ops as counting_ops
from tests.counting_pipeline import pipeline as counting


class DieOn(Op):
    """Log where each sample runs; kill this process at input ``die_on``."""

    name = "die_on"
    version = "1"

    def __init__(self, *, die_on: str = "", marker: str = "", fail_setup: bool = False) -> None:
        self.die_on, self.marker, self.fail_setup = die_on, marker, fail_setup

    @property
    def params(self) -> dict[str, Any]:
        return {"die_on": self.die_on, "marker": self.marker, "fail_setup": self.fail_setup}

    def setup(self) -> None:
        if self.fail_setup:
            raise RuntimeError("die_on: setup failed on purpose")

    def __call__(self, sample: Sample) -> Sample:
        log = os.environ.get("PRECACHE_WHERE_LOG")
        if log:
            append_line(log, f"{os.getpid()} {os.getppid()} {sample['key']}")
        if sample["key"] == self.die_on and not (self.marker and os.path.exists(self.marker)):
            if self.marker:
                open(self.marker, "x").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return sample


def make_ops(delay: float = 0.0, die_on: str = "", marker: str = "",
             fail_setup: bool = False) -> list[Op]:
    count, *rest = counting_ops(delay=delay)
    return [count, DieOn(die_on=die_on, marker=marker, fail_setup=fail_setup), *rest]


pipeline = Pipeline(name="dying", make_ops=make_ops, extensions=counting.extensions,
                    description="the counting pipeline, with a worker that can die")
