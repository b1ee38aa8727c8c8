"""MTCNN in torch (``precache.faces.mtcnn_torch``) against today's OpenCV engine: the networks
layer by layer, then whole cascades on real photos, generated sample pictures and video frames
(same faces, boxes and points within 1 px, batched or one by one), and the ``device`` parameter
of the face ops (one-line errors, not in the fingerprint)."""

from __future__ import annotations

import os
import subprocess
import sys

import cv2
import numpy as np
import pytest
import torch
from skimage import data

from precache.faces.mtcnn import MTCNN, _level, _nms, _nms_loop, mtcnn_weight_files
from precache.faces.mtcnn_torch import TorchMTCNN, _device_level, torch_nets
from precache.processing.ops.face_detect import DetectFaces, make_mtcnn
from precache.processing.ops.video_faces import VideoFaces
from precache.processing.pipeline import PipelineError, load_pipeline
from tests.face_photos import group_photo, hopper, sample_pictures
from tests.helpers import REPO, load_script

PIXEL = 1.0  # boxes and points agree within 1 px


def video_frames(count: int) -> list[np.ndarray]:
    """``count`` frames of a generated video (``data/make_videos.py``'s first scene: a face
    gliding over a background, flicker and noise), 320x240, not encoded."""
    videos = load_script(REPO / "data" / "make_videos.py", "make_videos")
    faces, backgrounds = videos.samples.load_photos()
    rng = np.random.default_rng([videos.SEED, 0])
    shots = videos.make_scene(videos.scene_kind(0), faces, backgrounds, rng, (320, 240), 2.0, 15)
    return [videos.render(shots, t, rng, None)[0] for t in np.arange(count) / 15]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as in stage-1 workers (two threads on a busy 2-core machine made the
    torch engine 10x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def shrunk(image: np.ndarray, side: int = 400) -> np.ndarray:
    """``image`` with its longer side at most ``side`` (a cheaper pyramid)."""
    scale = min(1.0, side / max(image.shape[:2]))
    size = (round(image.shape[1] * scale), round(image.shape[0] * scale))
    return cv2.resize(image, size, interpolation=cv2.INTER_AREA) if scale < 1 else image


@pytest.fixture(scope="module")
def photos() -> dict[str, np.ndarray]:
    found = {"astronaut": data.astronaut(), "hopper": hopper(), "group": group_photo(),
             "coffee": data.coffee(), **sample_pictures(8)}
    return {name: shrunk(photo) for name, photo in found.items()}


@pytest.fixture(scope="module")
def engines() -> tuple[MTCNN, TorchMTCNN]:
    return MTCNN(), TorchMTCNN(device="cpu")


@pytest.fixture(scope="module")
def opencv_faces(photos, engines) -> dict[str, tuple]:
    """Today's faces: the OpenCV engine on each photo alone."""
    return {name: engines[0].detect(photo) for name, photo in photos.items()}


def assert_same_faces(expected: tuple, found: tuple, name: str) -> None:
    assert len(found[0]) == len(expected[0]), f"{name}: {len(found[0])} faces, not {len(expected[0])}"
    if len(expected[0]):
        np.testing.assert_allclose(found[0], expected[0], atol=PIXEL, err_msg=name)
        np.testing.assert_allclose(found[2], expected[2], atol=PIXEL, err_msg=name)
        np.testing.assert_allclose(found[1], expected[1], atol=1e-3, err_msg=name)


@pytest.mark.parametrize("name, size", [("pnet", (31, 25)), ("pnet", (40, 57)),
                                        ("rnet", (24, 24)), ("onet", (48, 48))])
def test_each_network_equals_opencvs_on_the_same_input(name, size):
    """Odd and even P-Net sizes (ceil-mode pooling), and the dense layers' input order."""
    batch = np.random.default_rng(0).standard_normal((3, *size, 3)).astype(np.float32)
    net = cv2.dnn.readNetFromONNX(str(mtcnn_weight_files()[name]))
    net.setInput(np.ascontiguousarray(batch.transpose(0, 2, 1, 3)))  # the graphs' transposed input
    expected = net.forward(net.getUnconnectedOutLayersNames())
    with torch.inference_mode():
        found = torch_nets("cpu")[name](torch.from_numpy(batch).permute(0, 3, 1, 2))
    if name == "pnet":  # maps back upright; P-Net's face probability alone
        expected = [expected[0].transpose(0, 2, 1, 3), expected[1].transpose(0, 2, 1, 3)[..., 1]]
    assert len(found) == len(expected)
    for want, got in zip(expected, found):
        assert tuple(got.shape) == want.shape
        np.testing.assert_allclose(got.numpy(), want, atol=1e-4)


@pytest.mark.parametrize("mode", ["union", "min"])
def test_nms_on_the_overlap_matrix_keeps_what_greedy_nms_keeps(mode):
    """Chains of overlapping boxes (where one round of matrix suppression is not greedy NMS),
    ties and scattered boxes."""
    rng = np.random.default_rng(1)
    for n in (1, 2, 30, 300):
        corners = rng.uniform(0, 200, (n, 2)).round()
        sides = rng.uniform(5, 60, (n, 1)).round()
        boxes = np.concatenate([corners, corners + sides], axis=1)
        chain = np.arange(n)[:, None] * np.array([[4.0, 0, 4, 0]]) + [0, 0, 20, 20]
        scores = rng.choice([0.7, 0.8, 0.9, 0.95], n).astype(np.float32)
        for candidates in (boxes, chain):
            for threshold in (0.3, 0.5, 0.7):
                want = _nms_loop(candidates, np.argsort(scores)[::-1], threshold, mode)
                np.testing.assert_array_equal(_nms(candidates, scores, threshold, mode), want)


def test_torch_finds_opencvs_faces_one_by_one_and_in_one_batch(photos, engines, opencv_faces):
    torch_mtcnn = engines[1]
    expected = opencv_faces
    assert sum(len(found[0]) for found in expected.values()) >= 10  # faces to compare
    for name, photo in photos.items():
        assert_same_faces(expected[name], torch_mtcnn.detect(photo), name)
    batched = torch_mtcnn.detect_batch(list(photos.values()))  # mixed sizes in one call
    for (name, want), got in zip(expected.items(), batched):
        assert_same_faces(want, got, name)


def test_the_device_pyramid_is_opencvs_resize_and_finds_the_same_faces(photos, opencv_faces):
    """The pyramid CUDA builds (``area_matrix`` products), here on the CPU."""
    image = photos["group"]
    for scale in (0.6, 0.3016, 0.0762):
        want = _level(image, scale)
        got = _device_level(torch.from_numpy(image[None]).float(), want.shape[:2])[0].numpy()
        assert np.abs(got - want).max() <= 1 and (got != want).mean() < 1e-4
    on_device = TorchMTCNN(device="cpu", device_pyramid=True)
    names = [name for name in photos if len(opencv_faces[name][0])][:5]
    for name, got in zip(names, on_device.detect_batch([photos[name] for name in names])):
        assert_same_faces(opencv_faces[name], got, name)


def test_video_frames_in_one_batch_equal_opencv_frame_by_frame_and_refine_too(engines):
    opencv, torch_mtcnn = engines
    frames = video_frames(6)
    expected = [opencv.detect(frame) for frame in frames]
    assert all(len(found[0]) == 1 for found in expected)
    for k, (want, got) in enumerate(zip(expected, torch_mtcnn.detect_batch(frames))):
        assert_same_faces(want, got, f"frame {k}")
    boxes = [want[0] for want in expected[:-1]]  # each frame's box, followed on the next frame
    refined = zip(opencv.refine(frames[1:], boxes), torch_mtcnn.refine(frames[1:], boxes))
    for k, (want, got) in enumerate(refined):
        assert_same_faces(want, got, f"refined frame {k + 1}")


def test_detect_faces_runs_on_the_engine_asked_for_and_device_is_not_in_the_fingerprint(
        monkeypatch):
    cpu = DetectFaces(device="cpu")
    assert cpu.describe() == DetectFaces(device="auto").describe() == DetectFaces().describe()
    assert "device" not in VideoFaces(device="cpu").params
    assert type(make_mtcnn("cpu", 20, (0.6, 0.7, 0.7))) is MTCNN  # CPU_ENGINE
    monkeypatch.setenv("PRECACHE_MTCNN_CPU_ENGINE", "torch")
    cpu.setup()
    assert isinstance(cpu.detector, TorchMTCNN) and cpu.detector.device.type == "cpu"
    face = cpu({"key": "a", "image": data.astronaut()[::2, ::2]})
    assert 85 < face["box"][0] < 95 and 30 < face["box"][1] < 45
    monkeypatch.setenv("PRECACHE_MTCNN_CPU_ENGINE", "onnx")
    with pytest.raises(ValueError, match="PRECACHE_MTCNN_CPU_ENGINE must be torch or opencv"):
        DetectFaces(device="cpu").setup()


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.path.exists("/dev/nvidiactl")
                    or os.path.exists("/proc/driver/nvidia"),
                    reason="an NVIDIA driver here (or not Linux): auto asks torch")
def test_auto_without_a_gpu_keeps_torch_out_of_the_worker():
    """A stage-1 worker on a CPU machine sets up DetectFaces(device="auto") without importing
    torch (its start-up and memory in every worker, for an engine not used there)."""
    code = ("import sys; from skimage import data\n"
            "from precache.processing.ops.face_detect import DetectFaces\n"
            "op = DetectFaces(); op.setup(); op({'key': 'a', 'image': data.astronaut()[::4, ::4]})\n"
            "assert 'torch' not in sys.modules, 'auto imported torch'")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_bad_or_absent_device_is_one_line_naming_the_fix():
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda"):
        DetectFaces(device="gpu")
    faces = load_pipeline("faces")
    with pytest.raises(PipelineError, match="device must be auto, cpu or cuda.*not 'tpu'"):
        faces.build_ops(faces.resolve_params({"device": "tpu"}))
    video = load_pipeline("video-faces")
    missing = "cuda:99" if torch.cuda.is_available() else "cuda"
    with pytest.raises(PipelineError, match=f"device={missing} .*use device=cpu or device=auto"):
        video.build_ops(video.resolve_params({"device": missing}))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")
def test_on_cuda_the_faces_are_opencvs(photos, engines, opencv_faces):
    opencv = engines[0]
    gpu = TorchMTCNN(device="cuda")
    for (name, photo), got in zip(photos.items(), gpu.detect_batch(list(photos.values()))):
        assert_same_faces(opencv_faces[name], got, name)
    frames = video_frames(8)
    for k, got in enumerate(gpu.detect_batch(frames)):
        assert_same_faces(opencv.detect(frames[k]), got, f"frame {k}")
