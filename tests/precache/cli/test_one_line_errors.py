"""Every failure of the ``precache`` command is one line (exit 2: what was typed; exit 1: the job
cannot go on) in true words: a full disk, a pipeline file that does not load, a ``--set`` value
in the natural syntax, and output piped into ``head``. Real subprocesses.

The disk-full tests make a real small file system: a tmpfs mounted in a private mount namespace
(``unshare -rm``: as root, or as a user where unprivileged user namespaces are allowed). Where
that is refused they skip, and ``test_disk_full_simulated_at_publish`` still checks the message,
with ENOSPC raised by ``open`` of the manifest's temporary file (patched in the subprocess).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from precache import Cache
from tests.helpers import (COUNTING_PIPELINE, REPO, assert_one_line_error, precache_cli,
                           write_photos)

DRIVER = "tests.precache.cli.test_one_line_errors"  # run as a module: the disk-full driver


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    write_photos(folder, 3)
    return folder


@pytest.fixture(scope="module")
def small_cache(photos: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cache") / "cache"
    done = precache_cli("run", COUNTING_PIPELINE, "-i", str(photos), "-o", str(out), "-q",
                        "-j", "1")
    assert done.returncode == 0, done.stderr
    return out


# ---- 8e: a pipeline file that does not load ---------------------------------------------------

@pytest.mark.parametrize(("source", "line", "fragments"), [
    ("from precache import Pipeline\ndef make_ops(:\n    return []\n", 2,
     ["SyntaxError: invalid syntax", "fix the code there"]),
    ("import os\nimport no_such_module_xyz\n", 2,
     ["no module named 'no_such_module_xyz'",
      "install the package that provides 'no_such_module_xyz'"]),
    ("x = 1\nraise RuntimeError('no GPU here')\n", 2,
     ["RuntimeError: no GPU here", "fix the code there"]),
])
def test_a_pipeline_file_that_fails_to_load_is_one_line_naming_file_and_line(
        tmp_path: Path, photos: Path, source: str, line: int, fragments: list[str]) -> None:
    path = tmp_path / "mine.py"
    path.write_text(source)
    result = precache_cli("run", str(path), "-i", str(photos), "-o", str(tmp_path / "out"))
    assert_one_line_error(result, 2, f"pipeline file '{path}', line {line}: ", *fragments)
    assert not (tmp_path / "out").exists()


def test_a_module_it_imports_beside_it_is_named_with_the_fix(tmp_path: Path,
                                                             photos: Path) -> None:
    (tmp_path / "helpers.py").write_text("X = 1\n")
    path = tmp_path / "pipeline.py"
    path.write_text("from helpers import X\n")
    result = precache_cli("run", f"{tmp_path}/", "-i", str(photos), "-o", str(tmp_path / "out"))
    assert_one_line_error(result, 2, f"pipeline file '{path}', line 1: no module named 'helpers'",
                          f"add {tmp_path} to PYTHONPATH")


def test_module_attr_whose_module_fails_names_its_file_and_line(tmp_path: Path,
                                                                photos: Path) -> None:
    (tmp_path / "broken_pipeline_mod.py").write_text("import os\nimport no_such_module_abc\n")
    result = precache_cli("run", "broken_pipeline_mod:pipeline", "-i", str(photos), "-o",
                          str(tmp_path / "out"), env={"PYTHONPATH": str(tmp_path)})
    assert_one_line_error(result, 2, "pipeline 'broken_pipeline_mod:pipeline': "
                          f"{tmp_path / 'broken_pipeline_mod.py'}, line 2: no module named "
                          "'no_such_module_abc'")
    missing = precache_cli("run", "no_such_pipeline_mod:pipeline", "-i", str(photos), "-o",
                           str(tmp_path / "out"))
    assert_one_line_error(missing, 2, "cannot import pipeline 'no_such_pipeline_mod:pipeline': "
                          "No module named 'no_such_pipeline_mod'")


# ---- 9a: --set of a tuple ----------------------------------------------------------------------

TUPLE_PIPELINE = """
from precache import Pipeline
from tests.counting_pipeline import make_ops as counting_ops

def make_ops(size: int = 16, thresholds: tuple = (0.6, 0.7, 0.7)):
    if len(thresholds) != 3:
        raise ValueError(f"thresholds must be three scores, not {thresholds!r}")
    return counting_ops(size=size)

pipeline = Pipeline("tuples", make_ops, (".jpg", ".png"))
"""


def test_set_takes_a_tuple_as_comma_separated_values_and_says_the_syntax_when_wrong(
        tmp_path: Path, photos: Path) -> None:
    path = tmp_path / "tuples.py"
    path.write_text(TUPLE_PIPELINE)
    out = tmp_path / "out"
    done = precache_cli("run", str(path), "-i", str(photos), "-o", str(out), "-q", "-j", "1",
                        "--set", "thresholds=0.5,0.6,0.7", env={"PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert Cache(out).manifest.params["thresholds"] == [0.5, 0.6, 0.7]
    bad = precache_cli("run", str(path), "-i", str(photos), "-o", str(out), "-q",
                       "--set", "thresholds=low,mid,high", env={"PYTHONPATH": str(REPO)})
    assert_one_line_error(bad, 2, "--set 'thresholds=low,mid,high': expected a tuple of float "
                          "as comma-separated items, e.g. --set thresholds=0.6,0.7,0.7 (or JSON: "
                          "--set 'thresholds=[0.6, 0.7, 0.7]')")


# ---- 8d: output into a pipe that closes ---------------------------------------------------------

@pytest.mark.parametrize("args", [["inspect", "CACHE"], ["inspect", "CACHE", "--json"],
                                  ["verify", "CACHE"]])
def test_output_into_a_closed_pipe_exits_quietly(small_cache: Path, args: list[str]) -> None:
    """``precache inspect CACHE | head``: the reader is gone before we write; no traceback."""
    read, write = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "precache",
                             *[a.replace("CACHE", str(small_cache)) for a in args]],
                            stdout=write, stderr=subprocess.PIPE, text=True, cwd=REPO)
    os.close(write)
    os.close(read)  # before the command writes anything: every write fails with EPIPE
    _, stderr = proc.communicate(timeout=120)
    assert stderr == ""
    assert proc.returncode == 141  # 128 + SIGPIPE, as a tool that SIGPIPE stopped


# ---- 8a: a full disk -----------------------------------------------------------------------

def _small_fs_works() -> str | None:
    """Why a private tmpfs cannot be mounted here, or None."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs unshare and mount (util-linux)"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c",
                            "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a private namespace: {probe.stderr.strip()[:200]}"
    return None


@pytest.fixture(scope="module")
def disk_full_runs(photos: Path, tmp_path_factory) -> dict:
    """Runs of the real command on a 1 MiB tmpfs: the results of the driver below."""
    why = _small_fs_works()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("small-fs")
    mount = root / "mnt"
    mount.mkdir()
    done = subprocess.run(["unshare", "-rm", sys.executable, "-m", DRIVER, str(mount),
                           str(photos)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_disk_full_at_start_or_publish_is_one_line_and_the_cache_survives(
        disk_full_runs: dict) -> None:
    """With 0, 1, 2... free pages left, a run that adds one input fails at its start, while its
    worker writes, while it publishes; each time one line (exit 1) naming the cache, the cause,
    what was kept and the fix; the old cache still verifies; with space, a re-run succeeds."""
    cache = disk_full_runs["cache"]
    attempts = disk_full_runs["attempts"]
    assert attempts[-1]["code"] == 0, attempts[-1]  # enough space in the end: it succeeds
    failed = attempts[:-1]
    assert failed, "the run never ran out of space"
    for attempt in failed:
        assert attempt["code"] == 1, attempt
        lines = attempt["stderr"].strip().splitlines()
        assert "Traceback" not in attempt["stderr"], attempt
        assert lines[-1] == (f"precache: error: no space left on device writing {cache}; the "
                             "cache still reads as it did before this run (a run replaces its "
                             "manifest last) and finished shards are kept: free space on that "
                             f"file system (df -h {cache}), then re-run the same command to "
                             "resume"), attempt
        assert len(lines) <= 2 and all(line.startswith("precache: ") for line in lines)
        assert attempt["old_cache_reads"], attempt  # generation 1, 6 rows, verified
    # It ran out at the start (nothing logged) and after its worker's shard was committed (the
    # re-run computed nothing): during publish.
    assert "inputs:" not in failed[0]["stderr"]
    assert any(a["rerun_computed"] == 0 for a in failed)
    assert disk_full_runs["after"] == {"rows": disk_full_runs["before"]["rows"] + 1,
                                       "verified": True}


def test_disk_full_at_the_start_of_a_new_cache_says_how_to_go_on(disk_full_runs: dict) -> None:
    """A new cache on a full disk: one line; where the run left a file that makes the re-run
    refuse the folder, the line names it and says to remove it, and then the re-run succeeds."""
    for fresh in disk_full_runs["fresh"]:
        first = fresh["first"]
        assert first["code"] == 1 and "Traceback" not in first["stderr"], fresh
        line = first["stderr"].strip().splitlines()[-1]
        assert line.startswith("precache: error: no space left on device writing ")
        assert "no cache was published there" in line and "free space on that file system" in line
        if fresh["rerun"]["code"] != 0:
            leftovers = [name for name in fresh["left"] if name != ".lock"]
            assert leftovers and all(name in line for name in leftovers), fresh
            assert "and re-run the same command" in line
            assert fresh["removed"]["code"] == 0, fresh


def test_disk_full_at_the_start_of_a_new_cache_lets_the_plain_rerun_go_on(
        disk_full_runs: dict) -> None:
    for fresh in disk_full_runs["fresh"]:
        assert fresh["rerun"]["code"] == 0, fresh


def test_read_only_file_system_is_one_line(disk_full_runs: dict) -> None:
    ro = disk_full_runs["read_only"]
    assert ro["code"] == 1 and "Traceback" not in ro["stderr"], ro
    assert ro["stderr"].strip().splitlines()[-1].startswith(
        f"precache: error: read-only file system writing {disk_full_runs['cache']}; the cache "
        "still reads as it did before this run")
    assert "write to a writable place (or remount it read-write)" in ro["stderr"]


SIMULATE_ENOSPC = """
import builtins, errno, os, sys
real_open = builtins.open
def full_open(file, mode="r", *args, **kwargs):
    if "w" in mode and os.path.basename(str(file)).startswith(".manifest.json.tmp"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
    return real_open(file, mode, *args, **kwargs)
builtins.open = full_open
from precache.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_disk_full_simulated_at_publish(photos: Path, tmp_path: Path) -> None:
    """Where no small file system can be made: the manifest's write fails with ENOSPC (``open``
    of its temporary file, patched in the subprocess); the same one line, and the old cache
    reads."""
    out = tmp_path / "cache"
    assert precache_cli("run", COUNTING_PIPELINE, "-i", str(photos), "-o", str(out), "-q",
                        "-j", "1").returncode == 0
    (photos / "extra.png").write_bytes((photos / "img0000.png").read_bytes())
    try:
        result = subprocess.run([sys.executable, "-c", SIMULATE_ENOSPC, "run", COUNTING_PIPELINE,
                                 "-i", str(photos), "-o", str(out), "-q", "-j", "1"],
                                capture_output=True, text=True, cwd=REPO, timeout=120)
    finally:
        (photos / "extra.png").unlink()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"precache: error: no space left on device writing {out}; the cache still reads as it "
        "did before this run (a run replaces its manifest last) and finished shards are kept: "
        f"free space on that file system (df -h {out}), then re-run the same command to resume")
    assert Cache(out).manifest.counts["ok"] == 3


# ---- the driver, run inside ``unshare -rm`` ---------------------------------------------------

def _driver(mount: Path, photos: Path) -> dict:
    """Mount a 1 MiB tmpfs at ``mount``; build a cache of ``photos`` there; then, adding one
    input, run again with 0, 1, 2... pages left free until a run succeeds, recording each."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    cache, filler = mount / "cache", mount / "filler"

    def cli(*args: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "precache", *args], capture_output=True,
                              text=True, cwd=REPO, timeout=300)
        return {"code": done.returncode, "stdout": done.stdout, "stderr": done.stderr}

    def fill(free_pages: int) -> None:
        st = os.statvfs(mount)
        with open(filler, "wb") as f:
            f.write(b"\0" * ((st.f_bavail - free_pages) * st.f_frsize))

    def state() -> dict:
        from precache import Cache
        from precache.cache.verify import verify

        opened = Cache(cache)
        return {"rows": opened.manifest.rows, "generation": opened.manifest.generation,
                "verified": not verify(cache)}

    run = ["run", "tests/counting_pipeline.py", "-i", str(photos), "-o", str(cache), "-q",
           "-j", "1"]
    assert cli(*run)["code"] == 0
    before = state()
    extra = photos / "extra.png"
    extra.write_bytes((photos / "img0000.png").read_bytes())
    attempts = []
    try:
        for free_pages in range(32):
            fill(free_pages)
            attempt = cli(*run)
            filler.unlink()
            attempt["free_pages"] = free_pages
            attempts.append(attempt)
            if attempt["code"] == 0:
                break
            attempt["old_cache_reads"] = state() == before
            # what a re-run with space would compute: 0 once the new input's shard is committed
            journal = list((cache / "journal").glob("part-*.json"))
            attempt["rerun_computed"] = 0 if journal else 1
        after = state()

        # A new cache on a full disk (0 or 1 page free: its lock or its marker does not fit),
        # then the re-run with space.
        fresh = []
        for free_pages in range(2):
            out = mount / f"fresh{free_pages}"
            fill(free_pages)
            first = cli("run", "tests/counting_pipeline.py", "-i", str(photos), "-o", str(out),
                        "-q", "-j", "1")
            filler.unlink()
            left = sorted(p.name for p in out.iterdir())
            rerun = cli("run", "tests/counting_pipeline.py", "-i", str(photos), "-o", str(out),
                        "-q", "-j", "1")
            removed = None
            if rerun["code"] != 0:  # do what the message said: remove what the run left
                for name in left:
                    if name != ".lock" and name in first["stderr"]:
                        (out / name).unlink()
                removed = cli("run", "tests/counting_pipeline.py", "-i", str(photos), "-o",
                              str(out), "-q", "-j", "1")
            fresh.append({"first": first, "left": left, "rerun": rerun, "removed": removed})

        # The file system read-only.
        (photos / "extra2.png").write_bytes((photos / "img0000.png").read_bytes())
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        read_only = cli(*run)
    finally:
        extra.unlink(missing_ok=True)
        (photos / "extra2.png").unlink(missing_ok=True)
    return {"cache": str(cache), "attempts": attempts, "before": before,
            "after": {k: after[k] for k in ("rows", "verified")},
            "fresh": fresh, "read_only": read_only}


if __name__ == "__main__":
    print(json.dumps(_driver(Path(sys.argv[1]), Path(sys.argv[2]))))
