"""``precache doctor RUN``: where a training run's step time goes, and what to try."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_parser", "doctor_command"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``precache doctor``."""
    parser = subparsers.add_parser(
        "doctor", help="say where a training run's step time goes and what to try",
        description="Reads the metrics.jsonl that precache's trainers write (pipelines/): every "
        "epoch's step timeline and the run's settings. The data wait is timed on every batch; "
        "the host-to-device copy, forward, backward and optimizer phases on a random sample of "
        "about one batch in --timeline-every, or on every batch of an epoch of few batches "
        "(CUDA events on a GPU, so the measured step never waits for the device). Prints each "
        "epoch's shares, then the checklist's suggestions for the chosen epoch: fp32 where the "
        "CPU emulates bf16, more loader workers, fewer columns, caching a transform, pinned "
        "memory, mixed precision, torch.compile, channels_last, a bigger batch or accumulation, "
        "loader threads instead of worker processes, JPEG decoding on the GPU. --plot draws it.",
        epilog="examples:\n  precache doctor runs/finetune\n"
        "  precache doctor runs/faces/metrics.jsonl --epoch 0 --json\n"
        "  precache doctor runs/faces --plot steps.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run", help="a run folder (holding metrics.jsonl) or a metrics.jsonl")
    parser.add_argument("--epoch", type=int, default=None,
                        help="the epoch to diagnose (default: the last one with a timeline)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also draw each epoch's step time by phase (a stacked bar per "
                        "epoch, ms per batch beside it) into this PNG (needs matplotlib)")
    parser.set_defaults(handler=doctor_command)


def doctor_command(args: argparse.Namespace) -> int:
    from precache.training.doctor import (PHASES, TimelineError, diagnose, load_timeline, plot,
                                          table, timed)

    try:
        config, epochs, steps = load_timeline(args.run)
    except TimelineError as e:
        print(f"precache: error: {e}", file=sys.stderr)
        return 2
    chosen = epochs[-1] if args.epoch is None else next(
        (r for r in epochs if r.get("epoch") == args.epoch), None)
    if chosen is None:
        have = ", ".join(str(r.get("epoch")) for r in epochs)
        print(f"precache: error: {args.run} has no timeline for epoch {args.epoch} "
              f"(epochs with one: {have})", file=sys.stderr)
        return 2
    findings = diagnose(config, chosen)
    if args.plot:
        try:
            plot(epochs, args.plot, title=f"{args.run}: where step time goes")
        except (RuntimeError, OSError) as e:
            print(f"precache: error: {args.plot}: {e}", file=sys.stderr)
            return 2
    if args.json:
        timeline = dict(chosen["timeline"])
        if not timed(timeline):  # unknown, not 0: no batch was timed in detail
            timeline.update({p: None for p in PHASES if p != "data_wait"})
        print(json.dumps({"epoch": chosen.get("epoch"), "timeline": timeline,
                          "config": config, "sampled_steps": len(steps),
                          "findings": [f.to_json() for f in findings]}))
        return 0
    print("\n".join(table(epochs)))
    t = chosen["timeline"]
    print(f"\nepoch {chosen.get('epoch')}: {t.get('batches', 0)} batches, "
          f"{t.get('sampled', 0)} timed in detail")
    if not findings:
        top = max(("data_wait", "h2d", "forward", "backward", "optimizer"),
                  key=lambda p: t.get(p, 0.0))
        print(f"no rule fired: the largest share is {top} ({100 * t.get(top, 0.0):.0f}%)")
    for n, finding in enumerate(findings, 1):
        print(f"{n}. {finding.advice}\n   because: {finding.evidence} [{finding.rule}]")
    return 0
