"""Join the training job's process group, wherever the launcher put this process.

Training entry points call ``init_distributed()`` first. It reads where this process stands from
the environment its launcher set, in this order:

1. **torchrun** (also ``srun torchrun``, one torchrun per node): ``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``, ``GROUP_RANK`` (the node), ``MASTER_ADDR``, ``MASTER_PORT``. torchrun's
   variables win over Slurm's, which its workers also inherit.
2. **Slurm without torchrun** (``srun python train.py``, one task per GPU): ``SLURM_PROCID``,
   ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``. The group meets at ``MASTER_ADDR`` if
   set, else at the first host of ``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST``), where
   task 0 runs under srun's default block distribution; on ``MASTER_PORT`` if set, else on
   ``slurm_default_port(SLURM_JOB_ID)``. Start it with ``srun``: a python started directly by
   the batch script sees the allocation's ``SLURM_NTASKS`` and would wait for tasks that never
   come.
3. **Neither**: one process, no process group.

With CUDA the backend is NCCL and the device is the local rank's GPU; otherwise gloo on the CPU.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product

import torch
import torch.distributed as dist

__all__ = ["Launch", "cleanup", "device_for", "expand_hostlist", "init_distributed",
           "resolve_launch", "slurm_default_port"]

SLURM_PORT_BASE = 20000  # + job id % 10000: below Linux's ephemeral ports (32768+)


@dataclass(frozen=True)
class Launch:
    """Where this process stands in the job, as its launcher described it.

    Attributes:
        launcher: ``"torchrun"``, ``"slurm"`` or ``"single"``.
        rank, world_size: this process among all of the job's processes.
        local_rank: this process among those on its node (picks its GPU).
        node_rank: the node's index in the job.
        master_addr, master_port: where the group meets (``None`` for one process under
            torchrun, which needs no meeting point).
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    master_addr: str | None = None
    master_port: int | None = None


def expand_hostlist(hostlist: str) -> list[str]:
    """Host names of a Slurm host list, in order: ``"gpu[01-02,07],login1"`` ->
    ``["gpu01", "gpu02", "gpu07", "login1"]``.

    A range keeps the zero padding of its first number (``n[08-10]`` -> ``n08 n09 n10``);
    several bracket groups in one name expand to every combination (``r[1-2]-n[1-2]``).

    Raises:
        ValueError: unbalanced brackets, or a range that is not ``low-high`` with low <= high.
    """
    hosts: list[str] = []
    for name in _split_outside_brackets(hostlist.strip()):
        parts = re.split(r"(\[[^\]]*\])", name)  # odd items: the bracket groups
        choices = [_expand_brackets(p, hostlist) if i % 2 else [p] for i, p in enumerate(parts)]
        hosts.extend("".join(combo) for combo in product(*choices))
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    names, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"unbalanced brackets in Slurm host list {text!r}")
        if char == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in Slurm host list {text!r}")
    names.append(text[start:])
    return [n for n in names if n]


def _expand_brackets(group: str, hostlist: str) -> list[str]:
    """``"[01-03,7]"`` -> ``["01", "02", "03", "7"]``."""
    out = []
    for item in group[1:-1].split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not match or (match[2] is not None and int(match[2]) < int(match[1])):
            raise ValueError(f"bad range {item!r} in Slurm host list {hostlist!r}; "
                             f"expected a number or low-high, e.g. node[01-04,07]")
        low, high = match[1], match[2] or match[1]
        out.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return out


def slurm_default_port(job_id: str | int) -> int:
    """The rendezvous port of a Slurm job that sets no ``MASTER_PORT``: 20000 + job id % 10000.

    Every task of the job computes the same port without talking to the others, and two jobs
    sharing a first node collide only if their ids are 10000 apart. Two concurrent training
    steps in one job must set ``MASTER_PORT`` themselves.
    """
    return SLURM_PORT_BASE + int(job_id) % 10000


def resolve_launch(env: Mapping[str, str] | None = None) -> Launch:
    """Read this process's place in the job from ``env`` (default ``os.environ``).

    See the module docstring for which variables are read, in which order.

    Raises:
        ValueError: a variable is not an integer, the rank is outside the world, or a
            multi-process job lacks a meeting point (the message names what to set).
    """
    env = os.environ if env is None else env
    if "RANK" in env or "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1)
        launch = Launch("torchrun", rank, world, _int(env, "LOCAL_RANK", 0),
                        _int(env, "GROUP_RANK", 0), env.get("MASTER_ADDR"),
                        _int(env, "MASTER_PORT", 0) or None)
        if world > 1 and not (launch.master_addr and launch.master_port):
            raise ValueError(f"RANK={rank} and WORLD_SIZE={world} are set but MASTER_ADDR or "
                             f"MASTER_PORT is not: launch with torchrun, or set both to rank "
                             f"0's host and a free port")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _int(env, "SLURM_PROCID", 0), _int(env, "SLURM_NTASKS", 1)
        launch = Launch("slurm", rank, world, _int(env, "SLURM_LOCALID", 0),
                        _int(env, "SLURM_NODEID", 0), *_slurm_meeting_point(env, world))
    else:
        return Launch("single", 0, 1, 0, 0)
    if not 0 <= launch.rank < launch.world_size:
        raise ValueError(f"{launch.launcher} set rank {launch.rank} for a world of "
                         f"{launch.world_size}; the rank must be in [0, {launch.world_size})")
    return launch


def _slurm_meeting_point(env: Mapping[str, str], world: int) -> tuple[str | None, int | None]:
    if world == 1:
        return None, None
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        hosts = expand_hostlist(nodelist)
        if not hosts:
            raise ValueError("SLURM_PROCID is set but neither SLURM_STEP_NODELIST nor "
                             "SLURM_JOB_NODELIST names a host: start the tasks with srun, or "
                             "set MASTER_ADDR to the host of task 0")
        addr = hosts[0]
    port = _int(env, "MASTER_PORT", 0)
    if not port:
        if "SLURM_JOB_ID" not in env:
            raise ValueError("SLURM_PROCID is set but neither MASTER_PORT nor SLURM_JOB_ID is: "
                             "set MASTER_PORT to a free port on the host of task 0")
        port = slurm_default_port(_int(env, "SLURM_JOB_ID", 0))
    return addr, port


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def device_for(local_rank: int) -> torch.device:
    """This process's device: the local rank's GPU, else the CPU.

    When a task sees a single GPU (``srun --gpus-per-task=1`` hides the others), that one is
    its own, whatever its local rank.

    Raises:
        ValueError: CUDA shows fewer GPUs than the local rank needs.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    index = 0 if visible == 1 else local_rank
    if index >= visible:
        raise ValueError(f"local rank {local_rank} needs GPU {index}, but this process sees "
                         f"{visible} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}"
                         f"); start at most {visible} processes per node")
    return torch.device("cuda", index)


def init_distributed(backend: str | None = None) -> tuple[int, int, int, torch.device]:
    """Join the job's process group (if it has more than one process) and pick the device.

    Args:
        backend: default NCCL with CUDA, else gloo.

    Returns:
        ``(rank, world_size, local_rank, device)``.

    Raises:
        ValueError: the launcher's variables are inconsistent (see ``resolve_launch``).
    """
    launch = resolve_launch()
    device = device_for(launch.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL starts, so it uses this GPU
    if launch.world_size > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if launch.launcher == "torchrun":
            dist.init_process_group(backend)  # env://, which torchrun prepared
        else:
            host = str(launch.master_addr)
            host = f"[{host}]" if ":" in host else host  # an IPv6 address
            dist.init_process_group(backend, init_method=f"tcp://{host}:{launch.master_port}",
                                    rank=launch.rank, world_size=launch.world_size)
    return launch.rank, launch.world_size, launch.local_rank, device


def cleanup() -> None:
    """Wait for every rank, then leave the process group, if this process joined one.

    Call it once training ended on every rank (not on an error path: the barrier would wait for
    ranks that are gone). Without the barrier a rank that finished first (one that writes no
    checkpoint) tears its connections down while rank 0 still writes, and exits before the
    checkpoint exists.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
