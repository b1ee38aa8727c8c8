"""FaceAugment's torch form on a CUDA batch gives what it gives on the same CPU tensors with the
same draws (points exactly, pixels within a grey level): the face trainers augment on the GPU.
Synthetic faces (a smooth crop, a random mesh and its region hulls), so no face model is needed
on the GPU machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from precache.augment import FaceAugment
from precache.faces import topology

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
N, S = 16, 96


def synthetic_faces() -> dict[str, torch.Tensor]:
    import cv2

    rng = np.random.default_rng(0)
    samples = []
    for _ in range(N):
        image = cv2.resize(rng.integers(0, 255, (6, 6, 3), dtype=np.uint8), (S, S),
                           interpolation=cv2.INTER_CUBIC)
        mesh = (0.2 + 0.6 * rng.random((topology.MESH_POINTS, 2))).astype(np.float32) * (S - 1)
        regions, sizes = topology.region_hulls(mesh)
        samples.append({"image": image, "landmarks5": mesh[:5].copy(), "mesh": mesh,
                        "has_mesh": np.bool_(True), "regions": regions, "region_sizes": sizes})
    return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}


def test_the_torch_form_on_cuda_matches_it_on_the_cpu():
    batch = synthetic_faces()
    aug = FaceAugment(flip_p=0.5, affine_p=0.8, color_p=0.8, blur_p=0.5, cutout_p=0.8,
                      region_color_p=0.6, region_blur_p=0.5, occlude_p=0.5, seed=3)
    draws = aug.draw(N)
    on_cpu = aug.apply(batch, draws, form="torch")
    on_gpu = aug.apply({k: v.cuda() for k, v in batch.items()}, draws)  # torch form: default
    assert on_gpu["image"].device.type == "cuda" and on_gpu["image"].dtype == torch.uint8
    for key in ("landmarks5", "mesh", "regions", "region_sizes"):
        np.testing.assert_allclose(on_gpu[key].cpu().numpy(), on_cpu[key].numpy(), atol=1e-3,
                                   err_msg=key)
    diff = (on_gpu["image"].cpu().int() - on_cpu["image"].int()).abs()
    assert (diff > 1).float().mean() < 0.001  # rounding of float kernels, not other pixels
    assert not torch.equal(on_cpu["image"], batch["image"])  # it did augment
