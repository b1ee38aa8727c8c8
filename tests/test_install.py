"""A non-editable install: the wheel holds every package of the tree, installs the pipelines as
``precache.pipelines`` (no top-level ``pipelines``), and the quick start's main job runs from it.

The wheel is installed into a fresh venv without its dependencies; they are made visible by a
``.pth`` line naming this project's ``.venv`` site-packages. A path added by a ``.pth`` line does
not have its own ``.pth`` files run, so the editable install of the checkout stays inactive there:
the test checks that ``precache`` is imported from the fresh venv.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import cv2
import pytest
from skimage import data

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _packages(root: Path, name: str) -> set[str]:
    return {".".join([name, *p.parent.relative_to(root).parts])
            for p in root.rglob("__init__.py")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel of this checkout installed (no editable install)."""
    tmp = tmp_path_factory.mktemp("install")
    # built from a copy of the sources: setuptools reuses a build/ folder in the source tree,
    # which would hide a package missing from pyproject's list
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("precache", "pipelines"):
        shutil.copytree(REPO / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = tmp / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(source)],
                   check=True, cwd=tmp, timeout=300)
    venv = tmp / "venv"
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                    "--no-deps", *map(str, wheels.glob("precache-*.whl"))],
                   check=True, cwd=tmp, timeout=300)
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    deps = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    (Path(venv_site) / "zz_test_dependencies.pth").write_text(
        "\n".join(dict.fromkeys(deps)) + "\n")
    return venv


def _run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(list(args), capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600)


def test_the_wheel_installs_every_package_and_no_top_level_pipelines(installed: Path,
                                                                     tmp_path: Path) -> None:
    expected = _packages(REPO / "precache", "precache") | _packages(
        REPO / "pipelines", "precache.pipelines")
    done = _run(installed, str(installed / "bin" / "python"), "-c", (
        "import importlib, importlib.util, json, pkgutil, precache\n"
        "found = {'precache'} | {m.name for m in pkgutil.walk_packages(precache.__path__, "
        "'precache.') if m.ispkg}\n"
        "print(json.dumps({'file': precache.__file__, 'packages': sorted(found),\n"
        "  'faces': importlib.import_module('precache.pipelines.faces.pipeline').__file__,\n"
        "  'pipelines': importlib.util.find_spec('pipelines') is not None}))\n"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    site_dir = str(installed)
    assert result["file"].startswith(site_dir), result["file"]  # the wheel, not the checkout
    assert result["faces"].startswith(site_dir), result["faces"]
    assert result["pipelines"] is False  # no top-level `pipelines` package
    missing = expected - set(result["packages"])
    assert not missing, f"packages missing from the wheel (pyproject's packages list): {missing}"


def test_the_quick_start_main_job_runs_from_the_installed_package(installed: Path,
                                                                  tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    face = cv2.cvtColor(data.astronaut(), cv2.COLOR_RGB2BGR)
    for i, scale in enumerate((1.0, 0.8, 0.6)):
        small = cv2.resize(face, None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA)
        cv2.imwrite(str(photos / f"astronaut{i}.jpg"), small)
    precache = str(installed / "bin" / "precache")
    version = _run(installed, precache, "--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("precache "), version.stderr
    cache = tmp_path / "cache"
    ran = _run(installed, precache, "run", "faces", "--input", str(photos), "--output",
               str(cache), "--set", "size=64", "--workers", "1", "--quiet", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    verified = _run(installed, precache, "verify", str(cache), cwd=tmp_path)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    rows = _run(installed, str(installed / "bin" / "python"), "-c",
                "import precache, sys; c = precache.Cache(sys.argv[1]); "
                "print(len(c), c.manifest.pipeline, precache.__file__)", str(cache), cwd=tmp_path)
    assert rows.returncode == 0, rows.stderr
    count, pipeline, where = rows.stdout.split()
    assert (int(count), pipeline) == (3, "faces")
    assert where.startswith(str(installed))
