"""Ray executor: the local executor's tasks, run by one Ray actor per worker slot.

Each actor sets up the ops once (``init_worker``: models load once per actor), then takes tasks
one at a time; whichever actor is free gets the next task (largest first), so actors finish
together. An actor commits its task's shard itself, straight into the output: on a cluster of
several machines the output is an object-store URL (then the driver writes the journal entries)
or a path that every node sees at the same place (a shared file system). Results come back to the driver as they complete, in completion order, as
with ``precache.processing.executors.local.run_tasks``.

An actor that dies (killed, out of memory, its node lost) costs only its task: the task goes to a
fresh actor, up to ``MAX_ATTEMPTS`` times in all. Re-running a task is safe: a task always writes
the same shard (same name, same bytes) and the same journal entry, each by atomic rename, and the
driver only counts the attempt whose result it received, so no input is lost or counted twice.

Actors get the driver's import path and ``PRECACHE_*`` environment variables, so a pipeline given
as a file or module imports in them as it does in the driver; on a cluster, every node needs
precache and the pipeline's packages installed, and those folders at the same paths.

With a device stage (``device_stage``), the ops that declare it run in a pool of device actors
(one per GPU of the cluster, each asking Ray for a GPU, up to one per worker actor; one without
GPUs), which the worker actors call: each device actor runs the batches that reach it together,
as the local device stage does (``precache.processing.executors.device_stage``), device parts' method calls too.

Ray is imported only here and only when this executor runs: ``pip install 'precache[ray]'``.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Iterator

from precache.processing.executors.device_stage import (MAX_BATCH, DeviceStats, Target,
                                                         _without_data, one_per_gpu, part_results,
                                                         restored, run_batch, served_ops)
from precache.processing.executors.local import WorkerDied, largest_first
from precache.processing.worker import Task, TaskResult, WorkerConfig, init_worker, run_task
from precache.errors import RunError

__all__ = ["run_tasks_ray", "require_ray", "MAX_ATTEMPTS", "INSTALL_HINT"]

MAX_ATTEMPTS = 3
"""Times a task is started on an actor before the run gives up (each death of its actor counts)."""
INSTALL_HINT = "the ray executor needs Ray, which is not installed: pip install 'precache[ray]'"
CONNECT_TIMEOUT_S = 5.0
"""How long ``require_ray`` waits for the cluster's address to accept a connection."""
KILL_WAIT_S = 30.0
"""How long an abandoned run waits for the processes of its killed actors to exit."""
ENV_PREFIX = "PRECACHE_"
"""Environment variables with this prefix are passed on to the actors, as local workers inherit
them."""


def require_ray(address: str | None = None) -> None:
    """Fail early, before any work, if Ray is not installed or nothing listens at ``address``
    (Ray itself would go on trying to connect for minutes).

    Raises:
        RunError: Ray cannot be imported, or ``address`` (``HOST:PORT``) refuses connections.
    """
    if importlib.util.find_spec("ray") is None:
        raise RunError(INSTALL_HINT)
    host, _, port = (address or "").rpartition(":")
    if not host or "://" in address or not port.isdigit():
        return  # no address, "auto", or ray://...: Ray finds or reaches it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise RunError(f"no Ray cluster at '{address}' ({e}): start one with `ray start --head`, "
                       "or give the address it printed") from None


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return ray


class PrecacheWorker:
    """Body of one Ray actor: the ops, set up once, and the tasks it is given.

    Args:
        config: what ``init_worker`` needs.
        env: environment variables to set first (the driver's ``PRECACHE_*``).
        python_path: folders to put in front of ``sys.path`` first (the driver's), so the
            pipeline's modules import as they do in the driver.
    """

    def __init__(self, config: WorkerConfig, env: dict[str, str], python_path: list[str],
                 device: Any = None) -> None:
        os.environ.update(env)
        sys.path[:0] = [path for path in python_path if path not in sys.path]
        init_worker(config, device)

    def ready(self) -> tuple[int, str]:
        """Answered once set up (the driver gives an actor tasks only after this): where it runs,
        its pid and Ray node id."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def run(self, task: Task) -> TaskResult:
        return run_task(task)


class DeviceActor:
    """Body of one device actor: the device ops, set up once, and a thread that runs every
    call waiting (from any worker actor; the actor takes ``max_concurrency`` calls at once)
    as one batch of up to ``MAX_BATCH`` samples."""

    def __init__(self, config: WorkerConfig, env: dict[str, str], python_path: list[str]) -> None:
        os.environ.update(env)
        sys.path[:0] = [path for path in python_path if path not in sys.path]
        self._served = served_ops(config)
        self._waiting: queue.Queue = queue.Queue()
        self._counts = [0.0, 0, 0, 0]  # busy seconds, batches, samples, calls waiting
        self._started = time.time()
        threading.Thread(target=self._serve, daemon=True).start()

    def call(self, target: Target, items: list[Any]) -> Any:
        """Op ``target`` on samples, or a method of one of its device parts on items
        (``device_stage.Target``), run with whatever other calls are waiting."""
        done, reply = threading.Event(), []
        self._waiting.put((target, items, done, reply))
        done.wait()
        return reply[0]

    def stats(self) -> DeviceStats:
        busy, batches, samples, waiting = self._counts
        return DeviceStats(busy, batches, samples, waiting, time.time() - self._started)

    def _serve(self) -> None:
        while True:
            batch = [self._waiting.get()]
            while sum(len(b[1]) for b in batch) < MAX_BATCH:
                try:
                    batch.append(self._waiting.get_nowait())
                except queue.Empty:
                    break
            started = time.perf_counter()
            replies = run_batch(self._served, [(b[0], b[1]) for b in batch])
            self._counts = [self._counts[0] + time.perf_counter() - started,
                            self._counts[1] + 1, self._counts[2] + sum(len(b[1]) for b in batch),
                            self._counts[3] + len(batch)]
            for (_, _, done, reply), results in zip(batch, replies):
                reply.append(results)
                done.set()


class RayDeviceClient:
    """A worker actor's end of the device actors: ``call`` as ``DeviceClient.call``, on the
    device actor ``worker % pool`` (each worker sticks to one, so their loads balance)."""

    def __init__(self, actors: list[Any], worker: int) -> None:
        self._actor = actors[worker % len(actors)]

    def call(self, position: int, samples: list[dict[str, Any]]) -> list[Any]:
        return restored(self._ask(position, _without_data(samples)), samples)

    def call_part(self, position: int, part: str, method: str, items: list[tuple]) -> list[Any]:
        """As ``DeviceClient.call_part``."""
        return part_results(self._ask((position, part, method), items))

    def _ask(self, target: Target, items: list[Any]) -> Any:
        import ray

        try:
            return ray.get(self._actor.call.remote(target, items))
        except ray.exceptions.RayActorError as e:
            raise _device_actor_died(e) from None


def _first_line(error: BaseException) -> str:
    """An error's first line (Ray's errors go on with the remote traceback and advice)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _device_actor_died(error: BaseException) -> WorkerDied:
    """The one line that stops a run whose device actor died (Ray's ``RayActorError``)."""
    return WorkerDied(f"a device actor died ({_first_line(error)})")


def _device_pool(ray: Any, config: WorkerConfig, env: dict[str, str], python_path: list[str],
                 workers: int) -> list[Any]:
    """One device actor per GPU of the cluster, no more than its worker actors
    (``device_stage.one_per_gpu``, as a local run's device processes), each with one GPU (one
    actor, without GPUs: it then shares the CPUs, asking for none of them)."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    actor_class = ray.remote(DeviceActor).options(
        num_cpus=0, num_gpus=1 if gpus else 0, max_restarts=0, max_task_retries=0,
        max_concurrency=workers + 1)
    return [actor_class.remote(config, env, python_path)
            for _ in range(one_per_gpu(gpus, workers))]


def _pool_stats(ray: Any, pool: list[Any]) -> DeviceStats:
    """The device actors' counters together, as a local run's device processes'
    (``DeviceStats.combined``: the summary names how many)."""
    try:
        return DeviceStats.combined(ray.get([actor.stats.remote() for actor in pool]))
    except ray.exceptions.RayActorError as e:  # one died since the last batch: the run stops
        raise _device_actor_died(e) from None


def _python_path() -> list[str]:
    """This process's import path without the interpreter's own folders (nodes of a cluster must
    hold these folders at the same paths)."""
    own = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    paths: list[str] = []
    for entry in sys.path:
        path = os.path.realpath(entry or os.curdir)
        inside_own = any(path == p or path.startswith(p + os.sep) for p in own)
        if os.path.isdir(path) and not inside_own and path not in paths:
            paths.append(path)
    return paths


def _connect(ray: Any, address: str | None, workers: int | None) -> bool:
    """Use this process's Ray connection if it has one, else start a private local Ray
    (``address=None``) or connect to the cluster at ``address``. Returns whether it connected
    (and so must shut down)."""
    if ray.is_initialized():
        return False
    quiet: dict[str, Any] = {"logging_level": logging.WARNING}
    try:
        if address is None:
            # "local" starts a new instance even where `ray start` left one running.
            ray.init(address="local", num_cpus=workers, include_dashboard=False, **quiet)
        else:
            ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as e:
        from precache.processing import RunError

        if address is None:
            raise RunError(f"cannot start a local Ray: {e}") from None
        raise RunError(f"cannot connect to the Ray cluster at '{address}': {e}") from None
    return True


def _describe(task: Task) -> str:
    if not task.inputs:
        return f"task {task.seq}"
    return (f"task {task.seq} ({len(task.inputs)} inputs, '{task.inputs[0].locator}' to "
            f"'{task.inputs[-1].locator}')")


@dataclass
class _Actor:
    """One actor and what the driver knows of it: its task, once set up its pid and node."""

    handle: Any
    task: Task | None = None
    pid: int = 0
    node: str = ""


def _wait_until_gone(pid: int, timeout_s: float) -> None:
    """Run on a killed actor's node: return once its process has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def _stop(ray: Any, pending: dict[Any, _Actor]) -> None:
    """Kill the actors still working or starting, and wait until those that were running a task
    have exited: Ray reports a killed actor dead some milliseconds before its process is gone, and
    the task could still commit its shard then, after this run has ended (and, on a re-run,
    beside the new run)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    for actor in pending.values():
        ray.kill(actor.handle)
    waits = [ray.remote(num_cpus=0)(_wait_until_gone).options(
                 scheduling_strategy=NodeAffinitySchedulingStrategy(actor.node, soft=False)
             ).remote(actor.pid, KILL_WAIT_S)
             for actor in pending.values() if actor.task is not None]
    try:
        ray.get(waits, timeout=KILL_WAIT_S)
    except ray.exceptions.RayError:
        pass  # a lost node, or a process that would not die: nothing more to do from here


def run_tasks_ray(tasks: list[Task], config: WorkerConfig, workers: int | None = None,
                  address: str | None = None, device_stage: bool = False,
                  ) -> Iterator[TaskResult]:
    """Run ``tasks`` on Ray actors, one per worker slot; yield each result as it completes.

    Args:
        tasks: the tasks (each becomes one shard, committed by the actor that runs it).
        config: what every actor needs to set up the ops and write the cache.
        workers: actors to run (default: the CPUs of the Ray cluster).
        address: a running cluster's address (``HOST:PORT``, ``ray://...`` or ``auto``); ``None``
            starts a local Ray for this run and stops it at the end. If this process is already
            connected to Ray (``ray.init`` was called), that connection is used and kept.
        device_stage: the ops that declare ``device_stage`` run in a pool of device actors
            (one per GPU, at most one per worker actor: ``device_stage.one_per_gpu``); each result then
            carries their counters.

    Raises:
        WorkerDied: an actor could not set up the ops, a task raised outside any one input (e.g.
            disk full), or a task's actor died ``MAX_ATTEMPTS`` times.
        RunError: Ray could not be started or reached.
    """
    if not tasks:
        return  # nothing to compute: do not start Ray
    ray = _import_ray()
    connected = _connect(ray, address, workers)
    pending: dict[Any, _Actor] = {}  # the call each actor is busy with -> that actor
    pool: list[Any] = []  # the device actors
    try:
        slots = min(workers or int(ray.cluster_resources().get("CPU", 1)), len(tasks))
        # One task in key order keeps --fail-fast's "first failing input" as with one process.
        todo = deque(tasks if slots <= 1 else largest_first(tasks))
        # The environment goes as arguments, not as a Ray runtime_env: an actor with a runtime_env
        # of its own cannot use the idle worker processes Ray keeps ready (~1 s more per start).
        env = {name: value for name, value in os.environ.items() if name.startswith(ENV_PREFIX)}
        python_path = _python_path()
        actor_class = ray.remote(PrecacheWorker).options(num_cpus=1, max_restarts=0,
                                                         max_task_retries=0)
        attempts: Counter[int] = Counter()
        deaths_at_start = 0

        if device_stage:
            pool = _device_pool(ray, config, env, python_path, slots)
        numbers = itertools.count()  # each worker actor's number: which device actor it calls

        def start_actor() -> None:
            device = RayDeviceClient(pool, next(numbers)) if pool else None
            handle = actor_class.remote(config, env, python_path, device)
            pending[handle.ready.remote()] = _Actor(handle)

        for _ in range(slots):
            start_actor()
        # Done when no task is left or running: an actor still waiting for a free CPU (more
        # workers than the cluster has CPUs) is not waited for.
        while pending and (todo or any(a.task is not None for a in pending.values())):
            [ref], _ = ray.wait(list(pending), num_returns=1)
            actor = pending.pop(ref)
            task, actor.task = actor.task, None
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                if e.actor_init_failed:
                    raise WorkerDied(f"worker setup failed:\n{e}") from None
                ray.kill(actor.handle)  # if only unreachable, it must not go on beside another
                if task is None:
                    deaths_at_start += 1
                    if deaths_at_start >= MAX_ATTEMPTS * slots:
                        raise WorkerDied(f"Ray actors keep dying as they start:\n{e}") from None
                else:
                    attempts[task.seq] += 1
                    if attempts[task.seq] >= MAX_ATTEMPTS:
                        raise WorkerDied(f"{_describe(task)} was started {MAX_ATTEMPTS} times and "
                                         f"its worker died each time; last:\n{e}") from None
                    todo.appendleft(task)  # next in line, on whichever actor is free first
                if todo:
                    start_actor()
                continue
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, WorkerDied):  # a device actor died under this task
                    raise WorkerDied(_first_line(e.cause)) from None
                raise WorkerDied(f"{_describe(task) if task else 'a task'} failed:\n{e}") from None
            if task is None:
                actor.pid, actor.node = result  # set up, ready for tasks
            if todo:  # give the actor its next task before handing this result on
                actor.task = todo.popleft()
                pending[actor.handle.run.remote(actor.task)] = actor
            else:
                ray.kill(actor.handle)
            if task is not None:
                if pool:
                    result.device_stats = _pool_stats(ray, pool)
                yield result
    finally:
        if pending:
            _stop(ray, pending)
        for actor in pool:
            ray.kill(actor)
        if connected:
            ray.shutdown()
