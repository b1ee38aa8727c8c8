"""Finding pipelines, typing ``--set`` overrides, and fingerprints of plain-function ops."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from precache import FunctionOp, Op, PipelineError
from precache.processing.pipeline import load_pipeline
from precache.processing.pipeline import fingerprint, op_fingerprint


def test_installed_pipeline_and_its_typed_overrides() -> None:
    pipeline = load_pipeline("images")
    assert pipeline.name == "images" and pipeline.defaults()["size"] == 128
    assert pipeline.parse_overrides(["size=64", "max_pixels=1000"]) == {"size": 64,
                                                                         "max_pixels": 1000}
    with pytest.raises(PipelineError, match="type int"):
        pipeline.parse_overrides(["size=1.5"])


def test_pipeline_from_module_attr_and_from_file(tmp_path: Path) -> None:
    assert load_pipeline("precache.pipelines.images.pipeline:pipeline").name == "images"
    path = tmp_path / "mine.py"
    path.write_text("from precache import Pipeline\n"
                    "def make_ops(flag: bool = False, name: str = 'a'):\n    return []\n"
                    "pipeline = Pipeline('mine', make_ops, ('.jpg',))\n")
    pipeline = load_pipeline(str(path))
    assert pipeline.ref == str(path.resolve())
    assert pipeline.parse_overrides(["flag=yes", "name=b=c"]) == {"flag": True, "name": "b=c"}
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(PipelineError, match="no variable named 'pipeline'"):
        load_pipeline(str(tmp_path / "empty.py"))
    with pytest.raises(PipelineError, match="does not exist"):
        load_pipeline(str(tmp_path / "missing.py"))


def test_an_input_folder_named_like_a_pipeline_neither_shadows_it_nor_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`precache run images -i images -o cache` in a folder holding `images/`: the installed
    pipeline runs, and `images/pipeline.py` is not executed; `./images` asks for the folder."""
    import os
    import subprocess
    import sys

    from tests.helpers import write_photos

    write_photos(tmp_path / "images", 4)
    ran = tmp_path / "pipeline-py-ran"
    (tmp_path / "images" / "pipeline.py").write_text(
        f"open({str(ran)!r}, 'w').write('ran')\n"
        "from precache.pipelines.images.pipeline import pipeline as images\n"
        "from precache import Pipeline\n"
        "pipeline = Pipeline('folder', images.make_ops, images.extensions)\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "precache", *args], capture_output=True,
                              text=True, cwd=tmp_path, env=env, timeout=120)

    done = cli("run", "images", "-i", "images", "-o", "cache", "-q")
    assert done.returncode == 0, done.stderr
    assert not ran.exists()
    from precache import Cache
    assert Cache(tmp_path / "cache").manifest.pipeline == "images"
    assert Cache(tmp_path / "cache").manifest.counts["ok"] == 4

    (tmp_path / "mine").mkdir()  # a bare name that is no installed pipeline: a hint, no run
    (tmp_path / "mine" / "pipeline.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PipelineError, match=r"unknown pipeline 'mine'.*write './mine'"):
        load_pipeline("mine")
    assert not ran.exists()
    done = cli("run", "./images", "-i", "images", "-o", "cache2", "-q")
    assert done.returncode == 0, done.stderr
    assert ran.read_text() == "ran"
    assert Cache(tmp_path / "cache2").manifest.pipeline == "folder"


def double(sample: dict) -> dict:
    return sample


def test_function_op_fingerprint_follows_name_params_and_source() -> None:
    base = fingerprint([FunctionOp(double).describe()], "parquet")
    assert base == fingerprint([FunctionOp(double).describe()], "parquet")
    assert base != fingerprint([FunctionOp(double, params={"k": 1}).describe()], "parquet")
    assert base != fingerprint([FunctionOp(double, version="2").describe()], "parquet")
    assert base != fingerprint([FunctionOp(double).describe()], "hdf5")
    assert FunctionOp(double).version.startswith("src-")


class WeightedOp(Op):
    """An op that 'loads' a model file, to check its hash joins the fingerprint."""

    name = "weighted"

    def __init__(self, *, path: Path) -> None:
        self.path = path

    def weight_files(self) -> list[Path]:
        return [self.path]


def test_model_file_contents_change_the_fingerprint(tmp_path: Path) -> None:
    weights = tmp_path / "model.onnx"
    weights.write_bytes(b"weights v1")
    first = WeightedOp(path=weights).describe()
    assert first["weights"] == {"model.onnx": hashlib.sha256(b"weights v1").hexdigest()}
    weights.write_bytes(b"weights v2")
    second = WeightedOp(path=weights).describe()
    assert fingerprint([first], "parquet") != fingerprint([second], "parquet")
    assert op_fingerprint(first) != op_fingerprint(second)
