"""Stage-2 augmentations that use cached columns: on one sample in DataLoader workers, or on a
whole batch (CPU or GPU tensors) after the loader."""

from precache.augment.face import FORMS, FaceAugment, FaceDraws

__all__ = ["FaceAugment", "FaceDraws", "FORMS"]
