"""``precache inspect CACHE``: schema, counts, shards, fingerprints and errors of a cache."""

from __future__ import annotations

import argparse
import json

from precache.cache.inspect import describe_cache, format_description


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect", help="describe a cache",
        description="Print a cache's schema, row counts, shards, bytes, op fingerprints and "
        "error summary.",
        epilog="example:\n  precache inspect data/cache --json | jq .counts",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("cache", help="cache directory or URL (s3://, gs://, file://)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=inspect_command)


def inspect_command(args: argparse.Namespace) -> int:
    description = describe_cache(args.cache)
    print(json.dumps(description, indent=2) if args.json else format_description(description))
    return 0
