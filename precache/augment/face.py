"""Stage-2 face augmentation, for one cached face sample or a whole batch: region edits from the
cached hulls, one keypoint-aware flip/affine warp, colour, blur and cutout.

Every random choice of a batch is drawn first, in one call (``draw`` -> ``FaceDraws``), then
applied (``apply``): so one sample is a batch of one, ``same()`` and ``groups`` are one draw
repeated, and the CPU form (``face_opencv``: OpenCV per uint8 crop, fastest on a CPU) and the GPU
form (``face_torch``: a few tensor ops over the batch) give the same result on the same draws
(within a grey level where their interpolation differs, and along the edge of a region's mask).
Flip, scale, rotation and shift are one 2 x 3 matrix per sample: one warp moves the pixels and the
same matrix every point, and a flip re-indexes the points so that names keep meaning the same side
of the face.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Sequence

import numpy as np
import torch
import torch.utils.data

from precache.augment.face_draws import FaceDraws, draw_face, draw_layout
from precache.augment.face_opencv import POINT_KEYS, apply_opencv
from precache.augment.face_torch import apply_torch
from precache.faces import topology

__all__ = ["FaceAugment", "FaceDraws", "FORMS"]

FORMS = ("opencv", "torch")
"""How ``apply`` runs: per-sample OpenCV on uint8 (CPU), or batched tensor ops (any device)."""
_FACE_KEYS = ("image", "landmarks5", "mesh", "has_mesh", "regions", "region_sizes")
_CHANGED = ("image", *POINT_KEYS, "region_sizes")  # what an augmentation replaces


class FaceAugment:
    """Augment cached face samples, one (``image`` (H, W, 3)) or a batch (``image`` (N, H, W, 3)
    uint8, as ``make_loader`` yields it, on the CPU or a GPU): ``data -> new data``; the input is
    not modified, and keys other than the face columns pass through.

    Region steps (on the crop, before geometry) each pick one of ``regions`` that the sample has
    (a hull of at least 3 points) and edit only the pixels inside its mask. Then one warp (flip
    and affine) moves pixels and points together; points use the pixel-centre convention of
    stage 1 (pixel ``i`` has its centre at ``i``, so a flip maps x to ``width - 1 - x``). Points
    that leave the crop are kept; NaN points stay NaN. Last, colour (brightness/contrast, then hue
    and saturation, one 3 x 4 colour matrix), Gaussian blur and cutout (black holes).

    Randomness is per sample, drawn per batch from one generator, reseeded on the first call in
    each process: from the DataLoader worker's seed in a worker (so workers differ, and
    ``torch.manual_seed`` makes runs repeatable), from ``seed`` in the process that built the
    object, and from ``seed`` and the pid elsewhere. ``same(samples)``, or ``groups`` for a
    batch, gives several samples one draw (the frames of a clip, a real/fake pair). Several
    threads may call it at once (``thread_safe``): a batch's draws are taken under a lock, so
    each batch gets its own run of the stream (which batch gets which run follows the threads'
    timing).

    Args:
        flip_p (float): probability of a horizontal flip. Default: ``0.5``.
        affine_p (float): probability of the affine step. Default: ``0.7``.
        scale (tuple[float, float]): zoom range of the affine step (same on both axes).
            Default: ``(0.9, 1.1)``.
        rotate (float): rotation limit in degrees (uniform in ``±rotate``). Default: ``15.0``.
        shift (float): translation limit, a fraction of the size per axis. Default: ``0.05``.
        color_p (float): probability of the brightness/contrast change; hue/saturation runs with
            half of it. Default: ``0.5``.
        brightness (float): brightness limit, an offset as a fraction of 255. Default: ``0.2``.
        contrast (float): contrast limit, a gain in ``1 ± contrast``. Default: ``0.2``.
        saturation (float): saturation limit, a gain of the distance from the pixel's grey in
            ``1 ± saturation`` (torchvision's meaning). Default: ``0.2``.
        hue (float): hue limit, a turn about the grey axis as a fraction of the circle.
            Default: ``0.03``.
        blur_p (float): probability of a Gaussian blur (kernel radius ``ceil(3 sigma)``).
            Default: ``0.1``.
        blur_sigma (tuple[float, float]): its sigma range in pixels. Default: ``(0.5, 1.5)``.
        cutout_p (float): probability of cutout. Default: ``0.2``.
        cutout_holes (tuple[int, int]): number of holes (inclusive). Default: ``(1, 2)``.
        cutout_size (tuple[float, float]): hole height and width, each a fraction of the size.
            Default: ``(0.1, 0.25)``.
        region_color_p (float): probability of a colour change inside one region. Default: ``0.2``.
        region_color (float): its per-channel gain limit; the bias limit is ``64 * region_color``.
            Default: ``0.3``.
        region_blur_p (float): probability of blurring one region. Default: ``0.1``.
        region_blur_sigma (tuple[float, float]): its sigma range in pixels. Default: ``(1.0, 2.5)``.
        occlude_p (float): probability of filling one region with a random colour (or, half the
            time, uniform noise). Default: ``0.05``.
        regions (tuple[str, ...]): names from ``topology.REGIONS`` the region steps pick from.
            Default: ``("left_eye", "right_eye", "mouth")``.
        seed (int, optional): seed in the building process (reproducible there). Default: ``None``.
    """

    def __init__(
        self,
        *,
        flip_p: float = 0.5,
        affine_p: float = 0.7,
        scale: tuple[float, float] = (0.9, 1.1),
        rotate: float = 15.0,
        shift: float = 0.05,
        color_p: float = 0.5,
        brightness: float = 0.2,
        contrast: float = 0.2,
        saturation: float = 0.2,
        hue: float = 0.03,
        blur_p: float = 0.1,
        blur_sigma: tuple[float, float] = (0.5, 1.5),
        cutout_p: float = 0.2,
        cutout_holes: tuple[int, int] = (1, 2),
        cutout_size: tuple[float, float] = (0.1, 0.25),
        region_color_p: float = 0.2,
        region_color: float = 0.3,
        region_blur_p: float = 0.1,
        region_blur_sigma: tuple[float, float] = (1.0, 2.5),
        occlude_p: float = 0.05,
        regions: tuple[str, ...] = ("left_eye", "right_eye", "mouth"),
        seed: int | None = None,
    ) -> None:
        self.params: dict[str, Any] = {k: v for k, v in locals().items() if k != "self"}
        self.params["regions"] = tuple(regions)
        unknown = set(regions) - set(topology.REGIONS)
        if unknown:
            raise ValueError(f"unknown regions {sorted(unknown)}; known: {topology.REGIONS}")
        if not 0 <= cutout_holes[0] <= cutout_holes[1]:
            raise ValueError(f"cutout_holes must be (low, high) with 0 <= low <= high, got {cutout_holes}")
        self._region_rows = [topology.REGIONS.index(name) for name in regions]
        self._layout = draw_layout(self.params)
        self._owner_pid = os.getpid()
        self._seeded_pid: int | None = None
        self._rng = np.random.default_rng(seed)
        self._lock, self._lock_pid = threading.Lock(), os.getpid()

    thread_safe = True
    """``make_loader`` keeps its worker threads for it: the draws are taken under a lock, and
    applying them changes nothing of the augment (OpenCV and torch release the GIL)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.params.items())})"

    def __getstate__(self) -> dict[str, Any]:
        # The generator is not shipped: a copy starts its stream afresh (see _reseed...).
        return {"params": self.params, "owner_pid": self._owner_pid}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state["params"])  # type: ignore[misc]
        self._owner_pid = state["owner_pid"]

    def _reseed_if_new_process(self) -> None:
        """Give each process its own stream; a forked copy would repeat its parent's otherwise."""
        pid = os.getpid()
        if pid == self._seeded_pid:
            return
        seed = self.params["seed"]
        info = torch.utils.data.get_worker_info()
        if info is not None:
            entropy: Any = info.seed if seed is None else [seed, info.seed]
        elif pid == self._owner_pid:
            entropy = seed
        else:
            entropy = None if seed is None else [seed, pid]
        self._rng = np.random.default_rng(np.random.SeedSequence(entropy))
        self._seeded_pid = pid

    def draw(self, n: int, groups: Sequence[int] | np.ndarray | torch.Tensor | None = None,
             ) -> FaceDraws:
        """Draw the random choices of ``n`` samples (one call of this augment's stream).

        Args:
            n: samples in the batch.
            groups: optional (n,) labels; samples with the same label get one draw (the frames
                of a clip, a real/fake pair). Draws follow the order in which labels first
                appear, so distinct labels draw as no ``groups`` does.

        Returns:
            The draws, for ``apply``.
        """
        if groups is None:
            return self._draw(n)
        labels = np.asarray(groups.cpu() if isinstance(groups, torch.Tensor) else groups)
        if labels.shape != (n,):
            raise ValueError(f"groups must have shape ({n},), got {labels.shape}")
        _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
        rank = np.empty(len(first), np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(first))
        return self._draw(len(first)).take(rank[inverse.reshape(-1)])

    def _draw(self, n: int) -> FaceDraws:
        """``n`` samples' draws, one run of the stream however many threads call at once."""
        if self._lock_pid != os.getpid():  # a forked copy: the parent's lock may be held there
            self._lock, self._lock_pid = threading.Lock(), os.getpid()
        with self._lock:
            self._reseed_if_new_process()
            return draw_face(self._rng, n, self.params, self._layout)

    def apply(self, batch: dict[str, Any], draws: FaceDraws, *, form: str | None = None,
              ) -> dict[str, Any]:
        """Augment a batch with given draws (no randomness is used here).

        Args:
            batch: ``image`` (N, H, W, 3) uint8 and any of ``landmarks5``, ``mesh``,
                ``has_mesh``, ``regions``, ``region_sizes`` with a leading N; NumPy arrays or
                tensors (the result has the input's types, on its device).
            draws: ``len(draws) == N``, from ``draw``.
            form: ``"opencv"`` or ``"torch"`` (see ``FORMS``); default: ``"torch"`` for tensors
                on a GPU, ``"opencv"`` otherwise (each is the faster one there).

        Returns:
            A new dict: ``image`` and the point columns augmented, other keys as they were.

        Raises:
            ValueError: on a batch that is not (N, H, W, 3) with N draws, or an unknown form.
        """
        image = batch["image"]
        if image.ndim != 4 or image.shape[-1] != 3 or len(image) != len(draws):
            raise ValueError(f"expected image (N, H, W, 3) and N draws, got {tuple(image.shape)} "
                             f"and {len(draws)} draws")
        device = image.device if isinstance(image, torch.Tensor) else None
        form = form or ("torch" if device is not None and device.type != "cpu" else "opencv")
        if form not in FORMS:
            raise ValueError(f"unknown form {form!r}; known: {FORMS}")
        face = {k: batch[k] for k in _FACE_KEYS if batch.get(k) is not None}
        if form == "opencv":
            done = apply_opencv({k: _numpy(v) for k, v in face.items()}, draws, self._region_rows)
        else:
            done = apply_torch({k: torch.as_tensor(v, device=device) for k, v in face.items()},
                               draws, self._region_rows)
        out = dict(batch)
        for key in _CHANGED:
            if key in face:
                value = done[key]
                if device is None:
                    out[key] = _numpy(value)
                else:
                    out[key] = torch.as_tensor(value).to(device)
        return out

    def __call__(self, data: dict[str, Any], *,
                 groups: Sequence[int] | np.ndarray | torch.Tensor | None = None,
                 ) -> dict[str, Any]:
        """Augment one sample (``image`` (H, W, 3)) or a batch (``image`` (N, H, W, 3)) with a
        fresh draw per sample, or per group of a batch (``groups``, see ``draw``)."""
        if data["image"].ndim == 4:
            return self.apply(data, self.draw(len(data["image"]), groups))
        if groups is not None:
            raise ValueError("groups is for a batch; one sample is one group")
        return self._one(data, self.draw(1))

    def same(self, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Augment every sample with ONE random draw: the same flip, affine, colour, blur, cutout
        and region choices for all; returns the augmented copies in order.

        For the frames of a clip (``ClipDataset`` calls it once per clip), or a real/fake pair
        requested together, which must move and change alike. It uses one draw of this augment's
        stream, whatever the samples (so successive calls differ, and the calls after it repeat).
        Sizes are fractions of the crop, so crops of any size get the same holes and shifts
        relative to their size.

        A region step picks among the configured regions present in each sample (a hull of at
        least 3 points), so a region missing from one frame may change that frame's pick (and
        a sample without a mesh skips the region steps); with the same regions present, every
        sample edits the same region with the same parameters (each at its own hull).
        """
        if not samples:
            return []
        draws = self.draw(1)
        return [self._one(sample, draws) for sample in samples]

    def _one(self, sample: dict[str, Any], draws: FaceDraws) -> dict[str, Any]:
        """One sample as a batch of one (NumPy samples straight to the OpenCV form: a worker
        calls this per sample, where a few microseconds of checks add up)."""
        batch = {k: _one_row(sample[k]) for k in _FACE_KEYS if sample.get(k) is not None}
        if isinstance(sample["image"], np.ndarray):
            done = apply_opencv(batch, draws, self._region_rows)
        else:
            done = self.apply(batch, draws)
        out = dict(sample)
        out.update({k: done[k][0] for k in _CHANGED if k in batch})
        return out


def _numpy(value: Any) -> np.ndarray:
    return value.cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def _one_row(value: Any) -> Any:
    """``value`` with a leading batch dimension of 1 (a view), NumPy or torch."""
    if isinstance(value, torch.Tensor):
        return value.reshape(1, *value.shape)
    value = np.asarray(value)
    return value.reshape(1, *value.shape)
