"""The README and docs/*.md run: every ``python`` and ``bash`` block, on small sample data.

Each block runs in a folder of its own, a copy of one small workspace built once for the module
(the paths the docs use: ``data/samples`` and its faces cache ``data/cache``, ``data/videos`` and
``data/video_cache``, ``data/corpus`` and ``data/text_cache``, ``photos/``). A Python block runs
as a script (``__name__ == "__main__"``) in this process; a bash block runs under ``bash -eu``
with this environment's bin folder (``.venv/bin``) taken off PATH, as in a new shell, and put
back first only where the reader has been told to activate it: in the README after it says
``source .venv/bin/activate``, on every docs page (read after the README). So a README whose
commands need the venv but never say to activate it fails here, as it would for a new user.

A block that cannot run here (a GPU, a cluster, a bucket, minutes of work, placeholder paths)
is preceded by ``<!-- not run: REASON -->``: it is reported as skipped with that reason, and a
marker without a reason fails. Blocks without a language (diagrams, printed output) are not
run and must not hold commands or code. The relative links between the pages must resolve,
anchors included.
"""

from __future__ import annotations

import ast
import os
import re
import runpy
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO, load_script, write_photos

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN = {"python", "bash"}
NOT_RUN = re.compile(r"^<!--\s*not run:(.*?)-->\s*$")
README_MAX_LINES = 300
ACTIVATE = "source .venv/bin/activate"
VENV_COMMAND = re.compile(r"^\s*(precache|python3?|torchrun)\b", re.M)
"""A line that calls a command the venv provides (not ``.venv/bin/python``, which needs none)."""


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int  # of the opening fence, from 1
    lang: str
    code: str
    marker: str | None  # the `<!-- not run: ... -->` line before the fence, if any

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def reason(self) -> str | None:
        match = NOT_RUN.match(self.marker or "")
        return match.group(1).strip() if match else None


def read_blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` (fences at the start of a line), in order."""
    lines = page.read_text(encoding="utf-8").split("\n")
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, lang = i, lines[i][3:].strip()
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            assert end is not None, f"{page.name}:{i + 1}: a code block is never closed"
            before = next((lines[j].strip() for j in range(start - 1, -1, -1)
                           if lines[j].strip()), "")
            marker = before if before.startswith("<!-- not run") else None
            blocks.append(Block(page, start + 1, lang, "\n".join(lines[start + 1:end]) + "\n",
                                marker))
            i = end
        i += 1
    return blocks


BLOCKS = [block for page in PAGES for block in read_blocks(page)]
RUNNABLE = [block for block in BLOCKS if block.lang in RUN]


# --- the workspace the blocks run in --------------------------------------------------------------

CORPUS = {
    "pos": ["A calm and lovely morning by the sea, with good friends and good bread.",
            "The concert was wonderful: every song made the crowd smile and sing along.",
            "Great news today. The garden is green again and the tomatoes are ripe.",
            "I enjoyed the book from the first page to the last; a delight to read.",
            "Sunny days, warm tea and a quiet street. Life is good here."],
    "neg": ["The train was late again and the coffee on board was cold and bitter.",
            "A dull film, far too long, with a plot that made no sense at all.",
            "The printer jammed twice and then the network went down for the day.",
            "Rain all week, a leaking roof, and the repairman never came.",
            "Terrible service: the soup was cold and the bill was wrong."],
}


def quiet(*args: object, **kwargs: object) -> None:
    """A ``log`` for ``precache.run`` that prints nothing."""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every block's own folder is copied from (built once: about 10 s)."""
    import precache

    root = tmp_path_factory.mktemp("docs_workspace")
    subprocess.run([sys.executable, str(REPO / "data" / "make_samples.py"), "--output",
                    str(root / "data" / "samples"), "--count", "12"], check=True,
                   capture_output=True)
    videos = load_script(REPO / "data" / "make_videos.py", "make_videos_for_docs")
    videos.write_videos(root / "data" / "videos", per_label=1, seconds=1.0, fps=8)
    for label, texts in CORPUS.items():
        folder = root / "data" / "corpus" / label
        folder.mkdir(parents=True)
        for i, text in enumerate(texts):
            (folder / f"doc{i}.txt").write_text(text + "\n", encoding="utf-8")
    write_photos(root / "photos", 12)
    cwd = Path.cwd()
    os.chdir(root)  # the caches record their inputs as the docs name them: relative paths
    try:
        precache.run("faces", "data/samples", "data/cache", params={"size": 128}, workers=1,
                     progress=False, log=quiet)
        precache.run("video-faces", "data/videos", "data/video_cache", workers=1,
                     params={"size": 64, "frames": 8, "labels": "data/videos_metadata.json"},
                     progress=False, log=quiet)
        precache.run("text", "data/corpus", "data/text_cache", workers=1, progress=False,
                     log=quiet)
    finally:
        os.chdir(cwd)
    return root


@pytest.fixture
def block_folder(workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the workspace, made the current directory."""
    folder = tmp_path / "ws"
    shutil.copytree(workspace, folder, symlinks=True)
    monkeypatch.chdir(folder)
    monkeypatch.setenv("PRECACHE_HOME", str(tmp_path / "precache_home"))
    return folder


# --- the blocks -----------------------------------------------------------------------------------

def activated(block: Block) -> bool:
    """Whether the reader has activated the venv by this block: on a docs page always; in the
    README once its text before the block says ``source .venv/bin/activate``."""
    if block.page.name != "README.md":
        return True
    before = block.page.read_text(encoding="utf-8").split("\n")[:block.line - 1]
    return ACTIVATE in "\n".join(before)


def new_shell_path() -> str:
    """PATH as in a new shell: without this environment's bin folder (nor any other folder that
    holds a ``precache`` or ``torchrun`` command, so none is found by accident)."""
    venv_bin = Path(sys.executable).parent.resolve()
    kept = [entry for entry in os.environ["PATH"].split(os.pathsep)
            if entry and Path(entry).resolve() != venv_bin
            and not any((Path(entry) / name).is_file() for name in ("precache", "torchrun"))]
    return os.pathsep.join(kept)


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.id for block in RUNNABLE])
def test_block_runs(block: Block, block_folder: Path) -> None:
    if block.marker is not None:
        pytest.skip(f"not run: {block.reason}")
    if block.lang == "python":
        script = block_folder / "block.py"
        script.write_text(block.code, encoding="utf-8")
        runpy.run_path(str(script), run_name="__main__")
        return
    script = block_folder / "block.sh"
    script.write_text(block.code, encoding="utf-8")
    path = new_shell_path()
    if activated(block):  # what `source .venv/bin/activate` does to PATH
        path = f"{Path(sys.executable).parent}{os.pathsep}{path}"
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    done = subprocess.run(["bash", "-eu", "-o", "pipefail", str(script)], cwd=block_folder,
                          env=dict(env, PATH=path), capture_output=True, text=True, timeout=180)
    hint = "" if activated(block) else (f"\n(no `{ACTIVATE}` in {block.page.name} before this "
                                        "block: a new user's shell has no precache, torchrun or "
                                        "the venv's python)")
    assert done.returncode == 0, (f"{block.id} exited {done.returncode}{hint}\n{block.code}\n"
                                  f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")


def test_the_readme_says_to_activate_the_venv_before_its_commands_need_it() -> None:
    """Run or not, a README block that calls precache, python or torchrun comes after the line
    that activates the venv (the blocks above run without it on PATH; this covers the rest)."""
    early = [block.id for block in read_blocks(REPO / "README.md")
             if block.lang == "bash" and VENV_COMMAND.search(block.code) and not activated(block)]
    assert not early, (f"README blocks call precache/python/torchrun before the README says "
                       f"`{ACTIVATE}`: {early}")


def test_every_block_that_is_not_run_says_why() -> None:
    unexplained = [block.id for block in BLOCKS if block.marker is not None and not block.reason]
    assert not unexplained, f"<!-- not run: REASON --> without a reason: {unexplained}"
    on_others = [block.id for block in BLOCKS if block.marker is not None and block.lang not in RUN]
    assert not on_others, f"a not-run marker on a block that would not run anyway: {on_others}"


def test_python_blocks_that_are_not_run_still_parse_and_import() -> None:
    """A block that cannot run here still names modules and names that exist."""
    for block in BLOCKS:
        if block.lang != "python" or block.marker is None:
            continue
        tree = ast.parse(block.code, filename=block.id)
        imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        exec(compile(ast.Module(body=imports, type_ignores=[]), block.id, "exec"), {})


def test_blocks_without_a_language_hold_no_code() -> None:
    """Diagrams and printed output only: a command or code there would escape the test."""
    code = re.compile(r"^\s*(\$ |precache |python |torchrun |import |from \S+ import )", re.M)
    hidden = [block.id for block in BLOCKS if block.lang not in RUN and code.search(block.code)]
    assert not hidden, f"code in a block that is not run (label it python or bash): {hidden}"


def test_there_are_blocks_to_run() -> None:
    run = [block for block in RUNNABLE if block.marker is None]
    assert sum(block.lang == "python" for block in run) >= 5
    assert sum(block.lang == "bash" for block in run) >= 3


# --- the README and the links ---------------------------------------------------------------------

def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < README_MAX_LINES
    first = next(block for block in read_blocks(REPO / "README.md") if block.lang == "bash")
    commands = [line.split("#")[0].strip() for line in first.code.splitlines() if line.strip()]
    assert commands == ["bash .ci/quickstart", ".venv/bin/python -m pytest"]
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert ".venv/bin/python -m pytest" in ci


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped,
    spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text(encoding="utf-8"))
    return {slug(match) for match in re.findall(r"(?m)^#{1,6} (.+)$", text)}


def test_links_between_the_pages_resolve() -> None:
    link = re.compile(r"\]\(([^)\s]+)\)|src=\"([^\"]+)\"")
    broken = []
    for page in PAGES:
        text = re.sub(r"(?ms)^```.*?^```", "", page.read_text(encoding="utf-8"))
        for match in link.finditer(text):
            target = match.group(1) or match.group(2)
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_docs_name_no_module_from_before_the_rename() -> None:
    stale = re.compile(r"precache[/.]build\b|precache/(pipeline|records)\.py|precache/ops/")
    found = [f"{page.name}:{n}" for page in PAGES
             for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             if stale.search(line)]
    assert not found, f"paths from before precache/build moved to precache/processing: {found}"
