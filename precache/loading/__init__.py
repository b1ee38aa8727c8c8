"""Stage 2: read a finished cache fast, for training."""

from precache.loading.dataset import CachedDataset

__all__ = ["CachedDataset"]
