"""save_checkpoint replaces the file whole or not at all."""

from __future__ import annotations

import threading

import pytest
import torch

from precache.checkpoint import save_checkpoint


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint({"step": 1, "w": torch.ones(3)}, path)
    assert torch.load(path)["step"] == 1
    with pytest.raises(Exception):
        save_checkpoint({"step": 2, "lock": threading.Lock()}, path)  # cannot be pickled
    assert torch.load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left
    save_checkpoint({"step": 3}, path)
    assert torch.load(path)["step"] == 3
