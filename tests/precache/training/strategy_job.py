"""One rank of the strategy tests (``python -m tests.precache.training.strategy_job``, started
by ``launch_ranks``): train a small model with a ModuleList of blocks on a fixed global batch
per step, optionally load a checkpoint first and save one after, and write the losses and the
full final parameters to ``<out>/rank<R>.json``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from precache.training.distributed import cleanup, init_distributed
from precache.training.strategy import make_strategy

GLOBAL_BATCH = 12  # split evenly over 2 or 3 ranks


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


def full_parameters(strategy, model) -> dict[str, list[float]]:
    if strategy.name == "fsdp" and strategy.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    else:
        state = strategy.unwrap(model).state_dict()
    return {k: v.detach().flatten().tolist() for k, v in state.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", required=True)
    p.add_argument("--first-step", type=int, default=0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--load", default=None)
    p.add_argument("--save", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, world, _, device = init_distributed()
    torch.manual_seed(0)
    strategy = make_strategy(args.strategy, rank=rank, world_size=world, device=device)
    model = strategy.wrap(Blocks())
    optimizer = strategy.make_optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=1e-2)
    extra = {}
    if args.load:
        extra = strategy.load(Path(args.load), model, optimizer)
    losses = []
    for step in range(args.first_step, args.first_step + args.steps):
        x, y = batch(step)
        x, y = x[rank::world], y[rank::world]  # each rank its share of the global batch
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    if args.save:
        strategy.save(Path(args.save), model, optimizer,
                      {"step": args.first_step + args.steps, "note": "plain"})
    result = {"losses": losses, "params": full_parameters(strategy, model), "extra": extra}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    cleanup()


if __name__ == "__main__":
    main()
