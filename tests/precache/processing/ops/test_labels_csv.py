"""A labels CSV as people write it: Excel's byte-order mark just works; a file that is not UTF-8,
or that gives one file two labels, stops the run with one line naming the file, where, and the
fix (exit 2, before any work). Real ``precache run`` subprocesses, and ``read_label_file``."""

from __future__ import annotations

import codecs
import subprocess
from pathlib import Path

import pytest

from precache import Cache
from precache.processing.ops.labels import Labels, read_label_file
from tests.helpers import precache_cli, write_photos


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    write_photos(folder, 3)  # img0000.png, img0001.jpg, img0002.jpg
    return folder


def run_with_labels(photos: Path, labels: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return precache_cli("run", "images", "-i", str(photos), "-o", str(out), "-q", "-j", "1",
                        "--set", "size=16", "--set", f"labels={labels}")


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("precache: error: "), result.stderr
    return lines[0]


def test_excel_byte_order_mark_just_works(photos: Path, tmp_path: Path) -> None:
    labels = tmp_path / "labels.csv"
    labels.write_bytes(codecs.BOM_UTF8 + b"file,label\r\nimg0000.png,cat\r\nimg0001.jpg,dog\r\n"
                       b"img0002.jpg,caf\xc3\xa9\r\n")  # what Excel's "CSV UTF-8" writes
    out = tmp_path / "cache"
    done = run_with_labels(photos, labels, out)
    assert done.returncode == 0, done.stderr
    assert "3 ok" in done.stdout
    rows = Cache(out).read_all(["key", "label"])
    assert dict(zip(rows["key"], rows["label"])) == {"img0000.png": "cat", "img0001.jpg": "dog",
                                                        "img0002.jpg": "café"}


def test_a_csv_that_is_not_utf8_is_one_line_naming_offset_line_and_fix(photos: Path,
                                                                       tmp_path: Path) -> None:
    labels = tmp_path / "labels.csv"
    labels.write_bytes("file,label\nimg0000.png,cat\nimg0001.jpg,café\n".encode("cp1252"))
    line = one_line(run_with_labels(photos, labels, tmp_path / "cache"))
    assert line == (f"precache: error: pipeline 'images': labels file '{labels}' is not UTF-8: "
                    "the byte 0xe9 at offset 42 (line 3) is not valid UTF-8 (invalid "
                    "continuation byte); save the file as UTF-8 (in Excel: Save As 'CSV UTF-8') "
                    "and re-run")
    assert labels.read_bytes()[42] == 0xE9
    assert not (tmp_path / "cache").exists()  # refused before any work


def test_two_different_labels_for_one_file_is_one_line_naming_both_rows(photos: Path,
                                                                       tmp_path: Path) -> None:
    labels = tmp_path / "labels.csv"
    labels.write_text("file,label\nimg0000.png,cat\nimg0001.jpg,dog\nimg0002.jpg,dog\n"
                      "img0001.jpg,cat\n")
    line = one_line(run_with_labels(photos, labels, tmp_path / "cache"))
    assert line == (f"precache: error: pipeline 'images': labels file '{labels}' lists "
                    "'img0001.jpg' twice with different labels: line 3 says 'dog', line 5 says "
                    "'cat'; keep one row per file and re-run")


def test_identical_duplicate_rows_are_accepted_and_originals_may_not_differ(
        tmp_path: Path) -> None:
    labels = tmp_path / "meta.csv"
    labels.write_text("file,label,original\na.mp4,FAKE,b.mp4\nb.mp4,REAL,\na.mp4,FAKE,b.mp4\n")
    assert read_label_file(labels) == {"a.mp4": {"label": "FAKE", "original": "b.mp4"},
                                       "b.mp4": {"label": "REAL", "original": ""}}
    labels.write_text("file,label,original\na.mp4,FAKE,b.mp4\na.mp4,FAKE,c.mp4\n")
    with pytest.raises(ValueError, match=r"lists 'a.mp4' twice with different originals: line 2 "
                       r"says 'b.mp4', line 3 says 'c.mp4'"):
        read_label_file(labels)


def test_the_op_reads_its_file_when_built_and_a_bom_json_file_works_too(tmp_path: Path) -> None:
    meta = tmp_path / "metadata.json"
    meta.write_bytes(codecs.BOM_UTF8 + b'{"x.mp4": {"label": "FAKE", "original": "y.mp4"}}')
    op = Labels(labels=str(meta))
    assert op.entries == {"x.mp4": {"label": "FAKE", "original": "y.mp4"}}
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"file,label\nx.mp4,\xff\n")
    with pytest.raises(ValueError, match=r"is not UTF-8: the byte 0xff at offset 17 \(line 2\)"):
        Labels(labels=str(bad))  # when the pipeline is built: before any worker starts
