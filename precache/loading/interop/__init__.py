"""Stage 2 for other frameworks' users; each module imports its framework: ``hf`` (Hugging Face
``Trainer`` and ``datasets``), ``lightning`` (``CacheDataModule``)."""
