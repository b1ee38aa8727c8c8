"""precache.training.distributed without processes: Slurm host lists, which launcher's variables win, the
meeting point of a Slurm job, and the device a local rank gets. The real launches (two torchrun
"nodes", two srun-style tasks) are in tests/pipelines/test_multinode.py."""

from __future__ import annotations

import pytest
import torch

from precache.training.distributed import (Launch, cleanup, device_for, expand_hostlist,
                                           init_distributed, resolve_launch, slurm_default_port)


@pytest.mark.parametrize("hostlist, hosts", [
    ("node07", ["node07"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
    ("n[08-10]", ["n08", "n09", "n10"]),  # the first number's padding is kept
    ("a[1-2],b3,c[5]", ["a1", "a2", "b3", "c5"]),
    ("rack[1-2]-n[01,03]", ["rack1-n01", "rack1-n03", "rack2-n01", "rack2-n03"]),
    ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["node[1-2", "node1-2]", "node[[1]]", "node[3-1]",
                                      "node[a-b]", "node[]", "node[1-]"])
def test_expand_hostlist_refuses_what_slurm_would_not_write(hostlist):
    with pytest.raises(ValueError, match="Slurm host list"):
        expand_hostlist(hostlist)


def test_slurm_default_port_is_the_same_for_every_task_and_below_ephemeral_ports():
    assert slurm_default_port("4242") == slurm_default_port(4242) == 24242
    assert slurm_default_port(123456789) == 26789
    assert all(20000 <= slurm_default_port(j) < 30000 for j in range(0, 10**6, 9973))


TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "GROUP_RANK": "2",
            "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}
SRUN = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "3",
        "SLURM_JOB_NODELIST": "node[01-04,07]", "SLURM_JOB_ID": "987654"}


def test_torchrun_variables():
    assert resolve_launch(TORCHRUN) == Launch("torchrun", 5, 8, 1, 2, "node01", 29500)


def test_slurm_variables_without_torchrun():
    assert resolve_launch(SRUN) == Launch("slurm", 3, 4, 0, 3, "node01",
                                          slurm_default_port(987654))


def test_torchrun_inside_srun_wins_over_the_slurm_task_it_runs_in():
    # srun starts one torchrun per node; its workers inherit SLURM_PROCID = the node's task id
    assert resolve_launch({**SRUN, **TORCHRUN}).launcher == "torchrun"
    assert resolve_launch({**SRUN, **TORCHRUN}).rank == 5


def test_slurm_meeting_point_prefers_master_variables_then_the_step_nodelist():
    env = {**SRUN, "SLURM_STEP_NODELIST": "node[03-04]"}
    assert resolve_launch(env).master_addr == "node03"  # task 0 of this step runs there
    env.update(MASTER_ADDR="10.0.0.9", MASTER_PORT="31000")
    assert (resolve_launch(env).master_addr, resolve_launch(env).master_port) == ("10.0.0.9", 31000)


def test_one_process_needs_no_meeting_point():
    assert resolve_launch({}) == Launch("single", 0, 1, 0, 0)
    assert resolve_launch({"WORLD_SIZE": "1"}) == Launch("torchrun", 0, 1, 0, 0)
    one_task = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}  # no nodelist, no job id: fine
    assert resolve_launch(one_task) == Launch("slurm", 0, 1, 0, 0)


@pytest.mark.parametrize("env, message", [
    ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR or MASTER_PORT is not"),
    ({**TORCHRUN, "RANK": "8"}, r"rank must be in \[0, 8\)"),
    ({**TORCHRUN, "LOCAL_RANK": "one"}, "LOCAL_RANK='one' is not an integer"),
    ({k: v for k, v in SRUN.items() if k != "SLURM_JOB_NODELIST"}, "set MASTER_ADDR"),
    ({k: v for k, v in SRUN.items() if k != "SLURM_JOB_ID"}, "set MASTER_PORT"),
    ({**SRUN, "SLURM_JOB_NODELIST": "node[01-04"}, "unbalanced brackets"),
])
def test_inconsistent_variables_are_refused_with_the_fix(env, message):
    with pytest.raises(ValueError, match=message):
        resolve_launch(env)


def test_init_distributed_alone_starts_no_group(monkeypatch):
    for name in [*TORCHRUN, *SRUN]:
        monkeypatch.delenv(name, raising=False)
    rank, world, local_rank, device = init_distributed()
    assert (rank, world, local_rank) == (0, 1, 0)
    assert device == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    assert not torch.distributed.is_initialized()
    cleanup()  # nothing to leave: no error


def test_device_for_uses_the_local_rank_or_the_only_gpu_a_task_sees(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_for(3) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert device_for(3) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # srun --gpus-per-task=1
    assert device_for(3) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="start at most 2 processes per node"):
        device_for(3)
