"""Where a stage-1 run's time goes: each stage's seconds summed over every task and worker.

Every worker runs every stage of an input (read, each op, store), so the stage with the largest
share of the time is the one that bounds the run; its share is what a faster form of it (a
faster detector, a GPU) can win at most. The progress bar names that stage as the run goes and
the run's summary lists them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["StageTimes", "stage_names", "READ", "STORE"]

READ, STORE = "read", "store"
"""The stages before and after the ops: reading an input's bytes (and hashing them), and
checking rows and writing the shard."""


def stage_names(op_names: Sequence[str]) -> list[str]:
    """Each op's stage, by position: its name, or where an earlier stage has that name (two
    ``crop_face`` ops, an op named ``read``), the name with ``#2``, ``#3``...
    (``crop_face#2``), so every op has its own line and two ops of one name do not share one."""
    taken, stages = {READ, STORE}, []
    for name in op_names:
        stage, k = name, 1
        while stage in taken:
            k += 1
            stage = f"{name}#{k}"
        taken.add(stage)
        stages.append(stage)
    return stages


class StageTimes:
    """Seconds per stage of the tasks finished so far, and the inputs they covered."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.inputs = 0
        self.device: Any = None  # the device stage's latest counters (``DeviceStats``)

    def add(self, seconds: Mapping[str, float], inputs: int, device: Any = None) -> None:
        """Add one finished task's ``stage_seconds`` (``TaskResult``) over ``inputs`` inputs,
        and the device stage's counters when it had one."""
        for stage, spent in seconds.items():
            self.seconds[stage] = self.seconds.get(stage, 0.0) + spent
        self.inputs += inputs
        if device is not None:
            self.device = device

    def slowest(self) -> str:
        """The stage with the largest share, for the progress bar: ``"detect_faces 81%"``;
        empty before any task finished."""
        total = sum(self.seconds.values())
        if not total:
            return ""
        stage = max(self.seconds, key=lambda s: self.seconds[s])
        slowest = f"{stage} {100 * self.seconds[stage] / total:.0f}%"
        return slowest if self.device is None else f"{slowest}, {self.device.describe()}"

    def describe(self) -> str:
        """Each stage's seconds per input, in one worker, and its share of the run's time, in
        pipeline order: ``"read 0.2 ms (0%), decode_image 8.1 ms (9%), ..."``."""
        total = sum(self.seconds.values())
        if not total or not self.inputs:
            return ""
        line = ", ".join(f"{stage} {1000 * spent / self.inputs:.1f} ms ({100 * spent / total:.0f}%)"
                         for stage, spent in self.seconds.items())
        return line if self.device is None else f"{line}; {self.device.describe()}"
