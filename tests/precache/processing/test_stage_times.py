"""Where a stage-1 run's time goes: every stage's seconds reach the summary, in pipeline order,
from the workers that ran them (worker processes included), and the CLI prints them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import precache
from precache.processing.ops import FunctionOp
from precache.processing.pipeline import Pipeline
from precache.processing.stage_times import StageTimes, stage_names

SLEEP_S = 0.02


def wait_a_little(sample: dict) -> dict:
    time.sleep(SLEEP_S)  # the stage that bounds this pipeline
    sample["size"] = len(sample["data"])
    return sample


def keep_going(sample: dict) -> dict:
    sample["double"] = 2 * sample["size"]
    return sample


def make_ops() -> list:
    return [FunctionOp(wait_a_little), FunctionOp(keep_going)]


pipeline = Pipeline(name="timed", make_ops=make_ops, extensions=(".txt",),
                    description="a slow op, then a fast one")
PIPELINE = "tests.precache.processing.test_stage_times:pipeline"


def _inputs(folder: Path, count: int) -> Path:
    folder.mkdir()
    for i in range(count):
        (folder / f"{i:03d}.txt").write_text("x" * (i + 1))
    return folder


def test_each_stage_is_timed_in_order_and_the_slowest_is_named(tmp_path: Path) -> None:
    inputs = _inputs(tmp_path / "in", 6)
    summary = precache.run(PIPELINE, inputs, tmp_path / "cache", workers=2,
                           shard_rows=2, progress=False, log=lambda *_: None)
    stages = summary.stages
    assert list(stages.seconds) == ["read", "wait_a_little", "keep_going", "store"]
    assert stages.inputs == 6
    # every input slept in the first op, whichever process ran it
    assert stages.seconds["wait_a_little"] >= 6 * SLEEP_S
    assert stages.describe().startswith("read ")


def make_twice() -> list:
    return [FunctionOp(keep_going_first), FunctionOp(wait_a_little), FunctionOp(wait_a_little)]


def keep_going_first(sample: dict) -> dict:
    sample["size"] = len(sample["data"])
    return sample


twice = Pipeline(name="timed-twice", make_ops=make_twice, extensions=(".txt",),
                 description="one slow op, twice")


def test_two_ops_of_one_name_each_have_their_own_line(tmp_path: Path) -> None:
    # stages are kept by position: the second wait_a_little is not added to the first's
    inputs = _inputs(tmp_path / "in", 3)
    summary = precache.run("tests.precache.processing.test_stage_times:twice", inputs,
                           tmp_path / "cache", workers=1, progress=False, log=lambda *_: None)
    seconds = summary.stages.seconds
    assert list(seconds) == ["read", "keep_going_first", "wait_a_little", "wait_a_little#2",
                             "store"]
    assert seconds["wait_a_little"] >= 3 * SLEEP_S and seconds["wait_a_little#2"] >= 3 * SLEEP_S
    assert stage_names(["crop", "read", "crop", "crop#2", "crop"]) == [
        "crop", "read#2", "crop#2", "crop#2#2", "crop#3"]


def test_the_shares_and_times_per_input_add_up() -> None:
    stages = StageTimes()
    stages.add({"read": 0.125, "detect": 0.5}, inputs=2)
    stages.add({"read": 0.125, "detect": 1.75, "store": 0.0}, inputs=2)
    assert stages.seconds == {"read": 0.25, "detect": 2.25, "store": 0.0}
    assert stages.slowest() == "detect 90%"
    assert stages.describe() == "read 62.5 ms (10%), detect 562.5 ms (90%), store 0.0 ms (0%)"
    assert StageTimes().slowest() == "" and StageTimes().describe() == ""


def test_a_run_with_nothing_to_compute_has_no_stage_times(tmp_path: Path) -> None:
    inputs = _inputs(tmp_path / "in", 2)
    quiet = {"progress": False, "log": lambda *_: None, "workers": 1}
    precache.run(PIPELINE, inputs, tmp_path / "cache", **quiet)
    again = precache.run(PIPELINE, inputs, tmp_path / "cache", **quiet)
    assert again.stages.inputs == 0 and again.stages.describe() == ""


def test_the_cli_prints_the_time_per_input_of_each_stage(tmp_path: Path) -> None:
    inputs = _inputs(tmp_path / "in", 2)
    done = subprocess.run([sys.executable, "-m", "precache", "run", PIPELINE,
                           "-i", str(inputs), "-o", str(tmp_path / "cache"), "--workers", "1"],
                          capture_output=True, text=True, check=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("time per input"))
    assert "wait_a_little" in line and "keep_going" in line and "store" in line
