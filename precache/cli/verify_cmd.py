"""``precache verify CACHE``: re-read every shard; exit 1 naming each bad one."""

from __future__ import annotations

import argparse
import sys

from precache.cache.verify import verify


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify", help="check every shard of a cache",
        description="Re-read every shard of a cache and check its checksum, row count and that "
        "every column decodes to the schema. Exit 0 if sound, 1 naming each bad file.",
    )
    parser.add_argument("cache", help="cache directory or URL (s3://, gs://, file://)")
    parser.set_defaults(handler=verify_command)


def verify_command(args: argparse.Namespace) -> int:
    problems = verify(args.cache)
    for problem in problems:
        print(f"BAD {args.cache}/{problem}", file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s) found in {args.cache}", file=sys.stderr)
        return 1
    print(f"{args.cache}: all shards, index and errors table verified")
    return 0
