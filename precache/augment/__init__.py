"""Stage-2 augmentations that use cached columns: on one sample, or on a whole batch (CPU or GPU
tensors) in the loader's threads (``make_loader(batch_transform=...)``) or after the loader."""

from precache.augment.face import FORMS, FaceAugment, FaceDraws
from precache.augment.volume import VolumeAugment

__all__ = ["FaceAugment", "FaceDraws", "FORMS", "VolumeAugment"]
