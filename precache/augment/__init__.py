"""Stage-2 augmentations that use cached columns (run in DataLoader workers, after decoding)."""

from precache.augment.face import FaceAugment

__all__ = ["FaceAugment"]
