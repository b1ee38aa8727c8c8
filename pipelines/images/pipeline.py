"""``images``: decode every picture in a folder and resize / center-crop it to ``size`` pixels.

    precache run images --input data/samples --output data/cache
    precache run images --input photos/ --output cache/ --set size=224 --format hdf5

Columns: ``image`` (size x size x 3, RGB uint8), ``orig_height``, ``orig_width``, plus ``key``,
``source_key`` and ``source_hash``.
"""

from __future__ import annotations

from precache.ops import IMAGE_EXTENSIONS, DecodeImage, Op, ResizeCenterCrop
from precache.ops.image import DEFAULT_MAX_PIXELS
from precache.pipeline import Pipeline


def make_ops(size: int = 128, max_pixels: int = DEFAULT_MAX_PIXELS) -> list[Op]:
    """Decode (refusing images over ``max_pixels``), then resize / center-crop to ``size``."""
    return [DecodeImage(max_pixels=max_pixels), ResizeCenterCrop(size=size)]


pipeline = Pipeline(
    name="images",
    make_ops=make_ops,
    extensions=IMAGE_EXTENSIONS,
    description="decode pictures to RGB and resize / center-crop them to size x size",
)
