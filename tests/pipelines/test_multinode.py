"""Multi-node launches, for real, on this one machine, of the one training loop every trainer
runs (``precache.training.loop.fit``, here with the tiny task of
tests/precache/training/loop_job.py, so no cache has to be built):

* two torchrun "nodes" (``--nnodes=2 --node_rank=0/1``, one process each);
* two plain python processes with the variables srun sets (SLURM_PROCID, ...) and no torchrun
  variables.

Each rank logs the key of every sample it trains on (``--log-keys``); the test checks that every
training sample is seen exactly once per epoch across the two ranks. The sbatch scripts in
pipelines/slurm/ are checked too: they parse, and their torchrun / python commands name files
and flags that exist.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser  # torchrun's own command line

from precache.training.distributed import slurm_default_port
from tests.helpers import REPO, assert_each_sample_once_per_epoch, free_port, seen_keys
from tests.helpers.training import clean_env, read_metrics

JOB = REPO / "tests" / "precache" / "training" / "loop_job.py"
SBATCH = sorted((REPO / "pipelines" / "slurm").glob("*.sbatch"))
TIMEOUT = 120.0  # seconds for one launch of both ranks


def launch(commands: list[list[str]], envs: list[dict[str, str]], logs: Path) -> None:
    """Run the commands side by side to the end; kill them all if one fails or time runs out."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, (command, env) in enumerate(zip(commands, envs)):
        with open(logs / f"proc{i}.log", "w") as log:
            procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + TIMEOUT
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: takes its children too
                p.wait()
    if any(p.returncode != 0 for p in procs):
        text = "\n".join(f"--- process {i} (exit {p.returncode})\n"
                         f"{(logs / f'proc{i}.log').read_text()[-8000:]}"
                         for i, p in enumerate(procs))
        pytest.fail(f"the launch failed or timed out after {TIMEOUT:.0f} s:\n{text}")


def job(out: Path, samples: int, *args: str) -> list[str]:
    """The loop job's command: ``samples`` samples (keys s000, s001, ...), keys logged."""
    return [sys.executable, str(JOB), "--cache", "unused", "--out", str(out / "run"),
            "--workers", "0", "--precision", "fp32", "--log-keys", str(out / "keys"),
            "--samples", str(samples), *args]


def keys(samples: int) -> list[str]:
    return [f"s{i:03d}" for i in range(samples)]


@pytest.mark.slow
def test_two_torchrun_nodes_train_on_every_sample_once_per_epoch(tmp_path):
    port = free_port()
    train = job(tmp_path, 13, "--epochs", "2", "--batch-size", "4")  # odd: one repeats
    nodes = [[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
              f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
              *train[1:]] for node in (0, 1)]  # one torchrun per "node", as srun starts them
    launch(nodes, [clean_env(), clean_env()], tmp_path / "logs")

    records = read_metrics(tmp_path / "run")
    assert [(r["epoch"], r["world_size"]) for r in records] == [(0, 2), (1, 2)]
    ranks = seen_keys(tmp_path / "keys", 2)
    assert_each_sample_once_per_epoch(ranks, keys(13), pads=[1, 1])
    assert ranks[0][0] != ranks[0][1]  # a new order each epoch


@pytest.mark.slow
def test_srun_style_tasks_without_torchrun_form_a_group_and_train_on_every_sample_once(
        tmp_path):
    train = job(tmp_path, 36, "--epochs", "1", "--batch-size", "6")  # 3 rounds of 2 x 6
    # What srun sets for 2 tasks on 2 nodes; the group meets at the first host of the list.
    slurm = {"SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
             "SLURM_JOB_ID": "4242", "MASTER_PORT": str(free_port())}
    envs = [clean_env(**slurm, SLURM_PROCID=str(task), SLURM_NODEID=str(task)) for task in (0, 1)]
    launch([train, train], envs, tmp_path / "logs")

    records = read_metrics(tmp_path / "run")
    assert [(r["epoch"], r["world_size"]) for r in records] == [(0, 2)]
    assert_each_sample_once_per_epoch(seen_keys(tmp_path / "keys", 2), keys(36), pads=[0])


# --- the sbatch scripts -------------------------------------------------------------------------

def script_commands(script: Path) -> list[list[str]]:
    """The torchrun / python commands of an sbatch script, as words: its ``srun`` lines and the
    commands shown in comments as ``#   $ ...``. ``bash -c '...'`` is opened up."""
    lines, current = [], ""
    for raw in script.read_text().splitlines():
        comment = re.match(r"\s*#\s+\$ (.*)", raw)
        if comment:
            lines.append(comment[1])
        elif not raw.lstrip().startswith("#"):
            current += raw[:-1] + " " if raw.endswith("\\") else raw
            if not raw.endswith("\\"):
                lines.append(current)
                current = ""
    commands = []
    for line in lines:
        words = shlex.split(line)
        if not words or words[0] != "srun" or "torchrun" not in line and "python" not in words:
            continue
        if "-c" in words and words[words.index("-c") - 1] == "bash":
            words = shlex.split(words[words.index("-c") + 1])
        commands.append(words)
    return commands


def help_flags(command: list[str]) -> set[str]:
    done = subprocess.run(command + ["--help"], capture_output=True, text=True, cwd=REPO,
                          timeout=60, env=clean_env(), check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return set(re.findall(r"--[a-z][\w-]*", done.stdout))


def test_sbatch_scripts_parse_and_name_files_and_flags_that_exist():
    assert {s.name for s in SBATCH} == {"faces_4nodes_x1gpu.sbatch", "faces_1node_x8gpu.sbatch",
                                        "classifier_2nodes_x1gpu.sbatch"}
    torchrun_flags = set(re.findall(r"--[a-z][\w-]*", get_args_parser().format_help()))
    trainer_flags: dict[str, set[str]] = {}
    for script in SBATCH:
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                              check=False)
        assert done.returncode == 0, f"{script.name}: {done.stderr}"
        lines = script.read_text().splitlines()
        for i, line in enumerate(lines):  # every #SBATCH line says why it is there
            if line.startswith("#SBATCH"):
                assert lines[i - 1].startswith("# "), f"{script.name}:{i + 1} has no comment"
        sbatch = [line.split()[1] for line in lines if line.startswith("#SBATCH")]
        assert "--requeue" in sbatch and "--open-mode=append" in sbatch

        commands = script_commands(script)
        launchers = sorted(next(w for w in c if w in ("torchrun", "python")) for c in commands)
        assert launchers == ["python", "torchrun"], f"{script.name}: {commands}"
        for words in commands:
            at = next(i for i, w in enumerate(words) if w.endswith(".py"))
            path = words[at]
            assert (REPO / path).is_file(), f"{script.name} runs {path}, which does not exist"
            if path not in trainer_flags:
                trainer_flags[path] = help_flags([sys.executable, str(REPO / path)])
            used = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", " ".join(words[at + 1:])))
            unknown = used - trainer_flags[path]
            assert used and not unknown, f"{script.name} passes {path} unknown flags {unknown}"
            assert "--resume" in used
            if "torchrun" in words:
                flags = {w.split("=")[0] for w in words[words.index("torchrun") + 1:at]}
                assert {"--nnodes", "--node_rank", "--rdzv-backend"} <= flags
                assert flags <= torchrun_flags, f"{script.name}: {flags - torchrun_flags}"


@pytest.mark.parametrize("script", SBATCH, ids=lambda s: s.name)
@pytest.mark.parametrize("resume", [False, True])
def test_sbatch_script_gives_torchrun_its_node_and_resumes_from_the_last_checkpoint(
        script, resume, tmp_path):
    """Run the script with stand-ins for srun (a task on node 3 of 4), scontrol and torchrun
    (which records its arguments): the quoting must hand each node its own SLURM_NODEID."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {
        "srun": f'while [[ $1 == -* ]]; do shift; done\n'
                f'SLURM_NODEID=3 SLURM_NNODES=4 PATH="{bin_dir}:$PATH" exec "$@"',
        "scontrol": 'echo node01; echo node02',  # show hostnames node[01-02]
        "torchrun": f'printf "%s\\n" "$@" > "{tmp_path}/args"',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "run dir"  # a space: the path must stay one argument
    out.mkdir()
    if resume:
        (out / "last.pt").write_bytes(b"")
    env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="123456",
                    SLURM_JOB_NODELIST="node[01-02]", CACHE="/shared/cache", OUT=str(out))
    done = subprocess.run(["bash", str(script)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "args").read_text().splitlines()
    assert {"--nnodes=4", "--node_rank=3", "--rdzv-backend=c10d", "--rdzv-id=123456",
            f"--rdzv-endpoint=node01:{slurm_default_port(123456)}"} <= set(args)
    trainer = next(a for a in args if a.startswith("pipelines/") and a.endswith(".py"))
    script_args = args[args.index(trainer) + 1:]
    assert script_args[:4] == ["--cache", "/shared/cache", "--out", str(out)]
    assert ("--resume" in script_args) == resume
    if resume:
        assert script_args[-2:] == ["--resume", str(out / "last.pt")]
