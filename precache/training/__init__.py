"""Training on cached shards: the one loop every trainer in ``pipelines/`` runs, and its parts.

- ``loop``: ``fit(task, settings)``; a ``Task`` supplies the data, the model, the loss step, a
  validation hook and checkpoint extras.
- ``settings``: ``Settings`` (what a run needs) and ``training_parser`` (the common flags).
- ``metrics_log``: the metrics log, one epoch record schema (``EPOCH_FIELDS``).
- ``distributed``: the process group from torchrun's or Slurm's environment, and the device.
- ``strategy``: ``--strategy ddp|zero|fsdp``: wrapping, optimizer, checkpoints.
- ``step``: mixed precision, ``OneCycleSchedule``, the optimizer step (accumulation, clipping,
  ``set_to_none``), and the per-step logs.
- ``timeline``: where step time goes; ``doctor`` reads it.
- ``checkpoint``: atomic saves and weights-only loads.

The tasks themselves (models, metrics, their flags) are recipes: ``precache.pipelines``.
"""

from precache.training.step import (PRECISIONS, OneCycleSchedule, log_lr, mixed_precision,
                                    one_cycle, open_keys_log, open_lr_log, optimizer_step)

__all__ = ["OneCycleSchedule", "log_lr", "mixed_precision", "one_cycle", "open_keys_log",
           "open_lr_log", "optimizer_step", "PRECISIONS"]
