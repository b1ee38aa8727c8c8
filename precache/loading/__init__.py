"""Stage 2: read a finished cache fast, for training. Every stage-2 name is importable from here
(the HF ``Trainer`` interop lives in ``precache.loading.interop.hf``, the Lightning
``CacheDataModule`` in ``precache.loading.interop.lightning``: they import those libraries).
Grouped by concern: ``datasets/``, ``samplers/``, ``loaders/``, ``interop/``; ``_engine/`` is
private."""

from precache.loading.datasets.batches import RaggedRows
from precache.loading.datasets.cache_backed import CacheBacked
from precache.loading.datasets.cached import CachedDataset
from precache.loading.datasets.targets import class_targets
from precache.loading.datasets.text_blocks import PackedBlocks
from precache.loading.datasets.video_clips import ClipDataset, VideoFrameDataset, collate_clips
from precache.loading.datasets.volume_patches import PatchDataset
from precache.loading.loaders.cache_loader import CacheLoader, loader_workers, make_loader
from precache.loading.loaders.device import DevicePrefetcher, as_nchw, to_device
from precache.loading.loaders.image_decode import decode_images, decodes_on
from precache.loading.loaders.text_collate import TokenCollate
from precache.loading.loaders.threaded import ThreadedBatches
from precache.loading.samplers.length_buckets import ExactOnceBucketSampler, LengthBucketSampler
from precache.loading.samplers.shard_sampler import DistributedShardSampler

__all__ = ["CachedDataset", "DistributedShardSampler", "make_loader", "CacheLoader",
           "loader_workers", "DevicePrefetcher", "to_device", "as_nchw", "PackedBlocks",
           "ClipDataset", "VideoFrameDataset", "collate_clips", "TokenCollate",
           "LengthBucketSampler", "ExactOnceBucketSampler", "RaggedRows", "ThreadedBatches",
           "decode_images", "decodes_on", "PatchDataset", "CacheBacked", "class_targets"]
