"""How the model and optimizer are spread over the ranks: ``--strategy ddp|zero|fsdp``.

- ``ddp``: every rank holds the whole model and optimizer; gradients are all-reduced
  (``DistributedDataParallel``). The checkpoint is one file, written by rank 0.
- ``zero``: DDP, with the optimizer state sharded over the ranks (ZeRO stage 1, torch's
  ``ZeroRedundancyOptimizer``): Adam's two moments take 1/world of the memory per rank. Saving
  gathers the state on rank 0 (``consolidate_state_dict``), so the file is the same as ddp's and
  loads on any number of ranks, under any strategy.
- ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer
  state sharded; each block of the model (every item of its ``nn.ModuleList``s, e.g. BERT's
  layers) is gathered only while it computes. The checkpoint is a ``torch.distributed.checkpoint``
  (DCP) folder of shards, which DCP re-shards when loaded on another number of ranks.

On one process every strategy trains the plain model and saves ddp's one file.

Checkpoint layout of fsdp: ``last.pt`` (weights-only loadable, written by rank 0 after every
rank's shards are on disk) holds the plain state (schedule, sampler, epoch...) and
``{"strategy": "fsdp", "shards": "<folder name>"}``; the shards are in that folder beside it,
named uniquely per save. A save killed half-way leaves a folder ``last.pt`` does not name (it is
removed by the next save), never a checkpoint that looks complete: ``last.pt`` is replaced
(atomically) only once every rank's shards and DCP's ``.metadata`` are written.

Every checkpoint resumes under every strategy, on any number of ranks: a ddp or zero file is
sharded on load under fsdp; fsdp shards load into a whole model under ddp (or on one process, for
evaluation), and under zero through a whole optimizer built for the load, whose state ZeRO then
partitions (so for a moment each rank holds all of it).

Gradient clipping needs nothing special: under fsdp the gradients are DTensors, and
``nn.utils.clip_grad_norm_`` returns their global norm (a replicated DTensor) in torch 2.13.

Tested on CPU with gloo (2 and 3 ranks): the three strategies follow the same loss curve on a
fixed seed; the model and optimizer state loaded on 3 ranks equal those saved by 2; checkpoints
move between strategies; under fsdp an inf in one rank's gradient shard makes every rank skip the
step.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from precache.training.checkpoint import load_checkpoint, save_checkpoint

__all__ = ["STRATEGIES", "Strategy", "StrategyMismatch", "make_strategy"]

STRATEGIES = ("ddp", "zero", "fsdp")


class StrategyMismatch(ValueError):
    """A checkpoint cannot be resumed with the requested strategy."""


class Strategy:
    """Wraps the model, builds the optimizer, saves and loads checkpoints for one strategy.

    Args:
        name: one of ``STRATEGIES``.
        rank, world_size: this process in the job (``init_distributed``).
        device: the training device.
    """

    def __init__(self, name: str, *, rank: int, world_size: int, device: torch.device) -> None:
        if name not in STRATEGIES:
            raise ValueError(f"unknown strategy {name!r}; one of {', '.join(STRATEGIES)}")
        self.name, self.rank, self.world_size, self.device = name, rank, world_size, device
        self.sharded = world_size > 1 and dist.is_available() and dist.is_initialized()
        self._optimizer_args: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None

    # -- the model and the optimizer ------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to train (``model`` is already on the device)."""
        if not self.sharded:
            return model
        if self.name == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for param in model.parameters():  # FSDP2 shards contiguous tensors only
                if not param.is_contiguous():  # e.g. channels_last conv weights
                    param.data = param.data.contiguous()
            for block in _blocks(model):
                fully_shard(block)
            fully_shard(model)
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    def make_optimizer(self, model: nn.Module, optimizer_class: type[torch.optim.Optimizer],
                       **kwargs: Any) -> torch.optim.Optimizer:
        """``optimizer_class`` over ``model``'s parameters; sharded over the ranks under zero (on
        one process, the plain optimizer: there is nothing to shard)."""
        self._optimizer_args = (optimizer_class, kwargs)  # zero builds a whole one to load shards
        if self.name == "zero" and self.sharded:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class,
                                           **kwargs)
        return optimizer_class(model.parameters(), **kwargs)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The bare module (DDP's ``module``; an FSDP2 module is its own)."""
        return _unwrapped(model)

    def grad_scaler(self, enabled: bool) -> torch.amp.GradScaler:
        """The loss scaler of fp16 (``enabled``): torch's ``GradScaler`` under every strategy.

        Under fsdp each rank holds a shard of the gradients, so whether any is inf must be
        agreed over the ranks, or one rank skips a step that another takes. FSDP2's gradients
        are DTensors, and DTensor's dispatch of the unscale op all-reduces ``found_inf`` (max)
        over the mesh (torch 2.13, ``found_inf_reduce_handler`` in
        ``torch/distributed/tensor/_dispatch.py``). FSDP1's ``ShardedGradScaler`` would
        all-reduce it a second time and warn on every step.
        """
        return torch.amp.GradScaler(self.device.type, enabled=enabled)

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any]) -> Path:
        """Save model, optimizer and the plain ``extra`` to ``path``; every rank calls it."""
        path = Path(path)
        if self.name == "fsdp" and self.sharded:
            return self._save_shards(path, model, optimizer, extra)
        if self.name == "zero" and self.sharded:
            optimizer.consolidate_state_dict(to=0)  # a collective: every rank
        if self.rank == 0:
            save_checkpoint({"strategy": self.name, "model": self.unwrap(model).state_dict(),
                             "optimizer": optimizer.state_dict(), **extra}, path)
        if self.sharded:
            dist.barrier()  # nobody reads or replaces it before it is whole
        return path

    def _save_shards(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                     extra: dict[str, Any]) -> Path:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        token = [f"{time.time_ns():x}" if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)  # one folder name for every rank
        folder = path.with_name(f"{path.stem}.shards-{token[0]}")
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
        dist.barrier()  # every rank's shards are written
        if self.rank == 0:
            save_checkpoint({"strategy": "fsdp", "shards": folder.name, **extra}, path)
            for old in path.parent.glob(f"{path.stem}.shards-*"):
                if old.name != folder.name:  # earlier saves, or one killed half-way
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return path

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
             map_location: Any = None) -> dict[str, Any]:
        """Restore ``model`` and ``optimizer`` from ``path`` in place; return the plain state.
        Every rank calls it; the checkpoint may come from another strategy and another number
        of ranks.

        Args:
            map_location: unused, kept for the call's shape: tensors are read to the CPU and
                copied to the parameters' devices.

        Raises:
            StrategyMismatch: the checkpoint's shard folder is missing or incomplete, or an fsdp
                checkpoint resumed under zero with an optimizer not built by ``make_optimizer``.
            CheckpointRefused: the file holds more than tensors and plain data.
        """
        path = Path(path)
        state = load_checkpoint(path, map_location="cpu")
        saved = state.pop("strategy", "ddp")  # checkpoints from before strategies were ddp's
        shards = state.pop("shards", None)
        if saved == "fsdp" and shards is not None:
            folder = path.with_name(shards)
            if not (folder / ".metadata").is_file():
                raise StrategyMismatch(f"{path} names the shard folder {folder}, which is missing "
                                       "or incomplete; resume from an earlier checkpoint")
            if self.name == "zero" and self.sharded:
                self._load_shards_into_zero(path, folder, model, optimizer)
            else:  # fsdp re-shards them; a whole model (ddp, one process) reads them whole
                self._load_shards(folder, model, optimizer)
            return state
        model_state, optimizer_state = state.pop("model"), state.pop("optimizer")
        if self.name == "fsdp" and self.sharded:  # a full file, sharded on load
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 set_state_dict)

            set_state_dict(model, optimizer, model_state_dict=model_state,
                           optim_state_dict=_by_name(optimizer_state, model),
                           options=StateDictOptions(full_state_dict=True))
        else:
            self.unwrap(model).load_state_dict(model_state)
            optimizer.load_state_dict(optimizer_state)  # zero: keeps this rank's part
        return state

    def _load_shards(self, folder: Path, model: nn.Module,
                     optimizer: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)  # this run's sharding
        target = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(target, checkpoint_id=folder)  # DCP re-shards to it
        set_state_dict(model, optimizer, model_state_dict=target["model"],
                       optim_state_dict=target["optimizer"])

    def _load_shards_into_zero(self, path: Path, folder: Path, model: nn.Module,
                               optimizer: torch.optim.Optimizer) -> None:
        """fsdp shards under zero: DCP fills the model and a whole optimizer of the same kind;
        ZeroRedundancyOptimizer keeps this rank's part of the latter's state."""
        if self._optimizer_args is None:
            raise StrategyMismatch(f"{path} holds fsdp shards, which --strategy zero loads only "
                                   "into an optimizer built by Strategy.make_optimizer; build it "
                                   "there, or resume with --strategy fsdp or ddp")
        optimizer_class, kwargs = self._optimizer_args
        whole = optimizer_class(self.unwrap(model).parameters(), **kwargs)
        self._load_shards(folder, model, whole)
        optimizer.load_state_dict(whole.state_dict())  # every rank: its part (by index)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards one by one: every item of every ``nn.ModuleList`` (a transformer's
    layers); the root takes the rest."""
    blocks = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            blocks.extend(m for m in module if any(p.requires_grad for p in m.parameters()))
    return blocks


def _by_name(optimizer_state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """A plain optimizer's state dict (parameters numbered in order) keyed by parameter names,
    the form ``set_state_dict`` takes."""
    names = [name for name, _ in _unwrapped(model).named_parameters()]
    groups = [dict(group, params=[names[i] for i in group["params"]])
              for group in optimizer_state["param_groups"]]
    return {"state": {names[i]: s for i, s in optimizer_state["state"].items()},
            "param_groups": groups}


def _unwrapped(model: nn.Module) -> nn.Module:
    """DDP's ``module``, else ``model`` itself."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def make_strategy(name: str, *, rank: int, world_size: int, device: torch.device) -> Strategy:
    """The ``Strategy`` called ``name`` for this process."""
    return Strategy(name, rank=rank, world_size=world_size, device=device)
