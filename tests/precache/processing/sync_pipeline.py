"""A test pipeline that lets a test synchronise with a run's processes on events instead of sleeps:
the counting pipeline's ops, with ``Sync`` after the op that logs each call. Environment variables
set it (so runs with and without it have one fingerprint and reuse each other's shards; Ray passes
``PRECACHE_*`` variables on to its actors, spawned workers inherit them):

- ``PRECACHE_MEET=N``: each process waits at its first sample until N processes have logged a
  call to ``$PRECACHE_CALL_LOG``, so that N worker processes each provably run a task, however
  slowly the others start;
- ``PRECACHE_GATE=PATH``: each process waits before its sample number ``PRECACHE_GATE_AFTER + 1``
  (default: its first) until the file ``PATH`` exists, so that a run is provably still going, with
  exactly the tasks before that point committed.

A wait longer than ``TIMEOUT_S`` fails the sample: a test that forgot to open a gate fails, and
does not hang.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from precache.processing.ops import Op, Sample
from precache.processing.pipeline import Pipeline
from tests.counting_pipeline import make_ops as counting_ops
from tests.counting_pipeline import pipeline as counting

TIMEOUT_S = 60.0

# `python -c RUN_WAITING SYNC_PIPELINE INPUT OUTPUT`: a run that waits for the cache's lock
# (precache.run(..., wait=True)), for tests that start two runs at once; prints its summary.
SYNC_PIPELINE = __file__
RUN_WAITING = """
import sys
import precache
summary = precache.run(sys.argv[1], sys.argv[2], sys.argv[3], workers=1, progress=False,
                       wait=True, log=lambda line: None)
print(summary.computed, summary.published, summary.generation, flush=True)
"""


def logged_pids(log: str) -> set[str]:
    """The processes that logged a call to the counting pipeline's log."""
    try:
        with open(log) as f:
            return {line.split(" ", 1)[0] for line in f if line.strip()}
    except FileNotFoundError:
        return set()


def wait_for(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"sync: waited {TIMEOUT_S:.0f} s for {what}")
        time.sleep(0.01)


class Sync(Op):
    """Wait for the other processes or for a file, as the environment says (see the module)."""

    name = "sync"
    version = "1"

    def __init__(self) -> None:
        self.calls = 0  # in this process: ops are set up once per worker process

    @property
    def params(self) -> dict[str, Any]:
        return {}

    def __call__(self, sample: Sample) -> Sample:
        self.calls += 1
        meet = int(os.environ.get("PRECACHE_MEET") or 0)
        if meet > 1 and self.calls == 1:
            log = os.environ["PRECACHE_CALL_LOG"]  # PRECACHE_MEET needs the call log
            wait_for(f"{meet} processes in {log}", lambda: len(logged_pids(log)) >= meet)
        gate = os.environ.get("PRECACHE_GATE")
        if gate and self.calls > int(os.environ.get("PRECACHE_GATE_AFTER") or 0):
            wait_for(f"the file {gate}", lambda: os.path.exists(gate))
        return sample


def make_ops(size: int = 16, delay: float = 0.0, version: str = "1") -> list[Op]:
    count, *rest = counting_ops(size=size, delay=delay, version=version)
    return [count, Sync(), *rest]


pipeline = Pipeline(name="sync", make_ops=make_ops, extensions=counting.extensions,
                    description="the counting pipeline, with waits a test controls")
