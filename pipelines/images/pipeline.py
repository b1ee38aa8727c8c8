"""``images``: decode every picture in a folder and resize / center-crop it to ``size`` pixels.

    precache run images --input data/samples --output data/cache
    precache run images --input photos/ --output cache/ --set size=224 --format hdf5
    precache run images -i photos/ -o cache/ --set labels=meta.csv --set image_codec=jpeg

Columns: ``image`` (size x size x 3, RGB uint8; JPEG/WebP bytes with ``image_codec``, decoded by
``CachedDataset``), ``label`` (the first folder under the input, ``""`` at the top level, or
from a metadata file: see ``precache.processing.ops.labels``; none with ``labels=none``),
``orig_height``, ``orig_width``, plus ``key``, ``source_key`` and ``source_hash``.
"""

from __future__ import annotations

from precache.processing.ops import (DEFAULT_MAX_PIXELS, IMAGE_EXTENSIONS, DecodeImage,
                                     EncodeImage, Labels, Op, ResizeCenterCrop)
from precache.processing.pipeline import Pipeline


def make_ops(size: int = 128, max_pixels: int = DEFAULT_MAX_PIXELS, labels: str = "folder",
             image_codec: str = "raw", quality: int = 95) -> list[Op]:
    """Label (``labels``: folder, none, or a .csv/.json file), decode (refusing images over
    ``max_pixels``), resize / center-crop to ``size``, store as ``image_codec`` (raw, jpeg,
    webp) at ``quality``."""
    return [Labels(labels=labels), DecodeImage(max_pixels=max_pixels), ResizeCenterCrop(size=size),
            EncodeImage(codec=image_codec, quality=quality)]


pipeline = Pipeline(
    name="images",
    make_ops=make_ops,
    extensions=IMAGE_EXTENSIONS,
    description="decode pictures to RGB and resize / center-crop them to size x size",
)
