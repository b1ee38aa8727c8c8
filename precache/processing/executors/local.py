"""Local executor: this process and ``workers - 1`` spawned processes take tasks from one queue.

The calling process works from the first moment, so the others' start-up (about half a second of
imports and model loading each) overlaps with real work, and a small job is done before they are
even ready. Whoever is free takes the next task (largest first), so workers finish together.
A task's shard is committed by the process that ran it; a process that dies mid-task leaves no
journal entry, so its task is simply redone by the next run.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import queue
import signal
import sys
import threading
import traceback
from typing import Any, Iterator, Sequence

from precache.errors import RunError
from precache.processing.worker import (Task, TaskResult, WorkerConfig, WorkerDied, init_worker,
                                        run_task)
from precache.threads import threads_pinned

__all__ = ["run_tasks", "largest_first", "WorkerDied"]

_POLL_S = 0.2
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this worker if the run's process dies (even by kill -9), so no
    orphan goes on writing shards beside the next run (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _child_main(config: WorkerConfig, tasks: Any, results: Any, parent_pid: int,
                device: Any = None) -> None:
    """Body of a spawned worker: set up the ops once, then run tasks until a ``None``."""
    _die_with_parent(parent_pid)
    try:
        init_worker(config, device)
    except Exception:  # noqa: BLE001 - reported to the parent, which stops the run
        results.put(("error", f"worker setup failed:\n{traceback.format_exc()}"))
        return
    while (task := tasks.get()) is not None:
        try:
            results.put(("ok", run_task(task)))
        except RunError as e:  # a refusal (a link planted where the shard is written): its line
            results.put(("run_error", str(e)))
            return
        except OSError as e:  # a full disk, a read-only file system: the run says it in one line
            results.put(("os_error", (e.errno, e.strerror, e.filename, str(e))))
            return
        except WorkerDied as e:  # the device stage died: its line, as in the calling process
            results.put(("error", str(e)))
            return
        except Exception:  # noqa: BLE001 - a bug: the parent stops the run with the traceback
            results.put(("error", f"task {task.seq} failed:\n{traceback.format_exc()}"))
            return


@contextlib.contextmanager
def _children_ignore_ctrl_c() -> Iterator[None]:
    """Start children with SIGINT ignored (the setting survives exec), so Ctrl-C reaches only
    this process, which stops them; otherwise each prints its own traceback, even mid-start."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be changed from the main thread
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _result(message: tuple[str, Any]) -> TaskResult:
    """A child's result, or its failure raised here as the same task run in this process would
    have raised it (``RunError``, ``OSError``: one line), else as ``WorkerDied``."""
    kind, payload = message
    if kind == "run_error":
        raise RunError(payload)
    if kind == "os_error":
        errno, strerror, filename, text = payload
        raise OSError(errno, strerror, filename) if errno is not None else OSError(text)
    if kind == "error":
        raise WorkerDied(payload)
    return payload


def largest_first(tasks: list[Task]) -> list[Task]:
    """Tasks by input bytes, largest first, so that no big task starts last."""
    return sorted(tasks, key=lambda t: -sum(max(0, i.size) for i in t.inputs))


def run_tasks(tasks: list[Task], config: WorkerConfig, workers: int,
              device_stage: bool = False,
              gpus: Sequence[str | None] = (None,)) -> Iterator[TaskResult]:
    """Run ``tasks`` with ``workers`` processes in all (this one included); yield each result.

    In one process tasks go in key order (so ``--fail-fast`` stops at the first failing input);
    with more they go largest first (by input bytes) so that no big task starts last.
    ``device_stage``: the ops that declare ``device_stage`` run in device processes shared by
    the workers (``device_stage.DevicePool``): one per entry of ``gpus``
    (``device_stage.device_gpus``: the GPU each is bound to, or ``None``), at most one per
    worker; each result then carries their counters.

    Raises:
        WorkerDied: a spawned worker or the device stage died (killed, out of memory, a crash
            in native code) or could not set up its ops.
    """
    if device_stage and tasks:
        yield from _run_staged(tasks, config, workers, gpus)
        return
    children = min(workers - 1, len(tasks) - 1)
    with threads_pinned():  # spawned children inherit this one-thread environment
        init_worker(config)
        if children <= 0:
            for task in tasks:
                yield run_task(task)
            return
        context = multiprocessing.get_context("spawn")  # native models and fork do not mix
        todo, results, procs = _start_children(context, tasks, config, [None] * children)
    yield from _collect(tasks, todo, results, procs)


def _start_children(context: Any, tasks: list[Task], config: WorkerConfig,
                    devices: list[Any]) -> tuple[Any, Any, list[Any]]:
    """The task queue, the results queue and one started child per ``devices`` entry (its
    ``DeviceClient``, or ``None``). Tasks go largest first where there are children."""
    todo, results = context.Queue(), context.Queue()
    todo.cancel_join_thread()  # tasks left behind by an abandoned run must not block exit
    for task in (largest_first(tasks) if devices else tasks):
        todo.put(task)
    for _ in range(len(devices) + 1):
        todo.put(None)  # one stop sign per worker, this process included
    procs = [context.Process(target=_child_main, args=(config, todo, results, os.getpid(), device),
                             daemon=True) for device in devices]
    with _children_ignore_ctrl_c():
        for proc in procs:
            proc.start()
    return todo, results, procs


def _run_staged(tasks: list[Task], config: WorkerConfig, workers: int,
                gpus: Sequence[str | None]) -> Iterator[TaskResult]:
    """``run_tasks`` with device processes: started first (they load the device ops' models
    while the workers load theirs), stopped last; each result carries their counters."""
    from precache.processing.executors.device_stage import DevicePool

    children = max(0, min(workers - 1, len(tasks) - 1))
    context = multiprocessing.get_context("spawn")
    with threads_pinned():
        pool = DevicePool(context, config, children + 1, gpus)
        with _children_ignore_ctrl_c():
            pool.start()
    try:  # this process sets up first, as without a stage: if that fails, no worker is left
        with threads_pinned():
            client = pool.client(0)
            init_worker(config, client)
            todo, results, procs = _start_children(
                context, tasks, config, [pool.client(k + 1) for k in range(children)])
        # while this process waits for the device: the workers, and every device process's exit
        # code (its liveness by pid cannot tell a dead child from a live one without /proc; the
        # run needs the ones this process does not call as well)
        client.watch = lambda: _died(procs) or pool.died()
        for result in _collect(tasks, todo, results, procs, pool.died):
            result.device_stats = pool.snapshot()
            yield result
    finally:
        pool.stop()


def _died(procs: list[Any]) -> str | None:
    """Which worker process died, if one did."""
    dead = [p for p in procs if p.exitcode not in (None, 0)]
    return f"worker process {dead[0].pid} died with exit code {dead[0].exitcode}" if dead else None


def _collect(tasks: list[Task], todo: Any, results: Any, procs: list[Any],
             also_dead: Any = None) -> Iterator[TaskResult]:
    """Run tasks in this process too, and yield every process's results until all are in.
    ``also_dead()``: why another process the run needs is gone, if it is."""
    try:
        received = 0
        while (task := todo.get()) is not None:
            with threads_pinned():
                result = run_task(task)
            received += 1
            yield result
            while True:  # pass on what the children finished meanwhile
                try:
                    message = results.get_nowait()
                except queue.Empty:
                    break
                received += 1
                yield _result(message)
        while received < len(tasks):
            try:
                message = results.get(timeout=_POLL_S)
            except queue.Empty:
                gone = _died(procs) or (also_dead() if also_dead is not None else None)
                if gone:
                    raise WorkerDied(gone) from None
                continue
            received += 1
            yield _result(message)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()  # idle, still starting, or the run is being abandoned
            proc.join()
