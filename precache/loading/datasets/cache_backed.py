"""``CacheBacked``: what a dataset that reads one generation of a cache declares
(``CachedDataset``, ``ClipDataset``, ``VideoFrameDataset``, ``PackedBlocks``, ``PatchDataset``),
so that loaders and the training loop ask it instead of probing attributes: the loader finds it
by type under ``Subset``s, records ``generation`` with a resumable state and refuses a state of
another generation (naming ``path`` and whether the saved generation is still among
``kept_generations()``); ``shard_ids`` keeps a sampler's reads shard-local; ``encoded_columns``
and ``decode_images`` tell the loop where JPEG/WebP images are decoded.

``CacheBackedByRows`` declares it once for every dataset that reads its rows through an inner
``CachedDataset`` (its ``rows``), so those datasets do not each copy the forwarding members."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from precache.loading.datasets.cached import CachedDataset

__all__ = ["CacheBacked", "CacheBackedByRows"]


@runtime_checkable
class CacheBacked(Protocol):
    """A dataset over one generation of a cache. ``isinstance(dataset, CacheBacked)`` checks the
    members are there (not their types or values)."""

    @property
    def path(self) -> Any:
        """The cache (a folder or a URL)."""

    @property
    def generation(self) -> int:
        """The generation read, held while the dataset is open."""

    def kept_generations(self) -> list[int]:
        """The generations of the cache whose files are kept now."""

    @property
    def shard_ids(self) -> np.ndarray:
        """The shard (in manifest order) of every item, ``(len(dataset),)``: what
        ``make_loader(shard_window=...)`` keeps reads local by. An item that reads several
        rows names the shard of its first one."""

    @property
    def encoded_columns(self) -> list[str]:
        """The columns read that are stored as JPEG/WebP (stage 1's ``image_codec``); empty
        when none are."""

    @property
    def decode_images(self) -> bool:
        """Whether the dataset decodes ``encoded_columns`` itself (else it hands out their
        bytes, for ``precache.loading.decode_images`` on the device)."""

    def close(self) -> None:
        """Let go of the generation and close the cache's files."""


class CacheBackedByRows:
    """Declares ``CacheBacked`` for a dataset that reads its rows through ``rows``, a
    ``CachedDataset``: every member is ``rows``' own. A dataset whose items are not rows
    overrides ``shard_ids`` (one entry per item); one that opens more than ``rows`` extends
    ``close``."""

    rows: CachedDataset
    """The inner dataset of the cache's rows (set by the subclass's constructor)."""

    @property
    def path(self) -> Any:
        """The cache read."""
        return self.rows.path

    @property
    def generation(self) -> int:
        """The cache generation read (``CacheLoader`` records it with a resumable state)."""
        return self.rows.generation

    def kept_generations(self) -> list[int]:
        """The generations of the cache whose files are kept now."""
        return self.rows.kept_generations()

    @property
    def shard_ids(self) -> np.ndarray:
        """The shard of every row (override where an item is not one row)."""
        return self.rows.shard_ids

    @property
    def encoded_columns(self) -> list[str]:
        """The columns read that are stored as JPEG/WebP."""
        return self.rows.encoded_columns

    @property
    def decode_images(self) -> bool:
        """Whether ``rows`` decodes them (its ``decode_images=`` option)."""
        return self.rows.decode_images

    def close(self) -> None:
        """Close the cache's shard files and let go of its generation."""
        self.rows.close()
