"""The pipelines and trainers are examples of the library's use, so they import only its public
names: each name from a module that lists it in ``__all__``, no private module, and stage 1's ops
(and the storage layer) only through their packages, never their internal modules."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

INTERNAL = ("precache.processing.ops.", "precache.storage.")  # their modules are internals


def exported(module: str) -> set[str]:
    """The ``__all__`` of a precache module, read from its source."""
    parts = module.split(".")[1:]
    path = REPO.joinpath("precache", *parts)
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("precache"):
            continue
        module = node.module
        if module.startswith("precache.pipelines") or module == "precache":
            continue
        where = f"{path.relative_to(REPO)}:{node.lineno} {module}"
        if module.startswith(INTERNAL) or any(p.startswith("_") for p in module.split(".")):
            found.append(f"{where} (import it from its package)")
            continue
        missing = {a.name for a in node.names} - exported(module)
        if missing:
            found.append(f"{where}: {sorted(missing)} not in its __all__")
    return found


def test_pipelines_import_only_public_names() -> None:
    found = [line for path in sorted((REPO / "pipelines").rglob("*.py"))
             for line in private_imports(path)]
    assert found == []
