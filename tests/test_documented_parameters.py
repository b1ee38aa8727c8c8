"""Every public parameter of the classes and functions users configure most is documented.

The rule: the object's page (``PAGES``) has a heading ```Name` parameters`` (any level), and the
Markdown table under it (before the next heading) has one row per parameter: the name in
backticks in the first cell, the default in the second (in backticks, as Python writes it:
``0.5``, ``(0.9, 1.1)``, ``None``, ``"auto"``, then any words; ``required`` for a parameter
without one), then what it does. Public parameters are those of ``inspect.signature`` less ``self``, ``*args`` and
``**kwargs``. A parameter added without a row, a row left for a parameter removed, and a default
changed without its row fail here, naming the page, the heading and the fix.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO


def _objects() -> dict[str, tuple[Callable[..., Any], Path]]:
    from precache.augment.face import FaceAugment
    from precache.augment.volume import VolumeAugment
    from precache.loading.datasets.cached import CachedDataset
    from precache.bring_your_own import cache_dataset
    from precache.loading.loaders.cache_loader import make_loader

    found: dict[str, tuple[Callable[..., Any], Path]] = {
        "FaceAugment": (FaceAugment, REPO / "docs" / "pipelines.md"),
        "VolumeAugment": (VolumeAugment, REPO / "docs" / "volumes.md"),
        "CachedDataset": (CachedDataset, REPO / "docs" / "stage2-loading.md"),
        "make_loader": (make_loader, REPO / "docs" / "stage2-loading.md"),
        "cache_dataset": (cache_dataset, REPO / "docs" / "stage1.md"),
    }
    try:
        from precache.loading.interop.lightning import CacheDataModule
    except ImportError:  # lightning is an extra
        pass
    else:
        found["CacheDataModule"] = (CacheDataModule, REPO / "docs" / "interop.md")
    return found


PAGES = _objects()
NAMES = ["FaceAugment", "VolumeAugment", "CachedDataset", "make_loader", "CacheDataModule",
         "cache_dataset"]


def public_parameters(obj: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The parameters a user passes: not ``self``, ``*args`` or ``**kwargs``."""
    return {name: p for name, p in inspect.signature(obj).parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def parameter_rows(page: Path, name: str) -> dict[str, list[str]]:
    """The rows of the table under the heading ```name` parameters`` on ``page``: the backticked
    name of the first cell -> the row's other cells. Fails if there is no such heading or table."""
    lines = re.sub(r"(?ms)^```.*?^```", "", page.read_text(encoding="utf-8")).splitlines()
    heading = re.compile(rf"^#{{1,6}} `{re.escape(name)}` parameters\s*$")
    start = next((i for i, line in enumerate(lines) if heading.match(line)), None)
    assert start is not None, (f"{page.name} has no heading '`{name}` parameters': add one, with "
                               "a table of every parameter (name, default, what it does, when "
                               "to change it)")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("#")), len(lines))
    rows: dict[str, list[str]] = {}
    for line in lines[start + 1:end]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(\w+)`", cells[0]) if line.startswith("|") else None
        if match:
            rows[match.group(1)] = cells[1:]
    assert rows, f"{page.name}: no table of parameters under '`{name}` parameters'"
    return rows


def default_text(parameter: inspect.Parameter) -> str:
    """What the default cell must contain: ``required``, or the default as Python writes it
    (strings and tuples of strings with either quote; a function by its name, e.g. ``print``)."""
    if parameter.default is inspect.Parameter.empty:
        return "required"
    if inspect.isroutine(parameter.default):
        return parameter.default.__name__
    return repr(parameter.default).replace("'", '"')


def documented_default(cells: list[str]) -> str | None:
    """The default a row gives: ``required``, or its default cell's first backticked span
    (quotes made double); any words after it explain."""
    cell = cells[0] if cells else ""
    if cell.startswith("required"):
        return "required"
    match = re.match(r"`([^`]+)`", cell)
    return match.group(1).replace("'", '"') if match else None


@pytest.mark.parametrize("name", NAMES)
def test_every_public_parameter_has_a_row_with_its_default(name: str) -> None:
    if name not in PAGES:
        pytest.skip(f"{name} needs an extra that is not installed")
    obj, page = PAGES[name]
    parameters = public_parameters(obj)
    rows = parameter_rows(page, name)
    where = f"{page.relative_to(REPO)}, under '`{name}` parameters'"
    missing = [p for p in parameters if p not in rows]
    assert not missing, (f"{name}'s parameters {missing} are not in the table in {where}: add a "
                         "row each (name, default, what it does, when to change it)")
    stale = [r for r in rows if r not in parameters]
    assert not stale, f"{where}: rows for {stale}, which {name} no longer takes: remove them"
    wrong = [f"{p}: want {default_text(parameters[p])!s}, row says {rows[p][0]!r}"
             for p in parameters if documented_default(rows[p]) != default_text(parameters[p])]
    assert not wrong, f"{where}: defaults that differ from the code: {wrong}"
    empty = [p for p in parameters if len(rows[p]) < 2 or not rows[p][1]]
    assert not empty, f"{where}: rows that do not say what the parameter does: {empty}"


def test_the_rule_finds_a_missing_parameter(tmp_path: Path) -> None:
    """The check itself: a page without one parameter's row is caught."""
    def f(a, b: int = 2, *args, c: str = "x", **kwargs):  # noqa: ANN001, ANN202
        """A function whose public parameters are a, b and c."""

    page = tmp_path / "page.md"
    page.write_text("# Page\n\n### `f` parameters\n\n| parameter | default | what |\n|---|---|---|\n"
                    "| `a` | required | one |\n| `c` | `\"x\"` | two |\n\n## Next\n\n| `b` | 2 | no |\n",
                    encoding="utf-8")
    assert list(public_parameters(f)) == ["a", "b", "c"]
    rows = parameter_rows(page, "f")
    assert set(rows) == {"a", "c"}  # b's row is under another heading: not counted
    assert documented_default(rows["c"]) == default_text(public_parameters(f)["c"]) == '"x"'
    assert documented_default(rows["a"]) == "required"
    assert documented_default(["`1.05` (more)"]) != default_text(inspect.Parameter(
        "d", inspect.Parameter.KEYWORD_ONLY, default=1.0))  # a whole span, not a substring
