"""One rank of the strategy tests (``python -m tests.precache.training.strategy_job``, started
by ``launch_ranks``): train a small model with a ModuleList of blocks on a fixed global batch
per step through ``optimizer_step`` (clipping on, OneCycle rate), optionally load a checkpoint
first and save one after, and write the losses and the full final parameters to
``<out>/rank<R>.json``. ``--dump`` adds the whole model and optimizer state (gathered, keyed by
parameter name) right after loading and right before saving; ``--inf-at`` puts an inf in one
element of rank 0's gradient (its shard, under fsdp) at that step, with the loss scaler on."""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from precache.training import OneCycleSchedule, optimizer_step
from precache.training.distributed import cleanup, init_distributed
from precache.training.strategy import Strategy, make_strategy

GLOBAL_BATCH = 12  # split evenly over 2 or 3 ranks
PLANNED_STEPS = 8  # the schedule's plan: the reference run's length


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        return value.detach().flatten().tolist()
    return value


def full_state(strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer,
               rank: int) -> dict[str, Any] | None:
    """The whole model and optimizer state by parameter name on rank 0 (None elsewhere); every
    rank calls it (gathering is collective)."""
    if strategy.name == "fsdp" and strategy.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_state, optimizer_state = get_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True))
        by_name = optimizer_state["state"]
    else:
        model_state = strategy.unwrap(model).state_dict()
        if strategy.name == "zero" and strategy.sharded:
            optimizer.consolidate_state_dict(to=0)
            if rank != 0:
                return None
        names = [name for name, _ in strategy.unwrap(model).named_parameters()]
        by_name = {names[i]: s for i, s in optimizer.state_dict()["state"].items()}
    if rank != 0:
        return None
    return {"model": {k: _plain(v) for k, v in model_state.items()},
            "optimizer": {name: {k: _plain(v) for k, v in state.items()}
                          for name, state in by_name.items()}}


def full_parameters(strategy: Strategy, model: nn.Module) -> dict[str, list[float]]:
    if strategy.name == "fsdp" and strategy.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    else:
        state = strategy.unwrap(model).state_dict()
    return {k: _plain(v) for k, v in state.items()}


def local_parameters(model: nn.Module) -> list[torch.Tensor]:
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for p in model.parameters()]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", required=True)
    p.add_argument("--first-step", type=int, default=0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--load", default=None)
    p.add_argument("--save", default=None)
    p.add_argument("--dump", action="store_true")
    p.add_argument("--inf-at", type=int, default=-1)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, world, _, device = init_distributed()
    torch.manual_seed(0)
    strategy = make_strategy(args.strategy, rank=rank, world_size=world, device=device)
    model = strategy.wrap(Blocks())
    optimizer = strategy.make_optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=1e-2)
    schedule = OneCycleSchedule(optimizer, 1e-2, samples_planned=PLANNED_STEPS * GLOBAL_BATCH)
    scaler = strategy.grad_scaler(enabled=args.inf_at >= 0)  # fp32 here: the scaling is exact
    result: dict[str, Any] = {"extra": {}}
    if args.load:
        result["extra"] = strategy.load(Path(args.load), model, optimizer)
        schedule.load_state_dict(result["extra"]["schedule"])
        if args.dump:
            result["loaded"] = full_state(strategy, model, optimizer, rank)
    losses, scales, moved = [], [], []
    for step in range(args.first_step, args.first_step + args.steps):
        x, y = batch(step)
        x, y = x[rank::world], y[rank::world]  # each rank its share of the global batch
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if step == args.inf_at and rank == 0:
            grad = next(p.grad for p in model.parameters() if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
        before = local_parameters(model)
        optimizer_step(model, optimizer, scaler, schedule, clip=0.5, samples=GLOBAL_BATCH)
        moved.append(any(not torch.equal(a, b) for a, b in zip(before, local_parameters(model))))
        scales.append(scaler.get_scale())
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    if args.save:
        if args.dump:
            result["saved"] = full_state(strategy, model, optimizer, rank)
        strategy.save(Path(args.save), model, optimizer,
                      {"step": args.first_step + args.steps, "schedule": schedule.state_dict()})
    result.update(losses=losses, scales=scales, moved=moved,
                  params=full_parameters(strategy, model))
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    del model, optimizer, strategy  # they hold the process group: go before the teardown at exit
    gc.collect()
    cleanup()


if __name__ == "__main__":
    main()
