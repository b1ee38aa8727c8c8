"""Where the sbatch scripts put the disk cache of a remote cache: a private folder per job and
node (mktemp -d, mode 0700, in $TMPDIR), never a fixed name under /tmp that another user could
make first; deleted when the node's task ends, also when it is terminated (preemption, scancel).
The scripts run as shipped, with stand-ins for srun, scontrol and torchrun (which records the
PRECACHE_HOME it was given)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.training import clean_env

SCRIPTS = sorted((REPO / "pipelines" / "slurm").glob("*.sbatch"))
JOB = "4242"


def stand_ins(tmp_path: Path, torchrun: str) -> Path:
    """srun (runs the task here, as node 0 of 1), scontrol and the given torchrun body."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    bodies = {
        "srun": f'while [[ $1 == -* ]]; do shift; done\n'
                f'SLURM_NODEID=0 SLURM_NNODES=1 PATH="{bin_dir}:$PATH" exec "$@"',
        "scontrol": "echo node01",
        "torchrun": torchrun,
    }
    for name, body in bodies.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def recording_torchrun(record: Path) -> str:
    """A torchrun that writes its PRECACHE_HOME, that folder's mode and owner, and whether it
    is there."""
    return (f'{{ echo "$PRECACHE_HOME"; stat -c "%a %u" "$PRECACHE_HOME"; }} > "{record}"')


def script_env(tmp_path: Path, bin_dir: Path, **extra: str) -> dict[str, str]:
    node_tmp = tmp_path / "node-tmp"
    node_tmp.mkdir(exist_ok=True)
    return clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID=JOB,
                     SLURM_JOB_NODELIST="node01", CACHE="s3://bucket/cache",
                     OUT=str(tmp_path / "out"), TMPDIR=str(node_tmp), **extra)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_each_run_gets_a_new_private_folder_that_is_deleted_afterwards(
        script: Path, tmp_path: Path) -> None:
    bin_dir = stand_ins(tmp_path, recording_torchrun(tmp_path / "record"))
    env = script_env(tmp_path, bin_dir)
    env.pop("PRECACHE_HOME", None)
    homes = []
    for _ in range(2):
        done = subprocess.run(["bash", str(script)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        home, mode_owner = (tmp_path / "record").read_text().splitlines()
        assert Path(home).parent == tmp_path / "node-tmp"
        assert Path(home).name.startswith(f"precache-{JOB}.")
        assert mode_owner == f"700 {os.geteuid()}"
        assert not Path(home).exists()  # deleted when the task ended
        homes.append(home)
    assert homes[0] != homes[1]  # not a name anyone could know beforehand
    assert list((tmp_path / "node-tmp").iterdir()) == []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_a_precache_home_that_is_set_is_used_and_kept(script: Path, tmp_path: Path) -> None:
    bin_dir = stand_ins(tmp_path, recording_torchrun(tmp_path / "record"))
    mine = tmp_path / "my-precache-home"
    mine.mkdir(mode=0o700)
    env = script_env(tmp_path, bin_dir, PRECACHE_HOME=str(mine))
    done = subprocess.run(["bash", str(script)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "record").read_text().splitlines()[0] == str(mine)
    assert mine.is_dir() and list((tmp_path / "node-tmp").iterdir()) == []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_a_terminated_task_deletes_its_folder(script: Path, tmp_path: Path) -> None:
    """As on preemption: every process of the step gets SIGTERM while training runs."""
    ready, hold = tmp_path / "ready", tmp_path / "hold"
    os.mkfifo(ready)
    os.mkfifo(hold)
    torchrun = (f'echo "$PRECACHE_HOME" > "{ready}"\n'
                f'read -r _ < "{hold}"')  # "training": until terminated (nobody writes hold)
    bin_dir = stand_ins(tmp_path, torchrun)
    env = script_env(tmp_path, bin_dir)
    env.pop("PRECACHE_HOME", None)
    proc = subprocess.Popen(["bash", str(script)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        fd = os.open(ready, os.O_RDONLY | os.O_NONBLOCK)
        try:
            chunks = []
            while not chunks or not chunks[-1].endswith(b"\n"):
                readable, _, _ = select.select([fd], [], [], 60)  # a guard, not a measurement
                assert readable, "the script never started torchrun"
                chunks.append(os.read(fd, 4096))
        finally:
            os.close(fd)
        home = Path(b"".join(chunks).decode().strip())
        assert home.is_dir() and home.parent == tmp_path / "node-tmp"
        os.killpg(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)  # EOF once every process of the task is gone
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not home.exists(), output.decode(errors="replace")
    assert list((tmp_path / "node-tmp").iterdir()) == []
