"""``precache preview CACHE -o preview.png``: contact sheets of cached face crops."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "preview", help="draw a contact sheet of cached crops with landmarks and regions",
        description="Draw N cached crops (spread evenly over the cache) with the 5 landmarks, the "
        "468-point mesh and the region outlines overlaid, and a second sheet of the same samples "
        "after FaceAugment (written beside the first as <name>_augmented.png).",
        epilog="example:\n  precache preview data/cache -o preview.png --n 36",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("cache", help="cache directory or URL (s3://, gs://, file://)")
    parser.add_argument("-o", "--output", default="preview.png",
                        help="PNG or JPEG file to write (default: %(default)s)")
    parser.add_argument("--n", type=int, default=64, help="samples to draw (default: %(default)s)")
    parser.add_argument("--scale", type=int, default=2,
                        help="enlarge each crop this many times (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the augmentation sheet (default: %(default)s)")
    parser.add_argument("--no-augment", action="store_true", help="skip the augmented sheet")
    parser.set_defaults(handler=preview_command)


def preview_command(args: argparse.Namespace) -> int:
    if args.n < 1 or args.scale < 1:
        print("precache preview: error: --n and --scale must be at least 1", file=sys.stderr)
        return 2
    # imported here: they import torch, which `precache --version` and other commands do not need
    from precache.cli.preview import write_previews

    augment = None
    if not args.no_augment:
        from precache.augment import FaceAugment

        augment = FaceAugment(seed=args.seed)
    try:
        written = write_previews(args.cache, args.output, n=args.n, scale=args.scale, augment=augment)
    except ValueError as e:
        print(f"precache preview: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0
