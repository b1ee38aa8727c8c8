"""The random tail of a cached MONAI chain served as plain tensors (``cache_transforms(...,
track_meta=False)``), as MONAI runs it under ``monai.data.set_track_meta(False)``.

Why: on a cached sample, MONAI's own crop and flip cost ~1.3 ms, nearly all of it ``MetaTensor``
bookkeeping (``applied_operations``, copied metadata, ``__torch_function__``), and restoring
the whole volume before cropping it costs ~0.4 ms more. Here the transforms precache knows
(``RandSpatialCropd``, ``RandScaleCropd``, ``RandFlipd``) crop and flip the stored rows
directly (views of the mapped shard; only the crop is copied), drawing their parameters from
the MONAI transform objects themselves (their ``randomize``, their ``R``) in the order MONAI
draws them, so a seed gives the values MONAI's tail gives. From the first transform it does
not know, the rest of the chain runs through MONAI with ``track_meta`` off.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from precache.bring_your_own import _META, RandomTail

__all__ = ["PlainTail", "native_steps"]

_CROPS = ("RandSpatialCropd", "RandScaleCropd")
_FLIPS = ("RandFlipd",)
_SKIP = frozenset({_META})
"""The cached sample's affines: plain tensors carry none."""


def _known(transform: Any) -> str | None:
    """``"crop"`` or ``"flip"`` for the MONAI transforms run here (exactly those classes, not
    subclasses, which may change what they do; eager only), else ``None``."""
    module = type(transform).__module__ or ""
    if not module.startswith("monai.") or getattr(transform, "lazy", False):
        return None
    name = type(transform).__name__
    if name in _CROPS:
        return "crop"
    if name in _FLIPS:
        return "flip"
    return None


def native_steps(transforms: list[Any], start: int, tensors: set[str] | frozenset[str]) -> int:
    """How many transforms from ``start`` on precache runs itself: the known ones, in a row,
    whose keys are all tensors of the cached sample (``tensors``: MONAI would turn anything
    else into a tensor first)."""
    count = 0
    for t in transforms[start:]:
        if _known(t) is None or not set(getattr(t, "keys", ())) <= set(tensors):
            break
        count += 1
    return count


@contextmanager
def _no_meta() -> Iterator[None]:
    """MONAI transforms return plain tensors inside (the flag is global: restored after)."""
    from monai.data import get_track_meta, set_track_meta

    before = get_track_meta()
    set_track_meta(False)
    try:
        yield
    finally:
        set_track_meta(before)


def _present(transform: Any, sample: dict[str, Any]) -> list[Any]:
    """The transform's keys in ``sample``, as MONAI's ``key_iterator`` gives them (a missing
    key is an error unless ``allow_missing_keys``)."""
    return list(transform.key_iterator(sample))


def _crop(transform: Any, sample: dict[str, Any]) -> None:
    """``RandSpatialCropd``/``RandScaleCropd``: the size and position drawn by the transform's
    own ``randomize`` from the first key's spatial shape, each key sliced (a view)."""
    from monai.transforms import CenterSpatialCrop

    keys = _present(transform, sample)
    if not keys:
        return
    first = sample[transform.first_key(sample)]
    transform.randomize(tuple(first.shape[1:]))
    cropper = transform.cropper
    for key in keys:
        value = sample[key]
        spatial = tuple(value.shape[1:])
        if cropper.random_center:
            slices = list(cropper._slices)
        else:
            slices = list(CenterSpatialCrop(cropper._size).compute_slices(spatial))
        slices += [slice(None)] * (len(spatial) - len(slices))
        sample[key] = value[(slice(None), *slices[:len(spatial)])]


def _flip(transform: Any, sample: dict[str, Any]) -> None:
    """``RandFlipd``: one draw per sample (the transform's ``randomize``), then every key
    flipped along the spatial axes MONAI's ``Flip`` maps (a view)."""
    from monai.transforms.utils import map_spatial_axes

    keys = _present(transform, sample)
    transform.randomize(None)
    if not transform._do_transform:
        return
    axis = transform.flipper.spatial_axis
    for key in keys:
        value = sample[key]
        index = [slice(None)] * value.ndim
        for a in map_spatial_axes(value.ndim, axis):
            index[a] = slice(None, None, -1)
        sample[key] = value[tuple(index)]


def _tensor(value: np.ndarray) -> torch.Tensor:
    """A view of a stored row (cropped, flipped) as its own contiguous tensor: the one copy."""
    return torch.from_numpy(np.array(value, order="C"))


class PlainTail(RandomTail):
    """A ``cache_transforms`` dataset's transform with ``track_meta=False``: the cached row,
    the random tail (see the module), the sample as MONAI's tail under ``set_track_meta(False)``
    returns it: plain tensors, no ``__meta__``. Seeds the chain per DataLoader worker with
    ``RandomTail``'s own ``_seed``, so a seed gives the same crops and flips as the MetaTensor
    tail."""

    def __init__(self, restore: Any, chain: Any, start: int) -> None:
        super().__init__("monai", chain, start)
        self.restore = restore
        columns = restore.layout["columns"]
        self._tensors = {tuple(s["path"])[0] for s in columns.values()
                         if s["type"] == "tensor" and len(s["path"]) == 1}
        # a lazy Compose resamples its pending crops and flips at once: MONAI's way, not ours
        lazy = getattr(chain, "lazy", False)
        self.native = 0 if lazy else native_steps(list(chain.transforms), start, self._tensors)

    def __call__(self, row: dict[str, Any]) -> Any:
        self._seed()
        sample = self.restore(row, views=self._tensors, skip=_SKIP)
        transforms = self.chain.transforms
        for t in transforms[self.start:self.start + self.native]:
            (_crop if _known(t) == "crop" else _flip)(t, sample)
        for key in self._tensors:
            if isinstance(sample.get(key), np.ndarray):
                sample[key] = _tensor(sample[key])
        rest = self.start + self.native
        if rest >= len(transforms):
            return sample
        with _no_meta():
            return self.chain(sample, start=rest)
