"""The ``precache`` command: a thin dispatcher over one module per subcommand."""

from __future__ import annotations

import argparse
import errno
import os
import select
import signal
import sys
from pathlib import Path

from precache import __version__
from precache.processing import RunError
from precache.processing.sources import InputError
from precache.cache import CacheBusyError
from precache.cache.manifest import ManifestError
from precache.cli import (bench_cmd, doctor_cmd, gc_cmd, inspect_cmd, preview_cmd, run_cmd,
                          tokenizer_cmd, verify_cmd)
from precache.errors import DISK_FULL, UsageError, disk_full
from precache.processing.pipeline import PipelineError
from precache.storage import StorageError

__all__ = ["main"]

_COMMANDS = (run_cmd, inspect_cmd, verify_cmd, gc_cmd, preview_cmd, bench_cmd, tokenizer_cmd,
             doctor_cmd)

USAGE_ERRORS = (InputError, PipelineError, UsageError)
"""Errors in what the user typed: one line, exit 2."""
RUN_ERRORS = (RunError, CacheBusyError, ManifestError, StorageError)
"""The job cannot go on: one line, exit 1."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="precache",
        description="Run expensive per-sample work once, offline and in parallel (stage 1), "
        "then train from compact shards (stage 2).",
    )
    parser.add_argument("--version", action="version", version=f"precache {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in _COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``precache`` console script; returns the exit code.

    A failure is one line on stderr: exit 2 for what was typed (``USAGE_ERRORS``), 1 for a job
    that cannot go on (``RUN_ERRORS``, and a full disk, exhausted quota or read-only file system,
    also when a run error wraps one), 130 for Ctrl-C. Output piped into a reader that stops
    early (``precache inspect CACHE | head``) ends quietly with 141 (128 + SIGPIPE)."""
    try:
        code = _dispatch(argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe is seen below
        return code
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # another pipe (a worker's): not the reader of our output going away
        # The reader (``| head``) has all it wanted: stop quietly, as a tool killed by SIGPIPE
        # would. Python flushes stdout again at exit: point it at devnull, so that flush is quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _dispatch(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        return int(args.handler(args))
    except USAGE_ERRORS as e:
        print(f"precache: error: {e}", file=sys.stderr)
        return 2
    except RUN_ERRORS as e:
        full = disk_full(e.__cause__ or e.__context__)  # e.g. a worker's write, wrapped
        print(f"precache: error: {_disk_full_message(args, full) if full else e}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("precache: interrupted; finished shards are kept: re-run the same command to resume",
              file=sys.stderr)
        return 130
    except OSError as e:
        if not disk_full(e):
            raise  # BrokenPipeError included: main() looks at it
        print(f"precache: error: {_disk_full_message(args, e)}", file=sys.stderr)
        return 1


def _stdout_closed() -> bool:
    """Whether nobody reads our stdout any more (the write end of a pipe whose reader closed)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), stdout closed or replaced
        return True


def _disk_full_message(args: argparse.Namespace, error: OSError) -> str:
    """One line for a full disk, an exhausted quota or a read-only file system: where, what was
    kept, what to do."""
    is_run = args.command == "run"
    target = (getattr(args, "output", None) if is_run else None) or error.filename or getattr(
        args, "output", None) or getattr(args, "cache", None) or "the output"
    reason = DISK_FULL[error.errno]
    local = "://" not in str(target)
    folder = Path(target)
    if is_run:
        published = local and (folder / "manifest.json").is_file()
        kept = ("the cache still reads as it did before this run (a run replaces its manifest "
                "last) and finished shards are kept" if published else
                "no cache was published there (a run writes its manifest last); finished shards "
                "are kept")
        again = "re-run the same command to resume"
        left = _leftovers(folder) if local and not published else []
        if left:  # the run failed before marking the folder as a cache: the re-run refuses it
            shown = ", ".join(left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
            kept = ("no cache was published there, and the folder is not yet marked as one "
                    f"(it holds only what this run left: {shown})")
            them = "it" if len(left) == 1 else "them"
            again = f"remove {them} from {folder} and re-run the same command"
    else:  # preview, tokenizer train...: what they write is a file of their own
        kept, again = "", "re-run the same command"
    if error.errno == errno.EROFS:
        fix = f"write to a writable place (or remount it read-write), then {again}"
    elif error.errno == getattr(errno, "EDQUOT", None):
        fix = f"free space within your quota (quota -s) or have it raised, then {again}"
    else:
        where = next((p for p in (folder, *folder.parents) if p.exists()), folder) if local \
            else folder
        fix = f"free space on that file system (df -h {where}), then {again}"
    return f"{reason} writing {target}; {kept}: {fix}" if kept else \
        f"{reason} writing {target}: {fix}"


def _leftovers(folder: Path) -> list[str]:
    """What a run left in ``folder`` that would make the next run refuse it: files other than
    the lock in a folder without precache's marker (``.precache``)."""
    try:
        names = sorted(p.name for p in folder.iterdir())
    except OSError:
        return []
    if ".precache" in names:
        return []
    return [name for name in names if name not in (".lock", ".writer.json")]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
