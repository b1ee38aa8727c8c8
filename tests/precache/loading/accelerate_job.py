"""An accelerate training loop over a ``make_loader`` loader, for test_accelerate.py.

    python accelerate_job.py CACHE OUT --stops 1,4,7

The loop is accelerate's own pattern for a stateful loader: ``Accelerator(dataloader_config=
DataLoaderConfiguration(use_stateful_dataloader=True))``, ``prepare`` (which hands a
``CacheLoader`` back as it is: it is already split among the ranks),
``register_for_checkpointing(loader)``, ``save_state`` after a step, and on a resume
``load_state`` and the loop from the loader's epoch, iterating without ``set_epoch``. It runs two
epochs uninterrupted, then for each stop a run that saves after that step and ends, and a new
model, optimizer and loader that load that state and train to the end of epoch 1. Writes
``OUT/result.json``: run name -> [[epoch, [keys of a batch]], ...].
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from precache.loading import CachedDataset, make_loader

EPOCHS = 2


def train(cache: str, *, stop: int | None = None, save: Path | None = None,
          resume: Path | None = None) -> list:
    """Batches trained on: [epoch, keys] each. Saves the state after step ``stop`` and ends.
    A new Accelerator each run, as a new process would have (it keeps what it prepared)."""
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = make_loader(CachedDataset(cache, columns=["key", "image"]), 4, seed=0,
                         num_workers=1)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    assert prepared is loader, "accelerate must not re-split a loader that is already per rank"
    accelerator.register_for_checkpointing(loader)
    if resume is not None:
        accelerator.load_state(str(resume))
    seen, step = [], 0
    for epoch in range(loader.epoch, EPOCHS):  # after load_state: the saved epoch, then on
        for batch in loader:
            seen.append([loader.epoch, list(batch["key"])])
            loss = model(batch["image"].float().mean(dim=(1, 2)) / 255).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == stop:
                accelerator.save_state(str(save))
                loader.close()
                return seen
    loader.close()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache")
    parser.add_argument("out")
    parser.add_argument("--stops", default="")
    args = parser.parse_args()
    out = Path(args.out)
    result = {"full": train(args.cache)}
    for stop in [int(s) for s in args.stops.split(",") if s]:
        state = out / f"state-{stop}"
        result[f"first-{stop}"] = train(args.cache, stop=stop, save=state)
        result[f"resumed-{stop}"] = train(args.cache, resume=state)
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
