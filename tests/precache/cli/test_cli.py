"""The ``precache`` command as a user meets it: real subprocesses, exit codes, messages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from precache import Cache
from tests.helpers import REPO, precache_cli, read_calls, wait_until

SYNC_PIPELINE = str(REPO / "tests" / "precache" / "processing" / "sync_pipeline.py")


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int,
                          fragment: str) -> None:
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("precache: error:"), result.stderr
    assert fragment in lines[0]


def test_run_prints_counts_and_inspect_and_verify_agree(photos: Path, tmp_path: Path) -> None:
    out = tmp_path / "cache"
    result = precache_cli("run", "images", "-i", str(photos), "-o", str(out), "-q",
                          "--set", "size=32", "--shard-rows", "10")
    assert result.returncode == 0, result.stderr
    assert "24 inputs -> 24 ok, 0 skipped, 0 failed" in result.stdout
    assert "samples/s" in result.stdout and "rows" in result.stdout
    described = json.loads(precache_cli("inspect", str(out), "--json").stdout)
    assert described["counts"]["ok"] == 24 and len(described["shards"]) == 3
    assert described["schema"]["image"] == {"kind": "ndarray", "dtype": "uint8",
                                            "shape": [32, 32, 3]}
    ops = {op["name"]: op for op in described["ops"]}
    assert ops["resize_center_crop"]["params"] == {"size": 32}
    assert ops["labels"]["params"] == {"labels": "folder"}
    text = precache_cli("inspect", str(out)).stdout
    assert "fingerprint" in text and "uint8[32, 32, 3]" in text
    ok = precache_cli("verify", str(out))
    assert ok.returncode == 0 and "verified" in ok.stdout


def test_verify_names_each_damaged_shard(photos: Path, tmp_path: Path) -> None:
    out = tmp_path / "cache"
    precache_cli("run", "images", "-i", str(photos), "-o", str(out), "-q", "--shard-rows", "10")
    shards = [out / s.path for s in Cache(out).manifest.shards]
    data = bytearray(shards[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    shards[0].write_bytes(bytes(data))
    shards[2].write_bytes(shards[2].read_bytes()[:100])
    result = precache_cli("verify", str(out))
    assert result.returncode == 1
    assert shards[0].name in result.stderr and "checksum" in result.stderr
    assert shards[2].name in result.stderr and "truncated" in result.stderr
    assert shards[1].name not in result.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["run", "images", "-i", "/no/such/folder", "-o", "OUT"], "does not exist"),
        (["run", "nosuchpipeline", "-i", "PHOTOS", "-o", "OUT"], "unknown pipeline 'nosuchpipeline'"),
        (["run", "images", "-i", "PHOTOS", "-o", "OUT", "--set", "size=big"], "expected a value of type int"),
        (["run", "images", "-i", "PHOTOS", "-o", "OUT", "--set", "colour=red"], "no parameter 'colour'"),
        (["run", "images", "-i", "PHOTOS", "-o", "OUT", "--set", "size"], "expected key=value"),
        (["run", "images", "-i", "PHOTOS", "-o", "OUT", "--set", "size=-3"], "size must be positive"),
        (["run", "images", "-i", "PHOTOS", "-o", "OUT", "--workers", "0"], "--workers"),
        (["inspect", "PHOTOS"], "not a precache cache"),
    ],
)
def test_user_errors_print_one_line_and_exit_2_or_1(photos: Path, tmp_path: Path,
                                                    args: list[str], fragment: str) -> None:
    args = [a.replace("PHOTOS", str(photos)).replace("OUT", str(tmp_path / "out")) for a in args]
    result = precache_cli(*args)
    assert_one_line_error(result, 1 if args[0] == "inspect" else 2, fragment)


def test_help_lists_pipelines_and_their_parameters() -> None:
    result = precache_cli("run", "--help")
    assert result.returncode == 0
    assert "images" in result.stdout and "size=128" in result.stdout
    assert "--shard-rows" in result.stdout and "--fail-fast" in result.stdout


def test_fail_fast_exits_1_naming_the_file(tmp_path: Path, photos: Path) -> None:
    (photos / "broken.jpg").write_text("not a jpeg")
    result = precache_cli("run", "images", "-i", str(photos), "-o", str(tmp_path / "c"),
                          "-q", "--fail-fast")
    assert result.returncode == 1
    assert "broken.jpg" in result.stderr and "not a recognised image" in result.stderr
    result = precache_cli("run", "images", "-i", str(photos), "-o", str(tmp_path / "d"), "-q")
    assert result.returncode == 0 and "1 failed" in result.stdout and "broken.jpg" in result.stdout


def test_many_failures_point_to_the_errors_table(tmp_path: Path, photos: Path) -> None:
    for n in range(7):
        (photos / f"broken{n}.jpg").write_text("not a jpeg")
    out = tmp_path / "c"
    result = precache_cli("run", "images", "-i", str(photos), "-o", str(out), "-q")
    assert result.returncode == 0 and "7 failed" in result.stdout
    assert result.stdout.count("failed broken") == 5  # the first five, then where the rest are
    assert f"... 2 more in {out}/errors-00001.parquet (or: precache inspect {out})" in result.stdout
    assert Cache(out).read_errors().num_rows == 7


def test_second_writer_is_refused_and_the_first_finishes(photos: Path, tmp_path: Path,
                                                         call_log: Path) -> None:
    out, gate = tmp_path / "cache", tmp_path / "gate"
    # The first run waits at its first sample until the gate file exists: it provably holds the
    # cache while the second one tries.
    first = subprocess.Popen(
        [sys.executable, "-m", "precache", "run", SYNC_PIPELINE, "-i", str(photos), "-o",
         str(out), "-q", "--workers", "1", "--shard-rows", "4"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PRECACHE_GATE=str(gate)))
    try:
        wait_until(lambda: bool(read_calls(call_log)), "the first run's first sample",
                   proc=first)
        second = precache_cli("run", SYNC_PIPELINE, "-i", str(photos), "-o", str(out), "-q")
        assert_one_line_error(second, 1, "being written by another precache run")
        assert f"pid {first.pid}" in second.stderr
        assert len(read_calls(call_log)) == 4  # the second computed nothing; the first waits
    finally:
        gate.touch()
    assert first.wait(timeout=120) == 0, first.stderr.read() if first.stderr else ""
    assert precache_cli("verify", str(out)).returncode == 0
    assert Cache(out).manifest.counts["ok"] == 24


@pytest.mark.parametrize(("args", "code", "fragment"), [
    (["--version"], 0, "precache 0."),
    (["run", "--help"], 0, "size=128"),
    (["run", "images", "-i", "/no/such/folder", "-o", "OUT"], 2, "does not exist"),
])
def test_module_and_console_script_agree(args: list[str], code: int, fragment: str,
                                         tmp_path: Path) -> None:
    """``precache ...`` and ``python -m precache ...``: the same exit code and the same output."""
    args = [a.replace("OUT", str(tmp_path / "out")) for a in args]
    script = Path(sys.executable).with_name("precache")
    assert script.is_file(), f"no console script beside {sys.executable}"
    by_script = subprocess.run([str(script), *args], capture_output=True, text=True, cwd=REPO,
                               timeout=120)
    by_module = precache_cli(*args)
    assert (by_script.returncode, by_script.stdout, by_script.stderr) == \
        (by_module.returncode, by_module.stdout, by_module.stderr)
    assert by_script.returncode == code and fragment in by_script.stdout + by_script.stderr


def sigint_state(pid: int) -> str:
    """How process ``pid`` handles SIGINT now: "ignored", "caught" or "default"."""
    status = dict(line.split(":\t", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    bit = 1 << (signal.SIGINT - 1)
    if int(status["SigIgn"], 16) & bit:
        return "ignored"
    return "caught" if int(status["SigCgt"], 16) & bit else "default"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_exits_130_with_one_line_and_the_rerun_resumes(photos: Path,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "cache"
    args = ["run", SYNC_PIPELINE, "-i", str(photos), "-o", str(out), "-q", "--workers", "2",
            "--shard-rows", "2"]
    # Each process commits its first task (2 inputs), then waits for a gate that never opens: the
    # run is provably still going when the signal comes, with some work to reuse.
    gated = dict(os.environ, PRECACHE_GATE=str(tmp_path / "never"), PRECACHE_GATE_AFTER="2")
    # The run must not inherit "ignore SIGINT": a shell starts background jobs (`cmd &`, nohup,
    # some CI runners) with SIGINT ignored, and Python then keeps ignoring it, as it should.
    proc = subprocess.Popen([sys.executable, "-m", "precache", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_sigint, env=gated)
    # Wait (polling: only the deadline guards against a hang) until a task has committed its
    # shard, so the workers were started, and the run catches SIGINT again: it ignores SIGINT
    # while it starts its workers, so that they inherit "ignore".
    try:
        wait_until(lambda: bool(list((out / "journal").glob("part-*.json")))
                   and sigint_state(proc.pid) == "caught",
                   "a committed shard and SIGINT caught again", proc=proc)
        masks = [line for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                 if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]  # for the message below
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the test failed: the run would wait
            proc.wait()
    assert proc.returncode == 130, (stderr, masks, signal.getsignal(signal.SIGINT))
    assert "Traceback" not in stderr and "interrupted" in stderr and "re-run" in stderr
    rerun = precache_cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert "24 ok" in rerun.stdout and "reused 0" not in rerun.stdout
