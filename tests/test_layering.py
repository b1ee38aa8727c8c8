"""The package's import structure: no two modules import each other in a loop, data flows down
the layers (processing -> cache -> storage), and the main names import from ``precache`` without
importing torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under the package folder ``root``."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, module: str, modules: set[str], *,
               top_level_only: bool) -> list[str]:
    """What ``module`` (the file ``path``) imports, as names of ``modules`` where it imports one
    of them (else the name as written): at import time only (module-level statements, ``if``/
    ``try`` included), or anywhere. ``TYPE_CHECKING`` blocks and ``from precache import
    __version__`` are not imports of a module."""
    is_package = path.name == "__init__.py"
    found: list[str] = []

    def resolve(name: str, level: int) -> str:
        if level == 0:
            return name
        base = module.split(".")
        base = base if is_package else base[:-1]
        base = base[:len(base) - (level - 1)]
        return ".".join(base + ([name] if name else []))

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = resolve(node.module or "", node.level)
                if target == "precache" and all(a.name == "__version__" for a in node.names):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.append(sub if sub in modules else target)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not top_level_only:
                    visit(node.body)
                continue
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    visit([c for c in children if isinstance(c, (ast.stmt, ast.ExceptHandler))])

    tree = ast.parse(path.read_text(), filename=str(path))
    visit(tree.body)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules its import runs at import time, including the ``__init__`` of each
    package on the way to them (except packages the importer is inside: they are already being
    initialised, and the root package)."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target in imports_of(path, name, set(modules), top_level_only=True):
            if target not in modules:
                continue  # another package
            graph[name].add(target)
            parts = target.split(".")
            for i in range(2, len(parts)):
                parent = ".".join(parts[:i])
                if parent in modules and not (name == parent or name.startswith(parent + ".")):
                    graph[name].add(parent)
        graph[name].discard(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop (``[a, b, a]``), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_a_loop_through_a_package_init(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.inner import thing\n")
    (pkg / "sub" / "inner.py").write_text("from pkg.other import helper\nthing = 1\n")
    (pkg / "other.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg.late import x\n"
        "def f():\n    from pkg.late import y\n"
        "from pkg.sub import thing\nhelper = 2\n")
    (pkg / "late.py").write_text("from pkg.other import helper\n")
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.other"] == {"pkg.sub"}  # not the TYPE_CHECKING or function-level import
    assert find_cycle(graph) == ["pkg.other", "pkg.sub", "pkg.sub.inner", "pkg.other"]
    (pkg / "other.py").write_text("helper = 2\n")
    assert find_cycle(import_graph(pkg, "pkg")) is None


def test_no_precache_modules_import_each_other_in_a_loop() -> None:
    cycle = find_cycle(import_graph(REPO / "precache", "precache"))
    assert cycle is None, "import loop: " + " -> ".join(cycle or [])


STAGE1_MACHINERY = ["precache.processing.runner", "precache.processing.plan",
                    "precache.processing.worker", "precache.processing.executors",
                    "precache.processing.sources"]

LAYER_RULES = [
    # (modules under, must not import anything under)
    ("precache.storage", ["precache.cache", "precache.processing", "precache.loading",
                          "precache.training", "precache.augment", "precache.faces",
                          "precache.cli", "precache.threads"]),
    ("precache.cache", ["precache.processing", "precache.loading", "precache.training",
                        "precache.cli", "precache.augment"]),
    ("precache.processing.executors", ["precache.processing.runner", "precache.processing.plan"]),
    # what a user writes (ops, pipeline, record files) sits below stage 1's machinery
    ("precache.processing.ops", [*STAGE1_MACHINERY, "precache.processing.pipeline",
                                 "precache.loading", "precache.training", "precache.cli"]),
    ("precache.processing.pipeline", [*STAGE1_MACHINERY, "precache.loading", "precache.training",
                                      "precache.cli"]),
    ("precache.processing.records", [*STAGE1_MACHINERY, "precache.processing.ops",
                                     "precache.processing.pipeline", "precache.cache",
                                     "precache.loading", "precache.cli"]),
    ("precache.processing", ["precache.loading", "precache.training", "precache.cli",
                             "precache.augment"]),
    ("precache.loading", ["precache.processing", "precache.cli", "precache.training"]),
    ("precache.training", ["precache.processing", "precache.cli"]),
    ("precache.errors", ["precache."]),
    ("precache", ["pipelines", "precache.pipelines"]),
]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix if prefix.endswith(".") else prefix + ".")


def test_each_layer_imports_only_the_layers_below_it() -> None:
    modules = module_names(REPO / "precache", "precache")
    broken = []
    for name, path in modules.items():
        for target in imports_of(path, name, set(modules), top_level_only=False):
            for layer, forbidden in LAYER_RULES:
                inside = layer != "precache" and _under(target, layer)  # its own layer
                if _under(name, layer) and not inside and any(_under(target, f)
                                                              for f in forbidden):
                    broken.append(f"{name} imports {target}")
    assert broken == []


def test_the_layer_check_sees_function_level_imports(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from precache.processing.runner import run\n"
                    "    import pipelines.faces\n")
    assert imports_of(path, "precache.cache.m", {"precache.processing.runner"},
                      top_level_only=False) == ["precache.processing.runner", "pipelines.faces"]
    assert imports_of(path, "precache.cache.m", set(), top_level_only=True) == []


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


@pytest.mark.parametrize("module", [
    "precache.errors", "precache.storage", "precache.cache", "precache.cache.transaction",
    "precache.processing.records", "precache.processing.ops", "precache.processing.pipeline",
    "precache.processing", "precache.processing.executors", "precache.processing.worker",
    "precache.loading", "precache.training",
    "precache.cli", "precache.pipelines.faces.pipeline"])
def test_each_layer_imports_alone_in_a_fresh_interpreter(module: str) -> None:
    done = _python(f"import {module}")
    assert done.returncode == 0, done.stderr


def test_main_names_import_from_precache_without_torch_until_used() -> None:
    done = _python(
        "import sys\n"
        "import precache, precache.cli\n"
        "assert 'torch' not in sys.modules, 'import precache or its CLI imported torch'\n"
        "from precache import CachedDataset, make_loader, run, Pipeline, Cache\n"
        "assert 'torch' in sys.modules\n"
        "assert len(precache.__all__) <= 15, precache.__all__  # the first hour's names only\n"
        "missing = [n for n in precache.__all__ if getattr(precache, n, None) is None]\n"
        "assert not missing, missing\n"
        "import precache.loading, precache.loading.interop.lightning\n"
        "assert precache.loading.CachedDataset is CachedDataset\n"
        "assert precache.Cache is Cache and precache.loading.interop.lightning.CacheDataModule\n"
        "print(run.__module__, Cache.__module__)\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["precache.processing.runner", "precache.cache.reader"]


def test_an_unknown_name_is_an_attribute_error() -> None:
    import precache

    with pytest.raises(AttributeError, match="no attribute 'CachedDatasett'"):
        precache.CachedDatasett  # noqa: B018


def test_no_test_file_imports_another_test_file_or_a_conftest() -> None:
    """Tests share helpers through tests/helpers/ (and job or pipeline scripts beside them), so
    collecting one test file never runs another's module code."""
    tests = REPO / "tests"
    modules = module_names(tests, "tests")
    broken = []
    for name, path in modules.items():
        if not path.name.startswith("test_"):
            continue
        for target in imports_of(path, name, set(modules), top_level_only=False):
            leaf = target.rsplit(".", 1)[-1]
            if target.startswith("tests.") and (leaf.startswith("test_") or leaf == "conftest"):
                broken.append(f"{name} imports {target}")
    assert broken == []


def test_nothing_outside_loading_imports_its_engine() -> None:
    """``precache.loading._engine`` is stage 2's private engine room: the library and the
    recipes reach it only through ``precache.loading``'s public names (tests of the engine
    itself may import it)."""
    modules = module_names(REPO / "precache", "precache")
    modules.update(module_names(REPO / "pipelines", "pipelines"))
    broken = [f"{name} imports {target}"
              for name, path in modules.items() if not _under(name, "precache.loading")
              for target in imports_of(path, name, set(modules), top_level_only=False)
              if _under(target, "precache.loading._engine")]
    assert broken == []
