"""A run's write of a cache, as one object: check the output, take the lock, load what the cache
already holds, take committed shards in, drop stale rows, publish, clean up.

The runner plans the tasks and runs the executors; this object is all it does to the cache::

    with WriteTransaction(output, pipeline="faces", fingerprint=fp, overwrite=False) as tx:
        tx.records                  # key -> record the cache holds for this fingerprint
        todo = tx.recompute_damaged(inputs, todo, kept)  # after classifying the inputs
        ... run tasks; for each finished one: tx.add(result) ...
        tx.drop_stale_rows(kept, shard_format, next_seq)
        manifest = tx.publish(kept, ...)

Order of effects (crash-safe at every step):

1. **Enter**: refuse an output that is a file, or a non-empty folder without precache's manifest
   or marker; take the lock (``CacheLock``); with ``overwrite``, delete precache's own files
   (manifest first); write the marker; adopt the journal of an interrupted run with the same
   fingerprint and delete orphan shards (files precache names, that no manifest or journal
   entry lists).
2. **Commit** (workers, one task each): a shard is written under ``.staging/``, fsynced, renamed
   into ``shards/``, then its journal entry is written. ``add`` journals a remote cache's entries
   here, where the journal lives.
3. **Publish**: the index and errors tables of the new generation, its kept copy
   ``generations/manifest-GGGGG.json``, then ``manifest.json`` (last, atomically, its folder
   fsynced): from that moment the new cache is the cache. Then the files no kept generation
   names (``generations.collect``: older generations stay while a reader holds them and for a
   retention period), the journal and staging are deleted.
4. **Exit**: the lock is released (also on error; committed shards stay for a re-run).

A run that changes nothing (the same fingerprint, parameters and source, no input added, changed
or removed, no shard committed or rewritten) publishes nothing: ``publish`` returns the current
manifest, and ``published`` is False. With ``wait``, entering waits for a run that holds the
lock to finish (``CacheLock.wait_free``), then enters as usual: a run that waited for another
that published the same work then finds nothing to do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from precache.cache.formats import ShardFormat, ShardInfo
from precache.cache.generations import (DEFAULT_RETENTION_S, collect, generation_path,
                                        kept_generations, leased_generations, load_generation)
from precache.cache.layout import MARKER, CacheLayout
from precache.cache.lock import CacheBusyError, CacheLock
from precache.cache.manifest import Manifest, ManifestError
from precache.cache.reader import load_manifest
from precache.cache.schema import schema_from_json, schema_to_json
from precache.cache.tables import ERRORS_SCHEMA, INDEX_SCHEMA, read_table
from precache.errors import RunError
from precache.storage import ChecksumError
from precache.storage.durable import create_new, fsync_dir
from precache.storage.hashing import file_checksum
from precache.storage.lease import LEASE_FILE

__all__ = ["WriteTransaction", "COMPACT_FRACTION"]

COMPACT_FRACTION = 0.5
"""A shard more than this fraction deleted is rewritten with only its live rows."""


@dataclass
class _State:
    """What the cache already holds for the current fingerprint."""

    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    shards: dict[int, ShardInfo] = field(default_factory=dict)
    schemas: dict[int, dict[str, Any]] = field(default_factory=dict)
    referenced: set[str] = field(default_factory=set)  # shard files that must not be deleted
    max_seq: int = 0
    checked: set[int] = field(default_factory=set)  # old shards whose checksum this run checked
    published: dict[str, dict[str, Any]] = field(default_factory=dict)  # the old index's records
    changed: bool = False  # a journal entry adopted, or a shard committed or rewritten


class WriteTransaction:
    """One run's write of the cache at ``output`` (a folder or a URL), from lock to publish.

    Args:
        output: the cache folder, or a URL (``s3://``, ``gs://``, ``file://``): then the lock,
            journal and staging live in a private local working folder and shards are uploaded.
        pipeline: the pipeline's name (a cache of another pipeline is refused without
            ``overwrite``).
        fingerprint: the run's fingerprint; journal entries and cached records of another one
            are not reused.
        overwrite: replace a cache of another pipeline, or a corrupt one.
        log: where one-line notes go (files left alone in the output).
        retention_s: how long the files of the generation this run supersedes are kept when
            no reader holds it (see ``precache.cache.generations``).
        wait_s: when another run holds the cache, wait up to this many seconds for it to
            finish (``None``: raise ``CacheBusyError`` at once). ``waited_s`` says how long
            entering waited.

    Raises (on entering):
        RunError: the output is a file, a non-empty folder that is not a cache, a cache of
            another pipeline, or its manifest or index is unreadable.
        CacheBusyError: another run holds the cache (still, after ``wait_s``).
        StorageError: the output URL cannot be written.
    """

    def __init__(self, output: str | Any, *, pipeline: str, fingerprint: str,
                 overwrite: bool = False, log: Callable[[str], Any] = print,
                 retention_s: float = DEFAULT_RETENTION_S, wait_s: float | None = None) -> None:
        self.layout = CacheLayout.for_output(output)  # a URL: work locally, publish to the URL
        self.pipeline = pipeline
        self.fingerprint = fingerprint
        self.overwrite = overwrite
        self.log = log
        self.retention_s = retention_s
        self.old: Manifest | None = None
        self._floor = 0  # the highest generation number this cache has had (see _prepare_output)
        self._state = _State()
        self._lock = CacheLock(self.layout)
        self.wait_s = wait_s
        self.waited_s = 0.0
        self.published = False

    # ---- entering: check, lock, prepare, load ------------------------------------------------

    def __enter__(self) -> WriteTransaction:
        if self.wait_s is None:
            return self._enter()
        start = time.monotonic()
        deadline = start + self.wait_s
        waited = False
        while True:
            try:
                entered = self._enter()
            except CacheBusyError as busy:
                if not waited:
                    self.log(f"precache: cache '{self.location}' is being written by another "
                             f"precache run ({busy.holder or 'unknown'}); waiting for it to "
                             f"finish (up to {self.wait_s:g} s)")
                    waited = True
                if not self._lock.wait_free(deadline):
                    raise CacheBusyError(
                        f"gave up after waiting {self.wait_s:g} s: cache '{self.location}' is "
                        f"still being written by another precache run "
                        f"({busy.holder or 'unknown'}); wait longer (--wait-timeout SECONDS, "
                        "or wait=SECONDS) or stop that run", holder=busy.holder) from None
                continue
            if waited:
                self.waited_s = time.monotonic() - start
            return entered

    def _enter(self) -> WriteTransaction:
        """Check the output, take the lock (or raise ``CacheBusyError``), prepare, load."""
        self._check_output()
        self.layout.check_owned_folders()  # before the lock: nothing written or deleted yet
        self._lock.acquire()
        try:
            layout = self.layout
            self.old = self._prepare_output()
            layout.mark()  # before the first shard: from here on the folder is precache's
            for path in (layout.shards, layout.journal):
                path.mkdir(parents=True, exist_ok=True)
            layout.check_planted_links()  # before the journal and staging are written
            layout.forget_stale_journal(self.old.generation if self.old is not None else 0)
            layout.clear_local(layout.staging)
            layout.staging.mkdir(exist_ok=True)
            foreign = layout.foreign_files()
            if foreign:
                more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
                self.log(f"precache: left alone in '{layout.location}', not written by precache: "
                         + ", ".join(foreign[:5]) + more)
            self._state = self._load_state()
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    @property
    def location(self) -> str:
        """The cache as the user named it (path or URL), for messages."""
        return self.layout.location

    @property
    def records(self) -> dict[str, dict[str, Any]]:
        """Key -> index record of every input the cache holds for this fingerprint (published,
        or committed by an interrupted run)."""
        return self._state.records

    @property
    def next_seq(self) -> int:
        """The first shard number not used by the cache or its journal."""
        return self._state.max_seq + 1

    def _check_output(self) -> None:
        """Refuse an output that is a file, or a non-empty folder (or URL prefix) holding no
        cache; for a URL, check that its bucket exists and the credentials are accepted."""
        layout = self.layout
        if layout.url is None:
            root = layout.root
            if root.exists() and not root.is_dir():
                raise RunError(f"output '{root}' exists and is not a directory")
            names = [p.name for p in root.iterdir()] if root.exists() else []
        else:
            layout.store.check_bucket()
            if layout.store.size("") >= 0:
                raise RunError(f"output '{layout.url}' is a file, not a folder of a cache")
            names = layout.store.list(folders=True)
        # a run that died between taking its lock and writing the marker left only the lock
        holds_files = any(name not in (".lock", LEASE_FILE) for name in names)
        if holds_files and not layout.is_cache():
            if layout.url is None:
                # a run that started an instant before this one: it holds the lock but has not
                # written its marker yet (only its temporary file): name it, not "no cache"
                self._lock.check_free()
            raise RunError(f"output '{layout.location}' is not empty and holds no precache cache "
                           f"(no manifest.json or {MARKER}); choose a new or empty directory")

    def _prepare_output(self) -> Manifest | None:
        """Check the output may be written; clear precache's files from it with ``overwrite``;
        return the old manifest."""
        layout = self.layout
        store = layout.store  # the published files: in the directory, or at the URL
        old: Manifest | None = None
        if store.exists("manifest.json"):
            try:
                old = load_manifest(store)
            except ManifestError as e:
                if not self.overwrite:
                    hint = "" if "--overwrite" in str(e) else "; use --overwrite to replace it"
                    raise RunError(f"{e}{hint}") from None
        if old is not None and old.pipeline != self.pipeline and not self.overwrite:
            raise RunError(f"output '{layout.location}' holds a cache of pipeline "
                           f"'{old.pipeline}', not '{self.pipeline}'; use --overwrite to replace "
                           "it, or another --output")
        # Generation numbers only grow, --overwrite included: a reader of a replaced generation
        # must never find a new one under its number (it fails with GenerationError instead).
        self._floor = max([layout.marked_generation(), *kept_generations(store),
                           *leased_generations(store), old.generation if old is not None else 0])
        if self.overwrite:
            layout.mark(generation=self._floor)  # survives the deletes below, and a crash
            store.delete("manifest.json")  # first: from here on it is not a finished cache
            for name in store.list("shards"):
                layout.delete_own("shards", name)
            for name in store.list():
                if layout.is_table(name):
                    layout.delete_own("", name)
            for name in store.list("generations"):  # their shards are gone: readers of them too
                layout.delete_own("generations", name)
            layout.clear_local(layout.journal)
            layout.clear_local(layout.staging)
            old = None
        return old

    def _load_state(self) -> _State:
        """Collect records and shards from the old manifest (same fingerprint) and the journal
        of an interrupted run; delete journal entries of other fingerprints and orphan shards."""
        layout, old, state = self.layout, self.old, _State()
        unreadable: tuple[int, str] | None = None  # a kept generation whose manifest is not
        if old is not None:
            state.referenced |= {Path(s.path).name for s in old.shards}
            for generation in kept_generations(layout.store):  # pinned by readers, or recent
                try:
                    kept = load_generation(layout.store, generation, old)
                except (ManifestError, OSError) as e:
                    unreadable = unreadable or (generation, str(e))
                    continue
                state.referenced |= {Path(s.path).name for s in kept.shards}
        # numbers go on past every shard file there is (names carry a content hash anyway)
        state.max_seq = max((layout.shard_seq(name) for name in layout.store.list("shards")
                             if layout.is_own("shards", name)), default=0)
        if old is not None:
            state.max_seq = max([state.max_seq, *(layout.shard_seq(s.path) for s in old.shards)])
            if old.fingerprint == self.fingerprint:
                try:
                    index = read_table(layout.store, old.index["path"]).to_pylist()
                except (OSError, pa.ArrowInvalid) as e:
                    raise RunError(f"the index of cache '{layout.location}' is unreadable ({e}); "
                                   "use --overwrite to rebuild the cache") from None
                state.records = {r["key"]: r for r in index}
                for info in old.shards:
                    seq = layout.shard_seq(info.path)
                    state.shards[seq] = info
                    state.schemas[seq] = schema_to_json(old.schema)
                state.published = dict(state.records)
        for entry_path in sorted(layout.journal.glob("part-*.json")):
            try:
                entry = json.loads(entry_path.read_text())
            except (OSError, json.JSONDecodeError):
                entry = {}
            try:
                shard = ShardInfo.from_json(entry["shard"]) if entry.get("shard") else None
            except (KeyError, TypeError, ValueError):
                entry, shard = {}, None  # not an entry precache wrote: dropped below as unusable
            usable = (entry.get("fingerprint") == self.fingerprint
                      and entry.get("pipeline") == self.pipeline
                      and (shard is None or layout.store.size(shard.path) == shard.bytes))
            if not usable:
                entry_path.unlink()
                continue
            seq = int(entry["seq"])
            state.max_seq = max(state.max_seq, seq)
            state.changed = True  # an interrupted run's committed work: publish it
            if shard is not None:
                state.shards[seq] = shard
                state.schemas[seq] = entry["schema"]
                state.referenced.add(Path(shard.path).name)
            for record in entry["records"]:
                state.records[record["key"]] = record
        if unreadable is not None:
            # which shards it names cannot be known (a reader may hold it): delete none here,
            # as `precache gc` and the collect after publishing do in that state
            generation, why = unreadable
            self.log(f"precache: kept generation {generation} of '{layout.location}' has an "
                     f"unreadable manifest ({why}); no shard was deleted: if no reader needs "
                     f"it, delete '{layout.store.uri(generation_path(generation))}' and run "
                     f"`precache gc {layout.location}`")
            return state
        for shard_name in layout.store.list("shards"):
            if shard_name not in state.referenced:
                # an orphan: written by a run that died before journaling it (only precache's
                # own shard names are deleted; anything else is reported and left alone)
                layout.delete_own("shards", shard_name)
        return state

    # ---- during the run ------------------------------------------------------------------------

    def add(self, seq: int, shard: ShardInfo | None, schema: dict[str, Any] | None,
            journal: dict[str, Any] | None = None) -> None:
        """Take in task ``seq``'s committed shard (or none: every input skipped or failed).
        ``journal``: its journal entry, which a worker writing a remote cache hands back (it
        may run on another machine than the journal)."""
        self._state.changed = True
        if journal is not None:
            self.layout.write_journal_entry(journal)
        if shard is not None:
            self._state.shards[seq] = shard
            self._state.schemas[seq] = schema or {}

    def _touched(self, kept: dict[str, dict[str, Any]]) -> list[int]:
        """The shards ``drop_stale_rows`` reads: those holding rows of ``kept`` inputs beside
        rows of changed or deleted ones."""
        owned_rows: dict[int, int] = {}
        for record in kept.values():
            if record["shard"] >= 0:
                owned_rows[record["shard"]] = owned_rows.get(record["shard"], 0) + record["rows"]
        return [seq for seq, info in sorted(self._state.shards.items())
                if owned_rows.get(seq, 0) not in (0, info.live_rows)]

    def _damage(self, info: ShardInfo) -> str | None:
        """Why the shard ``info`` does not hold the bytes its manifest entry names (missing,
        or another checksum), or ``None`` if it does. A remote shard is downloaded into staging
        here, checked as it arrives, where ``drop_stale_rows`` then reads it."""
        layout = self.layout
        try:
            if layout.url is not None:
                layout.local_shard(info)
                return None
            found = file_checksum(layout.root / info.path)
        except FileNotFoundError:
            return "it is missing"
        except ChecksumError:  # (a download that did not match)
            found = None
        if found != info.checksum:
            return f"its checksum does not match the manifest's {info.checksum}"
        return None

    def recompute_damaged(self, inputs: Sequence[Any], todo: list[Any],
                          kept: dict[str, dict[str, Any]]) -> list[Any]:
        """Check the checksum of every old shard this run will read (``drop_stale_rows``:
        it copies their kept rows into a new shard, or reads their keys to mark the rest
        deleted), before any task runs. A damaged shard's rows are never copied (a copy would
        carry the damage under a fresh, valid checksum) nor read (damaged offsets raise): its
        inputs are taken out of ``kept`` and computed again, as if not cached, and the run
        says so in one line per shard.

        Args:
            inputs: every input of the run (objects with a ``key``), in the run's order.
            todo: the inputs to compute (``classify``).
            kept: key -> record of the unchanged inputs (``classify``); changed in place.

        Returns:
            The inputs to compute: ``todo`` and those of the damaged shards, in input order.
        """
        damaged: set[int] = set()
        for seq in self._touched(kept):
            info = self._state.shards[seq]
            why = self._damage(info)
            self._state.checked.add(seq)
            if why is not None:
                damaged.add(seq)
                count = sum(r["shard"] == seq for r in kept.values())
                self.log(f"precache: shard {info.path} of '{self.location}' is damaged ({why}): "
                         f"its {count} unchanged input(s) are computed again; `precache verify` "
                         "names the older generations that still list it")
        if not damaged:
            return todo
        again = {key for key, record in kept.items() if record["shard"] in damaged}
        for key in again:
            del kept[key]
        keys = again | {item.key for item in todo}
        return [item for item in inputs if item.key in keys]

    def drop_stale_rows(self, kept: dict[str, dict[str, Any]], shard_format: ShardFormat,
                        next_seq: int) -> tuple[int, int]:
        """Mark rows of changed and deleted inputs as deleted in their shards (a manifest
        change, no copy); rewrite a shard once most of it is deleted, as shard ``next_seq`` and
        on. ``kept``: the records of the inputs the new cache holds. Returns (shards touched,
        rewritten).

        Every shard read here was checked by ``recompute_damaged``; one it did not check is
        checked now, and a damaged one stops the run (its rows cannot be computed again this
        late; the re-run does, as ``recompute_damaged`` checks it before its tasks).

        Raises:
            RunError: a shard not checked before the tasks is damaged.
        """
        layout, state = self.layout, self._state
        touched = rewritten = 0
        for seq in self._touched(kept):
            info = state.shards[seq]
            if seq not in state.checked:
                why = self._damage(info)
                if why is not None:
                    raise RunError(f"shard {info.path} of '{self.location}' is damaged ({why}); "
                                   "nothing was published: re-run the same command to compute "
                                   "its rows again")
                state.checked.add(seq)
            schema = schema_from_json(state.schemas[seq])
            reader = shard_format.open(layout.local_shard(info), schema)
            try:
                keys = reader.read(columns=["source_key"])["source_key"]
                live = [i for i, k in enumerate(keys) if kept.get(k, {}).get("shard") == seq]
                touched += 1
                if len(live) >= (1 - COMPACT_FRACTION) * info.rows:
                    dead = sorted(set(range(info.rows)) - set(live))
                    state.shards[seq] = dataclasses.replace(info, deleted=tuple(dead))
                    continue
                columns = reader.read(indices=live)
            finally:
                reader.close()
            state.changed = True
            state.shards[next_seq] = layout.commit_shard(next_seq, shard_format, columns, schema)
            state.schemas[next_seq] = state.schemas[seq]
            for record in kept.values():
                if record["shard"] == seq:
                    record["shard"] = next_seq
            next_seq += 1
            rewritten += 1
        return touched, rewritten

    # ---- publishing ------------------------------------------------------------------------------

    def _write_table(self, name: str, rows: list[dict[str, Any]], schema: pa.Schema) -> str:
        """Write a table under staging, then move it to ``name`` in the cache (rename or
        upload); returns its checksum."""
        tmp = self.layout.staging / f"{name}.tmp"
        with os.fdopen(create_new(tmp), "wb") as out:  # never through a planted link
            pq.write_table(pa.Table.from_pylist(rows, schema=schema), out, compression="zstd")
        checksum = file_checksum(tmp)
        self.layout.publish_file(tmp, name)
        return checksum

    def _unchanged(self, records: dict[str, dict[str, Any]], *, pipeline_ref: str,
                   params: dict[str, Any], source: str) -> bool:
        """Whether the new cache would be the published one: the same fingerprint (ops,
        parameters of ops, format), pipeline, parameters and source, the same index records
        (no input added, changed, touched or removed), and no shard committed or rewritten."""
        old, state = self.old, self._state
        return (old is not None and not state.changed and old.fingerprint == self.fingerprint
                and old.pipeline == self.pipeline and old.pipeline_ref == pipeline_ref
                and old.source == source
                and json.dumps(old.params, sort_keys=True, default=str)
                == json.dumps(params, sort_keys=True, default=str)
                and records == state.published)

    def publish(self, records: dict[str, dict[str, Any]], *, pipeline_ref: str,
                params: dict[str, Any], ops: list[dict[str, Any]], shard_format: str,
                source: str) -> Manifest:
        """Write the index and errors tables, then the manifest; delete what the new manifest
        no longer uses. ``records``: key -> index record of every input of the new cache.
        When that cache is the published one (``_unchanged``), write nothing and return the
        published manifest (``published`` stays False): a re-run that changes nothing makes
        no new generation, so readers of the current one have nothing to reopen.

        Raises:
            CacheBusyError: a run on another machine took the remote cache's lease.
            RunError: the shards disagree on their columns.
        """
        self._lock.check()  # a remote cache: still this run's lease
        layout, old, state = self.layout, self.old, self._state
        if old is not None and self._unchanged(records, pipeline_ref=pipeline_ref,
                                               params=params, source=source):
            self._clean_up(old)  # what a re-run always did: old generations past retention
            return old
        ordered = [records[k] for k in sorted(records)]
        used = sorted({r["shard"] for r in ordered if r["shard"] >= 0})
        schemas = {json.dumps(state.schemas[seq], sort_keys=True) for seq in used}
        if len(schemas) > 1:
            raise RunError(f"shards of '{layout.location}' disagree on their columns "
                           f"({sorted(schemas)}); "
                           "the pipeline's ops emit different columns for different inputs")
        schema = schema_from_json(state.schemas[used[0]]) if used else (
            old.schema if old is not None and old.fingerprint == self.fingerprint else {})
        generation = max(old.generation if old is not None else 0, self._floor) + 1
        index_name = layout.index(generation).name
        index_sum = self._write_table(index_name, ordered, INDEX_SCHEMA)
        errors = [{k: r[k] for k in ERRORS_SCHEMA.names} for r in ordered
                  if r["status"] == "failed"]
        errors_name = layout.errors(generation).name
        errors_sum = self._write_table(errors_name, errors, ERRORS_SCHEMA)
        counts = {status: sum(r["status"] == status for r in ordered)
                  for status in ("ok", "skipped", "failed")}
        shards = [state.shards[seq] for seq in used]
        counts.update(inputs=len(ordered), rows=sum(s.live_rows for s in shards))
        from precache import __version__

        manifest = Manifest(
            pipeline=self.pipeline, pipeline_ref=pipeline_ref, params=params, ops=ops,
            fingerprint=self.fingerprint, format=shard_format, schema=schema, shards=shards,
            counts=counts, index={"path": index_name, "checksum": index_sum},
            errors={"path": errors_name, "checksum": errors_sum}, source=source,
            generation=generation,
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            precache_version=__version__,
        )
        data = manifest.to_bytes()
        if old is not None and not layout.store.exists(generation_path(old.generation)):
            # a cache written before generations were kept: keep the one this run supersedes
            # too, so that its readers' leases hold its files
            layout.store.write_bytes(generation_path(old.generation),
                                     layout.store.read_bytes("manifest.json"))
        layout.store.write_bytes(generation_path(generation), data)  # kept for its readers
        try:
            layout.store.write_bytes("manifest.json", data)  # last: now it is the cache
        except BaseException:  # not published: no copy of it may look kept (or be opened)
            try:
                layout.store.delete(generation_path(generation))
            except OSError:
                pass  # the next run numbers past it
            raise
        if layout.url is None:
            fsync_dir(layout.root)  # the manifest's rename, too, survives a power cut
        self.published = True
        self._clean_up(manifest)
        return manifest

    def _clean_up(self, manifest: Manifest) -> None:
        """After publishing: delete the superseded generations no reader holds and that are
        past the retention period, and precache's shards and tables no kept generation names
        (``generations.collect``); then the journal and staging."""
        layout = self.layout
        try:
            collect(layout.store, manifest, retention_s=self.retention_s, is_own=layout.is_own,
                    log=self.log)
        except OSError as e:  # published all the same: the old files wait for the next collect
            self.log(f"precache: published generation {manifest.generation} of "
                     f"'{layout.location}', but removing old files failed ({e}); `precache gc "
                     f"{layout.location}` removes them later")
        layout.clear_local(layout.journal)
        layout.clear_local(layout.staging)
