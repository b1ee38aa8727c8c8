"""``precache run PIPELINE --input PATH --output CACHE``: stage 1, one call to ``precache.run``."""

from __future__ import annotations

import argparse
import re
import sys

from precache.processing import DEFAULT_SHARD_ROWS, RunSummary, stage1_workers, run
from precache.cache.lock import DEFAULT_WAIT_S
from precache.processing.sources import DEFAULT_MAX_INPUT_BYTES, format_bytes
from precache.cache.formats import FORMATS
from precache.cache.inspect import _size
from precache.processing.dataset_source import dataset_from_ref, run_dataset
from precache.processing.pipeline import PipelineError, available_pipelines, load_pipeline

EPILOG = """\
examples:
  precache run faces --input photos/ --output cache/ --set size=128 --set keep=all
  precache run images --input photos/ --output cache/
  precache run images -i photos/ -o cache/ --set size=224 --workers 4 --format hdf5
  precache run path/to/my_pipeline.py -i list.txt -o cache/   # imports and runs that file
  precache run mymodule:make_dataset -o cache/   # a Dataset factory: each dataset[i] cached
  precache run faces -i photos/ -o cache/ --executor ray              # a local Ray, all cores
  precache run faces -i /shared/photos -o /shared/cache --executor ray --address HEAD_IP:6379
  precache run images -i photos/ -o cache/ --wait   # on every rank: one computes, the rest wait

Re-running the same command is cheap: unchanged inputs are not recomputed (a re-run that changes
nothing publishes no new generation), an interrupted run resumes where it stopped, and changed
ops or parameters rebuild the cache. Inputs that fail are
recorded in the cache's errors table and the run goes on (exit 0); --fail-fast stops at the first.
A pipeline .py file (or module:attr) is Python code: precache imports and runs it with your rights,
in every worker too, as `python my_pipeline.py` would; run only pipeline files you trust.

installed pipelines (parameters and defaults):
{pipelines}
"""


def _pipeline_help() -> str:
    lines = []
    for name in sorted(available_pipelines()):
        try:
            pipeline = load_pipeline(name)
            params = ", ".join(f"{k}={v!r}" for k, v in pipeline.defaults().items())
            lines.append(f"  {name:<10} {pipeline.description}\n  {'':<10} ({params})")
        except PipelineError as e:
            lines.append(f"  {name:<10} (cannot load: {e})")
    return "\n".join(lines) or "  none"


_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """A byte count: ``1000``, or with a suffix in powers of 1024: ``512K``, ``64M``, ``4G``,
    ``1T`` (``KiB``, ``MB``, ``GiB``... are read the same way)."""
    match = _SIZE.match(text)
    if not match or int(match[1]) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive size: give bytes (1000000) or a number with K, M, G or "
            "T (powers of 1024), e.g. 4G")
    return int(match[1]) * 1024 ** " KMGT".index(match[2].upper() or " ")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a stage-1 pipeline over inputs into a cache",
        description="Run a stage-1 pipeline over a folder (or list) of inputs and write a cache: "
        "shards, an index and an errors table, and manifest.json last.",
        epilog=EPILOG.format(pipelines=_pipeline_help()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("pipeline", help="installed pipeline name (e.g. images), module:attr, "
                        "or path to a pipeline .py file (imported and run with your rights: "
                        "only files you trust)")
    parser.add_argument("-i", "--input", default=None,
                        help="folder of inputs (searched recursively), one file, or a .txt list; "
                        "a local path or a URL (s3://, gs://, file://). Required, but for a "
                        "Dataset factory (PIPELINE module:attr that is not a Pipeline: a "
                        "function or class giving a map-style dataset, whose dataset[i] are "
                        "cached)")
    parser.add_argument("-o", "--output", required=True,
                        help="cache to write: a directory or a URL (s3://, gs://, file://)")
    parser.add_argument("-j", "--workers", type=int, default=None,
                        help=f"worker processes (default: the cores, here {stage1_workers()})")
    parser.add_argument("--format", choices=sorted(FORMATS), default="parquet",
                        help="shard format (default: parquet)")
    parser.add_argument("--shard-rows", type=int, default=None,
                        help=f"inputs per shard (default: the pipeline's, {DEFAULT_SHARD_ROWS}; "
                        "text: 4096; or fewer for small runs so there are at least 32 shards of "
                        "at least 16)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a pipeline parameter (repeatable)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a cache of another pipeline at --output")
    parser.add_argument("--fail-fast", action="store_true",
                        help="stop at the first failed input with exit code 1")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--max-input-bytes", type=parse_size, default=DEFAULT_MAX_INPUT_BYTES,
                        metavar="SIZE",
                        help="the most bytes one input may have (default "
                        f"{format_bytes(DEFAULT_MAX_INPUT_BYTES)}); K, M, G, T suffixes are "
                        "powers of 1024 (e.g. 8G). A bigger input is a failed input (stage read), "
                        "refused before it is read and never read past the limit; so is one that "
                        "is not a regular file (a FIFO, device or socket; a symlink to a file is "
                        "fine). The run goes on")
    parser.add_argument("--executor", choices=["local", "ray"], default="local",
                        help="local: worker processes on this machine (default). ray: one Ray "
                        "actor per worker, each loading the models once; without --address a "
                        "local Ray is started for the run (needs: pip install 'precache[ray]')")
    parser.add_argument("--address", default=None, metavar="ADDR",
                        help="with --executor ray: a running Ray cluster (the HOST:PORT that "
                        "`ray start --head` printed, or 'auto'); -j then defaults to the "
                        "cluster's CPUs. The actors write the shards, so --input and --output "
                        "must be at the same paths on every node (a shared file system)")
    parser.add_argument("--wait", action="store_true",
                        help="if another run is writing --output (another rank of the same job), "
                        "wait for it to finish, then compute only what it left (usually "
                        f"nothing) instead of failing; up to {DEFAULT_WAIT_S / 3600:.0f} hours")
    parser.add_argument("--wait-timeout", type=float, default=None, metavar="SECONDS",
                        help="with --wait (implies it): wait at most this long, then fail with "
                        "one line naming the run that holds the cache")
    parser.add_argument("--device-stage", choices=["auto", "on", "off"], default="auto",
                        help="run the ops that use a device (a GPU face detector: --set "
                        "device=cuda) in one process for all workers, which batches every "
                        "worker's inputs together, while the workers decode and crop; auto "
                        "(default): when an op asks for it; off: every worker runs every op. "
                        "With --executor ray: a pool of device actors, one per GPU")
    parser.set_defaults(handler=run_command)


def print_summary(summary: RunSummary) -> None:
    """The end-of-run report: counts, time, throughput, cache size, first failures."""
    print(
        f"done in {summary.wall_s:.1f} s: {summary.inputs} inputs -> {summary.ok} ok, "
        f"{summary.skipped} skipped, {summary.failed} failed; computed {summary.computed} "
        f"({summary.samples_per_s:.1f} samples/s), reused {summary.reused}"
        + (f", dropped {summary.deleted} deleted" if summary.deleted else "")
    )
    if summary.waited_s:
        print(f"waited {summary.waited_s:.1f} s for another run of this cache")
    if summary.stages.describe():
        print(f"time per input in a worker, by stage: {summary.stages.describe()}")
    print(f"cache {summary.cache}: {summary.rows} rows, {_size(summary.cache_bytes)}, generation "
          f"{summary.generation}" + ("" if summary.published else " (up to date: nothing new "
                                     "published)"))
    for record in summary.failures[:5]:
        print(f"  failed {record['key']}: [{record['stage']}] {record['error_type']}: "
              f"{record['message']}")
    if summary.failed > 5:
        print(f"  ... {summary.failed - 5} more in {summary.cache}/{summary.errors_table} "
              f"(or: precache inspect {summary.cache})")


def run_command(args: argparse.Namespace) -> int:
    if args.workers is not None and args.workers < 1:
        raise PipelineError(f"--workers must be at least 1, got {args.workers}")
    if args.shard_rows is not None and args.shard_rows < 1:
        raise PipelineError(f"--shard-rows must be at least 1, got {args.shard_rows}")
    if args.address is not None and args.executor != "ray":
        raise PipelineError("--address is the address of a Ray cluster: add --executor ray")
    if args.wait_timeout is not None and not args.wait_timeout >= 0:
        raise PipelineError(f"--wait-timeout must be seconds >= 0, got {args.wait_timeout}")
    wait: bool | float = args.wait if args.wait_timeout is None else args.wait_timeout
    dataset = dataset_from_ref(args.pipeline)
    if dataset is not None:
        return _run_dataset(dataset, args, wait)
    if args.input is None:
        raise PipelineError("the following argument is required: --input/-i (a folder, file or "
                            "list of inputs)")
    pipeline = load_pipeline(args.pipeline)
    overrides = pipeline.parse_overrides(args.overrides)
    summary = run(
        pipeline, args.input, args.output, params=overrides, workers=args.workers,
        format=args.format, shard_rows=args.shard_rows, overwrite=args.overwrite,
        fail_fast=args.fail_fast, progress=not args.quiet, executor=args.executor,
        ray_address=args.address, max_input_bytes=args.max_input_bytes, wait=wait,
        device_stage={"auto": None, "on": True, "off": False}[args.device_stage],
        log=lambda msg: print(msg, file=sys.stderr),
    )
    print_summary(summary)
    return 0


def _run_dataset(dataset: object, args: argparse.Namespace, wait: bool | float) -> int:
    """``precache run module:attr`` for a Dataset factory: ``dataset[i]`` for every index."""
    unused = [flag for flag, used in (("--input", args.input is not None),
                                      ("--set", bool(args.overrides)),
                                      ("--executor ray", args.executor != "local"))
              if used]
    if unused:
        raise PipelineError(f"'{args.pipeline}' is a Dataset factory: {', '.join(unused)} do not "
                            "apply (its samples are dataset[0] .. dataset[len - 1]); leave them out")
    summary = run_dataset(dataset, args.output, workers=args.workers, format=args.format,
                          shard_rows=args.shard_rows, overwrite=args.overwrite,
                          fail_fast=args.fail_fast, progress=not args.quiet, wait=wait,
                          log=lambda msg: print(msg, file=sys.stderr))
    print_summary(summary)
    return 0
