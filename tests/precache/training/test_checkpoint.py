"""save_checkpoint replaces the file whole or not at all; load_checkpoint loads only tensors and
plain data, so a checkpoint that would run code is refused, and the trainers' states round-trip."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch
from torch import nn

from precache.loading import make_loader
from precache.loading.samplers.length_buckets import LengthBucketSampler
from precache.training import OneCycleSchedule, optimizer_step
from precache.training.checkpoint import CheckpointRefused, load_checkpoint, save_checkpoint


class RunsCode:
    """Unpickled, this opens (so creates) ``marker``: what a hostile checkpoint could do."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint({"step": 1, "w": torch.ones(3)}, path)
    assert load_checkpoint(path)["step"] == 1
    with pytest.raises(TypeError, match="cannot pickle '_thread.lock' object"):
        save_checkpoint({"step": 2, "lock": threading.Lock()}, path)
    assert load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left
    save_checkpoint({"step": 3}, path)
    assert load_checkpoint(path)["step"] == 3


def test_a_checkpoint_that_would_run_code_is_refused_with_one_line_naming_it(tmp_path):
    marker, path = tmp_path / "marker", tmp_path / "last.pt"
    save_checkpoint({"model": {"w": torch.ones(2)}, "step": 5, "payload": RunsCode(marker)}, path)
    # The file really does run code when fully unpickled ...
    torch.load(path, weights_only=False)["payload"].close()
    assert marker.exists()
    marker.unlink()
    # ... and load_checkpoint refuses it before anything runs.
    message = (rf"^refusing to load checkpoint {re.escape(str(path))}: it holds "
               r"(io|builtins)\.open, and loading it could run code \(only tensors and plain data")
    with pytest.raises(CheckpointRefused, match=message):
        load_checkpoint(path)
    assert not marker.exists()
    with pytest.raises(CheckpointRefused) as refused:
        load_checkpoint(path)
    assert "\n" not in str(refused.value)


def same(a, b) -> bool:
    """Equal nested states, tensors included."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def training_state():
    """Model, AdamW, GradScaler and schedule after 3 optimizer steps."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = OneCycleSchedule(optimizer, 1e-3, samples_planned=40)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(3):
        scaler.scale(model(torch.randn(8, 4)).square().mean()).backward()
        optimizer_step(model, optimizer, scaler, schedule, clip=1.0, samples=8)
    return model, optimizer, schedule, scaler


def test_the_trainers_states_round_trip_through_a_weights_only_load(tmp_path):
    model, optimizer, schedule, scaler = training_state()
    loader = make_loader(list(range(20)), batch_size=2, num_workers=0, seed=3, rank=0,
                         world_size=2)
    loader.set_epoch(1)
    lengths = np.arange(30) % 7 + 1
    sampler = LengthBucketSampler(lengths, 4, seed=3, rank=0, world_size=2)
    sampler.set_epoch(1)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "schedule": schedule.state_dict(), "scaler": scaler.state_dict(),
             "loader": loader.state_dict(consumed=4), "sampler": sampler.state_dict(batches=2),
             "classes": ["cars", "cats"], "max_length": 48, "epoch": 1, "step": 3}
    path = save_checkpoint(state, tmp_path / "last.pt")
    loaded = load_checkpoint(path)
    assert same(loaded, state)
    assert loaded["schedule"] == {"samples_seen": 24, "samples_planned": 40}
    assert loaded["scaler"]["_growth_tracker"] == 3

    # Restored into fresh objects, training goes on exactly as it would have.
    model2, optimizer2, _, scaler2 = training_state()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(torch.randn_like(p))  # no longer the saved weights
    model2.load_state_dict(loaded["model"])
    optimizer2.load_state_dict(loaded["optimizer"])
    schedule2 = OneCycleSchedule(optimizer2, 1e-3, samples_planned=40)
    schedule2.load_state_dict(loaded["schedule"])
    scaler2.load_state_dict(loaded["scaler"])
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    batch = torch.randn(8, 4)
    for m, o, sc, sch in ((model, optimizer, scaler, schedule),
                          (model2, optimizer2, scaler2, schedule2)):
        sc.scale(m(batch).square().mean()).backward()
        optimizer_step(m, o, sc, sch, clip=1.0, samples=8)
    assert same(model2.state_dict(), model.state_dict())
    assert same(optimizer2.state_dict(), optimizer.state_dict())

    loader2 = make_loader(list(range(20)), batch_size=2, num_workers=0, seed=3, rank=0,
                          world_size=2)
    loader2.load_state_dict(loaded["loader"])
    loader2.set_epoch(1)
    assert list(loader2.sampler) == list(loader.sampler)[4:]  # the samples not yet seen
    from_file, from_memory = (LengthBucketSampler(lengths, 4, seed=3, rank=0, world_size=2)
                              for _ in range(2))
    from_file.load_state_dict(loaded["sampler"])
    from_memory.load_state_dict(state["sampler"])
    for resumed in (from_file, from_memory):
        resumed.set_epoch(1)
    assert len(from_file) == 2 and list(from_file) == list(from_memory)  # the rest, re-planned
