"""Processes the tests start: the ``precache`` command, gloo ranks, torchrun; waiting for an event
instead of sleeping; free ports."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.helpers.files import REPO


@contextlib.contextmanager
def memory_cap(extra: int = 1024**3) -> Iterator[None]:
    """This process may map at most ``extra`` bytes more inside the block: a runaway allocation
    (a decompression bomb, a read of /dev/zero) raises MemoryError instead of filling the
    machine's memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    in_use = int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                      if line.startswith("VmSize:"))) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (in_use + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int,
                          *fragments: str) -> str:
    """Exit ``code``, no traceback, and one ``precache: error:`` line holding ``fragments``."""
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("precache: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def precache_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
                 **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run the real ``precache`` command (``python -m precache``) in a subprocess."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "precache", *args], capture_output=True,
                          text=True, env=full_env, timeout=timeout, cwd=REPO, **kwargs)


def wait_until(done: Callable[[], bool], what: str, *, timeout: float = 60.0,
               proc: subprocess.Popen | None = None, interval: float = 0.02) -> None:
    """Poll ``done()`` until it is true: the event a test waits for instead of a sleep.
    ``timeout`` only guards against a hang (the test fails naming ``what``); ``proc``, if given,
    must stay alive meanwhile (the test fails with its stderr if it ends first)."""

    deadline = time.monotonic() + timeout
    while not done():
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            err = err.decode(errors="replace") if isinstance(err, bytes) else err
            pytest.fail(f"the process ended (exit {proc.returncode}) before {what}\n{err}")
        assert time.monotonic() < deadline, f"gave up after {timeout:.0f} s waiting for {what}"
        time.sleep(interval)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a torch.distributed rendezvous)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 a moment ago (held open together, so they
    differ): for servers the tests start."""

    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_torchrun(script: Path, ranks: int, *args: str) -> list[dict]:
    """Run a training entry point under torchrun (one node) with ``ranks`` CPU processes; return
    the epoch records it appended to ``<--out>/metrics.jsonl`` in this run."""

    out = Path(args[args.index("--out") + 1])
    metrics = out / "metrics.jsonl"
    before = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")  # stacks on a crash
    # --standalone: torchrun binds a free port itself (no window in which another process could
    # take one picked here).
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={ranks}", str(script), *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, (f"exit {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n"
                                  f"--- stderr\n{done.stderr[-8000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()[before:]]
    return [r for r in records if r.get("kind", "epoch") == "epoch"]  # not run or step records


def launch_ranks(module: str, world: int, out: Path, args: list[str], timeout: float) -> list[dict]:
    """Run ``python -m module *args`` as ``world`` gloo ranks (RANK, WORLD_SIZE, a free
    MASTER_PORT on 127.0.0.1), each in its own process group; kill them all if one fails or
    ``timeout`` (a guard against a hang) runs out. Each rank writes ``out/rank<R>.json``, and
    their contents are returned in rank order."""

    out.mkdir(parents=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    procs = []
    for rank in range(world):
        log = open(out / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=REPO,
            env=dict(env, RANK=str(rank)), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))  # its own process group: killing it takes its workers too
        log.close()
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while any(p.poll() is None for p in procs):
            timed_out = time.monotonic() > deadline
            if timed_out or any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if any(p.returncode != 0 for p in procs):
        logs = "\n".join(f"--- rank {r} (exit {p.returncode})\n{(out / f'rank{r}.log').read_text()}"
                         for r, p in enumerate(procs))
        why = f"timed out after {timeout:.0f} s" if timed_out else "failed"
        pytest.fail(f"{world} ranks {why}:\n{logs[-6000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
