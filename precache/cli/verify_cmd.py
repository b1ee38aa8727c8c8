"""``precache verify CACHE [--generation N]``: re-read every shard of every kept generation;
exit 1 naming each bad one."""

from __future__ import annotations

import argparse
import sys

from precache.cache.verify import generations_checked, verify


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify", help="check every shard of a cache",
        description="Re-read every shard of every kept generation of a cache (the current one and "
        "those kept for readers) and check its checksum, that its row count and columns (read "
        "from the file's own footer) are the manifest's, and that every column decodes to the "
        "schema; then the index and errors tables. Exit 0 if sound, 1 naming each bad file.",
    )
    parser.add_argument("cache", help="cache directory or URL (s3://, gs://, file://)")
    parser.add_argument("--generation", type=int, default=None, metavar="N",
                        help="check only generation N (default: every kept generation; "
                        "`precache inspect` lists them)")
    parser.set_defaults(handler=verify_command)


def verify_command(args: argparse.Namespace) -> int:
    numbers = generations_checked(args.cache, args.generation)
    problems = verify(args.cache, args.generation)
    for problem in problems:
        print(f"BAD {args.cache}/{problem}", file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s) found in {args.cache}", file=sys.stderr)
        return 1
    which = ", ".join(map(str, numbers))
    print(f"{args.cache}: generation{'s' if len(numbers) > 1 else ''} {which}: all shards, "
          "index and errors tables verified")
    return 0
