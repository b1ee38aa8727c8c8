"""The settings of a training run, and the command-line flags every trainer shares.

A recipe in ``pipelines/`` builds its parser with ``training_parser`` (the common flags, with the
recipe's own defaults), adds its own flags, and turns the parsed arguments into ``Settings`` with
``Settings.from_args``; ``precache.training.loop.fit`` reads only ``Settings``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from precache.loading.loaders.cache_loader import WORKER_KINDS, check_worker_kind
from precache.training.step import auto_precision
from precache.training.strategy import STRATEGIES

__all__ = ["PRECISION_CHOICES", "Settings", "check_cache", "precision_help", "training_parser"]

PRECISION_CHOICES = ("bf16", "fp16", "fp32", "auto")
_STRATEGY_HELP = {"ddp": "replicate the model", "zero": "ZeRO-1, shard the optimizer state",
                  "fsdp": "FSDP2, shard parameters, gradients and optimizer state",
                  "deepspeed_stage_2": "DeepSpeed ZeRO stage 2 (CUDA; pip install deepspeed)"}


@dataclass
class Settings:
    """What ``fit`` needs to know about a run (the common flags of ``training_parser``).

    Attributes:
        cache: the cache to train on.
        out: folder of ``last.pt``, ``metrics.jsonl`` and ``lr.tsv``.
        epochs: epochs of the whole run, which the learning rate schedule spans.
        batch_size: samples (a task's items: images, documents, videos) per batch, per rank.
        accumulate: batches per optimizer step.
        lr: the peak learning rate of the OneCycle schedule.
        clip: the maximum gradient norm (0: no clipping).
        workers: DataLoader workers per rank (None: ``loader_workers()``, from the cores).
        worker_kind: ``auto``, ``threads`` or ``processes``: who reads the batches
            (``make_loader``'s ``worker_kind``; auto: threads unless the dataset has a
            per-sample Python transform).
        precision: ``bf16``, ``fp16`` (CUDA, with a GradScaler), ``fp32`` or ``auto`` (the
            default: ``step.auto_precision``, bf16 only where the device computes it natively).
        strategy: ``ddp``, ``zero`` or ``fsdp`` (``precache.training.strategy``).
        compile: ``torch.compile`` the model.
        timeline_every: time the phases of about one batch in this many.
        max_steps: stop after this many optimizer steps (0: no limit).
        save_every: checkpoint every this many optimizer steps (and at every epoch's end).
        resume: a checkpoint to continue from (any world size, any strategy).
        seed: of the weights, the sample order and the timeline's draw.
        log_keys: a folder for ``keys-rank<R>.tsv`` (every sample trained on), or None.
    """

    cache: str
    out: str
    epochs: int = 3
    batch_size: int = 32
    accumulate: int = 1
    lr: float = 1e-3
    clip: float = 1.0
    workers: int | None = None
    worker_kind: str = "auto"
    precision: str = "auto"
    strategy: str = "ddp"
    compile: bool = False
    timeline_every: int = 10
    max_steps: int = 0
    save_every: int = 50
    resume: str | None = None
    seed: int = 0
    log_keys: str | None = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISION_CHOICES:
            raise ValueError(f"precision must be one of {', '.join(PRECISION_CHOICES)}, not "
                             f"{self.precision!r}")
        check_worker_kind(self.worker_kind)
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, not "
                             f"{self.strategy!r}")
        for name in ("epochs", "batch_size", "accumulate", "save_every", "timeline_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        """The settings among ``args`` (a recipe's own flags are left out)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def precision_help(default: str) -> str:
    """The help of ``--precision``: what each choice does, what ``auto`` picks and, on a machine
    without CUDA, what it picks here (on CUDA each rank decides for its own GPU: asking the GPU
    while parsing would start a CUDA context on GPU 0 in every rank)."""
    here = "" if torch.cuda.is_available() else f"; here: {auto_precision(torch.device('cpu'))}"
    return ("autocast dtype; fp16 (CUDA only) uses a GradScaler; auto: bf16 where the device "
            "computes it natively (a GPU with bf16, a CPU with AVX512-BF16 or AMX), fp16 on a "
            "GPU without bf16, fp32 on other CPUs, where bf16 is emulated (measured 23x slower "
            f"on an AVX2 CPU){here} (default: {default})")


def check_cache(parser: argparse.ArgumentParser, cache: str, pipeline: str,
                columns: Sequence[str] = ()) -> None:
    """Exit 2 with one line naming ``cache`` and the fix when it is no finished cache of the
    ``columns`` a trainer reads: before any process group, model or loader starts, so that a
    mistyped ``--cache`` is one line, not a traceback from inside the loop.

    Args:
        parser: the trainer's parser (its ``prog`` starts the line, as argparse's errors do).
        cache: the ``--cache`` value.
        pipeline: the pipeline whose caches the trainer reads (named in the fix).
        columns: the columns the trainer reads.
    """
    from precache.cache import Cache
    from precache.cache.manifest import ManifestError
    from precache.storage import StorageError

    build = f"`precache run {pipeline} --input <your inputs> --output {cache}`"
    try:
        manifest = Cache(cache).manifest
    except (ManifestError, StorageError) as e:
        reason = str(e).rstrip(".")
        fix = "" if "re-run" in reason else f"; build it first with {build}"
        parser.exit(2, f"{parser.prog}: error: --cache: {reason}{fix}\n")
    missing = [c for c in columns if c not in manifest.schema]
    if missing:
        parser.exit(2, f"{parser.prog}: error: --cache: '{cache}' is a '{manifest.pipeline}' "
                    f"cache without the column{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(missing)} this trainer reads; give a {pipeline} cache "
                    f"(built by {build})\n")


def training_parser(description: str | None, *, out: str, lr: float, epochs: int = 3,
                    batch_size: int = 32, precision: str = "auto",
                    cache_help: str = "the cache to train on", items: str = "samples",
                    strategies: Sequence[str] = STRATEGIES,
                    loop: bool = True) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with the flags of ``Settings``, and the recipe's defaults.

    Args:
        description: the recipe's docstring (shown by ``--help`` as written).
        out, lr, epochs, batch_size, precision: the defaults of those flags.
        cache_help: the help of ``--cache``.
        items: what a batch holds, in the help of ``--batch-size`` and ``--log-keys``.
        strategies: the choices of ``--strategy`` (another framework's, e.g. Lightning's).
        loop: add the flags only ``fit`` reads (``--compile``, ``--timeline-every``,
            ``--save-every``); a recipe on another framework leaves them out.
    """
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", required=True, help=cache_help)
    p.add_argument("--out", default=out, help="checkpoints (last.pt) and the metrics log")
    p.add_argument("--epochs", type=int, default=epochs,
                   help="epochs of the whole run" + (
                       ", which the learning rate schedule spans" if loop else "") +
                   "; resume with more to extend a run")
    p.add_argument("--batch-size", type=int, default=batch_size,
                   help=f"{items} per batch, per rank")
    p.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate (OneCycle)" if loop else
                   "learning rate")
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: off)")
    p.add_argument("--workers", type=int, default=None,
                   help="DataLoader workers per rank (default: the rank's cores less one, <= 8)")
    p.add_argument("--worker-kind", choices=WORKER_KINDS, default="auto",
                   help="who reads the batches: threads of the training process (no process hop "
                        "per batch; the cache's reads, JPEG decoding and batched augmentation "
                        "release the GIL) or worker processes (per-sample Python transforms); "
                        "auto: threads unless the dataset has a per-sample transform")
    p.add_argument("--precision", choices=PRECISION_CHOICES, default=precision,
                   help=precision_help(precision))
    p.add_argument("--strategy", choices=strategies, default="ddp",
                   help="; ".join(f"{name}: {_STRATEGY_HELP.get(name, name)}"
                                  for name in strategies))
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many optimizer steps (0: no limit)")
    if loop:
        p.add_argument("--compile", action="store_true", help="torch.compile the model")
        p.add_argument("--timeline-every", type=int, default=10,
                       help="time the phases of about one batch in N (the data wait: every batch)")
        p.add_argument("--save-every", type=int, default=50,
                       help="checkpoint every N optimizer steps")
    p.add_argument("--resume", default=None,
                   help="checkpoint to continue from" + (
                       " (any number of ranks, any --strategy)" if loop else ""))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-keys", default=None, metavar="DIR",
                   help=f"append 'epoch<TAB>key' of every one of the {items} trained on to "
                        "DIR/keys-rank<R>.tsv (to check exact-once per epoch across ranks)")
    return p
