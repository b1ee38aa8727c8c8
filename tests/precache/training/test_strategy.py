"""--strategy ddp|zero|fsdp (precache.training.strategy) with real gloo ranks: the three follow
the same loss curve on a fixed seed; a checkpoint saved by 2 ranks resumes on 3 and training
continues as if it had not stopped; an fsdp save killed half-way is never taken for a complete
checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from precache.training.checkpoint import load_checkpoint
from tests.conftest import launch_ranks

JOB = "tests.precache.training.strategy_job"


def run(out: Path, world: int, strategy: str, *args: str) -> list[dict]:
    return launch_ranks(JOB, world, out, ["--strategy", strategy, "--out", str(out), *args], 180)


def assert_close(a: list[float], b: list[float], rel: float = 1e-5) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert math.isclose(x, y, rel_tol=rel, abs_tol=1e-6), (a, b)


def assert_same_parameters(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert_close(a[name], b[name])


@pytest.fixture(scope="module")
def ddp_eight_steps(tmp_path_factory) -> dict:
    """The reference: 8 uninterrupted steps on 2 ranks with ddp."""
    return run(tmp_path_factory.mktemp("ddp8") / "out", 2, "ddp", "--steps", "8")[0]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero", "fsdp"])
def test_sharded_strategies_follow_the_ddp_curve_and_resume_on_three_ranks(
        strategy, ddp_eight_steps, tmp_path):
    first = run(tmp_path / "a", 2, strategy, "--steps", "4", "--save", str(tmp_path / "last.pt"))
    # fp32 on one machine: only the summation order of the reductions differs (1e-5 relative)
    assert_close(first[0]["losses"], ddp_eight_steps["losses"][:4])
    saved = load_checkpoint(tmp_path / "last.pt")
    assert saved["strategy"] == strategy and saved["step"] == 4
    if strategy == "fsdp":
        assert "model" not in saved and (tmp_path / saved["shards"] / ".metadata").is_file()

    # Resumed on 3 ranks (each takes 4 of the 12 samples of a step instead of 6): the same
    # global batches, so the same curve, which needs the model and Adam's moments restored.
    rest = run(tmp_path / "b", 3, strategy, "--load", str(tmp_path / "last.pt"),
               "--first-step", "4", "--steps", "4")
    assert rest[0]["extra"] == {"step": 4, "note": "plain"}
    assert_close(rest[0]["losses"], ddp_eight_steps["losses"][4:])
    for rank in rest:
        assert_same_parameters(rank["params"], ddp_eight_steps["params"])


@pytest.mark.slow
def test_a_ddp_checkpoint_resumes_under_fsdp_and_an_fsdp_one_not_under_ddp(ddp_eight_steps,
                                                                           tmp_path):
    run(tmp_path / "a", 2, "ddp", "--steps", "4", "--save", str(tmp_path / "ddp.pt"))
    rest = run(tmp_path / "b", 2, "fsdp", "--load", str(tmp_path / "ddp.pt"),
               "--first-step", "4", "--steps", "4", "--save", str(tmp_path / "fsdp.pt"))
    assert_close(rest[0]["losses"], ddp_eight_steps["losses"][4:])

    with pytest.raises(pytest.fail.Exception) as failed:
        run(tmp_path / "c", 2, "ddp", "--load", str(tmp_path / "fsdp.pt"), "--steps", "1")
    assert "holds FSDP shards; resume it with --strategy fsdp" in str(failed.value)


@pytest.mark.slow
def test_a_half_written_fsdp_save_is_not_a_checkpoint_and_is_cleared(tmp_path):
    checkpoint = tmp_path / "last.pt"
    run(tmp_path / "a", 2, "fsdp", "--steps", "2", "--save", str(checkpoint))
    good = load_checkpoint(checkpoint)["shards"]
    # What a save killed before its last.pt was replaced leaves: a shard folder nobody names.
    stray = tmp_path / "last.shards-killed"
    stray.mkdir()
    (stray / "__0_0.distcp").write_bytes(b"partial")
    resumed = run(tmp_path / "b", 2, "fsdp", "--load", str(checkpoint), "--first-step", "2",
                  "--steps", "1", "--save", str(checkpoint))
    assert resumed[0]["extra"]["step"] == 2
    now = load_checkpoint(checkpoint)["shards"]
    assert now != good
    assert sorted(p.name for p in tmp_path.glob("last.shards-*")) == [now]  # old and stray gone

    # A checkpoint whose shard folder is gone is refused, naming the folder.
    import shutil

    shutil.rmtree(tmp_path / now)
    with pytest.raises(pytest.fail.Exception) as failed:
        run(tmp_path / "c", 2, "fsdp", "--load", str(checkpoint), "--steps", "1")
    assert f"names the shard folder {tmp_path / now}, which is missing" in str(failed.value)
