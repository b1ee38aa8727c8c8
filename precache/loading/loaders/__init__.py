"""Stage 2's loaders: ``cache_loader`` (``make_loader``, ``CacheLoader``: threads or processes,
read-ahead, the loader contract), ``threaded`` (``ThreadedBatches``), ``device`` (batches to the
GPU), ``image_decode`` (JPEG batches on the CPU or with nvJPEG), ``text_collate``."""
