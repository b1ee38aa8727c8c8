"""``precache bench CACHE``: stage-2 samples/s against a gather limit and a per-file loader."""

from __future__ import annotations

import argparse
import json
import sys

from precache.cache.manifest import ManifestError

# precache.cli.bench imports torch (over a second): it is imported when the command runs, so that
# every other subcommand starts fast.

EPILOG = """\
examples:
  precache bench data/cache
  precache bench data/cache --columns image,landmarks5 --workers 0,2 --seconds 5
  precache bench data/cache --json | jq .recommendation

For each --workers value it prints the samples/s a training loop receives from
make_loader(CachedDataset(CACHE, columns), batch_size, shuffle=True, num_workers=w), with the
workers as threads of the training process and as worker processes (worker_kind), epoch 1
(worker start, first reads) apart from the later epochs, against two baselines measured in the
same run: the limit and a plain DataLoader over one picture file per row (cv2.imread), then
batch sizes 64/256/1024 at the best workers, worker processes' memory (RSS) per epoch, and a
recommended num_workers, worker_kind and batch size.

The limit reads the same bytes from memory-mapped .npy files, every column asked for: np.take of
each fixed-shape column into preallocated batches; for each variable-length column (ragged,
bytes, str), exported as flat values + int64 offsets, one slice values[offsets[i]:offsets[i+1]]
per row (str decoded as UTF-8); an encoded image column (jpeg/webp) decoded row by row with
precache's decoder into one preallocated array. Temporary files go to $TMPDIR (about the
cache's size, fixed-shape columns decoded).
Worker processes copy every batch through shared memory; threads hand it over as is, and
processes pay off only for per-sample Python transforms: measure it.
"""


def _workers(text: str) -> list[int]:
    try:
        counts = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}")
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(f"worker counts must be >= 0: {text!r}")
    return counts


def _positive(kind: type) -> object:
    def parse(text: str) -> float | int:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
        return value
    parse.__name__ = kind.__name__
    return parse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="measure stage-2 loading of a cache",
        description="Measure the samples/s make_loader delivers from a cache, per number of "
        "DataLoader workers, against a NumPy gather limit (fixed-shape and variable-length "
        "columns alike) and a one-file-per-sample loader; recommend num_workers and a batch "
        "size.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("cache", help="cache directory or URL (s3://, gs://, file://)")
    parser.add_argument("--batch-size", type=_positive(int), default=256,
                        help="batch size of the comparison (default 256)")
    parser.add_argument("--workers", type=_workers, default=None,
                        help="comma-separated DataLoader worker counts (default: 0, 1, 2, then "
                        "powers of two up to the cores, and the cores)")
    parser.add_argument("--columns", default=None,
                        help="comma-separated columns to load (default: all)")
    parser.add_argument("--seconds", type=_positive(float), default=3.0,
                        help="seconds of epochs per setting after its epoch 1 (default 3)")
    parser.add_argument("--file-format", choices=["jpeg", "png"], default="jpeg",
                        help="per-file baseline files: jpeg (quality 95, default) or png")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with every number")
    parser.set_defaults(handler=bench_command)


def bench_command(args: argparse.Namespace) -> int:
    from precache.cli.bench import bench_loader, format_report

    columns = [c.strip() for c in args.columns.split(",") if c.strip()] if args.columns else None
    try:
        result = bench_loader(args.cache, batch_size=args.batch_size, workers=args.workers,
                              columns=columns, seconds=args.seconds, file_format=args.file_format,
                              log=lambda line: print(f"bench: {line}", file=sys.stderr, flush=True))
    except ManifestError:
        raise  # the dispatcher's "cannot go on" error: exit 1
    except (KeyError, ValueError) as e:
        print(f"precache: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0
