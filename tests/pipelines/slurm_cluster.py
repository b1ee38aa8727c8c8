"""A private Slurm cluster on this machine, for the tests: munged, slurmctld and four slurmd, one
per "node". The nodes are named 127.0.0.1 ... 127.0.0.4, addresses that all reach this machine,
so a job's node list (``127.0.0.[1-4]``) names hosts that resolve, as on a real cluster. Every
file (config, munge key, state, spool, logs) lives under one folder; every daemon listens on a
free port and is stopped by pid. The Debian packages slurmctld, slurmd, slurm-client and munge
provide the programs (``.ci/setup`` installs them); slurmd must run as root to start job steps.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tests.helpers import free_ports
from tests.helpers.training import clean_env

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "sinfo")
NODES = [f"127.0.0.{i}" for i in range(1, 5)]


def missing_reason() -> str | None:
    """Why a cluster cannot be started here, or ``None``."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmctld "
                "slurmd slurm-client munge (.ci/setup does)")
    if os.geteuid() != 0:
        return "slurmd must run as root to start job steps; run the tests as root"
    return None


@dataclass
class SlurmCluster:
    """A running cluster: its config file and the environment its commands need."""

    root: Path
    conf: Path

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment without any launcher's variables, pointed at this
        cluster (sbatch passes the submitting environment on to the job)."""
        return clean_env(SLURM_CONF=str(self.conf), **extra)

    def run(self, *command: str, timeout: float = 60, **extra: str) -> str:
        """Run a Slurm command against this cluster; its stdout (an error if it fails)."""
        done = subprocess.run(command, env=self.env(**extra), capture_output=True, text=True,
                              timeout=timeout, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr}")
        return done.stdout

    def job_state(self, job_id: str) -> tuple[str, str]:
        """``(JobState, ExitCode)`` of a job slurmctld still knows."""
        fields = dict(word.split("=", 1) for word in self.run("scontrol", "show", "job", job_id)
                      .split() if "=" in word)
        return fields["JobState"], fields["ExitCode"]

    def wait(self, job_id: str, timeout: float) -> tuple[str, str]:
        """Wait until the job ends; its ``(JobState, ExitCode)``."""
        deadline = time.monotonic() + timeout
        while True:
            state, code = self.job_state(job_id)
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return state, code
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job_id], env=self.env(), check=False, timeout=30)
                raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s")
            time.sleep(0.5)


def _config(root: Path, ctld_port: int, node_ports: list[int]) -> str:
    host = socket.gethostname().split(".")[0]  # slurmctld runs only where this names its host
    nodes = "\n".join(f"NodeName={name} Port={port} CPUs=1 RealMemory=2000 State=UNKNOWN"
                      for name, port in zip(NODES, node_ports))
    return f"""\
ClusterName=precachetest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _stop(pid_files: list[Path]) -> None:
    """SIGTERM the daemons whose pids the files hold; SIGKILL those not gone in 10 s."""
    pids = []
    for pid_file in pid_files:
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            pid = int(pid_file.read_text().strip())
            os.kill(pid, signal.SIGTERM)
            pids.append(pid)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    """Start the cluster under ``root``; stop every daemon on exit."""
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(parents=True)
    (root / "munge").chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    ctld_port, *node_ports = free_ports(1 + len(NODES))
    conf = root / "slurm.conf"
    conf.write_text(_config(root, ctld_port, node_ports))
    cluster = SlurmCluster(root, conf)
    pid_files = [root / "munge" / "munged.pid", root / "slurmctld.pid",
                 *(root / f"slurmd-{name}.pid" for name in NODES)]
    try:
        munge = root / "munge"
        subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={munge / 'socket'}",
                        f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                        f"--seed-file={munge / 'munged.seed'}"], check=True, timeout=30)
        subprocess.run(["slurmctld", "-f", str(conf), "-i"], env=cluster.env(), check=True,
                       timeout=30)
        for name in NODES:
            subprocess.run(["slurmd", "-f", str(conf), "-N", name], env=cluster.env(),
                           check=True, timeout=30)
        deadline = time.monotonic() + 60
        while cluster.run("sinfo", "-h", "-N", "-o", "%t").split() != ["idle"] * len(NODES):
            if time.monotonic() > deadline:
                logs = "\n".join(p.read_text()[-1500:] for p in sorted((root / "log").glob("*")))
                raise RuntimeError(f"the Slurm nodes did not come up:\n{logs}")
            time.sleep(0.5)
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            subprocess.run(["scancel", "--user=root"], env=cluster.env(), check=False, timeout=30)
        _stop(pid_files)
