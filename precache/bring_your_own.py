"""Bring your own pipeline: a map-style ``Dataset`` cached as it is, or a transform chain split at
its first random step (``cache_transforms``: the deterministic prefix cached, the tail run online).

``cache_dataset(dataset, output)`` runs ``dataset[i]`` once per index in stage 1's workers
(``precache.processing.dataset_source``) and returns a ``CachedDataset`` whose samples are the
dataset's: the same structure (dicts, nested dicts, tuples, lists), tensors back as tensors,
NumPy arrays and scalars as NumPy, Python numbers, strings and bytes as they were. This module
sits above both stages (stage 1 must not import stage 2), as ``precache`` itself does.
"""

from __future__ import annotations

import enum
import hashlib
import inspect
import json
import os
import random
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from precache.cache.reader import load_manifest
from precache.cache.layout import CacheLayout
from precache.cache.generations import DEFAULT_RETENTION_S
from precache.loading import CachedDataset
from precache.processing.dataset_source import PROBE, SampleLayout, _simple, run_dataset

__all__ = ["cache_dataset", "cache_transforms", "is_random", "Chain", "RandomTail",
           "RestoreSample", "TransformedSample", "read_image_item", "transforms_version"]


class RestoreSample:
    """A ``CachedDataset`` transform: a row of a dataset cache back into the dataset's sample
    (its ``SampleLayout``). Picklable, for DataLoader worker processes."""

    def __init__(self, layout: dict[str, Any]) -> None:
        self.layout = layout
        self._columns = layout["columns"]

    def __call__(self, row: dict[str, Any], views: frozenset[str] | set[str] = frozenset(),
                 skip: frozenset[str] | set[str] = frozenset()) -> Any:
        """The sample; the top-level fields named in ``views`` as NumPy views of the row (no
        copy: ``PlainTail`` crops them first), read-only where the row is; those in ``skip``
        left out."""
        return self._build(self.layout["tree"], row, views, skip)

    def _build(self, tree: dict[str, Any], row: dict[str, Any],
               views: frozenset[str] | set[str] = frozenset(),
               skip: frozenset[str] | set[str] = frozenset()) -> Any:
        (kind, body), = tree.items()
        if kind == "dict":
            return {k: self._build(sub, row) if k not in views else self._view(sub, row)
                    for k, sub in body if k not in skip}
        if kind == "tuple":
            return tuple(self._build(sub, row) for sub in body)
        if kind == "list":
            return [self._build(sub, row) for sub in body]
        name = self._name(body)
        return _value(self._columns[name], row[name], row.get(name + "#shape"))

    def _view(self, tree: dict[str, Any], row: dict[str, Any]) -> Any:
        (kind, body), = tree.items()
        if kind in ("dict", "tuple", "list"):
            return self._build(tree, row)
        name = self._name(body)
        return _stored_array(self._columns[name], row[name], row.get(name + "#shape"))

    def _name(self, path: list[str]) -> str:
        names = getattr(self, "_by_path", None)
        if names is None:
            names = self._by_path = {tuple(s["path"]): n for n, s in self._columns.items()}
        return names[tuple(path)]


def _stored_array(spec: dict[str, Any], value: Any, shape: Any) -> np.ndarray:
    """A tensor or array column's stored value in its shape: a view of the row (no copy)."""
    array = np.asarray(value)
    if spec["store"] == "ragged_nd":
        array = array.reshape(tuple(int(d) for d in shape))
    return array


def _value(spec: dict[str, Any], value: Any, shape: Any) -> Any:
    """One stored value as the dataset returned it."""
    kind = spec["type"]
    if kind in ("tensor", "ndarray"):
        array = _stored_array(spec, value, shape)
        if kind == "ndarray":
            return np.array(array)  # its own memory, writable, as the dataset's was
        return torch.from_numpy(np.array(array))
    if kind == "npscalar":
        return np.asarray(value, dtype=spec["dtype"])[()]
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "bool":
        return bool(value)
    if kind == "bytes":
        return bytes(value)
    return str(value)


def cache_dataset(
    dataset: Any,
    output: str | os.PathLike[str],
    *,
    key: Callable[[int], Any] | None = None,
    version: str | None = None,
    workers: int | None = None,
    progress: bool = True,
    sample_hash: Callable[[int], str] | None = None,
    ragged: Sequence[str] = (),
    format: str = "parquet",
    shard_rows: int | None = None,
    overwrite: bool = False,
    fail_fast: bool = False,
    log: Any = print,
    retention_s: float = DEFAULT_RETENTION_S,
    wait: bool | float = False,
    executor: str = "local",
    ray_address: str | None = None,
    **dataset_options: Any,
) -> CachedDataset:
    """Cache ``dataset[i]`` for every index at ``output`` and return the cached dataset.

    Args:
        dataset: a map-style dataset (``len`` and ``[i]``); with ``workers > 1`` it is pickled
            to spawned workers, so its class must be importable (not defined in a notebook).
        output: the cache directory (or a URL, as ``precache.run``).
        key: ``key(i)`` names sample ``i`` (default: the index); a sample is computed again
            when its key at its index changes.
        version: names what the samples are computed with. Default: the dataset class's source
            and its constructor arguments (attributes named like ``__init__``'s parameters);
            pass a version when the work depends on more (a transform object's settings, the
            files' contents). A changed fingerprint recomputes every sample; the run says why.
        workers: worker processes (default: the cores; 1 runs in this process).
        progress: show a progress bar.
        sample_hash: ``sample_hash(i)``, a content hash of sample ``i`` (say of its file): a
            sample whose hash changed is computed again alone. Default: the dataset's own
            ``sample_hash(i)`` if it has one, else the files a sample's entry names in the
            dataset's list of samples (``data``, as MONAI's datasets; ``samples``, ``files``,
            ``paths`` or ``imgs``, as torchvision's folders): their sizes and modification
            times (``dataset_files_hash``); none if it has neither.
        ragged: fields stored with varying length even if the first samples agree (``a.b``
            for nested dicts, ``0`` for a tuple's first item).
        format, shard_rows, overwrite, fail_fast, log, retention_s, wait: as ``precache.run``.
        executor, ray_address: ``"ray"`` runs ``dataset[i]`` in Ray actors (the dataset
            pickled to them), on a running cluster at ``ray_address`` or a local Ray, as
            ``precache.run``; on several nodes ``output`` must be a folder every node sees.
        dataset_options: passed to ``CachedDataset`` (``max_decoded_bytes``, ``where`` ...).

    Returns:
        A ``CachedDataset`` of the samples that could be computed, in index order after a
        full build (failed samples left out; samples recomputed alone come after the others;
        ``read_column("key")`` names each row's sample), whose ``transform`` rebuilds each
        sample as the dataset returned it. ``make_loader`` batches it like the dataset.

    Raises:
        RunError: no sample could be read, the dataset cannot be pickled to the workers, keys
            repeat, or the run cannot go on.
        TypeError, ValueError: the samples hold values that cannot be stored.
    """
    if sample_hash is None:
        sample_hash = dataset_files_hash(dataset)
    summary = run_dataset(dataset, output, key=key, version=version, sample_hash=sample_hash,
                          ragged=ragged, workers=workers, format=format, shard_rows=shard_rows,
                          overwrite=overwrite, fail_fast=fail_fast, progress=progress, log=log,
                          retention_s=retention_s, wait=wait, executor=executor,
                          ray_address=ray_address, prepare=_storable)
    manifest = load_manifest(CacheLayout.for_output(output).store)
    layout = SampleLayout.from_json(manifest.ops[0]["params"]["layout"])
    restore = RestoreSample(layout.to_json())
    with_meta = any(spec["path"][:1] == [_META] for spec in layout.columns.values())
    return CachedDataset(os.fspath(summary.cache), columns=layout.stored_columns(),
                         transform=TransformedSample(restore, None) if with_meta else restore,
                         **dataset_options)


# ---- a transform chain split at its first random step ---------------------------------------------

_TORCHVISION_RANDOM = frozenset({
    "ColorJitter", "RandAugment", "TrivialAugmentWide", "AutoAugment", "AugMix", "GaussianBlur",
    "GaussianNoise", "ElasticTransform", "ScaleJitter", "MixUp", "CutMix"})
"""torchvision v2 transforms that draw random parameters although not named ``Random...``."""

_RNG_ATTRS = ("random_generator", "py_random")
"""What an Albumentations transform draws its random parameters from."""

_STATE_ATTRS = frozenset({"R", *_RNG_ATTRS, "filenames"})
"""Attributes that change as a transform runs, left out of the fingerprint: random states, the
files a MONAI reader read last (thread-local state is left out too)."""

_META = "__meta__"
"""The field of a cached MONAI sample holding each ``MetaTensor``'s affine and metadata
(``__meta__.image.affine``, ``__meta__.image.filename_or_obj``...: ``_stored_meta``)."""


def _module(obj: Any) -> str:
    return type(obj).__module__ or ""


def _is_monai(obj: Any) -> bool:
    return _module(obj).startswith("monai.")


def _is_albumentations(obj: Any) -> bool:
    return _module(obj).startswith("albumentations.")


def _albumentations_random(transform: Any) -> bool:
    """An Albumentations transform is random when it may be skipped (``p < 1``), when it is a
    composition (``OneOf``, ``SomeOf``, ``Sequential``...: not looked into), or when its
    parameter methods (``get_params``, ``get_params_dependent_on_data``, its own or inherited,
    except albumentations.core's base classes) draw from its random generators (``random_generator``, ``py_random``). Conservative: a transform that draws
    only for some arguments (``LongestMaxSize`` with a list of sizes) counts as random."""
    from albumentations.core.composition import BaseCompose

    if isinstance(transform, BaseCompose) or float(getattr(transform, "p", 1.0)) < 1.0:
        return True
    for cls in type(transform).__mro__:
        module = cls.__module__ or ""
        if cls is object or module.startswith("albumentations.core"):
            continue
        for name in ("get_params", "get_params_dependent_on_data"):
            method = cls.__dict__.get(name)
            if method is None:
                continue
            try:
                source = inspect.getsource(method)
            except (OSError, TypeError):
                return True
            if any(attr in source for attr in _RNG_ATTRS):
                return True
    return False


def _monai_random(transform: Any) -> bool:
    """MONAI ``CacheDataset``'s rule: random, or not a MONAI ``Transform`` (unknown)."""
    from monai.transforms import RandomizableTrait, Transform

    return isinstance(transform, RandomizableTrait) or not isinstance(transform, Transform)


def _monai_transform(obj: Any) -> bool:
    """A MONAI transform, or a subclass of one (looked up only if MONAI is imported)."""
    transforms = sys.modules.get("monai.transforms")
    return _is_monai(obj) or (transforms is not None and isinstance(obj, transforms.Transform))


def _albumentations_transform(obj: Any) -> bool:
    """An Albumentations transform or composition, or a subclass of one."""
    if _is_albumentations(obj):
        return True
    if "albumentations" not in sys.modules:
        return False
    from albumentations.core.composition import BaseCompose
    from albumentations.core.transforms_interface import BasicTransform

    return isinstance(obj, (BasicTransform, BaseCompose))


def is_random(transform: Any) -> bool:
    """Whether ``transform`` marks the end of the cached prefix: a MONAI transform that is
    ``Randomizable``/``RandomizableTrait`` (or not a MONAI ``Transform`` at all, as MONAI's
    ``CacheDataset`` decides), a random Albumentations transform (``_albumentations_random``),
    a torchvision v2 transform named ``Random...`` (or ``ColorJitter``, ``RandAugment`` ...);
    any other callable counts as random (precache cannot know: pass ``split=``)."""
    if _monai_transform(transform):
        return _monai_random(transform)
    if _albumentations_transform(transform):
        return _albumentations_random(transform)
    if _module(transform).startswith("torchvision.transforms.v2"):
        name = type(transform).__name__
        return name.startswith("Random") or name in _TORCHVISION_RANDOM
    return True


def _albumentations_compose(chain: Any, transforms: list[Any]) -> Any:
    """An Albumentations ``Compose`` of ``transforms`` with ``chain``'s settings."""
    import albumentations as A

    processors = getattr(chain, "processors", {})
    return A.Compose(
        transforms,
        bbox_params=processors["bboxes"].params if "bboxes" in processors else None,
        keypoint_params=processors["keypoints"].params if "keypoints" in processors else None,
        additional_targets=dict(getattr(chain, "_additional_targets", {}) or {}) or None,
        is_check_shapes=getattr(chain, "is_check_shapes", True),
        strict=getattr(chain, "_strict", False),
        mask_interpolation=getattr(chain, "mask_interpolation", None),
        seed=getattr(chain, "seed", None))


class Chain:
    """A transform chain as precache runs it: ``kind`` (``monai``, ``albumentations`` or
    ``callables``), its ``transforms`` and ``split``, the index of the first random one
    (``None``: none is). ``prefix(item)`` runs the transforms before it, ``tail`` the rest."""

    def __init__(self, transforms: Any, split: int | None = None) -> None:
        self.chain, self.kind, self.transforms = self._normalise(transforms)
        if split is None:
            if self.kind == "monai" and type(self.chain).__name__ != "Compose":
                split = 0  # OneOf, RandomOrder, SomeOf: random as a whole
            elif self.kind == "albumentations" and float(getattr(self.chain, "p", 1.0)) < 1.0:
                split = 0
            else:
                rule = _monai_random if self.kind == "monai" else is_random
                split = next((i for i, t in enumerate(self.transforms) if rule(t)), None)
        if split is not None and not 0 <= split <= len(self.transforms):
            raise ValueError(f"split={split} is outside the chain's {len(self.transforms)} "
                             "transforms")
        self.split = None if split == len(self.transforms) else split

    @staticmethod
    def _normalise(transforms: Any) -> tuple[Any, str, list[Any]]:
        if _monai_transform(transforms) and hasattr(transforms, "transforms"):
            return transforms, "monai", list(transforms.transforms)
        if _albumentations_transform(transforms) and hasattr(transforms, "transforms"):
            return transforms, "albumentations", list(transforms.transforms)
        if hasattr(transforms, "transforms"):
            listed = list(transforms.transforms)
        elif isinstance(transforms, (list, tuple)):
            listed = list(transforms)
        else:
            listed = [transforms]
        if listed and all(_monai_transform(t) for t in listed):
            from monai.transforms import Compose

            chain = Compose(listed)
            return chain, "monai", list(chain.transforms)
        if listed and all(_albumentations_transform(t) for t in listed):
            chain = _albumentations_compose(None, listed)
            return chain, "albumentations", listed
        return listed, "callables", listed

    @property
    def prefix_names(self) -> list[str]:
        end = len(self.transforms) if self.split is None else self.split
        return [type(t).__name__ for t in self.transforms[:end]]

    def prefix(self, item: Any) -> Any:
        """``item`` through the deterministic transforms (MONAI: as ``CacheDataset`` runs
        them, ``threading=True``: thread-unsafe transforms copied)."""
        end = self.split
        if self.kind == "monai":
            return self.chain(item, end=end, threading=True)
        if self.kind == "albumentations":
            if not hasattr(self, "_prefix"):
                self._prefix = _albumentations_compose(self.chain, self.transforms[:end])
            return self._prefix(**item)
        for t in self.transforms[:end]:
            item = t(item)
        return item

    def tail(self) -> Callable[[Any], Any] | None:
        """The random transforms, as a picklable callable that seeds itself per DataLoader
        worker; ``None`` when the whole chain is deterministic."""
        if self.split is None:
            return None
        if self.kind == "monai":
            return RandomTail("monai", self.chain, self.split)
        if self.kind == "albumentations":
            return RandomTail("albumentations",
                              _albumentations_compose(self.chain, self.transforms[self.split:]))
        return RandomTail("callables", self.transforms[self.split:])

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_prefix", None)
        return state


class RandomTail:
    """The random tail of a chain, run on each restored sample. In a DataLoader worker it
    first seeds the chain's own random state from the worker's seed (MONAI and Albumentations
    transforms keep their own generators, which every worker would otherwise copy: the same
    crops in every worker and every epoch); torchvision draws from torch, seeded by torch."""

    def __init__(self, kind: str, chain: Any, start: int = 0) -> None:
        self.kind, self.chain, self.start = kind, chain, start
        self._seeded: tuple[int, int] | None = None

    def _seed(self) -> None:
        info = torch.utils.data.get_worker_info()
        if info is None or self._seeded == (os.getpid(), info.seed):
            return
        self._seeded = (os.getpid(), info.seed)
        seed = info.seed % (2 ** 32)
        if self.kind == "monai":
            self.chain.set_random_state(seed=seed)
        elif self.kind == "albumentations":
            self.chain.set_random_seed(seed)

    def __call__(self, sample: Any) -> Any:
        self._seed()
        if self.kind == "monai":
            return self.chain(sample, start=self.start)
        if self.kind == "albumentations":
            return self.chain(**sample)
        for t in self.chain:
            sample = t(sample)
        return sample


META_KEYS = ("original_affine", "spatial_shape", "space", "original_channel_dim",
             "filename_or_obj")
"""The ``MetaTensor`` metadata kept beside its affine (MONAI's ``MetaKeys`` that later
transforms and savers read: where the volume came from, its shape and affine as loaded, its
space and channel axis); the format's header fields (``pixdim``, ``srow_x``...) are not."""


def _stored_meta(tensor: Any) -> dict[str, Any]:
    """A ``MetaTensor``'s affine and ``META_KEYS`` as columns: arrays as float64 or int64
    arrays, the rest as strings (``space`` is an enum; ``original_channel_dim`` an int,
    ``"no_channel"`` or NaN), so every sample of a chain stores the same columns."""
    found: dict[str, Any] = {"affine": torch.as_tensor(tensor.affine, dtype=torch.float64)}
    for key in META_KEYS:
        if key not in tensor.meta:
            continue
        value = tensor.meta[key]
        if key == "original_affine":
            found[key] = np.asarray(value, dtype=np.float64)
        elif key == "spatial_shape":
            found[key] = np.asarray(value, dtype=np.int64)
        else:
            found[key] = str(getattr(value, "value", value))
    return found


def _restored_meta(stored: Any) -> tuple[Any, dict[str, Any]]:
    """``_stored_meta``'s columns back as ``(affine, meta)`` for ``MetaTensor``; a cache from
    before the metadata was kept holds the affine alone."""
    if not isinstance(stored, dict):
        return stored, {}
    meta = dict(stored)
    affine = meta.pop("affine")
    if "original_channel_dim" in meta:
        dim = meta["original_channel_dim"]
        meta["original_channel_dim"] = (int(dim) if dim.lstrip("-").isdigit()
                                        else float(dim) if dim == "nan" else dim)
    return affine, meta


def _storable(sample: Any) -> Any:
    """A MONAI sample (a dict) with each ``MetaTensor`` as a plain tensor and its affine and
    metadata (``_stored_meta``) under ``__meta__`` (a ``MetaTensor`` elsewhere is stored as a
    plain tensor)."""
    if not isinstance(sample, dict):
        return sample
    out: dict[str, Any] = {}
    metas: dict[str, Any] = {}
    for k, v in sample.items():
        if hasattr(v, "as_tensor") and hasattr(v, "affine"):
            out[k] = v.as_tensor()
            metas[k] = _stored_meta(v)
        else:
            out[k] = v
    if metas:
        out[_META] = metas
    return out


def read_image_item(item: Any) -> dict[str, Any]:
    """The default ``load`` of an Albumentations chain: a path is ``{"image": HWC uint8}``; a
    dict's ``image`` and ``mask`` paths are read (RGB and as stored), its other keys kept."""
    from PIL import Image

    sample = {"image": item} if isinstance(item, (str, os.PathLike)) else dict(item)
    for name in ("image", "mask"):
        value = sample.get(name)
        if isinstance(value, (str, os.PathLike)):
            with Image.open(value) as im:
                sample[name] = np.asarray(im.convert("RGB") if name == "image" else im)
    return sample


_KEEP_BYTES = 64 * 2**20
"""How many bytes of samples computed in this process (stage 1's probe) ``PrefixDataset``
keeps, to hand to the worker that stores them instead of computing them again."""


def _nbytes(sample: Any) -> int:
    if isinstance(sample, dict):
        return sum(_nbytes(v) for v in sample.values())
    if isinstance(sample, (list, tuple)):
        return sum(_nbytes(v) for v in sample)
    if isinstance(sample, torch.Tensor):
        return sample.numel() * sample.element_size()
    return int(getattr(sample, "nbytes", 64))


class PrefixDataset:
    """``items[i]`` through a chain's deterministic prefix: what ``cache_transforms`` caches
    (with ``load`` first, if given). Picklable, for stage 1's spawned workers.

    The samples stage 1 probes in this process (to infer the columns) are kept, up to
    ``PROBE`` of them and ``_KEEP_BYTES``, and travel to the workers with the dataset: the worker that stores one
    takes it instead of loading and resampling its volumes again. Each is handed out once."""

    def __init__(self, items: Sequence[Any], chain: Chain,
                 load: Callable[[Any], Any] | None = None) -> None:
        self.items, self.chain, self.load = list(items), chain, load
        self.computed: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        kept = self.computed.pop(i, None)
        if kept is not None:
            return kept
        item = self.items[i]
        if self.load is not None:
            item = self.load(item)
        sample = _storable(self.chain.prefix(item))
        if (len(self.computed) < PROBE and _is_main_process()
                and _held(self.computed) + _nbytes(sample) <= _KEEP_BYTES):
            self.computed[i] = sample
        return sample


def _held(computed: dict[int, Any]) -> int:
    return sum(_nbytes(s) for s in computed.values())


def _is_main_process() -> bool:
    """Not in one of stage 1's worker processes (there, nothing is kept: each sample is
    stored once, by the worker computing it)."""
    import multiprocessing

    return multiprocessing.parent_process() is None


class TransformedSample:
    """A ``cache_transforms`` dataset's transform: the cached row back into the prefix's
    output (``RestoreSample``, then each ``MetaTensor`` rebuilt with its affine and metadata),
    then the
    random tail."""

    def __init__(self, restore: RestoreSample, tail: Callable[[Any], Any] | None) -> None:
        self.restore, self.tail = restore, tail

    def __call__(self, row: dict[str, Any]) -> Any:
        sample = self.restore(row)
        if isinstance(sample, dict) and _META in sample:
            from monai.data import MetaTensor

            for k, stored in sample.pop(_META).items():
                affine, meta = _restored_meta(stored)
                sample[k] = MetaTensor(sample[k], affine=affine, meta=meta)
        return sample if self.tail is None else self.tail(sample)


def _describe(obj: Any, depth: int = 0) -> Any:
    """``obj`` as JSON for the fingerprint: simple values as they are, arrays by hash, objects
    as their class and attributes (random generators left out), down to a few levels."""
    simple = _simple(obj)
    if simple is not None or obj is None:
        return simple
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu().numpy()
    if isinstance(obj, np.ndarray):
        return {"array": hashlib.sha256(np.ascontiguousarray(obj).tobytes()).hexdigest()[:16],
                "shape": list(obj.shape), "dtype": obj.dtype.name}
    if isinstance(obj, enum.Enum):
        return str(obj)
    if isinstance(obj, (np.random.RandomState, np.random.Generator, random.Random,
                        threading.local)):
        return f"<{type(obj).__name__}>"
    if isinstance(obj, (list, tuple, set, frozenset)):
        values = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        return [_describe(v, depth + 1) for v in list(values)[:1000]]
    if isinstance(obj, dict):
        return {str(k): _describe(v, depth + 1) for k, v in list(obj.items())[:1000]}
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if inspect.isroutine(obj) or inspect.isclass(obj):
        return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"
    attrs = getattr(obj, "__dict__", None)
    if depth >= 4 or not isinstance(attrs, dict):
        return name
    return {"class": name, "attrs": {k: _describe(v, depth + 1) for k, v in sorted(attrs.items())
                                     if k not in _STATE_ATTRS
                                     and not isinstance(v, threading.local)}}


def transforms_version(chain: Chain, load: Callable[[Any], Any] | None = None) -> str:
    """The default fingerprint of ``cache_transforms``: the prefix's transforms (class names
    and attributes, nested objects included) and ``load``."""
    end = len(chain.transforms) if chain.split is None else chain.split
    described = {"kind": chain.kind, "prefix": [_describe(t) for t in chain.transforms[:end]],
                 "load": _describe(load)}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode())
    return f"{end} transforms {digest.hexdigest()[:16]}"


def _loaded_keys(chain: Chain, item: Any) -> list[str]:
    """The keys a MONAI prefix loads (its ``Load...`` dict transforms' keys in the first item):
    volumes whose shape follows each file, stored with varying shape (no sample is read to
    know it, so a re-run reads none)."""
    end = len(chain.transforms) if chain.split is None else chain.split
    keys = {k for t in chain.transforms[:end] if type(t).__name__.startswith("Load")
            for k in getattr(t, "keys", ())}
    return sorted(k for k in keys if isinstance(item, dict) and k in item)


def _item_keys(items: Sequence[Any]) -> list[str]:
    """Each item's key: the item itself as JSON (so an item changed, added or removed changes
    only its own sample); a repeated item gets ``#2``, ``#3``..."""
    keys, seen = [], {}
    for item in items:
        text = json.dumps(item, sort_keys=True, default=str, ensure_ascii=False)
        seen[text] = seen.get(text, 0) + 1
        keys.append(text if seen[text] == 1 else f"{text}#{seen[text]}")
    return keys


def _paths(item: Any) -> list[str]:
    if isinstance(item, (str, os.PathLike)):
        return [os.fspath(item)]
    if isinstance(item, dict):
        return [p for v in item.values() for p in _paths(v)]
    if isinstance(item, (list, tuple)):
        return [p for v in item for p in _paths(v)]
    return []


def _file_hash(item: Any) -> str:
    """The item's files' sizes and modification times: a file rewritten recomputes its sample."""
    parts = []
    for path in _paths(item):
        try:
            st = os.stat(path)
        except OSError:
            continue
        parts.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


SAMPLE_LISTS = ("data", "samples", "files", "paths", "imgs")
"""Attributes under which datasets keep one entry a sample that names its files: MONAI's
``Dataset.data`` (dicts of paths), torchvision's ``ImageFolder.samples``/``imgs`` ((path,
class) pairs), and the usual ``files``/``paths``."""


def dataset_files_hash(dataset: Any) -> Callable[[int], str] | None:
    """``cache_dataset``'s default ``sample_hash``: the dataset's own ``sample_hash``, or the
    sizes and modification times of the files that sample ``i``'s entry in one of
    ``SAMPLE_LISTS`` names (a list as long as the dataset whose first entry names an existing
    file); ``None`` if the dataset has neither."""
    own = getattr(dataset, "sample_hash", None)
    if callable(own):
        return own
    for name in SAMPLE_LISTS:
        entries = getattr(dataset, name, None)
        if (isinstance(entries, Sequence) and not isinstance(entries, (str, bytes))
                and len(entries) == len(dataset) and len(entries)
                and any(os.path.isfile(p) for p in _paths(entries[0]))):
            return _EntryFiles(entries)
    return None


class _EntryFiles:
    """``sample_hash`` from a list of per-sample entries naming files (picklable)."""

    def __init__(self, entries: Sequence[Any]) -> None:
        self.entries = entries

    def __call__(self, i: int) -> str:
        return _file_hash(self.entries[i])


def _task_rows(n: int, workers: int | None) -> int:
    """Samples per stage-1 task (and shard) of ``cache_transforms``: about four tasks per
    worker, at most 16 samples. Why: a chain's sample costs 0.1-1 s (a volume loaded and
    resampled), and a spawned worker spends seconds importing MONAI before its first one
    (13-18 s on 2 loaded cores); in small tasks the calling process, which has imported it,
    keeps taking them meanwhile and every process finishes within one task of the others
    (the default, 16 samples a task, left it waiting for a worker still importing)."""
    from precache.processing.runner import stage1_workers

    count = stage1_workers() if workers is None else max(1, workers)
    return max(1, min(16, n // (4 * count)))


def cache_transforms(
    items: Sequence[Any],
    transforms: Any,
    output: str | os.PathLike[str],
    *,
    workers: int | None = None,
    version: str | None = None,
    split: int | None = None,
    load: Callable[[Any], Any] | None = None,
    track_meta: bool = True,
    **options: Any,
) -> CachedDataset:
    """Cache ``items`` through the deterministic prefix of ``transforms`` and return the
    cached dataset, whose ``transform`` runs the random tail on every read.

    Args:
        items: a MONAI-style data list (``[{"image": path, "label": ...}, ...]``) or paths.
        transforms: a MONAI ``Compose`` (or list of MONAI transforms), an Albumentations
            ``Compose`` (or list), or a list of callables (torchvision v2, functions).
        output: the cache directory (or a URL, as ``precache.run``).
        workers: stage-1 processes (default: the cores; 1 runs in this process).
        version: the fingerprint; default: the prefix's transforms (their classes and
            attributes) and ``load``. A changed fingerprint recomputes every sample.
        split: the index of the first transform to run per epoch, instead of the first random
            one (``is_random``).
        load: applied to each item before the chain; default: none for MONAI chains and
            callables, ``read_image_item`` for Albumentations (paths read into arrays).
        track_meta: MONAI chains: ``False`` serves plain tensors, as MONAI under
            ``set_track_meta(False)`` (no affine, no ``applied_operations``), ~10x faster:
            ``RandSpatialCropd``, ``RandScaleCropd`` and ``RandFlipd`` crop and flip the stored
            rows directly, with the same random draws as MONAI's (``PlainTail``).
        options: as ``cache_dataset`` (``progress``, ``format``, ``shard_rows``, ``ragged``,
            ``overwrite``, ``log`` ...) and ``CachedDataset`` (``where`` ...). MONAI chains
            store their ``MetaTensor`` fields with varying shape unless ``ragged`` is given.
            ``shard_rows`` defaults to about a quarter of each worker's share, at most 16
            (``_task_rows``).

    Returns:
        A ``CachedDataset`` of the prefix's outputs (in items' order after a full build),
        whose ``transform`` rebuilds each (MONAI: ``MetaTensor`` with its affine) and applies
        the random tail, seeded per DataLoader worker.

    Raises:
        ValueError: the chain's first transform is random (nothing to cache), ``split`` is
            outside the chain, or ``track_meta=False`` is given for a chain that is not MONAI's.
        RunError, TypeError: as ``cache_dataset``.
    """
    chain = Chain(transforms, split)
    if chain.split == 0:
        first = type(chain.transforms[0]).__name__ if chain.transforms else type(transforms).__name__
        raise ValueError(f"cache_transforms: the chain's first transform ({first}) is random, "
                         "so there is nothing to cache; put the deterministic transforms "
                         "first, or pass split=N to cache the first N")
    if not track_meta and chain.kind != "monai":
        raise ValueError(f"cache_transforms: track_meta=False is for MONAI chains (MetaTensor "
                         f"metadata); this chain is {chain.kind}'s, whose samples carry none: "
                         "leave track_meta out")
    if load is None and chain.kind == "albumentations":
        load = read_image_item
    items = list(items)
    dataset = PrefixDataset(items, chain, load)
    if chain.kind == "monai" and "ragged" not in options and items:
        options["ragged"] = _loaded_keys(chain, items[0])
    if options.get("shard_rows") is None:
        options["shard_rows"] = _task_rows(len(items), workers)
    keys = _item_keys(items)
    try:
        cached = cache_dataset(
            dataset, output, key=keys.__getitem__, sample_hash=_EntryFiles(items),
            version=transforms_version(chain, load) if version is None else str(version),
            workers=workers, **options)
    finally:  # the probed samples not handed to a worker (kept, or workers > 1), a failed run's
        dataset.computed.clear()  # too (this process's stage-1 ops still hold the dataset)
    restore = getattr(cached.transform, "restore", cached.transform)
    assert isinstance(restore, RestoreSample)
    if track_meta:
        cached.transform = TransformedSample(restore, chain.tail())
    else:
        from precache.transforms_tail import PlainTail

        start = len(chain.transforms) if chain.split is None else chain.split
        cached.transform = PlainTail(restore, chain.chain, start)
    return cached
