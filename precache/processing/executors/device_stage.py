"""The device stage: one process runs the ops that want a device (a GPU detector) for every worker.

With a model on a GPU, a worker process per core that each loads the model would put a copy and a
CUDA context per process on the device and feed it batches of a few images. Instead the ops that
declare ``device_stage = True`` run in one process per run (the device worker), and the CPU
workers keep everything else (decoding before, crops and mesh after). A worker that reaches such
an op sends its batch (without the input's raw bytes) to the device worker and waits for the
results; the device worker takes whatever batches are waiting, from every worker, and runs the op
once over all of them (up to ``max_batch`` samples), so the device sees large batches while the
workers decode the next ones. The queue between them is bounded by its design: each worker has
one request in flight, so at most ``workers`` batches wait. Tasks, shards, journal entries and
resumption are unchanged: the worker that ran a task still commits its shard, and a re-run after
a crash (or kill -9 of any process) computes only what was not committed.

An op can also keep most of its work in the worker and send only a part of it: one that declares
``device_parts`` (``{"nets": ("detect", "refine")}`` in ``DetectFaces``, ``{"detect.nets":
...}`` in ``VideoFaces``, which decodes and tracks in the worker) gets, in each worker, a
``DevicePart`` in place of each such attribute (a dotted name: an attribute of an attribute),
whose named methods send their arguments to the device worker (a request ``(position, part,
method)``); the device worker runs every waiting worker's calls of one method as one call. Such a
method takes lists with one entry per item (``detect(images, min_faces)``, ``refine(boxes,
patches)``) and returns one result per item, so calls batch by joining their lists. What a part
is sent is what its networks read (``FaceNets``: an image shrunk to ``detect_size``, O-Net's
48 px patches), so little crosses the process boundary.

On a node with several GPUs the run starts one device worker per GPU (``DevicePool``), no
more than its workers (``device_processes``), each bound to its GPU by ``CUDA_VISIBLE_DEVICES``
in the environment it is spawned with (so its ``cuda`` is that GPU, whenever torch starts CUDA
there); worker ``w`` sends its requests to device worker ``w % G``. An op pinned to one GPU
(``device=cuda:1``) gets one device worker, not rebound.

How busy each device worker is (its share of the run's time), its average batch and the queue's
fill are shared through a small array, for the progress bar and the run's summary (over several
device workers: the busy share averaged, batches and samples summed, ``DeviceStats.combined``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, Union

from precache.processing.executors.local import WorkerDied, _die_with_parent
from precache.processing.ops.base import Op, Sample, Skip

__all__ = ["DeviceStage", "DevicePool", "DeviceClient", "DeviceStats", "DevicePart", "device_ops",
           "served_ops", "run_batch", "restored", "part_results", "attach_parts", "MAX_BATCH",
           "one_per_gpu", "device_processes", "visible_gpus", "device_gpus", "op_device"]

MAX_BATCH = 64
"""The most samples (or items of a part's method) the device worker runs in one call (several
workers' batches together)."""

Target = Union[int, tuple[int, str, str]]
"""What a request runs: op ``position`` on samples, or ``(position, part, method)``: a method of
a device part of that op (``device_parts``) on items."""

_POLL_S = 0.2
_BUSY, _BATCHES, _SAMPLES, _WAITING, _STARTED = range(5)


def device_ops(ops: list[Op]) -> list[int]:
    """Positions of the ops that run in the device worker (whole, or their ``device_parts``)."""
    return [i for i, op in enumerate(ops) if getattr(op, "device_stage", False)]


def one_per_gpu(gpus: int, workers: int) -> int:
    """How many device workers (processes, or Ray device actors) a run starts: one per GPU, but
    no more than its workers (each worker calls one, so a GPU beyond them would hold a model and
    wait for nothing), and one without GPUs."""
    return max(1, min(gpus, workers))


def _any_gpu(device: str | None) -> bool:
    """Whether an op told ``device`` may run on whichever GPU its process sees (``auto``,
    ``cuda``; ``None``: an op that does not say), not on a given one (``cuda:1``) or the CPU."""
    return device in (None, "auto", "cuda")


def device_processes(devices: Sequence[str | None], gpus: int, workers: int) -> int:
    """How many device processes a local run starts, given its device ops' ``devices``
    (``op_device``), the ``gpus`` this process sees and the run's ``workers``: one per GPU
    (``one_per_gpu``) where every device op may use any GPU, else one (an op pinned to
    ``cuda:K``, or on the CPU)."""
    if not all(_any_gpu(device) for device in devices):
        return 1
    return one_per_gpu(gpus, workers)


def _cuda_device_count() -> int:
    """CUDA GPUs torch sees here; 0 without torch, or on Linux without NVIDIA's driver files
    (then without importing torch)."""
    if sys.platform.startswith("linux") and not (
            Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia").exists()):
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count())


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` names them (its entries where it
    is set, else ``0``, ``1``, ...): what binds a device process to one of them."""
    count = _cuda_device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = ([name.strip() for name in listed.split(",")] if listed is not None
             else [str(k) for k in range(count)])
    return names[:count]


def device_gpus(ops: Sequence[Op], workers: int) -> list[str | None]:
    """One entry per device process of a local run with device ops ``ops``: the GPU it is
    bound to (its ``CUDA_VISIBLE_DEVICES``), or ``None`` (one process, not bound: no GPU, or an
    op pinned to ``cuda:K`` or the CPU, where torch is not asked)."""
    devices = [op_device(op) for op in ops]
    if not all(_any_gpu(device) for device in devices):
        return [None]
    gpus = visible_gpus()
    return list(gpus[:device_processes(devices, len(gpus), workers)]) or [None]


def op_device(op: Op) -> str | None:
    """Where a device op was told to run (``auto``, ``cuda``, ``cuda:1``, ``cpu``): its
    ``device``, or that of the object holding one of its device parts (``VideoFaces``:
    ``detect.device``); ``None`` where it does not say."""
    for holder in [op, *(_owner(op, part)[0] for part in parts_of(op))]:
        device = getattr(holder, "device", None)
        if isinstance(device, str):
            return device
    return None


def parts_of(op: Op) -> dict[str, tuple[str, ...]]:
    """The op's device parts (attribute, dotted where it is an attribute's, -> the methods a
    worker calls on it), ``{}`` where the whole op runs in the device worker."""
    return dict(getattr(op, "device_parts", None) or {})


def _owner(op: Op, part: str) -> tuple[Any, str]:
    """The object holding device part ``part`` of ``op`` (``"detect.nets"``: ``op.detect``)
    and the part's attribute name there."""
    *path, name = part.split(".")
    owner: Any = op
    for attribute in path:
        owner = getattr(owner, attribute)
    return owner, name


def part_of(op: Op, part: str) -> Any:
    """Device part ``part`` of ``op`` (a dotted name reaches into its attributes)."""
    owner, name = _owner(op, part)
    return getattr(owner, name)


@dataclass(frozen=True)
class DeviceStats:
    """The device worker's counters: busy seconds, batches and samples run, the requests that
    were waiting summed over batches, and its age in seconds."""

    busy_s: float
    batches: int
    samples: int
    waiting: float
    age_s: float
    processes: int = 1
    """Device workers counted (``combined``)."""

    @classmethod
    def combined(cls, found: Sequence[DeviceStats]) -> DeviceStats:
        """Several device workers' counters as one: the busy share averaged over them (as
        ``busy_s`` of the oldest's age), batches, samples and waiting requests summed."""
        age = max(f.age_s for f in found)
        share = sum(f.busy_s / f.age_s if f.age_s > 0 else 0.0 for f in found) / len(found)
        return cls(share * age, sum(f.batches for f in found), sum(f.samples for f in found),
                   sum(f.waiting for f in found), age, sum(f.processes for f in found))

    def describe(self) -> str:
        """One line: ``"device stage busy 83% (12.0 samples a batch, 1.4 batches waiting)"``;
        over several device workers ``"... busy 83% (mean of 2 device processes; ..."``."""
        if not self.batches:
            return "device stage: no batch yet"
        busy = 100 * self.busy_s / self.age_s if self.age_s > 0 else 0.0
        several = f"mean of {self.processes} device processes; " if self.processes > 1 else ""
        return (f"device stage busy {busy:.0f}% ({several}{self.samples / self.batches:.1f} "
                f"samples a batch, {self.waiting / self.batches:.1f} batches waiting)")


def _remote_error(kind: str, message: str) -> Exception:
    """An op's exception rebuilt in the worker under its own class name (the index records the
    name and message, as for an op run in the worker itself)."""
    return type(kind, (Exception,), {})(message)


def _portable(result: Any) -> Any:
    """A result the device worker can send back: a sample, a list of them, a ``Skip``, or an
    exception as ``("error", class name, message)``."""
    if isinstance(result, BaseException) and not isinstance(result, Skip):
        return ("error", type(result).__name__, str(result) or repr(result))
    return result


def served_ops(config: Any) -> dict[int, Op]:
    """The device ops of ``config``'s pipeline (``config.device_ops``) by position, set up
    (their models load here): the whole op, or only its device parts (the rest of it runs in
    the workers)."""
    from precache.processing.worker import config_ops

    ops = config_ops(config)
    served = {i: ops[i] for i in config.device_ops}
    for op in served.values():
        parts = parts_of(op)
        for part in parts:
            part_of(op, part).setup()
        if not parts:
            op.setup()
    return served


def run_batch(served: dict[int, Op], requests: list[tuple[Target, list[Any]]]) -> list[Any]:
    """Each request's reply, as one that can be sent back: for ``(op position, samples)`` its
    results (``_portable``), for ``((position, part, method), items)`` ``part_results``'s
    reply. Every request of one target runs in one call."""
    from precache.processing.worker import _call_op

    replies: list[Any] = [None] * len(requests)
    for target in sorted({t for t, _ in requests}, key=repr):
        mine = [k for k, (t, _) in enumerate(requests) if t == target]
        if isinstance(target, tuple):
            position, part, method = target
            found = _run_part(part_of(served[position], part), method,
                              [requests[k][1] for k in mine])
            for k, reply in zip(mine, found):
                replies[k] = reply
            continue
        results = [_portable(x) for x in _call_op(
            served[target], [s for k in mine for s in requests[k][1]])]
        at = 0
        for k in mine:
            count = len(requests[k][1])
            replies[k], at = results[at:at + count], at + count
    return replies


def _run_part(part: Any, method: str, calls: list[list[tuple]]) -> list[tuple]:
    """``part``'s ``method`` over every call's items at once (each item a tuple of the method's
    arguments): each call's ``("ok", results)``, or, where the method raised (or the part has
    no such method, as the op would have failed in the worker), ``("error", class name,
    message)``; a failure of the joined call is retried call by call, so it fails only the call
    (the worker's sample) that causes it."""
    items = [item for call in calls for item in call]
    try:
        results = getattr(part, method)(*[list(column) for column in zip(*items)])
        if len(results) != len(items):
            raise RuntimeError(f"{type(part).__name__}.{method} returned {len(results)} "
                               f"results for {len(items)} items")
    except Exception as error:  # noqa: BLE001 - the error of the call that causes it
        if len(calls) > 1:
            return [_run_part(part, method, [call])[0] for call in calls]
        return [("error", type(error).__name__, str(error) or repr(error))]
    replies, at = [], 0
    for call in calls:
        replies.append(("ok", list(results[at:at + len(call)])))
        at += len(call)
    return replies


def part_results(reply: tuple) -> list[Any]:
    """A part call's results from its reply, or its error raised here under its class name."""
    if reply[0] == "error":
        raise _remote_error(reply[1], reply[2])
    return reply[1]


def _device_main(config: Any, requests: Any, responses: dict[int, Any], stats: Any,
                 parent_pid: int) -> None:
    """Body of the device worker: set up the device ops once, then serve batches until ``None``
    (``responses``: the queue back to each worker it serves, by worker number)."""
    from precache.threads import pin_threads

    _die_with_parent(parent_pid)
    pin_threads()
    try:
        served = served_ops(config)
    except Exception:  # noqa: BLE001 - every waiting worker gets the failure
        failure = ("setup", traceback.format_exc())
        while (request := requests.get()) is not None:
            responses[request[0]].put(failure)
        return
    stats[_STARTED] = time.time()
    while (first := requests.get()) is not None:
        batch, stop = [_opened(first)], False
        while sum(len(r[3]) for r in batch) < MAX_BATCH:
            try:
                request = requests.get_nowait()
            except queue.Empty:
                break
            if request is None:
                stop = True
                break
            batch.append(_opened(request))
        started = time.perf_counter()
        replies = run_batch(served, [(r[2], r[3]) for r in batch])
        for (worker, request_id, _, _), results in zip(batch, replies):
            responses[worker].put(("ok", request_id, _packed(results)))
        with stats.get_lock():
            stats[_BUSY] += time.perf_counter() - started
            stats[_BATCHES] += 1
            stats[_SAMPLES] += sum(len(r[3]) for r in batch)
            stats[_WAITING] += len(batch)
        if stop:
            break


def _opened(request: tuple) -> tuple:
    """A request as the worker sent it, its samples unpickled (``DeviceClient.call``)."""
    worker, request_id, position, payload = request
    return worker, request_id, position, pickle.loads(payload)


def _packed(results: Any) -> bytes:
    """The results pickled here, not by the queue's feeder thread, which would drop a reply it
    cannot pickle and leave its worker waiting for ever: a result that cannot be pickled fails
    its sample instead (a part call's reply: the call), saying so."""
    try:
        return pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - find the results that cannot be sent
        if isinstance(results, tuple):  # a part call's reply (``_run_part``)
            return pickle.dumps(_sendable(results, "back to its worker"),
                                protocol=pickle.HIGHEST_PROTOCOL)
        return pickle.dumps([_sendable(r, "back to its worker") for r in results],
                            protocol=pickle.HIGHEST_PROTOCOL)


def _sendable(value: Any, where: str) -> Any:
    """``value``, or an error result saying why it cannot be pickled and sent ``where``."""
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        return value
    except Exception as e:  # noqa: BLE001 - any pickling failure
        return ("error", "PicklingError", f"this sample cannot be sent {where} from the device "
                f"stage ({type(e).__name__}: {e}); return arrays, numbers and strings")


class DeviceStage:
    """One device worker process of a run, and the queues to it and back to its workers.

    Args:
        context: the multiprocessing context (spawn).
        config: the run's ``WorkerConfig``.
        workers: the numbers of the workers that send it batches (the calling process is 0).
        gpu: the GPU it is bound to (its ``CUDA_VISIBLE_DEVICES``), or ``None``: the caller's.
    """

    def __init__(self, context: Any, config: Any, workers: Sequence[int],
                 gpu: str | None = None) -> None:
        self.gpu = gpu
        self.requests = context.Queue(maxsize=max(1, len(workers)))
        # a request of this process (worker 0) still in the pipe when the device worker dies
        # must not block this process's exit (the pipe has no reader left)
        self.requests.cancel_join_thread()
        self.responses = {worker: context.Queue() for worker in workers}
        self.stats = context.Array("d", 5)
        self.process = context.Process(
            target=_device_main, args=(config, self.requests, self.responses, self.stats,
                                       os.getpid()), daemon=True)

    def start(self) -> None:
        """Start the process, bound to ``gpu`` from its first instruction: the variable is in
        the environment it is spawned with, so even a torch imported while its arguments are
        unpickled (a pipeline module importing torch) starts CUDA on that GPU alone."""
        with _environment("CUDA_VISIBLE_DEVICES", self.gpu):
            self.process.start()

    def client(self, worker: int) -> DeviceClient:
        """What worker ``worker`` calls the device ops through."""
        return DeviceClient(worker, self.requests, self.responses[worker], self.process.pid)

    def snapshot(self) -> DeviceStats:
        with self.stats.get_lock():
            busy, batches, samples, waiting, started = list(self.stats)
        return DeviceStats(busy, int(batches), int(samples), waiting,
                           time.time() - started if started else 0.0)

    def died(self) -> str | None:
        """Why the device worker is gone, if it is."""
        code = self.process.exitcode
        return None if code in (None, 0) else (f"the device stage process {self.process.pid} "
                                               f"died with exit code {code}")

    def ask_to_stop(self) -> None:
        """Ask it to finish after the batches already sent (``stop`` then waits)."""
        if self.process.is_alive():
            try:
                self.requests.put(None, timeout=_POLL_S)
            except queue.Full:
                pass

    def stop(self, asked: bool = False) -> None:
        """Ask it to finish (after the batches already sent; ``asked``: done already), then
        make sure it is gone."""
        if not asked:
            self.ask_to_stop()
        if self.process.is_alive():
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.terminate()
        self.process.join()


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """``name`` set to ``value`` in this process's environment for a block (``None``: left as
    it is), so that a process spawned in it inherits the value; restored after."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


class DevicePool:
    """A local run's device workers: one per entry of ``gpus`` (``device_gpus``), each bound to
    that GPU, at most one per worker; worker ``w`` is served by device worker ``w % len``, so
    each has ``workers / len`` workers with one request in flight each.

    Args:
        context: the multiprocessing context (spawn).
        config: the run's ``WorkerConfig``.
        workers: worker processes that send batches, the calling process (worker 0) included.
        gpus: one entry per device worker: its GPU, or ``None`` (not bound).
    """

    def __init__(self, context: Any, config: Any, workers: int,
                 gpus: Sequence[str | None] = (None,)) -> None:
        bound = list(gpus) or [None]
        count = max(1, min(len(bound), workers))
        self.stages = [DeviceStage(context, config, range(k, max(workers, 1), count), bound[k])
                       for k in range(count)]

    def start(self) -> None:
        for stage in self.stages:
            stage.start()

    def client(self, worker: int) -> DeviceClient:
        """What worker ``worker`` calls the device ops through: its device worker's client."""
        return self.stages[worker % len(self.stages)].client(worker)

    def snapshot(self) -> DeviceStats:
        """The device workers' counters together (``DeviceStats.combined``)."""
        found = [stage.snapshot() for stage in self.stages]
        return found[0] if len(found) == 1 else DeviceStats.combined(found)

    def died(self) -> str | None:
        """Why a device worker is gone, if one is (the run needs every one)."""
        return next((why for stage in self.stages if (why := stage.died())), None)

    def stop(self) -> None:
        """Ask every device worker to finish, then make sure each is gone."""
        for stage in self.stages:
            stage.ask_to_stop()
        for stage in self.stages:
            stage.stop(asked=True)


def _alive(pid: int, proc: str = "/proc") -> bool:
    """Whether process ``pid`` runs (not gone, not a zombie): from ``proc`` (``/proc``, Linux);
    on a platform without it, whether ``os.kill(pid, 0)`` finds the process (a zombie then
    reads as alive: the device worker's parent also watches its exit code,
    ``DeviceStage.died``)."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        if os.path.isdir(proc):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


class DeviceClient:
    """A worker's end: ``call(position, samples)`` runs op ``position`` of the pipeline in the
    device worker on ``samples`` and returns its results as ``_call_op`` would;
    ``call_part(position, part, method, items)`` runs a method of one of its device parts.

    ``watch``: in the calling process (worker 0), why another process the run needs is gone, if
    it is (``None`` elsewhere): a worker killed while writing its request leaves the device
    worker waiting for the rest of it, and this process, waiting here, is the one that would
    notice the dead worker."""

    def __init__(self, worker: int, requests: Any, responses: Any, server_pid: int) -> None:
        self.worker, self._requests, self._responses = worker, requests, responses
        self._server_pid = server_pid
        self._next = 0
        self.watch: Callable[[], str | None] | None = None

    def call(self, position: int, samples: list[Sample]) -> list[Any]:
        """Send the samples (without their raw ``data``, which the device op does not need and
        the worker keeps) and wait for the results.

        Raises:
            WorkerDied: the device worker died or could not set up its ops (the run stops;
                a re-run resumes)."""
        try:  # here, not by the queue's feeder thread, which would drop what it cannot pickle
            payload = pickle.dumps(_without_data(samples), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - fail the samples that cannot be sent
            if len(samples) > 1:
                return [r for sample in samples for r in self.call(position, [sample])]
            return [_remote_error("PicklingError", f"this sample cannot be sent to the device "
                                  f"stage ({type(e).__name__}: {e}); give the device op arrays, "
                                  "numbers and strings")]
        return restored(self._ask(position, payload), samples)

    def call_part(self, position: int, part: str, method: str, items: list[tuple]) -> list[Any]:
        """``method`` of the device part ``part`` of op ``position``, run in the device worker
        on ``items`` (each a tuple of the method's arguments): one result per item.

        Raises:
            WorkerDied: as ``call``.
            Exception: the method's error, under its class name (it fails the worker's sample).
        """
        try:
            payload = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - this call cannot be sent
            raise _remote_error("PicklingError", f"{part}.{method}'s arguments cannot be sent to "
                                f"the device stage ({type(e).__name__}: {e})") from None
        return part_results(self._ask((position, part, method), payload))

    def _ask(self, target: Target, payload: bytes) -> Any:
        """Send one request and wait for its reply, unpickled."""
        self._next += 1
        self._put((self.worker, self._next, target, payload))
        while True:
            try:
                reply = self._responses.get(timeout=_POLL_S)
            except queue.Empty:
                self._raise_if_gone()
                continue
            if reply[0] == "setup":
                raise WorkerDied(f"the device stage could not set up its ops:\n{reply[1]}")
            if reply[1] == self._next:
                return pickle.loads(reply[2])

    def _put(self, request: tuple) -> None:
        while True:
            try:
                self._requests.put(request, timeout=_POLL_S)
                return
            except queue.Full:
                self._raise_if_gone()

    def _raise_if_gone(self) -> None:
        """Raises ``WorkerDied`` if the device worker (or, with ``watch``, another) is gone."""
        if not _alive(self._server_pid):
            raise WorkerDied(f"the device stage process {self._server_pid} died") from None
        gone = self.watch() if self.watch is not None else None
        if gone:
            raise WorkerDied(gone) from None


def _without_data(samples: list[Sample]) -> list[Sample]:
    """The samples as sent to the device: without the input's raw bytes, which the worker keeps."""
    return [{k: v for k, v in s.items() if k != "data"} for s in samples]


def restored(results: list[Any], samples: list[Sample]) -> list[Any]:
    """Results from the device as the worker's own op call would have returned them."""
    return [_restored(result, sample) for result, sample in zip(results, samples)]


def _restored(result: Any, sample: Sample) -> Any:
    """A result from the device worker as the worker's own op call would have returned it: the
    sample's raw ``data`` put back, an exception rebuilt."""
    if isinstance(result, tuple) and result and result[0] == "error":
        return _remote_error(result[1], result[2])
    if "data" in sample:
        if isinstance(result, dict):
            result.setdefault("data", sample["data"])
        elif isinstance(result, list):
            for child in result:
                child.setdefault("data", sample["data"])
    return result


class DevicePart:
    """In a worker, an op's device part (``device_parts``) in place of the part itself: the
    declared ``methods`` run in the device stage through ``client`` (``call_part``), batched
    there with other workers' calls; any other attribute is the local part's, which is not set
    up (its model stays out of the worker)."""

    def __init__(self, client: Any, position: int, name: str, methods: tuple[str, ...],
                 local: Any) -> None:
        self._client, self._position, self._name = client, position, name
        self._methods, self._local = tuple(methods), local

    def setup(self) -> None:
        """Nothing here: the device stage sets the part up."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        if name in self._methods:
            return lambda *columns: self._call(name, columns)
        return getattr(self._local, name)

    def _call(self, method: str, columns: tuple[list[Any], ...]) -> list[Any]:
        items = list(zip(*columns))
        if not items:
            return []
        return self._client.call_part(self._position, self._name, method, items)


def attach_parts(ops: list[Op], positions: tuple[int, ...], client: Any) -> frozenset[int]:
    """In a worker: put a ``DevicePart`` calling ``client`` in place of each device part of the
    ops at ``positions``; return the positions of the ops that run whole in the device stage."""
    whole = set()
    for position in positions:
        op = ops[position]
        parts = parts_of(op)
        for name, methods in parts.items():
            owner, attribute = _owner(op, name)
            setattr(owner, attribute, DevicePart(client, position, name, methods,
                                                 getattr(owner, attribute)))
        if not parts:
            whole.add(position)
    return frozenset(whole)
