"""--strategy ddp|zero|fsdp (precache.training.strategy) with real gloo ranks: the three follow
the same loss curve on a fixed seed; a checkpoint saved by 2 ranks loads on 3 with the model and
optimizer state it saved, and training continues as if it had not stopped; checkpoints move
between strategies (and fsdp shards load on one process); an fsdp save killed half-way is never
taken for a complete checkpoint; under fsdp an inf in one rank's gradient shard makes every rank
skip the step.

The jobs train in fp32 on one machine; DDP, ZeRO and FSDP differ only in the summation order of
their reductions (all-reduce vs reduce-scatter, a gradient norm summed per shard), a few float32
ulps per step, so curves and parameters agree to 1e-5 relative. Loaded states are copies of the
saved bytes (DCP re-shards without arithmetic): they must be equal exactly."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from precache.training.checkpoint import load_checkpoint
from tests.helpers import launch_ranks

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


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> Callable[[str], tuple[Path, dict]]:
    """``four_steps(strategy)``: the checkpoint of 4 steps on 2 ranks, and rank 0's report with
    the whole state it saved (run once per strategy; tests copy it before writing beside it)."""
    runs: dict[str, tuple[Path, dict]] = {}

    def get(strategy: str) -> tuple[Path, dict]:
        if strategy not in runs:
            folder = tmp_path_factory.mktemp(f"{strategy}4")
            report = run(folder / "out", 2, strategy, "--steps", "4", "--dump",
                         "--save", str(folder / "last.pt"))[0]
            runs[strategy] = folder / "last.pt", report
        return runs[strategy]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero", "fsdp"])
def test_sharded_strategies_follow_the_ddp_curve_and_resume_on_three_ranks(
        strategy, ddp_eight_steps, four_steps, tmp_path):
    checkpoint, first = four_steps(strategy)
    assert_close(first["losses"], ddp_eight_steps["losses"][:4])
    saved = load_checkpoint(checkpoint)
    assert saved["strategy"] == strategy and saved["step"] == 4
    if strategy == "fsdp":
        assert "model" not in saved
        assert (checkpoint.parent / saved["shards"] / ".metadata").is_file()

    # On 3 ranks (each takes 4 of the 12 samples of a step instead of 6): the state as saved,
    # then the same global batches, so the same curve, which needs Adam's moments restored.
    rest = run(tmp_path / "b", 3, strategy, "--load", str(checkpoint), "--dump",
               "--first-step", "4", "--steps", "4")
    assert rest[0]["loaded"] == first["saved"]
    assert {"model", "optimizer"} <= first["saved"].keys()
    assert len(first["saved"]["optimizer"]) == len(first["saved"]["model"])  # Adam state each
    assert rest[0]["extra"] == {"step": 4, "schedule": {"samples_seen": 48, "samples_planned": 96}}
    assert_close(rest[0]["losses"], ddp_eight_steps["losses"][4:])
    for rank in rest:
        assert_same_parameters(rank["params"], ddp_eight_steps["params"])


@pytest.mark.slow
def test_checkpoints_move_between_strategies_and_world_sizes(ddp_eight_steps, four_steps,
                                                             tmp_path):
    ddp_checkpoint, _ = four_steps("ddp")
    # ddp on 2 ranks -> fsdp on 3 (the full file sharded on load) -> zero on 2 (the shards read
    # into a whole optimizer, which ZeRO partitions): one uninterrupted curve.
    fsdp = run(tmp_path / "b", 3, "fsdp", "--load", str(ddp_checkpoint), "--first-step", "4",
               "--steps", "2", "--save", str(tmp_path / "fsdp.pt"))
    assert_close(fsdp[0]["losses"], ddp_eight_steps["losses"][4:6])
    zero = run(tmp_path / "c", 2, "zero", "--load", str(tmp_path / "fsdp.pt"), "--first-step", "6",
               "--steps", "2")
    assert_close(zero[0]["losses"], ddp_eight_steps["losses"][6:])
    for rank in zero:
        assert_same_parameters(rank["params"], ddp_eight_steps["params"])


@pytest.mark.slow
def test_fsdp_shards_load_whole_on_one_process(four_steps):
    import torch

    from precache.training.strategy import make_strategy
    from tests.precache.training.strategy_job import Blocks, full_state

    checkpoint, first = four_steps("fsdp")
    for name in ("ddp", "zero", "fsdp"):  # one process: the plain model under every strategy
        strategy = make_strategy(name, rank=0, world_size=1, device=torch.device("cpu"))
        model = strategy.wrap(Blocks())
        optimizer = strategy.make_optimizer(model, torch.optim.AdamW, lr=1e-3)
        extra = strategy.load(checkpoint, model, optimizer)
        assert extra["step"] == 4
        assert full_state(strategy, model, optimizer, rank=0) == first["saved"]


@pytest.mark.slow
def test_a_half_written_fsdp_save_is_not_a_checkpoint_and_is_cleared(four_steps, tmp_path):
    import torch

    from precache.training.strategy import StrategyMismatch, make_strategy
    from tests.precache.training.strategy_job import Blocks

    source, _ = four_steps("fsdp")
    checkpoint = tmp_path / "last.pt"
    shutil.copy(source, checkpoint)
    good = load_checkpoint(checkpoint)["shards"]
    shutil.copytree(source.parent / good, tmp_path / good)
    # What saves killed before last.pt was replaced leave: shard folders last.pt does not name,
    # one killed while writing (no .metadata), one after its shards were written.
    partial = tmp_path / "last.shards-killed-early"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"partial")
    shutil.copytree(tmp_path / good, tmp_path / "last.shards-killed-late")

    resumed = run(tmp_path / "b", 2, "fsdp", "--load", str(checkpoint), "--first-step", "4",
                  "--steps", "1", "--save", str(checkpoint))
    assert resumed[0]["extra"]["step"] == 4  # the complete checkpoint, not a stray folder
    now = load_checkpoint(checkpoint)
    assert now["step"] == 5 and now["shards"] != good
    assert sorted(p.name for p in tmp_path.glob("last.shards-*")) == [now["shards"]]

    # A checkpoint whose shard folder is gone or incomplete is refused, naming the folder.
    (tmp_path / now["shards"] / ".metadata").unlink()
    strategy = make_strategy("fsdp", rank=0, world_size=1, device=torch.device("cpu"))
    model = Blocks()
    with pytest.raises(StrategyMismatch, match="names the shard folder .*, which is missing or "
                                               "incomplete; resume from an earlier checkpoint"):
        strategy.load(checkpoint, model, strategy.make_optimizer(model, torch.optim.AdamW))


@pytest.mark.slow
def test_an_inf_in_one_ranks_fsdp_gradient_shard_makes_every_rank_skip_the_step(tmp_path):
    ranks = run(tmp_path / "a", 2, "fsdp", "--steps", "3", "--inf-at", "0")
    for rank in ranks:  # no rank stepped on the inf, every rank halved its scale once
        assert rank["moved"] == [False, True, True]
        assert rank["scales"] == [2.0**15] * 3
