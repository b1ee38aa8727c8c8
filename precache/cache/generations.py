"""Generations of a cache: which are kept, which readers hold, and what may be deleted.

Every publish of stage 1 makes a new generation (``manifest.json``, and the same bytes as
``generations/manifest-GGGGG.json``). A training process pins the generation it opened: it keeps
reading that manifest's shards while a re-run publishes the next one. So the files of a
superseded generation are not deleted at once. They are kept

- while a reader holds the generation: a reader lease, ``readers/gen-GGGGG-<host>-<pid>-<hex>
  .json``, written through the cache's ``Store`` (a local folder or a bucket alike) and renewed
  by a thread; it records its process (host, pid, boot id, PID namespace and start time:
  ``precache.storage.lease.process_identity``) and is stale once its ``expires`` time has
  passed, or once its process is known to be gone: only where its pid means the same process as
  here (same host, boot and PID namespace; not a container with this host's name) can it be
  known (``process_gone``);
- and for ``DEFAULT_RETENTION_S`` after the generation was superseded (the ``created`` time of
  the next generation's manifest), so a reader that is just opening the cache finds it.

``collect`` (run by every publish, and by ``precache gc``) deletes the generations no longer
kept, then every shard and table no kept generation names, only by the names precache writes.
``precache gc`` also keeps the shards that an interrupted run committed and named in its journal
(``journaled_shards``), so that re-running it does not compute them again.
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
from pathlib import Path
from typing import Any, Callable, Collection

from precache.cache.manifest import Manifest, ManifestError
from precache.storage import Store
from precache.storage.lease import (process_alive, process_gone, process_identity,
                                    unverifiable)
from precache.storage.locations import explained

__all__ = ["GenerationError", "ReaderLease", "GENERATIONS", "READERS", "DEFAULT_RETENTION_S",
           "LEASE_TTL_S", "generation_path", "kept_generations", "live_leases", "collect",
           "Collected", "load_generation", "journaled_shards", "leased_generations"]

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


def leased_generations(store: Store) -> list[int]:
    """The generations named by reader lease files, live or stale: a reader may hold them."""
    found = (_LEASE_NAME.fullmatch(name) for name in store.list(READERS))
    return [int(m.group(1)) for m in found if m]


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

    Args:
        store: the cache's files (a local folder or a bucket).
        generation: the generation held.
        ttl_s: a lease not renewed for this long is stale (default ``LEASE_TTL_S``).

    Raises:
        OSError: the lease cannot be written (a read-only cache).
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
        lease = {"generation": self.generation, **process_identity(),
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
        atexit.unregister(self.release)
        self._thread.join()  # a renewal under way would write the lease again after the delete
        try:
            self.store.delete(self.name)
        except OSError:
            pass  # it expires on its own


def _modified(store: Store, rel: str) -> float | None:
    """The modification time of file ``rel`` (seconds since the epoch), if the store keeps one."""
    try:
        with explained(store.uri(rel)):
            mtime = store.fs.get_file_info(f"{store.base}/{rel}").mtime
    except OSError:
        return None
    return mtime.timestamp() if mtime is not None else None


def live_leases(store: Store, *, ttl_s: float = LEASE_TTL_S) -> dict[int, list[dict[str, Any]]]:
    """Generation -> the live reader leases on it (stale ones are left out).

    A lease is stale once its ``expires`` time has passed and its process is not known to be
    alive (``process_alive``: a reader stopped with SIGSTOP renews nothing but still holds its
    generation), or once its process is known to be gone (``process_gone``: same host, boot and PID namespace as this process, and the pid is
    free or was reused; a lease that records no boot id and namespace, from an older precache,
    holds until it expires). A lease file that cannot be read (torn, foreign) counts as live
    until it is older than ``ttl_s`` by its modification time (for ever if the store keeps
    none): keeping files is the safe side.
    """
    return _scan_leases(store, ttl_s)[0]


def _scan_leases(store: Store, ttl_s: float) -> tuple[dict[int, list[dict[str, Any]]], list[str]]:
    """The live leases by generation (see ``live_leases``), and the names of the stale ones."""
    live: dict[int, list[dict[str, Any]]] = {}
    stale: list[str] = []
    now = time.time()
    for name in store.list(READERS):
        match = _LEASE_NAME.fullmatch(name)
        if match is None:
            continue
        try:
            lease = json.loads(store.read_bytes(f"{READERS}/{name}"))
            expires = float(lease["expires"])
            int(lease["pid"])  # a lease without a pid of its process is not one precache wrote
        except FileNotFoundError:
            continue  # released meanwhile
        except (OSError, ValueError, KeyError, TypeError):
            modified = _modified(store, f"{READERS}/{name}")
            expires = float("inf") if modified is None else modified + ttl_s
            lease = {"host": "?", "pid": "?", "expires": expires, "torn": True}
        if process_gone(lease) or (expires < now and not process_alive(lease)):
            stale.append(name)  # an expired lease of a live (stopped) reader still holds
            continue
        lease["name"] = name
        live.setdefault(int(match.group(1)), []).append(lease)
    return live, stale


def journaled_shards(journal: str | os.PathLike[str]) -> dict[str, str]:
    """The shards named by the entries of an interrupted run's journal, the folder ``journal``
    (a local cache's ``CACHE/journal``; a remote cache's is in its local working folder:
    ``CacheLayout.for_output(url).journal``): shard path (``shards/part-NNNNN-....parquet``) ->
    the entry's file name. Such a shard is in no manifest until the run is re-run, which adopts
    the entries whose fingerprint matches; ``precache gc`` keeps them until then. An entry that
    cannot be read names nothing (a re-run drops it too)."""
    found: dict[str, str] = {}
    folder = Path(journal)
    if not folder.is_dir():
        return found
    for entry_path in sorted(folder.glob("part-*.json")):
        try:
            shard = json.loads(entry_path.read_text()).get("shard")
            path = shard.get("path") if shard else None
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(path, str) and path.startswith("shards/"):
            found[path] = entry_path.name
    return found


@dataclass
class Collected:
    """What ``collect`` removed and kept."""

    removed: list[int] = field(default_factory=list)
    kept: dict[int, str] = field(default_factory=dict)  # generation -> why
    deleted_files: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    kept_files: list[str] = field(default_factory=list)  # in keep_files, else deleted


def _held_by(leases: list[dict[str, Any]]) -> str:
    """Why a generation is kept, naming the reader that holds it."""
    lease = leases[0]
    if lease.get("torn"):
        return f"held by an unreadable reader lease ({READERS}/{lease['name']})"
    expires = float(lease.get("expires", time.time()))
    until = "?" if expires == float("inf") else datetime.fromtimestamp(expires).strftime("%H:%M")
    more = f" (and {len(leases) - 1} more)" if len(leases) > 1 else ""
    why = unverifiable(lease)
    unknown = (f" ({why}: kept until the lease expires)"
               if why is not None and lease.get("host") == socket.gethostname() else "")
    if expires < time.time():  # live only because its process is (stopped, say)
        return (f"held by a reader on host {lease.get('host', '?')} pid {lease.get('pid', '?')}"
                f" whose lease expired at {until} but whose process is alive (stopped?){more}")
    return (f"held by a reader on host {lease.get('host', '?')} pid {lease.get('pid', '?')}"
            f"{unknown} until {until}{more}")


def _created(manifest: Manifest | None) -> float | None:
    if manifest is None:
        return None
    try:
        return datetime.fromisoformat(manifest.created).timestamp()
    except ValueError:
        return None


def collect(store: Store, current: Manifest, *, retention_s: float = DEFAULT_RETENTION_S,
            keep: int | None = None, dry_run: bool = False,
            is_own: Callable[[str, str], bool], log: Callable[[str], Any] = print,
            keep_files: Collection[str] = ()) -> Collected:
    """Remove the superseded generations no reader holds, then the files no kept one names.

    A superseded generation is removed when no live reader lease holds it, it was superseded
    (the ``created`` time of the next generation) more than ``retention_s`` ago, and it is not
    one of the ``keep`` newest superseded generations (default: no such floor). The caller
    holds the cache's write lock. A generation's manifest goes before its files, and the leases
    are read again after that: a reader that took a lease meanwhile either finds the manifest
    gone (and says so) or is seen here, and its generation is put back.

    Args:
        store: the cache's published files.
        current: the cache's current manifest (never removed).
        retention_s: keep generations superseded less than this many seconds ago.
        keep: keep at least this many of the newest superseded generations, whatever their age.
        dry_run: decide and report, delete nothing.
        is_own: ``(folder, name) -> bool``, whether precache writes such names there (only
            those are deleted).
        log: where a note goes when a kept generation's manifest cannot be read.
        keep_files: shards (``shards/<name>``) kept although no kept generation names
            them: those an interrupted run journaled (``journaled_shards``), for its resume.
            The ones that would have been deleted are listed in ``Collected.kept_files``.
    """
    leases, stale = _scan_leases(store, LEASE_TTL_S)
    result = Collected()
    superseded = sorted((g for g in kept_generations(store) if g < current.generation),
                        reverse=True)
    kept_bytes: dict[int, bytes] = {}  # the kept copies, as written (to put one back)
    manifests: dict[int, Manifest | None] = {current.generation: current}
    unreadable: dict[int, str] = {}
    for generation in superseded:
        rel = generation_path(generation)
        try:
            kept_bytes[generation] = store.read_bytes(rel)
            manifests[generation] = Manifest.from_bytes(kept_bytes[generation], store.uri(rel))
        except (ManifestError, OSError) as e:
            manifests[generation], unreadable[generation] = None, str(e)
    now = time.time()
    newer = _created(current)  # when the newest superseded generation was superseded
    for rank, generation in enumerate(superseded):
        age = now - newer if newer is not None else 0.0  # unknown: as young as can be
        newer = _created(manifests[generation]) or newer
        if generation in leases:
            result.kept[generation] = _held_by(leases[generation])
        elif keep is not None and rank < keep:
            result.kept[generation] = f"one of the {keep} newest superseded (--keep {keep})"
        elif age < retention_s:
            result.kept[generation] = (f"superseded {age:.0f} s ago (kept for "
                                       f"{retention_s:.0f} s)")
        else:
            result.removed.append(generation)
    if not dry_run:
        for generation in result.removed:
            store.delete(generation_path(generation))  # first: a reader opening it now fails
        leases, stale = _scan_leases(store, LEASE_TTL_S)  # a reader that took one meanwhile
        for generation in [g for g in result.removed if g in leases]:
            result.removed.remove(generation)
            result.kept[generation] = _held_by(leases[generation])
            if generation in kept_bytes:
                store.write_bytes(generation_path(generation), kept_bytes[generation])
    for generation in result.removed:
        result.deleted_files.append(generation_path(generation))
        result.freed_bytes += len(kept_bytes.get(generation, b""))
    doomed: list[str] = []
    held_unreadable = sorted(g for g in unreadable if g in result.kept)
    if held_unreadable:
        # cannot tell which files a kept generation names: delete no shard and no table
        first = held_unreadable[0]
        log(f"precache: kept generation {first} of '{store.url}' has an unreadable manifest "
            f"({unreadable[first]}); no shard or table was deleted: if no reader needs it, "
            f"delete '{store.uri(generation_path(first))}' and run `precache gc {store.url}`")
    else:
        kept_manifests = [m for g, m in manifests.items()
                          if m is not None and g not in result.removed]
        shards = {s.path for m in kept_manifests for s in m.shards}
        tables = ({m.index["path"] for m in kept_manifests}
                  | {m.errors["path"] for m in kept_manifests})
        unnamed = [f"shards/{n}" for n in store.list("shards")
                   if f"shards/{n}" not in shards and is_own("shards", n)]
        result.kept_files = [rel for rel in unnamed if rel in keep_files]
        doomed += [rel for rel in unnamed if rel not in keep_files]
        doomed += [n for n in store.list() if n not in tables and is_own("", n)
                   and n.endswith(".parquet")]
    doomed += [f"{READERS}/{name}" for name in stale]  # only leases seen to be stale
    for rel in doomed:
        result.freed_bytes += max(0, store.size(rel))
        result.deleted_files.append(rel)
        if not dry_run:
            store.delete(rel)
    return result
