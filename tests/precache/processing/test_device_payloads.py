"""What a worker sends the device stage for a face detector: each image shrunk to
``detect_size`` and O-Net's 48 px patches, not the source photo or frame; with the same faces as
when the worker runs the networks itself."""

from __future__ import annotations

import pickle
from typing import Any

import cv2
import numpy as np
import pytest

from precache.faces.mtcnn import _onet_result, _square
from precache.processing.executors.device_stage import attach_parts, part_results, run_batch
from precache.processing.ops.face_detect import DetectFaces

DETECT_SIZE = 256


class Loopback:
    """The device stage in this process: each call pickled both ways as ``DeviceClient`` does,
    run by ``run_batch`` on ops set up apart from the worker's, and what was sent kept."""

    def __init__(self, served: dict[int, Any]) -> None:
        self.served = served
        self.sent: list[tuple[str, list[tuple], int]] = []  # method, items, pickled bytes

    def call_part(self, position: int, part: str, method: str, items: list[tuple]) -> list[Any]:
        payload = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
        self.sent.append((method, pickle.loads(payload), len(payload)))
        reply = run_batch(self.served, [((position, part, method), pickle.loads(payload))])[0]
        return part_results(pickle.loads(pickle.dumps(reply)))


@pytest.fixture(scope="module")
def detectors() -> tuple[DetectFaces, DetectFaces, Loopback]:
    """A plain ``DetectFaces`` and one whose networks run through a ``Loopback``."""
    plain = DetectFaces(device="cpu", detect_size=DETECT_SIZE, keep="all")
    plain.setup()
    served = DetectFaces(device="cpu", detect_size=DETECT_SIZE, keep="all")
    served.nets.setup()
    staged = DetectFaces(device="cpu", detect_size=DETECT_SIZE, keep="all")
    device = Loopback({0: served})
    assert attach_parts([staged], (0,), device) == frozenset()  # the op runs in the worker
    staged.setup()
    return plain, staged, device


@pytest.fixture(scope="module")
def photos() -> list[np.ndarray]:
    """A photo 4x the astronaut's side (2048 px, 12 MB), the astronaut (512 px) and a small
    one (200 px, under ``DETECT_SIZE``)."""
    from skimage import data as skdata

    face = skdata.astronaut()
    return [cv2.resize(face, (2048, 2048), interpolation=cv2.INTER_CUBIC), face,
            np.ascontiguousarray(face[40:240, 120:320])]


def test_photos_go_to_the_device_shrunk_to_detect_size_with_the_same_faces(
        detectors: tuple[DetectFaces, DetectFaces, Loopback], photos: list[np.ndarray]) -> None:
    plain, staged, device = detectors
    device.sent.clear()
    samples = [{"key": f"p{k}", "image": photo} for k, photo in enumerate(photos)]
    got, expected = staged.call_batch(samples), plain.call_batch(samples)
    assert [len(faces) for faces in got] == [len(faces) for faces in expected]
    assert len(got[0]) >= 1 and len(got[1]) >= 1
    for faces, want in zip(got, expected):
        for face, wanted in zip(faces, want):
            for column in ("box", "score", "landmarks5"):
                np.testing.assert_array_equal(face[column], wanted[column])
    # one call for the batch; each image at most DETECT_SIZE on its longer side, the small
    # one as it is
    [(method, items, size)] = device.sent
    assert method == "detect"
    assert [max(image.shape[:2]) for image, _ in items] == [DETECT_SIZE, DETECT_SIZE, 200]
    assert size < 2 * DETECT_SIZE ** 2 * 3 + 200 ** 2 * 3 + 4096


def test_following_a_face_sends_o_nets_patches_and_finds_what_o_net_finds_on_the_frame(
        detectors: tuple[DetectFaces, DetectFaces, Loopback], photos: list[np.ndarray]) -> None:
    # boxes inside the frame, over its edges (zero-padded patches) and wholly outside it
    plain, staged, device = detectors
    frame = photos[1]
    boxes = np.array([[160, 50, 300, 210], [-30, -20, 60, 90], [480, 400, 560, 530],
                      [600, 600, 650, 660]], np.float32)
    device.sent.clear()
    got = staged.refine_many([frame, frame], [boxes, np.empty((0, 4), np.float32)])
    [(method, items, _)] = device.sent
    assert method == "refine"
    assert [patches.shape for _, patches in items] == [(4, 48, 48, 3), (0, 48, 48, 3)]
    # what O-Net gives on the whole frame, read there (as the cascade's own R-/O-Net pass does)
    cascade = plain.detector
    squared = np.fix(_square(boxes.astype(np.float64)))
    [outputs] = cascade._run_split("onet", [frame], [squared], 48)
    expected = [a.astype(np.float32) for a in _onet_result(squared, *outputs)]
    for found, want in zip(got[0], expected):
        np.testing.assert_array_equal(found, want)
    assert [len(a) for a in got[1]] == [0, 0, 0]
    for found, want in zip(got[0], plain.refine_many([frame], [boxes])[0]):
        np.testing.assert_array_equal(found, want)
