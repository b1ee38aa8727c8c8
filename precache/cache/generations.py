"""Generations of a cache: which are kept, which readers hold, and what may be deleted.

Every publish of stage 1 makes a new generation (``manifest.json``, and the same bytes as
``generations/manifest-GGGGG.json``). A training process pins the generation it opened: it keeps
reading that manifest's shards while a re-run publishes the next one. So the files of a
superseded generation are not deleted at once. They are kept

- while a reader holds the generation: a reader lease, ``readers/gen-GGGGG-<host>-<pid>-<hex>
  .json``, written through the cache's ``Store`` (a local folder or a bucket alike) and renewed
  by a thread; it is stale once its ``expires`` time has passed, or its process is gone (same
  host);
- and for ``DEFAULT_RETENTION_S`` after the generation was superseded (the ``created`` time of
  the next generation's manifest), so a reader that is just opening the cache finds it.

``collect`` (run by every publish, and by ``precache gc``) deletes the generations no longer
kept, then every shard and table no kept generation names, only by the names precache writes.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

from precache.cache.manifest import Manifest, ManifestError
from precache.storage import Store
from precache.storage.lease import pid_alive

__all__ = ["GenerationError", "ReaderLease", "GENERATIONS", "READERS", "DEFAULT_RETENTION_S",
           "LEASE_TTL_S", "generation_path", "kept_generations", "live_leases", "collect",
           "Collected", "load_generation"]

GENERATIONS = "generations"
READERS = "readers"
DEFAULT_RETENTION_S = 3600.0
"""A superseded generation's files stay this long (seconds) even if no reader holds it."""
LEASE_TTL_S = 600.0
"""A reader lease not renewed for this long belongs to a reader that died."""

_GENERATION_NAME = re.compile(r"manifest-([0-9]{5,})\.json")
_LEASE_NAME = re.compile(r"gen-([0-9]{5,})-.+\.json")


class GenerationError(ManifestError):
    """A generation of a cache that is not kept (removed by ``precache gc`` or a re-run)."""


def generation_path(generation: int) -> str:
    """Where generation ``generation``'s manifest is kept, relative to the cache."""
    return f"{GENERATIONS}/manifest-{generation:05d}.json"


def kept_generations(store: Store) -> list[int]:
    """The generations whose manifests are kept (``generations/``), ascending."""
    found = (_GENERATION_NAME.fullmatch(n) for n in store.list(GENERATIONS))
    return sorted(int(m.group(1)) for m in found if m)


def load_generation(store: Store, generation: int, current: Manifest) -> Manifest:
    """The manifest of ``generation``: ``current`` if it is that one, else the kept copy.

    Raises:
        GenerationError: it is not kept; the message lists those that are.
    """
    if generation == current.generation:
        return current
    try:
        data = store.read_bytes(generation_path(generation))
    except (FileNotFoundError, NotADirectoryError):
        kept = sorted(set(kept_generations(store)) | {current.generation})
        raise GenerationError(
            f"'{store.url}' has no generation {generation} any more (kept: "
            f"{', '.join(map(str, kept))}; current: {current.generation}); read the current one "
            "(no generation=), and start the epoch over if you were resuming") from None
    return Manifest.from_bytes(data, store.uri(generation_path(generation)))


class ReaderLease:
    """This process's hold on one generation of a cache (see the module docstring).

    Taken on construction; renewed every ``ttl_s / 3`` by a daemon thread; ``release()``
    (also at interpreter exit) deletes it. Only the process that took it renews or deletes
    it: a forked DataLoader worker's copy does nothing.
    """

    def __init__(self, store: Store, generation: int, *, ttl_s: float = LEASE_TTL_S) -> None:
        self.store, self.generation, self.ttl_s = store, generation, ttl_s
        self.pid = os.getpid()
        host = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())
        self.name = (f"{READERS}/gen-{generation:05d}-{host}-{self.pid}-"
                     f"{uuid.uuid4().hex[:12]}.json")
        self._stop = threading.Event()
        self._write()
        self._thread = threading.Thread(target=self._renew, name="precache-reader-lease",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.release)

    def _write(self) -> None:
        lease = {"generation": self.generation, "host": socket.gethostname(), "pid": self.pid,
                 "expires": time.time() + self.ttl_s}
        self.store.write_bytes(self.name, json.dumps(lease).encode())

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._write()
            except OSError:  # a network blip: the next beat tries again
                pass

    def release(self) -> None:
        """Stop renewing and delete the lease (in the process that took it; else nothing)."""
        if os.getpid() != self.pid or self._stop.is_set():
            return
        self._stop.set()
        try:
            self.store.delete(self.name)
        except OSError:
            pass  # it expires on its own


def live_leases(store: Store) -> dict[int, list[dict[str, Any]]]:
    """Generation -> the live reader leases on it (stale ones are left out). A lease file that
    cannot be read (torn, foreign) counts as live: keeping files is the safe side."""
    live: dict[int, list[dict[str, Any]]] = {}
    host = socket.gethostname()
    for name in store.list(READERS):
        match = _LEASE_NAME.fullmatch(name)
        if match is None:
            continue
        try:
            lease = json.loads(store.read_bytes(f"{READERS}/{name}"))
            expires, pid = float(lease["expires"]), int(lease["pid"])
        except FileNotFoundError:
            continue  # released meanwhile
        except (OSError, ValueError, KeyError, TypeError):
            lease, expires, pid = {"name": name}, float("inf"), -1
        if expires < time.time() or (lease.get("host") == host and not pid_alive(pid)):
            continue
        lease["name"] = name
        live.setdefault(int(match.group(1)), []).append(lease)
    return live


@dataclass
class Collected:
    """What ``collect`` removed and kept."""

    removed: list[int] = field(default_factory=list)
    kept: dict[int, str] = field(default_factory=dict)  # generation -> why
    deleted_files: list[str] = field(default_factory=list)
    freed_bytes: int = 0


def _superseded_at(store: Store, generation: int, current: Manifest) -> float:
    """When ``generation`` stopped being current: the ``created`` time of the next kept
    manifest after it (0 if none can be read: as old as can be)."""
    later = [g for g in kept_generations(store) if g > generation] + [current.generation]
    for g in sorted(set(later)):
        try:
            created = load_generation(store, g, current).created
            return datetime.fromisoformat(created).timestamp()
        except (ManifestError, ValueError, OSError):
            continue
    return 0.0


def collect(store: Store, current: Manifest, *, retention_s: float = DEFAULT_RETENTION_S,
            keep: int | None = None, dry_run: bool = False,
            is_own: Callable[[str, str], bool], log: Callable[[str], Any] = print) -> Collected:
    """Remove the superseded generations no reader holds, then the files no kept one names.

    A superseded generation is removed when it was superseded more than ``retention_s`` ago,
    or when it is beyond the ``keep`` newest superseded ones, and in either case no live
    reader lease holds it. The caller holds the cache's write lock.

    Args:
        is_own: ``(folder, name) -> bool``, whether precache writes such names there (only
            those are deleted).
        dry_run: decide and report, delete nothing.
    """
    leases = live_leases(store)
    result = Collected()
    superseded = sorted((g for g in kept_generations(store) if g < current.generation),
                        reverse=True)
    now = time.time()
    for rank, generation in enumerate(superseded):
        held = leases.get(generation)
        if held:
            lease = held[0]
            until = datetime.fromtimestamp(float(lease.get("expires", now))).strftime("%H:%M")
            result.kept[generation] = (f"held by a reader on host {lease.get('host', '?')} "
                                       f"pid {lease.get('pid', '?')} until {until}")
            continue
        age = now - _superseded_at(store, generation, current)
        beyond = keep is not None and rank >= keep
        if age < retention_s and not beyond:
            result.kept[generation] = f"superseded {age:.0f} s ago (kept for {retention_s:.0f} s)"
            continue
        result.removed.append(generation)
    kept_manifests = [current] + [load_generation(store, g, current) for g in result.kept]
    shards = {s.path for m in kept_manifests for s in m.shards}
    tables = {m.index["path"] for m in kept_manifests} | {m.errors["path"] for m in kept_manifests}
    doomed = [generation_path(g) for g in result.removed]
    doomed += [f"shards/{n}" for n in store.list("shards")
               if f"shards/{n}" not in shards and is_own("shards", n)]
    doomed += [n for n in store.list() if n not in tables and is_own("", n)
               and n.endswith(".parquet")]
    live_names = {lease["name"] for held in leases.values() for lease in held}
    doomed += [f"{READERS}/{n}" for n in store.list(READERS)
               if _LEASE_NAME.fullmatch(n) and n not in live_names]  # stale leases
    for rel in doomed:
        size = store.size(rel)
        result.freed_bytes += max(0, size)
        result.deleted_files.append(rel)
        if not dry_run:
            store.delete(rel)
    return result
