"""One writer per remote cache: a lease object, ``<url>/.writer.json``; and how a lease (this one
or a reader's, ``precache.cache.generations``) tells whether the process it names still lives.

A local cache is guarded by ``flock``, which the kernel releases when its holder dies. Object
stores have no locks, so a run writing ``s3://...`` also holds a lease: a small object naming
its process (``process_identity``) and a random token, rewritten every ``HEARTBEAT_S`` seconds.
Another run refuses to start while the lease is fresh, and takes it over when it is stale:
older than ``TTL_S``, or held by a process that is known to be gone (``process_gone``: a run
killed with kill -9, resumed here).

A process is known to be gone only where its pid means the same process as here: the same host
name, the same boot (``/proc/sys/kernel/random/boot_id``) and the same PID namespace
(``/proc/self/ns/pid``). A container with host networking has this host's name but its own
PID namespace, and another machine may have the same host name; there, and for a lease that
records no boot id and namespace (written by an older precache), only the lease's expiry tells.
The process's start time (``/proc/<pid>/stat``) is recorded too, so a pid the kernel has given
to another process since does not keep a dead holder's lease.

Two runs starting within the same second could both write the lease; each re-reads it after
``SETTLE_S``, and only the one whose token is there goes on. A run checks the lease again just
before it publishes the manifest, so a run that lost it never publishes.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from precache.storage.store import Store

__all__ = ["WriterLease", "LeaseLost", "LEASE_FILE", "TTL_S", "HEARTBEAT_S", "pid_alive",
           "process_identity", "process_gone", "process_alive", "unverifiable"]

LEASE_FILE = ".writer.json"
TTL_S = 120.0
"""A lease not renewed for this long belongs to a run that died."""
HEARTBEAT_S = 30.0
SETTLE_S = 1.0
BOOT_ID = "/proc/sys/kernel/random/boot_id"


class LeaseLost(RuntimeError):
    """Another run holds (or took over) the remote cache's lease."""


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists in this PID namespace (one owned by another user
    counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.lru_cache(maxsize=1)
def _boot_and_namespace() -> tuple[str | None, str | None]:
    """This machine's boot id and this process's PID namespace (``pid:[4026531836]``); ``None``
    for what cannot be read. The namespace only counts if ``/proc`` is this namespace's own
    (``/proc/self`` is this pid): otherwise the pids found there are another namespace's.
    Neither changes during a process's life (nor in a forked child)."""
    try:
        with open(BOOT_ID) as f:
            boot_id: str | None = f.read().strip() or None
    except OSError:
        boot_id = None
    try:
        own_proc = os.readlink("/proc/self") == str(os.getpid())
        namespace: str | None = os.readlink("/proc/self/ns/pid") if own_proc else None
    except OSError:
        namespace = None
    return boot_id, namespace


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot: field 22 of ``/proc/<pid>/stat``),
    or ``None`` if it cannot be read (gone, or hidden by ``hidepid``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # the command name (field 2) is in parentheses and may hold spaces and ')'
        return int(stat.rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_identity() -> dict[str, Any]:
    """This process, as a lease records it: ``host``, ``pid``, ``boot_id``, ``pid_ns`` and
    ``start_time`` (the last three ``None`` where ``/proc`` cannot tell them)."""
    boot_id, namespace = _boot_and_namespace()
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "boot_id": boot_id, "pid_ns": namespace,
            "start_time": start_time(pid) if namespace is not None else None}


def unverifiable(record: dict[str, Any]) -> str | None:
    """Why the process a lease ``record`` names cannot be checked from this process (``None``:
    it can, its pid means the same process here)."""
    here = process_identity()
    if record.get("host") != here["host"]:
        return "another host"
    if not record.get("boot_id") or not record.get("pid_ns"):
        return "a lease without boot id and PID namespace, from an older precache"
    if here["boot_id"] is None or here["pid_ns"] is None:
        return "this process cannot read its boot id or PID namespace"
    if record["boot_id"] != here["boot_id"]:
        return "another machine of the same name, or an earlier boot"
    if record["pid_ns"] != here["pid_ns"]:
        return "another PID namespace (a container)"
    return None


def _local_pid(record: dict[str, Any]) -> int | None:
    """The pid a lease ``record`` names, where it names a process of this host, boot and PID
    namespace (``unverifiable`` is None) and a valid pid; else None."""
    if unverifiable(record) is not None:
        return None
    try:
        pid = int(record["pid"])
    except (KeyError, TypeError, ValueError):
        return None
    return pid if pid > 0 else None  # 0 or less is no process (os.kill would signal a group)


def process_gone(record: dict[str, Any]) -> bool:
    """Whether the process a lease ``record`` names is known to be gone: it ran on this host,
    boot and PID namespace, and its pid is free, or names a process started at another time
    (the pid was reused). Where that cannot be known (``unverifiable``), ``False``: only the
    lease's expiry can tell then."""
    pid = _local_pid(record)
    if pid is None:
        return False
    if not pid_alive(pid):
        return True
    recorded = record.get("start_time")
    if recorded is None:
        return False
    started = start_time(pid)
    return started is not None and started != recorded


def _zombie(pid: int) -> bool:
    """Whether process ``pid`` has exited and waits to be reaped (state ``Z`` in
    ``/proc/<pid>/stat``): it holds nothing any more."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def process_alive(record: dict[str, Any]) -> bool:
    """Whether the process a lease ``record`` names is known to be alive: it ran on this host,
    boot and PID namespace, and its pid names a process (not a zombie) started at the time
    the lease records. A reader stopped (SIGSTOP, a debugger) renews nothing, yet still holds
    what it opened: its lease must not lapse while it lives. Where that cannot be known
    (``unverifiable``, or no start time recorded), ``False``: only the lease's expiry tells."""
    pid = _local_pid(record)
    recorded = record.get("start_time")
    if pid is None or recorded is None or not pid_alive(pid) or _zombie(pid):
        return False
    return start_time(pid) == recorded


class WriterLease:
    """The lease of one run on the remote cache ``store`` (see the module docstring)."""

    def __init__(self, store: Store, *, ttl_s: float | None = None,
                 heartbeat_s: float | None = None, settle_s: float | None = None) -> None:
        self.store = store
        self.ttl_s = TTL_S if ttl_s is None else ttl_s
        self.heartbeat_s = HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        self.settle_s = SETTLE_S if settle_s is None else settle_s
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.store.read_bytes(LEASE_FILE))
        except FileNotFoundError:
            return None
        except ValueError:  # a torn or foreign file: treat as stale
            return {"token": "", "time": 0.0}

    def _write(self) -> None:
        lease = {"token": self.token, **process_identity(), "time": time.time()}
        self.store.write_bytes(LEASE_FILE, json.dumps(lease).encode())

    def _describe(self, held: dict[str, Any]) -> str:
        age = time.time() - float(held.get("time", 0))
        why = unverifiable(held)
        where = f" ({why})" if why is not None and held.get("host") == socket.gethostname() else ""
        return (f"'{self.store.uri()}' is being written by another precache run (host "
                f"{held.get('host', '?')}, pid {held.get('pid', '?')}{where}, lease renewed "
                f"{age:.0f} s ago); wait for it to finish, or if that run is dead, wait "
                f"{self.ttl_s:.0f} s or delete '{self.store.uri(LEASE_FILE)}'")

    def _stale(self, held: dict[str, Any]) -> bool:
        if time.time() - float(held.get("time", 0)) > self.ttl_s:
            return True
        return process_gone(held)  # known to be gone; where that cannot be known, only the age

    def acquire(self) -> None:
        """Take the lease, or raise ``LeaseLost`` naming the run that holds it."""
        held = self._read()
        if held is not None and not self._stale(held):
            raise LeaseLost(self._describe(held))
        self._write()
        time.sleep(self.settle_s)  # let a run that started at the same moment write too
        self.check()
        self._thread = threading.Thread(target=self._renew, name="precache-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise ``LeaseLost`` if the lease is no longer this run's."""
        held = self._read()
        if held is None or held.get("token") != self.token:
            raise LeaseLost(self._describe(held) if held else
                            f"the lease on '{self.store.uri()}' was deleted during this run; "
                            "re-run to finish the cache")

    def _renew(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if (self._read() or {}).get("token") == self.token:
                    self._write()
            except OSError:  # a network blip: the next beat (or the check before publishing)
                pass         # will tell

    def release(self) -> None:
        """Stop renewing, and delete the lease if it is still this run's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            if (self._read() or {}).get("token") == self.token:
                self.store.delete(LEASE_FILE)
        except OSError:
            pass  # it expires on its own
