"""``precache gc CACHE``: remove superseded generations no reader holds, and their files; keep
the shards an interrupted run committed (named in its journal) until it is resumed, or until
``--drop-interrupted``."""

from __future__ import annotations

import argparse
import re

from precache.cache.generations import DEFAULT_RETENTION_S, collect, journaled_shards
from precache.cache.layout import CacheLayout
from precache.cache.lock import CacheLock
from precache.cache.reader import load_manifest
from precache.storage import Store

__all__ = ["add_parser", "gc_command", "duration"]

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """Seconds from ``0``, ``90``, ``90s``, ``30m``, ``2h`` or ``7d`` (argparse type)."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration; use seconds or a number with s, m, h or d "
            "(0, 90, 30m, 2h, 7d)")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def count(text: str) -> int:
    """A non-negative integer (argparse type)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (0, 1, 2, ...)")
    return int(text)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``precache gc``."""
    parser = subparsers.add_parser(
        "gc", help="remove old generations of a cache that no reader holds",
        description="Every run that publishes keeps the generation it replaces, for readers "
        "still using it (a training job opened before the run) and for a retention period "
        f"(default {DEFAULT_RETENTION_S / 3600:.0f} h). This removes superseded generations "
        "that no live reader holds, that were superseded longer ago than --older-than and "
        "that are not among the --keep newest, then every shard and table no kept generation "
        "names. The current generation is never removed. The shards that an interrupted run "
        "committed (named in the cache's journal/) are kept, so that re-running the same "
        "command resumes it without computing them again; --drop-interrupted deletes them and "
        "the journal. Takes the cache's write lock (fails while a run writes it).",
        epilog="examples:\n  precache gc cache/ --dry-run\n  precache gc cache/ --older-than 0"
        "\n  precache gc s3://bucket/cache --older-than 2h --keep 3",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("cache", help="cache directory or URL (s3://, gs://, file://)")
    parser.add_argument("--older-than", type=duration, default=DEFAULT_RETENTION_S,
                        metavar="DURATION",
                        help="remove generations superseded longer ago than this (0, 90s, 30m, "
                        "2h, 7d; default 1h)")
    parser.add_argument("--keep", type=count, default=None, metavar="N",
                        help="keep the N newest superseded generations whatever their age "
                        "(default: none kept by count)")
    parser.add_argument("--drop-interrupted", action="store_true",
                        help="also delete the shards an interrupted run committed, and its "
                        "journal (its re-run then starts over)")
    parser.add_argument("--dry-run", action="store_true",
                        help="say what would be removed; remove nothing")
    parser.set_defaults(handler=gc_command)


def gc_command(args: argparse.Namespace) -> int:
    """Collect under the write lock; one line per generation removed or kept, then the total.
    A run holding the lock is a ``CacheBusyError`` (exit 1, by the dispatcher)."""
    load_manifest(Store(args.cache))  # not a cache: say so before taking (making) a lock
    layout = CacheLayout.for_output(args.cache)
    layout.check_owned_folders()  # a folder replaced by a link: never delete where it points
    with CacheLock(layout):
        current = load_manifest(layout.store)
        journaled = journaled_shards(layout.journal)  # no run holds the lock: it was interrupted
        interrupted = layout.journal.is_dir() and any(layout.journal.glob("part-*.json"))
        if args.drop_interrupted and not args.dry_run:
            # the journal first: its shards are then orphans, which any later collect deletes
            layout.clear_local(layout.journal)
        done = collect(layout.store, current, retention_s=args.older_than, keep=args.keep,
                       dry_run=args.dry_run, is_own=layout.is_own,
                       keep_files=() if args.drop_interrupted else set(journaled))
    verb = "would remove" if args.dry_run else "removed"
    for generation in done.removed:
        print(f"{verb} generation {generation}")
    for generation, why in sorted(done.kept.items()):
        print(f"kept generation {generation}: {why}")
    journal = "journal/" if layout.url is None else str(layout.journal)
    if done.kept_files:
        print(f"kept {len(done.kept_files)} shard(s) of an interrupted run (named in its "
              f"journal, {journal}): re-run the same command to resume it, or `precache gc "
              f"{layout.location} --drop-interrupted` to delete them")
    if args.drop_interrupted:
        dropped = [rel for rel in done.deleted_files if rel in journaled]
        if interrupted:
            print(f"{'would delete' if args.dry_run else 'deleted'} {len(dropped)} shard(s) of "
                  f"an interrupted run, and its journal ({journal})")
    freed = "would free" if args.dry_run else "freed"
    print(f"current generation {current.generation}; {verb} {len(done.deleted_files)} file(s), "
          f"{freed} {done.freed_bytes} bytes ({done.freed_bytes / 1e6:.1f} MB)")
    return 0
