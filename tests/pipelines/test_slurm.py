"""The shipped sbatch scripts, submitted with ``sbatch`` to a real Slurm cluster of four "nodes"
on this machine (see ``slurm_cluster.py``), and the plain ``srun`` launch without torchrun.

The scripts run as shipped; only what a CPU machine lacks is overridden on sbatch's command line
(no GPUs, 1 core and little memory per node) and the sizes come from their documented variables
(CACHE, OUT, EPOCHS, BATCH_SIZE, TRAIN_ARGS). Each launch trains on every training sample
exactly once per epoch across all ranks; a second submission finds ``last.pt`` and resumes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, assert_each_sample_once_per_epoch, free_port, seen_keys
from tests.helpers.training import read_metrics, training_keys
from tests.pipelines.slurm_cluster import SlurmCluster, missing_reason, slurm_cluster

SLURM = REPO / "pipelines" / "slurm"
CPU_ONLY = ["--gpus-per-node=0", "--cpus-per-task=1", "--mem=500M"]  # what this machine has
JOB_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def submit(slurm: SlurmCluster, script: Path, tmp_path: Path, **variables: str) -> str:
    """``sbatch`` the script from the repository root on CPU; wait for it; return its log."""
    out = slurm.run("sbatch", "--parsable", *CPU_ONLY, f"--chdir={REPO}",
                    f"--output={tmp_path}/job-%j.log", str(script), **variables)
    job = out.strip().split(";")[0]
    state, code = slurm.wait(job, JOB_TIMEOUT)
    log = (tmp_path / f"job-{job}.log").read_text()
    assert (state, code) == ("COMPLETED", "0:0"), f"job {job}: {state} {code}\n{log[-6000:]}"
    return log


@pytest.mark.slow
def test_the_4_nodes_script_trains_on_every_sample_once_and_a_resubmission_resumes(
        slurm, face_cache, tmp_path):
    out, keys_dir = tmp_path / "run", tmp_path / "keys"
    settings = dict(CACHE=str(face_cache), OUT=str(out), BATCH_SIZE="2",
                    TRAIN_ARGS=f"--workers 0 --log-keys {keys_dir}")
    submit(slurm, SLURM / "faces_4nodes_x1gpu.sbatch", tmp_path, EPOCHS="2", **settings)
    assert [(r["epoch"], r["world_size"]) for r in read_metrics(out)] == [(0, 4), (1, 4)]
    train = training_keys(face_cache)
    pad = -len(train) % 4  # the sampler evens the 4 ranks by repeating samples
    assert_each_sample_once_per_epoch(seen_keys(keys_dir, 4), train, pads=[pad] * 2)

    submit(slurm, SLURM / "faces_4nodes_x1gpu.sbatch", tmp_path, EPOCHS="3", **settings)
    # resumed from last.pt: only epoch 2 was trained (a fresh start would log epochs 0-2 again)
    assert [(r["epoch"], r["world_size"]) for r in read_metrics(out)] == [(0, 4), (1, 4), (2, 4)]
    assert_each_sample_once_per_epoch(seen_keys(keys_dir, 4), train, pads=[pad] * 3)


@pytest.mark.slow
def test_the_1_node_8_gpus_script_starts_8_ranks_that_share_each_epoch(slurm, face_cache, tmp_path):
    out, keys_dir = tmp_path / "run", tmp_path / "keys"
    submit(slurm, SLURM / "faces_1node_x8gpu.sbatch", tmp_path, CACHE=str(face_cache),
           OUT=str(out), EPOCHS="1", BATCH_SIZE="1", TRAIN_ARGS=f"--workers 0 --log-keys {keys_dir}")
    assert [(r["epoch"], r["world_size"]) for r in read_metrics(out)] == [(0, 8)]
    train = training_keys(face_cache)
    assert_each_sample_once_per_epoch(seen_keys(keys_dir, 8), train, pads=[-len(train) % 8])


@pytest.mark.slow
def test_plain_srun_tasks_without_torchrun_form_one_group_across_nodes(slurm, tmp_path):
    """The scripts' documented variant: one srun task per GPU, each reading SLURM_PROCID etc.;
    the group meets at the first host of the job's node list (127.0.0.1 here). The loop every
    trainer runs, with the tiny task of tests/precache/training/loop_job.py."""
    out, keys_dir = tmp_path / "run", tmp_path / "keys"
    command = ["srun", "--nodes=2", "--ntasks=2", "--kill-on-bad-exit=1", f"--chdir={REPO}",
               sys.executable, "tests/precache/training/loop_job.py", "--cache", "unused",
               "--out", str(out), "--epochs", "1", "--batch-size", "2", "--workers", "0",
               "--precision", "fp32", "--samples", "13", "--log-keys", str(keys_dir)]
    slurm.run(*command, timeout=JOB_TIMEOUT, MASTER_PORT=str(free_port()))
    assert [(r["epoch"], r["world_size"]) for r in read_metrics(out)] == [(0, 2)]
    train = [f"s{i:03d}" for i in range(13)]
    assert_each_sample_once_per_epoch(seen_keys(keys_dir, 2), train, pads=[1])


@pytest.mark.slow
def test_the_classifier_script_shares_the_videos_of_each_epoch_across_2_nodes(
        slurm, video_cache, tmp_path):
    out, keys_dir = tmp_path / "run", tmp_path / "keys"
    submit(slurm, SLURM / "classifier_2nodes_x1gpu.sbatch", tmp_path, CACHE=str(video_cache),
           OUT=str(out), EPOCHS="1", BATCH_SIZE="1",
           TRAIN_ARGS=f"--workers 0 --frames-per-video 2 --log-keys {keys_dir}")
    metrics = read_metrics(out)
    assert [(r["epoch"], r["world_size"]) for r in metrics] == [(0, 2)]
    assert metrics[0]["val_videos"] >= 2
    seen = seen_keys(keys_dir, 2)
    train = sorted({video for rank in seen for keys in rank.values() for video in keys})
    assert len(train) == 8 - metrics[0]["val_videos"]
    assert_each_sample_once_per_epoch(seen, train, pads=[len(train) % 2])
