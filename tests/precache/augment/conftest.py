"""The face the FaceAugment tests augment: scikit-image's astronaut, cropped to 128 px, with
MediaPipe's mesh, the cached region hulls, and landmarks5 derived from the mesh."""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np
import pytest
from skimage import data

from precache.faces import topology

S = 128
EYES = ("left_eye", "right_eye")


@pytest.fixture(scope="session")
def face() -> dict[str, Any]:
    """The astronaut's face as stage 1 caches it (mesh in MediaPipe's ``x * w`` pixels), found
    once: tests copy it before they change it."""
    import mediapipe as mp

    image = cv2.resize(np.ascontiguousarray(data.astronaut()[0:230, 100:330]), (S, S),
                       interpolation=cv2.INTER_AREA)
    with mp.solutions.face_mesh.FaceMesh(static_image_mode=True, max_num_faces=1) as mesher:
        found = mesher.process(image).multi_face_landmarks
    assert found, "MediaPipe found no face in the astronaut crop"
    mesh = np.array([[p.x * S, p.y * S] for p in found[0].landmark[: topology.MESH_POINTS]],
                    dtype=np.float32)
    regions, sizes = topology.region_hulls(mesh)
    eye = {n: mesh[topology.MESH_REGIONS[n]].mean(axis=0) for n in EYES}
    landmarks5 = np.stack([eye["right_eye"], eye["left_eye"], mesh[1], mesh[61], mesh[291]])
    assert landmarks5[0, 0] < landmarks5[1, 0] and landmarks5[3, 0] < landmarks5[4, 0]
    return {"key": "astronaut", "image": image, "landmarks5": landmarks5.astype(np.float32),
            "mesh": mesh, "has_mesh": np.bool_(True), "regions": regions, "region_sizes": sizes}
