"""Stage 2's samplers: ``shard_sampler`` (``DistributedShardSampler``: exact-once, shard-local,
resumable) and ``length_buckets`` (``LengthBucketSampler``: batches of similar lengths)."""
