"""Where a run's tasks execute: ``local`` (this process plus spawned worker processes pulling
from one queue) or ``ray`` (one Ray actor per worker). Both yield ``TaskResult``s as tasks finish
and know nothing of the runner that consumes them."""

from precache.processing.executors.local import WorkerDied, largest_first, run_tasks
from precache.processing.executors.ray import require_ray, run_tasks_ray

__all__ = ["run_tasks", "run_tasks_ray", "require_ray", "largest_first", "WorkerDied"]
