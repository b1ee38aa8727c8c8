"""``load_checkpoint`` on a path that is no loadable checkpoint: one line saying what is wrong
(missing, a directory, empty, truncated, not a PyTorch checkpoint) and what to pass instead,
raised as a ``CheckpointRefused`` (the trainers print those as one line). Valid checkpoints
(torch's zip and legacy formats, an fsdp ``last.pt`` naming its shard folder) still load."""

from __future__ import annotations

import os

import re
from pathlib import Path

import pytest
import torch

from precache.training.checkpoint import (CheckpointRefused, CheckpointUnreadable,
                                          load_checkpoint, save_checkpoint)

EARLIER = "resume from an earlier checkpoint (or copy this one again), or start without it"


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return save_checkpoint({"step": 3, "model": {"w": torch.arange(2000.0)}},
                           tmp_path / "last.pt")


def refusal(path: Path) -> str:
    with pytest.raises(CheckpointUnreadable) as refused:
        load_checkpoint(path)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"cannot load checkpoint {path}: ")
    assert isinstance(refused.value, CheckpointRefused)  # caught by the trainers' handler
    return message[len(f"cannot load checkpoint {path}: "):]


def test_a_truncated_checkpoint_says_so_with_its_size(good: Path, tmp_path: Path) -> None:
    data = good.read_bytes()
    for size in (len(data) // 2, 100):
        cut = tmp_path / f"cut{size}.pt"
        cut.write_bytes(data[:size])
        assert refusal(cut) == (f"it is truncated ({size} bytes): a PyTorch checkpoint is a zip "
                                "archive and this one has no end (a partial copy, or a write cut "
                                f"short); {EARLIER}")


def test_a_truncated_legacy_format_checkpoint_says_so(tmp_path: Path) -> None:
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(100)}, legacy, _use_new_zipfile_serialization=False)
    assert load_checkpoint(legacy)["w"].sum() == 100  # the whole file loads
    cut = tmp_path / "cut.pt"
    cut.write_bytes(legacy.read_bytes()[:200])
    assert refusal(cut) == f"it is truncated (200 bytes); {EARLIER}"


def test_an_empty_file_says_empty(tmp_path: Path) -> None:
    empty = tmp_path / "last.pt"
    empty.write_bytes(b"")
    assert refusal(empty) == f"it is empty (0 bytes), not a checkpoint; {EARLIER}"


def test_a_text_file_is_not_a_checkpoint_and_not_said_to_run_code(tmp_path: Path) -> None:
    for text in ("step,loss\n1,0.5\n", '{"step": 1}'):
        path = tmp_path / "notes.pt"
        path.write_text(text)
        reason = refusal(path)
        first = text.splitlines()[0]
        assert reason == (f"it is not a PyTorch checkpoint: it is text (it begins {first!r}), "
                          "where torch.save writes a zip archive; give the checkpoint file a "
                          "trainer wrote (e.g. OUT/last.pt)")
        assert "run code" not in reason


def test_a_directory_names_the_file_to_pass(good: Path, tmp_path: Path) -> None:
    assert refusal(tmp_path) == f"it is a directory; pass the checkpoint file inside it: {good}"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert refusal(empty) == ("it is a directory holding no .pt file; pass a checkpoint file (a "
                              "trainer writes OUT/last.pt)")
    several = tmp_path / "several"
    several.mkdir()
    for name in ("epoch1.pt", "epoch2.pt"):
        save_checkpoint({"step": 1}, several / name)
    assert refusal(several) == ("it is a directory; pass one of the checkpoint files inside it: "
                                f"{several / 'epoch1.pt'}, {several / 'epoch2.pt'}")


def test_an_fsdp_shard_folder_names_the_last_pt_that_loads_it(tmp_path: Path) -> None:
    """fsdp's checkpoint is ``last.pt`` (plain data naming the shard folder beside it, which
    Strategy.load reads): the file loads; the folder given instead names the file."""
    folder = tmp_path / "last.shards-18c2f"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"dcp")
    last = save_checkpoint({"strategy": "fsdp", "shards": folder.name, "epoch": 1},
                           tmp_path / "last.pt")
    assert load_checkpoint(last) == {"strategy": "fsdp", "shards": folder.name, "epoch": 1}
    assert refusal(folder) == ("it is a directory of fsdp shards (torch.distributed.checkpoint); "
                               f"pass the checkpoint file that names it, {last}, which loads them")


def test_a_missing_file_and_other_files_say_what_they_are(tmp_path: Path) -> None:
    assert refusal(tmp_path / "nope.pt") == ("no such file; give the checkpoint file a trainer "
                                             "wrote (e.g. OUT/last.pt)")
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(200, 256)))
    assert refusal(binary) == ("it is not a PyTorch checkpoint: it begins with the bytes "
                               r"b'\xc8\xc9\xca\xcb\xcc\xcd\xce\xcf', where torch.save writes a "
                               "zip archive; give the checkpoint file a trainer wrote (e.g. "
                               "OUT/last.pt)")
    import zipfile

    with zipfile.ZipFile(tmp_path / "archive.pt", "w") as archive:
        archive.writestr("notes.txt", "hello")
    assert refusal(tmp_path / "archive.pt") == (
        "it is a zip archive but not a PyTorch checkpoint (no data.pkl inside); give a file "
        "torch.save wrote (e.g. OUT/last.pt)")


def test_valid_checkpoints_still_load_and_code_is_still_refused(good: Path,
                                                                tmp_path: Path) -> None:
    assert load_checkpoint(good)["step"] == 3
    assert load_checkpoint(str(good), map_location="cpu")["model"]["w"].shape == (2000,)

    class Hostile:
        def __reduce__(self):
            return (os.getcwd, ())  # not print: Ray, once imported, replaces builtins.print

    path = tmp_path / "hostile.pt"
    torch.save({"x": Hostile()}, path)
    with pytest.raises(CheckpointRefused, match=re.escape(f"refusing to load checkpoint {path}: "
                                                          "it holds ") + r"(posix|os)\.getcwd, "
                       "and loading it could run code") as refused:
        load_checkpoint(path)
    assert not isinstance(refused.value, CheckpointUnreadable)
