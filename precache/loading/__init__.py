"""Stage 2: read a finished cache fast, for training. Every stage-2 name is importable from here
(the HF ``Trainer`` interop lives in ``precache.loading.hf``, the Lightning ``CacheDataModule`` in
``precache.loading.lightning``: they import those libraries)."""

from precache.loading.buckets import LengthBucketSampler
from precache.loading.cache_backed import CacheBacked
from precache.loading.clips import ClipDataset, VideoFrameDataset, collate_clips
from precache.loading.dataset import CachedDataset, RaggedRows
from precache.loading.device import DevicePrefetcher, as_nchw, to_device
from precache.loading.image_decode import decode_images, decodes_on
from precache.loading.loader import CacheLoader, loader_workers, make_loader
from precache.loading.packing import PackedBlocks
from precache.loading.patches import PatchDataset
from precache.loading.sampler import DistributedShardSampler
from precache.loading.text_collate import TokenCollate
from precache.loading.threaded import ThreadedBatches

__all__ = ["CachedDataset", "DistributedShardSampler", "make_loader", "CacheLoader",
           "loader_workers", "DevicePrefetcher", "to_device", "as_nchw", "PackedBlocks",
           "ClipDataset", "VideoFrameDataset", "collate_clips", "TokenCollate",
           "LengthBucketSampler", "RaggedRows", "ThreadedBatches", "decode_images", "decodes_on",
           "PatchDataset", "CacheBacked"]
