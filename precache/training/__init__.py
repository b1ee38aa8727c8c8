"""Training on cached shards: the parts every entry point in ``pipelines/`` does the same way.

- ``distributed``: the process group from torchrun's or Slurm's environment, and the device.
- ``step``: mixed precision, ``OneCycleSchedule``, the optimizer step (accumulation, clipping,
  ``set_to_none``), and the per-step logs.
- ``checkpoint``: atomic saves and weights-only loads.
"""

from precache.training.step import (PRECISIONS, OneCycleSchedule, log_lr, mixed_precision,
                                    one_cycle, open_keys_log, open_lr_log, optimizer_step)

__all__ = ["OneCycleSchedule", "log_lr", "mixed_precision", "one_cycle", "open_keys_log",
           "open_lr_log", "optimizer_step", "PRECISIONS"]
