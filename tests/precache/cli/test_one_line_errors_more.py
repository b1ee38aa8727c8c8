"""More failures that are one line, not a traceback (issue 36, item 10): a ``--set tokenizer=``
naming a Hugging Face model (exit 2: what was typed), and caches whose files were not written by
precache (exit 1: the job cannot go on): junk ``ops`` or ``schema`` in a manifest, a manifest
nested 100,000 levels deep, a truncated index table. Each through the real command: the
``precache`` entry point in this process (``main``, as the console script calls it) for the many
cases, a subprocess for one of each; and through the Python API with its exception type.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

import precache
from precache import Cache
from precache.cache import ManifestError
from precache.cache.tables import TableError
from precache.cli import main
from precache.errors import UsageError
from precache.loading import CachedDataset
from precache.processing.ops.text import TokenizerNotFoundError
from tests.helpers import (COUNTING_PIPELINE, assert_one_line_error, build_counting, precache_cli,
                           quiet, write_photos)


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    write_photos(folder, 3)
    return folder


@pytest.fixture(scope="module")
def built(photos: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real cache of 3 photos, built once; each test changes a copy."""
    return build_counting(photos, tmp_path_factory.mktemp("built") / "cache").cache


def copy_with(built: Path, folder: Path, change: Callable[[dict[str, Any]], None] | None = None,
              text: str | None = None) -> Path:
    """A copy of ``built`` in ``folder`` whose manifest is changed by ``change`` (or is
    ``text``)."""
    cache = folder / "cache"
    shutil.copytree(built, cache)
    if change is not None:
        manifest = json.loads((cache / "manifest.json").read_text())
        change(manifest)
        text = json.dumps(manifest)
    if text is not None:
        (cache / "manifest.json").write_text(text)
    return cache


def one_line(capsys: pytest.CaptureFixture[str], argv: list[str], code: int,
             *fragments: str) -> str:
    """Run the command in this process; it must fail with ``code`` and one line on stderr."""
    assert main(argv) == code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("precache: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# ---- --set tokenizer=<a Hugging Face model name> ----------------------------------------------

def test_a_tokenizer_that_is_no_file_is_one_line_exit_2_and_a_usage_error(tmp_path: Path) -> None:
    """The docs promise one line and exit 2 for a bad ``--set``; it was a 28-line
    ``FileNotFoundError`` traceback with exit 1."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("a short document")
    out = tmp_path / "cache"
    done = precache_cli("run", "text", "-i", str(docs), "-o", str(out), "-q",
                        "--set", "tokenizer=distilbert-base-uncased")
    assert_one_line_error(done, 2, "tokenizer='distilbert-base-uncased': no such tokenizer file",
                          "precache downloads nothing", "--set tokenizer=tokenizer.json")
    assert not out.exists()
    with pytest.raises(TokenizerNotFoundError, match="distilbert-base-uncased") as raised:
        precache.run("text", docs, out, params={"tokenizer": "distilbert-base-uncased"},
                     progress=False, log=quiet)
    assert isinstance(raised.value, UsageError) and isinstance(raised.value, FileNotFoundError)


# ---- junk in a manifest ------------------------------------------------------------------------

def set_field(name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda manifest: manifest.__setitem__(name, value)


def without_op_key(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda manifest: [op.pop(key) for op in manifest["ops"]]


JUNK = {
    "ops ints": (set_field("ops", [1, 2]), "ops[0] is 1, expected an object with name, version"),
    "ops string": (set_field("ops", "resize"), "ops is 'resize', expected a list of objects"),
    "op without name": (without_op_key("name"), "ops[0] has no name, expected a string"),
    "op without weights": (without_op_key("weights"), "ops[0] has no weights, expected an object"),
    "op params a list": (lambda m: m["ops"][0].__setitem__("params", [1]),
                         "ops[0].params is [1], expected an object"),
    "schema kind": (lambda m: m["schema"]["image"].__setitem__("kind", "tensor"),
                    "schema.image.kind is 'tensor', expected one of"),
    "schema dtype": (lambda m: m["schema"]["image"].__setitem__("dtype", "object"),
                     "schema.image.dtype is 'object', expected a NumPy dtype name"),
}


@pytest.mark.parametrize("name", list(JUNK))
def test_junk_in_a_manifest_is_one_line_for_inspect_and_a_manifest_error_for_readers(
        built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    change, expected = JUNK[name]
    cache = copy_with(built, tmp_path, change)
    where = f"'{cache / 'manifest.json'}' is not a valid precache manifest: "
    one_line(capsys, ["inspect", str(cache)], 1, where + expected, "rebuild it")
    one_line(capsys, ["inspect", str(cache), "--json"], 1, where + expected)
    with pytest.raises(ManifestError, match=f"^{re.escape(where + expected)}"):
        CachedDataset(cache)


def test_junk_ops_through_the_real_command(built: Path, tmp_path: Path) -> None:
    cache = copy_with(built, tmp_path, set_field("ops", [1, 2]))
    assert_one_line_error(precache_cli("inspect", str(cache)), 1, "ops[0] is 1, expected")


# ---- a manifest nested 100,000 levels deep ------------------------------------------------------

def nested(depth: int) -> Callable[[str], str]:
    """The manifest's text with ``extra`` holding ``depth`` nested lists."""
    return lambda text: text.replace('"extra": {}', '"extra": {"x": ' + "[" * depth
                                     + "]" * depth + "}")


@pytest.mark.parametrize("depth", [100_000, 200])  # past the parser's own limit, and under it
def test_a_deeply_nested_manifest_is_one_line_in_every_command(
        built: Path, photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        depth: int) -> None:
    text = (built / "manifest.json").read_text()
    assert '"extra": {}' in text
    cache = copy_with(built, tmp_path, text=nested(depth)(text))
    expected = "is not a valid precache manifest: its values are nested more than 64 levels deep"
    for argv in (["inspect", str(cache)], ["inspect", str(cache), "--json"],
                 ["verify", str(cache)], ["gc", str(cache), "--dry-run"],
                 ["run", COUNTING_PIPELINE, "-i", str(photos), "-o", str(cache), "-q", "-j", "1"]):
        one_line(capsys, argv, 1, expected)
    with pytest.raises(ManifestError, match=expected):
        Cache(cache)
    if depth == 100_000:
        assert_one_line_error(precache_cli("verify", str(cache)), 1, expected)


# ---- a truncated index table -------------------------------------------------------------------

def test_inspect_of_a_truncated_index_table_is_one_line(
        built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = copy_with(built, tmp_path)
    index = cache / json.loads((cache / "manifest.json").read_text())["index"]["path"]
    index.write_bytes(index.read_bytes()[:index.stat().st_size // 2])
    line = one_line(capsys, ["inspect", str(cache)], 1, f"'{index}' is damaged: it is not a "
                    "readable Parquet table", f"run `precache verify {cache}`", "--overwrite")
    assert_one_line_error(precache_cli("inspect", str(cache), "--json"), 1, line[17:])
    with pytest.raises(TableError, match="is damaged"):
        Cache(cache).read_index()


def test_an_index_table_without_its_columns_is_one_line(
        built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cache = copy_with(built, tmp_path)
    index = cache / json.loads((cache / "manifest.json").read_text())["index"]["path"]
    pq.write_table(pa.table({"key": ["a"]}), index)
    one_line(capsys, ["inspect", str(cache)], 1, f"'{index}' is damaged: it has no column "
             "'locator', 'size'")
