"""Read a run's step timeline and say what the speed checklist suggests (``precache doctor``).

Input: the ``metrics.jsonl`` a precache trainer writes: one ``{"kind": "run", "config": ...}``
record (``timeline.run_record``), per-epoch records with a ``"timeline"`` summary, and sampled
``{"kind": "step"}`` records. Each rule reads one epoch's shares and the run's settings and, when
it fires, gives the evidence (the numbers it saw) and the advice. The thresholds are below.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Finding", "TimelineError", "diagnose", "emulated_bf16", "load_timeline", "plot",
           "table", "timed"]

DATA_WAIT_HIGH = 0.2  # share of step time waiting for the loader
H2D_HIGH = 0.1  # share in host-to-device copies (CUDA)
COMPUTE_HIGH = 0.5  # forward + backward share
OPTIMIZER_HIGH = 0.2  # optimizer share
HOST_BOUND_HIGH = 0.3  # share of a CUDA step outside its timed phases (the GPU waits on the host)
PHASES = ("data_wait", "h2d", "forward", "backward", "optimizer", "other")


class TimelineError(ValueError):
    """The file is missing, unreadable, or has no timeline to diagnose."""


@dataclass(frozen=True)
class Finding:
    """One rule that fired: its name, what it saw, what to try."""

    rule: str
    evidence: str
    advice: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def load_timeline(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict], list[dict]]:
    """``(config, epoch records with a timeline, step records)`` of a ``metrics.jsonl``, or of
    the one in the run folder ``path``.

    Raises:
        TimelineError: no such file, a line that is not JSON (named by number), or no epoch
            record with a timeline.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise TimelineError(f"{path}: no such file; give a run's metrics.jsonl or its folder")
    config: dict[str, Any] = {}
    epochs, steps = [], []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TimelineError(f"{path}, line {number}: not JSON ({e.msg})") from None
            kind = record.get("kind", "epoch")  # epoch records from before timelines: no kind
            if kind == "run":
                config = dict(record.get("config") or {})
            elif kind == "step":
                steps.append(record)
            elif kind == "epoch" and isinstance(record.get("timeline"), dict):
                epochs.append(record)
    if not epochs:
        raise TimelineError(f"{path} has no epoch record with a 'timeline': train with a precache "
                            "trainer (pipelines/), which writes one per epoch, then run doctor "
                            "on its metrics.jsonl")
    return config, epochs, steps


def _pct(share: float) -> str:
    return f"{100 * share:.0f}%"


def timed(timeline: dict[str, Any]) -> bool:
    """Whether the epoch timed any batch in detail: with 0 sampled batches the shares of h2d,
    forward, backward, optimizer (and so other) are unknown, not 0. Records from before the
    ``sampled`` count are taken as timed."""
    return timeline.get("sampled") != 0


NOT_TIMED_ADVICE = ("time some batches: lower --timeline-every (about one batch in that many "
                    "is timed; the trainers' default is 10, and an epoch of fewer than 100 "
                    "batches times every batch) or train more batches per epoch, then run "
                    "doctor again")


def emulated_bf16(config: dict[str, Any]) -> bool:
    """Whether the run computed in bf16 on a CPU that emulates it (the run record says
    ``cpu_bf16: false``): there bf16 autocast is many times slower than fp32 (23x for MiniLM
    fine-tuning on an AVX2 CPU), and no other advice on compute applies before fixing that.
    Records from before ``cpu_bf16`` say nothing: not judged."""
    return (config.get("device", "cpu") == "cpu" and config.get("precision") == "bf16"
            and config.get("cpu_bf16") is False)


def diagnose(config: dict[str, Any], epoch: dict[str, Any]) -> list[Finding]:
    """The rules that fire for one epoch record (its ``timeline``) under the run's ``config``.

    When the epoch timed no batch in detail, only the data wait (measured on every batch) is
    judged; the first finding, ``not-timed``, says the other phases are unknown. bf16 emulated
    on the CPU (``emulated_bf16``) comes first, whatever the shares: fp32 is the fix, and
    ``--compile`` is not advised then."""
    t = epoch["timeline"]
    found: list[Finding] = []
    if emulated_bf16(config):
        found.append(Finding(
            "fp32-on-this-cpu", "precision bf16 on a CPU without native bf16 (the run record "
            "says cpu_bf16: false, no AVX512-BF16 or AMX): torch emulates it",
            "--precision fp32, or auto (the trainers' default), which picks fp32 on this CPU: "
            "emulated bf16 autocast was 23x slower than fp32 for MiniLM on an AVX2 CPU"))
    if not timed(t):
        found.append(Finding(
            "not-timed", f"not timed: 0 sampled batches of {t.get('batches', 0)}, so the h2d, "
            "forward, backward and optimizer shares are unknown (only the data wait is measured "
            "on every batch)", NOT_TIMED_ADVICE))
    found.extend(_data_wait_rules(config, epoch))
    if timed(t):
        found.extend(_timed_rules(config, epoch))
    return found


def _data_wait_rules(config: dict[str, Any], epoch: dict[str, Any]) -> list[Finding]:
    t = epoch["timeline"]
    found: list[Finding] = []
    world = int(config.get("world_size") or epoch.get("world_size") or 1)
    workers = config.get("workers")
    cpus = config.get("cpus")

    wait = t.get("data_wait", 0.0)
    if wait > DATA_WAIT_HIGH:
        where = f"data wait {_pct(wait)} of step time"
        if workers is not None:
            where += f" with {workers} loader workers per rank"
        if cpus:
            where += f" on {cpus} CPUs, {world} rank{'s' if world > 1 else ''}"
        spare = (int(cpus) // world - 1) if cpus else None
        if workers is not None and spare is not None and int(workers) < spare:
            found.append(Finding("more-workers", where,
                                 f"raise --workers to {spare} (the cores per rank less one for "
                                 "the training process)"))
        read, used = config.get("columns"), config.get("columns_used")
        unused = sorted(set(read or []) - set(used or [])) if used is not None else []
        if unused:
            found.append(Finding("fewer-columns", where + f"; columns read but not used: "
                                 f"{', '.join(unused)}",
                                 "read only the columns the step uses (CachedDataset(columns=...))"))
        if config.get("worker_kind") == "processes" and not config.get("transform_in_loader"):
            found.append(Finding("thread-workers", where + " as worker processes",
                                 "make_loader(..., worker_kind='threads'), the default for a "
                                 "CachedDataset without a per-sample transform: batches are "
                                 "handed over as they are instead of copied through shared "
                                 "memory; augment whole batches (batch_transform=, or on the "
                                 "device)"))
        if config.get("device") == "cuda" and config.get("images_decoded_on") == "cpu":
            found.append(Finding("decode-on-gpu", where + "; JPEG crops decoded on the CPU",
                                 "CachedDataset(..., decode_images=False), then "
                                 "precache.loading.decode_images(batch['image'], 'cuda'): the "
                                 "batch travels as JPEG bytes and nvJPEG decodes it (pip install "
                                 "'precache[gpu]', TorchCodec)"))
        if config.get("transform_in_loader"):
            found.append(Finding("cache-the-transform", where + "; a transform runs in the loader",
                                 "move deterministic work into stage 1 (an op: it runs once, "
                                 "not every epoch) and keep only cheap random augmentation"))
        if not found:
            found.append(Finding("loader-at-its-limit", where,
                                 "the loader reads as fast as it can here: warm the page cache "
                                 "(CachedDataset warms shards it reads), use faster storage or a "
                                 "local disk cache, or store smaller samples (JPEG crops)"))
    return found


def _timed_rules(config: dict[str, Any], epoch: dict[str, Any]) -> list[Finding]:
    """Rules on the phases timed on sampled batches only."""
    t = epoch["timeline"]
    found: list[Finding] = []
    device = config.get("device", "cpu")

    h2d = t.get("h2d", 0.0)
    if device == "cuda" and h2d > H2D_HIGH:
        evidence = f"host-to-device copy {_pct(h2d)} of step time"
        if config.get("images_decoded_on") == "device":
            found.append(Finding(
                "device-inputs", f"h2d {_pct(h2d)} of step time: it includes the task's inputs, "
                "which decode the JPEG crops on the GPU and augment them there",
                "a larger --batch-size: their cost is mostly per batch, not per crop (a few "
                "hundred kernel launches; on an H100 ~12 ms for 32 frames of 128 px, ~37 ms "
                "for 256 crops of 224 px); or decode in the loader's workers on every core "
                "(the face trainers' --decode-on loader; in code, CachedDataset(..., "
                "decode_images=True)), and augment there too (--augment-on loader; "
                "make_loader(..., batch_transform=FaceAugment(...)))"))
        elif not config.get("pin_memory"):
            found.append(Finding("pin-memory", evidence + " from pageable memory",
                                 "pin_memory=True in the DataLoader and .to(device, "
                                 "non_blocking=True)"))
        else:
            found.append(Finding("smaller-transfers", evidence + " from pinned memory",
                                 "send uint8 images and normalize on the GPU; send token ids as "
                                 "int32, not int64"))

    compute = t.get("forward", 0.0) + t.get("backward", 0.0)
    if compute > COMPUTE_HIGH:
        evidence = f"forward + backward {_pct(compute)} of step time"
        precision = config.get("precision")
        if precision == "fp32" and (device == "cuda" or config.get("cpu_bf16")):
            found.append(Finding("mixed-precision", evidence + " in fp32",
                                 "--precision bf16 (Ampere or newer GPUs, CPUs with AVX512-BF16 "
                                 "or AMX); fp16 with a GradScaler on older GPUs"))
        if config.get("compile") is False and not emulated_bf16(config):
            found.append(Finding("compile", evidence + " in eager mode",
                                 "--compile (torch.compile; the first steps compile)"))
        if (device == "cuda" and config.get("input") == "images"
                and config.get("channels_last") is False):
            found.append(Finding("channels-last", evidence + " on NCHW images",
                                 "--channels-last: convolutions run faster in NHWC on tensor "
                                 "cores"))

    other = t.get("other", 0.0)
    if device == "cuda" and other > HOST_BOUND_HIGH:
        found.append(Finding(
            "host-bound", f"{_pct(other)} of step time outside the timed phases on CUDA, whose "
            "phases are the GPU's own times (CUDA events): the GPU ran out of queued kernels and "
            "waited for Python to launch more",
            ("--compile (fewer, fused kernels)" if not config.get("compile") else
             "torch.compile with mode='reduce-overhead' (CUDA graphs)") + ", or a larger "
            "--batch-size: the same launches then do more work"))

    opt = t.get("optimizer", 0.0)
    if opt > OPTIMIZER_HIGH:
        accumulate = int(config.get("accumulate") or 1)
        found.append(Finding("fewer-optimizer-steps",
                             f"optimizer {_pct(opt)} of step time at batch "
                             f"{config.get('batch_size', '?')}, accumulate {accumulate}",
                             "a bigger --batch-size or --accumulate N steps the optimizer once "
                             "per N batches; a fused or foreach optimizer costs less per step"))
    return found


def table(epochs: list[dict[str, Any]]) -> list[str]:
    """Lines of a table: one row per epoch, the share of each phase and seconds per batch.

    An epoch that timed no batch in detail shows ``-`` for the phases timed on sampled batches
    (and ``other``, the rest), and a line under the table says why."""
    head = f"{'epoch':>5} {'s/batch':>9} " + " ".join(f"{p:>9}" for p in PHASES)
    rows = [head]
    untimed = []
    for record in epochs:
        t = record["timeline"]
        known = timed(t)
        if not known:
            untimed.append(str(record.get("epoch", "?")))
        rows.append(f"{record.get('epoch', '?'):>5} {t.get('step_s', 0.0):>9.4f} "
                    + " ".join(f"{_pct(t.get(p, 0.0)) if known or p == 'data_wait' else '-':>9}"
                               for p in PHASES))
    if untimed:
        rows.append(f"-: not timed: 0 sampled batches in epoch{'s' if len(untimed) > 1 else ''} "
                    f"{', '.join(untimed)} (about one batch in --timeline-every is timed)")
    return rows


def plot(epochs: list[dict[str, Any]], path: str | os.PathLike[str], title: str = "") -> None:
    """Draw where step time goes: one stacked bar per epoch, each phase's share of the step
    (``data_wait`` first, as the part the loader decides), labelled with seconds per batch;
    written as a PNG (matplotlib, headless). An epoch that timed no batch in detail shows only
    its data wait, the rest as ``not timed``.

    Raises:
        RuntimeError: matplotlib is not installed (it comes with precache[faces]).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (or "
                           "precache[faces])") from None
    colours = {"data_wait": "#d62728", "h2d": "#ff7f0e", "forward": "#1f77b4",
               "backward": "#2ca02c", "optimizer": "#9467bd", "other": "#7f7f7f",
               "not timed": "#dddddd"}
    labels = [str(r.get("epoch", "?")) for r in epochs]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(epochs)))
    left = [0.0] * len(epochs)
    for phase in (*PHASES, "not timed"):
        shares = []
        for record in epochs:
            t = record["timeline"]
            known = timed(t)
            if phase == "not timed":
                shares.append(0.0 if known else max(0.0, 1.0 - t.get("data_wait", 0.0)))
            else:
                shares.append(t.get(phase, 0.0) if known or phase == "data_wait" else 0.0)
        if any(shares):
            ax.barh(labels, [100 * x for x in shares], left=[100 * x for x in left],
                    color=colours[phase], label=phase)
            left = [a + b for a, b in zip(left, shares)]
    for y, record in enumerate(epochs):
        ax.text(101, y, f"{record['timeline'].get('step_s', 0.0) * 1000:.1f} ms/batch",
                va="center", fontsize=8)
    ax.set_xlim(0, 125)
    ax.set_xlabel("share of step time (%)")
    ax.set_ylabel("epoch")
    ax.invert_yaxis()
    ax.set_title(title or "where step time goes")
    ax.legend(loc="lower right", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
