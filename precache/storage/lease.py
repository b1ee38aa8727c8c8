"""One writer per remote cache: a lease object, ``<url>/.writer.json``.

A local cache is guarded by ``flock``, which the kernel releases when its holder dies. Object
stores have no locks, so a run writing ``s3://...`` also holds a lease: a small object naming
its host, pid and a random token, rewritten every ``HEARTBEAT_S`` seconds. Another run refuses
to start while the lease is fresh, and takes it over when it is stale: older than ``TTL_S``, or
held by a process on this host that no longer exists (a run killed with kill -9, resumed here).

Two runs starting within the same second could both write the lease; each re-reads it after
``SETTLE_S``, and only the one whose token is there goes on. A run checks the lease again just
before it publishes the manifest, so a run that lost it never publishes.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from precache.storage.store import Store

__all__ = ["WriterLease", "LeaseLost", "LEASE_FILE", "TTL_S", "HEARTBEAT_S", "pid_alive"]

LEASE_FILE = ".writer.json"
TTL_S = 120.0
"""A lease not renewed for this long belongs to a run that died."""
HEARTBEAT_S = 30.0
SETTLE_S = 1.0


class LeaseLost(RuntimeError):
    """Another run holds (or took over) the remote cache's lease."""


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        lease = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                 "time": time.time()}
        self.store.write_bytes(LEASE_FILE, json.dumps(lease).encode())

    def _describe(self, held: dict[str, Any]) -> str:
        age = time.time() - float(held.get("time", 0))
        return (f"'{self.store.uri()}' is being written by another precache run (host "
                f"{held.get('host', '?')}, pid {held.get('pid', '?')}, lease renewed {age:.0f} s "
                f"ago); wait for it to finish, or if that run is dead, wait {self.ttl_s:.0f} s "
                f"or delete '{self.store.uri(LEASE_FILE)}'")

    def _stale(self, held: dict[str, Any]) -> bool:
        if time.time() - float(held.get("time", 0)) > self.ttl_s:
            return True
        return held.get("host") == socket.gethostname() and not pid_alive(int(held.get("pid", 0)))

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
