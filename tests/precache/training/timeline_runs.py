"""Real training loops under a StepTimeline, for the timeline's and the doctor's tests."""

from __future__ import annotations

import io
import json
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from precache.training.timeline import StepTimeline


class Slow(Dataset):
    """Samples that take ``delay`` seconds each to load (a loader-bound run when large)."""

    def __init__(self, count: int, delay: float) -> None:
        self.count, self.delay = count, delay

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return torch.full((64,), float(i))


def train(delay: float, width: int, every: int, accumulate: int = 1,
          batches: int = 24) -> tuple[dict, list[dict]]:
    """One epoch of a real MLP under the timeline; its summary and its step lines."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    log = io.StringIO()
    timeline = StepTimeline(torch.device("cpu"), every=every, log=log)
    timeline.begin_epoch(0)
    loader = DataLoader(Slow(batches * 4, delay), batch_size=4, num_workers=0)
    for i, x in enumerate(loader):
        timeline.data_ready()
        with timeline.phase("h2d"):
            x = x.to("cpu")
        with timeline.phase("forward"):
            loss = model(x).square().mean()
        with timeline.phase("backward"):
            loss.backward()
        if (i + 1) % accumulate == 0:
            with timeline.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        timeline.end_step(i)
    summary = timeline.epoch_summary()["timeline"]
    return summary, [json.loads(line) for line in log.getvalue().splitlines()]
