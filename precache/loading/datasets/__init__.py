"""Stage 2's datasets, by modality: ``cached`` (``CachedDataset``, any cache, and the batches it
returns), ``video_clips`` and ``video_index`` (clips and frames of a video cache),
``volume_patches`` (random 3D patches), ``text_blocks`` (token ids packed into blocks), and
``cache_backed`` (the protocol the loaders find them by)."""
