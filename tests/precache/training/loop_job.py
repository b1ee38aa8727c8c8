"""A tiny task for the tests of ``precache.training.loop.fit``: regress a smooth function of 6
numbers with a small MLP whose blocks sit in a ``ModuleList`` (so fsdp shards them), on
synthetic samples keyed ``s000``, ``s001``... Run it under torchrun
(``python -m torch.distributed.run ... loop_job.py --cache unused --out OUT ...``: the common
flags of ``training_parser``, and ``--samples``), or call ``fit(Regression(n), settings)``.

Its epoch records add ``val_mse`` (all ranks) and ``bf16_batches``: how many of the epoch's
batches (all ranks) ran their forward pass in bf16 (what ``--precision`` chose).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from precache.loading import make_loader
from precache.training.loop import Run, Step, Task, TrainData, fit
from precache.training.settings import Settings, training_parser


def features(i: int) -> torch.Tensor:
    return torch.sin(torch.arange(6, dtype=torch.float32) * 0.7 + i)


class Samples(Dataset):
    """``count`` samples: ``key``, ``x`` (6 numbers) and the target ``y``."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, Any]:
        x = features(i)
        return {"key": f"s{i:03d}", "x": x, "y": x.sum(0, keepdim=True).sin()}


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


class Regression(Task):
    """``samples`` training samples; 6 validation samples, split evenly over 1, 2 or 3 ranks."""

    input = "tensors"

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def data(self, run: Run) -> TrainData:
        s = run.settings
        loader = make_loader(Samples(self.samples), s.batch_size, num_workers=s.workers,
                             seed=s.seed)
        return TrainData(loader, self.samples, ["x", "y"])

    def model(self, run: Run) -> nn.Module:
        return Blocks()

    def inputs(self, batch: dict, run: Run) -> Any:
        return batch["x"], batch["y"]

    def loss(self, net: nn.Module, inputs: Any, run: Run) -> Step:
        x, y = inputs
        out = net(x)
        bf16 = torch.tensor(float(out.dtype == torch.bfloat16))
        return Step(nn.functional.mse_loss(out.float(), y), len(x), {"bf16": bf16})

    def validate(self, net: nn.Module, run: Run) -> dict[str, Any]:
        x = torch.stack([features(10_000 + i) for i in range(6)])[run.rank::run.world_size]
        with run.autocast():
            error = (net(x).float() - x.sum(1, keepdim=True).sin()).square().sum()
        total, count = run.all_sum([error.item(), len(x)])
        return {"val_mse": total / count}

    def report(self, sums: dict[str, float], seconds: float) -> dict[str, Any]:
        return {"bf16_batches": sums.get("bf16", 0.0)}

    def extra(self) -> dict[str, Any]:
        return {"task": "regression"}


def main() -> None:
    p = training_parser(__doc__, out="runs/loop", lr=1e-2, batch_size=2)
    p.add_argument("--samples", type=int, default=30)
    args = p.parse_args()
    fit(Regression(args.samples), Settings.from_args(args))


if __name__ == "__main__":
    main()
