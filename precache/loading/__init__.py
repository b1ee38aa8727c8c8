"""Stage 2: read a finished cache fast, for training."""

from precache.loading.clips import ClipDataset, VideoFrameDataset, collate_clips
from precache.loading.dataset import CachedDataset
from precache.loading.device import DevicePrefetcher, as_nchw, to_device
from precache.loading.loader import CacheLoader, loader_workers, make_loader
from precache.loading.packing import PackedBlocks
from precache.loading.sampler import DistributedShardSampler

__all__ = ["CachedDataset", "DistributedShardSampler", "make_loader", "CacheLoader",
           "loader_workers", "DevicePrefetcher", "to_device", "as_nchw", "PackedBlocks",
           "ClipDataset", "VideoFrameDataset", "collate_clips"]
