"""``CacheBacked``: what a dataset that reads one generation of a cache declares
(``CachedDataset``, ``ClipDataset``, ``VideoFrameDataset``, ``PackedBlocks``), so that the loader
finds it by type under ``Subset``s instead of probing attributes: it records ``generation``
with a resumable state and refuses a state of another generation, naming ``path`` and whether
the saved generation is still among ``kept_generations()``."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["CacheBacked"]


@runtime_checkable
class CacheBacked(Protocol):
    """A dataset over one generation of a cache. ``isinstance(dataset, CacheBacked)`` checks the
    members are there (not their types)."""

    path: Any
    """The cache (a folder or a URL)."""

    @property
    def generation(self) -> int:
        """The generation read, held while the dataset is open."""

    def kept_generations(self) -> list[int]:
        """The generations of the cache whose files are kept now."""

    def close(self) -> None:
        """Let go of the generation and close the cache's files."""
