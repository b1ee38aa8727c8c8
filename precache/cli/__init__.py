"""The ``precache`` command: a thin dispatcher over one module per subcommand."""

from __future__ import annotations

import argparse
import sys

from precache import __version__
from precache.build import RunError
from precache.build.sources import InputError
from precache.cache import CacheBusyError
from precache.cache.manifest import ManifestError
from precache.cli import (bench_cmd, doctor_cmd, gc_cmd, inspect_cmd, preview_cmd, run_cmd,
                          tokenizer_cmd, verify_cmd)
from precache.pipeline import PipelineError
from precache.storage import StorageError

__all__ = ["main"]

_COMMANDS = (run_cmd, inspect_cmd, verify_cmd, gc_cmd, preview_cmd, bench_cmd, tokenizer_cmd,
             doctor_cmd)

USAGE_ERRORS = (InputError, PipelineError)
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
    """Entry point of the ``precache`` console script; returns the exit code."""
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
        print(f"precache: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("precache: interrupted; finished shards are kept: re-run the same command to resume",
              file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
