"""BlazeFace vs MTCNN: speed in the same run, recall, 5-point error, threads, the faces pipeline.

    .venv/bin/python tests/benchmarks/bench_blazeface.py [--count 300] [--repeat 2] [--size 640]
        [--skip threads,pipeline,variants,points]

Photos: ``data/make_samples.py``'s set (real faces from scikit-image and matplotlib, single faces
and groups of 2-4 pasted at 40 px and up, and faceless photos; face boxes labelled) made in a
temporary folder and scaled so the longer side is ``--size`` pixels (``--size 0``: as made,
240-760 px, as the ``faces`` pipeline sees them, where BlazeFace also searches tiles of 640 px in
the larger ones), plus a mosaic of
scikit-image's ``lfw_subset()`` (the 100 labelled 25 x 25 LFW faces, tight crops without hair or
chin, scaled to 48-120 px on a background photo, 12 to a photo).

1. Detection, photos/s, photo by photo in rotating order, each photo's best of ``--repeat``, in
   this process, one thread: ``precache.faces.mtcnn.MTCNN`` (OpenCV, as it is now), the same
   file as of ``df506cf`` (the issue's "today", as ``bench_mtcnn.py`` loads it) and
   ``BlazeFace`` (its defaults).
2. Recall: the share of MTCNN's faces of at least 40 px (shorter side) that BlazeFace finds
   (IoU >= 0.5), per photo set; also each detector's recall against the labelled boxes of at
   least 40 px (IoU >= 0.4: labelled boxes run forehead to chin, the detectors' differ) and their
   false positives (a box with IoU < 0.3 against every label and every MTCNN face), for the
   defaults and other settings (``variants``).
3. Points (``points``): the error of BlazeFace's 5 points against MTCNN's on the same face, as a
   fraction of MTCNN's box side, median / 95th percentile / max, three ways: O-Net on the
   BlazeFace box (what ``BlazeFace`` does), BlazeFace's own keypoints (eyes and nose as they
   are, mouth corners = mouth centre -/+ 0.47 x the eye-to-eye vector, the factor fitted on this
   set), the face mesh's (MediaPipe's FaceMesh on the whole photo: eye-ring centres, nose tip
   1, mouth corners 61 and 291); and the cost of each per photo.
4. Threads (``threads``): two processes on the 2 cores, each running BlazeFace with 1 or 2
   TFLite threads over the photos: photos/s of both together.
5. Pipeline (``pipeline``): the ``faces`` pipeline's ops (decode, detect at ``detect_size=640``,
   crop, mesh, regions) in a plain loop over the sample files, DetectFaces' detector set to
   OpenCV MTCNN or BlazeFace: inputs/s (best of ``--repeat``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # spawned processes inherit sys.path, so they find it too

import cv2  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402
from skimage import data  # noqa: E402

from precache.faces.blazeface import BlazeFace  # noqa: E402
from precache.faces.mtcnn import MTCNN  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_mtcnn import BASELINE, load_baseline  # noqa: E402  (sibling scripts, not a package)
from bench_stage1 import load_make_samples  # noqa: E402

Found = tuple[np.ndarray, np.ndarray, np.ndarray]
MIN_SIDE = 40
MOUTH_K = 0.47  # mouth corner = mouth centre -/+ MOUTH_K x eye vector, fitted on the sample set


# --- Photos -----------------------------------------------------------------------------------


def scaled(image: np.ndarray, size: int) -> tuple[np.ndarray, float]:
    """``image`` scaled so its longer side is ``size`` pixels (0: as it is), and the scale."""
    if size == 0:
        return image, 1.0
    s = size / max(image.shape[:2])
    new = (round(image.shape[1] * s), round(image.shape[0] * s))
    return cv2.resize(image, new, interpolation=cv2.INTER_AREA if s < 1 else cv2.INTER_LINEAR), s


def sample_photos(folder: Path, count: int, size: int) -> list[tuple[str, np.ndarray, list]]:
    """``make_samples`` pictures at ``size`` px with their labelled boxes, scaled alike."""
    load_make_samples()(folder / "samples", count)
    truth = json.loads((folder / "samples_truth.json").read_text())
    photos = []
    for name in sorted(truth):
        image, s = scaled(np.asarray(Image.open(folder / "samples" / name).convert("RGB")), size)
        photos.append((name, image, [[(v + 0.5) * s - 0.5 for v in box] for box in truth[name]]))
    return photos


def lfw_photos() -> list[tuple[str, np.ndarray, list]]:
    """The 100 LFW faces of ``skimage.data.lfw_subset()``, 48-120 px, 12 to a 640 x 480 photo."""
    faces = data.lfw_subset()[:100]
    rng = np.random.default_rng(0)
    background = cv2.resize(data.coffee(), (640, 480)) // 2 + 64
    photos = []
    for first in range(0, 100, 12):
        canvas, boxes = background.copy(), []
        for k, face in enumerate(faces[first:first + 12]):
            side = int(rng.integers(48, 120))
            pixels = cv2.resize((face * 255).astype(np.uint8), (side, side), interpolation=cv2.INTER_CUBIC)
            y, x = 20 + (k // 4) * 155, 15 + (k % 4) * 158
            canvas[y:y + side, x:x + side] = pixels[..., None]
            boxes.append([x - 0.5, y - 0.5, x + side - 0.5, y + side - 0.5])
        photos.append((f"lfw_{first // 12}", canvas, boxes))
    return photos


# --- Measures ---------------------------------------------------------------------------------


def iou(a: np.ndarray, b: np.ndarray) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    return inter / max((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter, 1e-9)


def best_match(box: np.ndarray, boxes: np.ndarray) -> tuple[int, float]:
    overlaps = [iou(box, b) for b in boxes]
    return (int(np.argmax(overlaps)), max(overlaps)) if overlaps else (-1, 0.0)


def big(boxes: Any) -> list[np.ndarray]:
    return [np.asarray(b) for b in boxes if min(b[2] - b[0], b[3] - b[1]) >= MIN_SIDE]


def recall(photos: list, reference: list[Found], found: list[Found]) -> dict[str, Any]:
    """``found`` against MTCNN's (``reference``) faces >= 40 px and against the labels."""
    hits = total = label_hits = mtcnn_label_hits = labels = false = 0
    for (_, _, truth), ref, got in zip(photos, reference, found):
        for box in big(ref[0]):
            total += 1
            hits += best_match(box, got[0])[1] >= 0.5
        for box in big(truth):
            labels += 1
            label_hits += best_match(box, got[0])[1] >= 0.4
            mtcnn_label_hits += best_match(box, ref[0])[1] >= 0.4
        known = list(ref[0]) + [np.asarray(t) for t in truth]
        false += sum(best_match(b, np.asarray(known))[1] < 0.3 for b in got[0])
    return {"recall": hits / max(total, 1), "hits": hits, "faces": total,
            "label_recall": label_hits / max(labels, 1), "mtcnn_label_recall": mtcnn_label_hits / max(labels, 1),
            "labels": labels, "false": false}


def timed(function: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = function()
    return time.perf_counter() - start, out


def point_errors(reference: list[Found], boxes: list[np.ndarray], points: list[np.ndarray]
                 ) -> np.ndarray:
    """Per matched face (IoU >= 0.5 with an MTCNN face >= 40 px): the 5 point errors / box side."""
    errors = []
    for ref, got_boxes, got_points in zip(reference, boxes, points):
        for box, ref_points in zip(ref[0], ref[2]):
            if min(box[2] - box[0], box[3] - box[1]) < MIN_SIDE:
                continue
            k, overlap = best_match(box, got_boxes)
            if overlap >= 0.5:
                errors.append(np.linalg.norm(got_points[k] - ref_points, axis=1) / (box[2] - box[0]))
    return np.asarray(errors, dtype=np.float64).reshape(-1, 5)


def keypoint_points(images: list[np.ndarray]) -> tuple[float, list, list]:
    """BlazeFace's own keypoints (MediaPipe's FaceDetection, full range) mapped to 5 points."""
    from mediapipe.python.solutions.face_detection import FaceDetection

    graph = FaceDetection(min_detection_confidence=0.5, model_selection=1)
    boxes, points = [], []
    start = time.perf_counter()
    for image in images:
        height, width = image.shape[:2]
        b_list, p_list = [], []
        for found in graph.process(image).detections or []:
            b = found.location_data.relative_bounding_box
            b_list.append([b.xmin * width, b.ymin * height, (b.xmin + b.width) * width,
                           (b.ymin + b.height) * height])
            kp = np.array([(k.x * width, k.y * height) for k in found.location_data.relative_keypoints])
            eyes = kp[1] - kp[0]
            p_list.append(np.stack([kp[0], kp[1], kp[2], kp[3] - MOUTH_K * eyes, kp[3] + MOUTH_K * eyes]) - 0.5)
        boxes.append(np.asarray(b_list).reshape(-1, 4) - 0.5)
        points.append(np.asarray(p_list).reshape(-1, 5, 2))
    return (time.perf_counter() - start) / len(images), boxes, points


def mesh_points(images: list[np.ndarray]) -> tuple[float, list, list]:
    """5 points from MediaPipe's face mesh run on the whole photo (box: the mesh's extent)."""
    from mediapipe.python.solutions import face_mesh_connections as fmc
    from mediapipe.python.solutions.face_mesh import FaceMesh

    right_eye = sorted({i for edge in fmc.FACEMESH_RIGHT_EYE for i in edge})  # image-left
    left_eye = sorted({i for edge in fmc.FACEMESH_LEFT_EYE for i in edge})
    graph = FaceMesh(static_image_mode=True, max_num_faces=8, refine_landmarks=False)
    boxes, points = [], []
    start = time.perf_counter()
    for image in images:
        height, width = image.shape[:2]
        b_list, p_list = [], []
        for face in graph.process(image).multi_face_landmarks or []:
            mesh = np.array([(p.x * width, p.y * height) for p in face.landmark]) - 0.5
            b_list.append([*mesh.min(axis=0), *mesh.max(axis=0)])
            p_list.append(np.stack([mesh[right_eye].mean(axis=0), mesh[left_eye].mean(axis=0),
                                    mesh[1], mesh[61], mesh[291]]))
        boxes.append(np.asarray(b_list).reshape(-1, 4))
        points.append(np.asarray(p_list).reshape(-1, 5, 2))
    return (time.perf_counter() - start) / len(images), boxes, points


def thread_worker(threads: int, images: list[np.ndarray], passes: int, queue: Any) -> None:
    detector = BlazeFace(threads=threads)
    for image in images[:5]:
        detector.detect(image)
    start = time.perf_counter()
    for _ in range(passes):
        for image in images:
            detector.detect(image)
    queue.put((start, time.perf_counter(), passes * len(images)))


def two_processes(threads: int, images: list[np.ndarray], passes: int) -> float:
    """Photos/s of two processes together, each over every photo ``passes`` times."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=thread_worker, args=(threads, images, passes, queue))
               for _ in range(2)]
    for worker in workers:
        worker.start()
    results = [queue.get() for _ in workers]
    for worker in workers:
        worker.join()
    span = max(r[1] for r in results) - min(r[0] for r in results)
    return sum(r[2] for r in results) / span


def faces_ops(detector: Any) -> list[Any]:
    """The faces pipeline's ops (crops of 128 px, detection at 640 px), set up, with
    DetectFaces' detector set to ``detector``."""
    from precache.processing.ops import DetectFaces
    from precache.processing.pipeline import load_pipeline

    ops = load_pipeline("faces").build_ops({"size": 128, "detect_size": 640})
    for op in ops:
        if isinstance(op, DetectFaces):
            op.detector = detector
        else:
            op.setup()
    return ops


def run_file(ops: list[Any], path: Path) -> float:
    """Seconds to take one file through ``ops`` as the runner does (lists fan out, Skip drops)."""
    from precache.processing.ops import Skip

    start = time.perf_counter()
    live = [{"key": path.name, "source_key": path.name, "source_hash": "", "locator": str(path),
             "data": path.read_bytes()}]
    for op in ops:
        produced = []
        for sample in live:
            try:
                out = op(sample)
            except Skip:
                out = []
            produced.extend(out if isinstance(out, list) else [out])
        live = produced
    return time.perf_counter() - start


def pipeline_rates(files: list[Path], detectors: dict[str, Any], repeat: int) -> dict[str, float]:
    """Inputs/s of the faces pipeline with each detector: file by file, the order alternating,
    each file's best of ``repeat`` kept."""
    pipelines = {name: faces_ops(detector) for name, detector in detectors.items()}
    seconds = {name: np.full(len(files), np.inf) for name in pipelines}
    for rep in range(repeat):
        for k, path in enumerate(files):
            names = list(pipelines)[::1 if (k + rep) % 2 else -1]
            for name in names:
                seconds[name][k] = min(seconds[name][k], run_file(pipelines[name], path))
    return {name: len(files) / s.sum() for name, s in seconds.items()}


def summary(errors: np.ndarray) -> str:
    if not len(errors):
        return "no matched faces"
    return (f"median {np.median(errors, axis=0).round(3).tolist()}  "
            f"p95 {np.percentile(errors, 95, axis=0).round(3).tolist()}  max {errors.max():.3f}  "
            f"({len(errors)} faces)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--size", type=int, default=640,
                        help="the sample photos' longer side; 0: as made (240-760 px, as the faces "
                             "pipeline sees them: BlazeFace then also searches tiles of 640 px in "
                             "the 109 of 300 that are larger)")
    parser.add_argument("--skip", default="", help="comma-separated: variants,points,threads,pipeline")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    cv2.setNumThreads(1)
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as temp:
        folder = Path(temp)
        sets = {"samples": sample_photos(folder, args.count, args.size), "lfw": lfw_photos()}
        photos = sets["samples"]
        images = [image for _, image, _ in photos]
        mtcnn, blaze = MTCNN(), BlazeFace()
        for image in images[:3]:
            mtcnn.detect(image), blaze.detect(image)

        # 1. Speed: each photo through each detector, the order rotating, each photo's best of
        # the repeats kept (a busy machine only ever slows a call down).
        detectors = {"MTCNN": mtcnn, f"MTCNN@{BASELINE}": load_baseline(BASELINE).MTCNN(),
                     "BlazeFace": blaze}
        ms = {name: np.full(len(images), np.inf) for name in detectors}
        outputs: dict[str, list[Found]] = {name: [] for name in detectors}
        for rep in range(args.repeat):
            for k, image in enumerate(images):
                names = list(detectors)
                shift = (k + rep) % len(names)
                for name in names[shift:] + names[:shift]:
                    seconds, out = timed(lambda: detectors[name].detect(image))
                    ms[name][k] = min(ms[name][k], seconds * 1e3)
                    if rep == 0:
                        outputs[name].append(out)
        reference, found = outputs["MTCNN"], outputs["BlazeFace"]
        mtcnn_s, blaze_s = ms["MTCNN"].sum() / 1e3, ms["BlazeFace"].sum() / 1e3
        print(f"\n1. detection on {len(images)} sample photos at {args.size or 'their own'} px, one thread, "
              f"photo by photo in rotating order, best of {args.repeat} each:")
        for name in detectors:
            seconds = ms[name].sum() / 1e3
            print(f"   {name:16s} {len(images) / seconds:7.1f} photos/s  {seconds / len(images) * 1e3:6.1f} ms"
                  + (f"   BlazeFace = {seconds / blaze_s:.1f}x this (goal: 8x)" if name != "BlazeFace" else ""))

        # 2. Recall, the defaults and other settings.
        references = {"samples": reference, "lfw": [mtcnn.detect(image) for _, image, _ in sets["lfw"]]}
        variants: dict[str, dict[str, Any]] = {"defaults": {}}
        if "variants" not in skip:
            variants.update({
                "thresholds=(0.5, 0.3, 0.7)": {"thresholds": (0.5, 0.3, 0.7)},
                "thresholds=(0.05, 0.3, 0.7)": {"thresholds": (0.05, 0.3, 0.7)},
                "thresholds=(0.01, 0.3, 0.7)": {"thresholds": (0.01, 0.3, 0.7)},
                "thresholds=(0.02, 0.0, 0.7) (no R-Net)": {"thresholds": (0.02, 0.0, 0.7)},
                "tile=400": {"tile": 400},
                "tile=0 (the whole photo only)": {"tile": 0},
                "model=short": {"model": "short"},
            })
        print(f"\n2. recall of MTCNN's faces >= {MIN_SIDE} px (IoU >= 0.5); label recall (IoU >= 0.4) "
              f"BlazeFace / MTCNN; false positives; speed as x MTCNN's (each setting timed photo by "
              f"photo alternating with the defaults, best of {args.repeat}, scaled by part 1)")
        for name, params in variants.items():
            detector = blaze if not params else BlazeFace(**params)
            for set_name, set_photos in sets.items():
                mine, theirs = np.full(len(set_photos), np.inf), np.full(len(set_photos), np.inf)
                got: list[Found] = []
                for rep in range(args.repeat):
                    for k, (_, image, _) in enumerate(set_photos):
                        seconds, out = timed(lambda: detector.detect(image))
                        mine[k] = min(mine[k], seconds)
                        theirs[k] = min(theirs[k], timed(lambda: blaze.detect(image))[0])
                        if rep == 0:
                            got.append(out)
                speed = mtcnn_s / blaze_s * theirs.sum() / mine.sum()
                r = recall(set_photos, references[set_name], got)
                print(f"   {name:38s} {set_name:8s} recall {r['recall']:.3f} ({r['hits']}/{r['faces']})  "
                      f"labels {r['label_recall']:.3f} / {r['mtcnn_label_recall']:.3f} of {r['labels']}  "
                      f"false {r['false']}  {speed:4.1f}x MTCNN")

        # 3. Points.
        if "points" not in skip:
            print("\n3. 5-point error / MTCNN box side (image-left eye, image-right eye, nose, "
                  "mouth left, mouth right), faces matched with IoU >= 0.5:")
            errors = point_errors(reference, [f[0] for f in found], [f[2] for f in found])
            onet_ms = blaze_s / len(images) * 1e3
            print(f"   O-Net on BlazeFace's box (BlazeFace's detect, {onet_ms:.1f} ms a photo in all): {summary(errors)}")
            seconds, boxes, points = keypoint_points(images)
            print(f"   BlazeFace keypoints (graph alone {seconds * 1e3:.1f} ms a photo): "
                  f"{summary(point_errors(reference, boxes, points))}")
            seconds, boxes, points = mesh_points(images)
            print(f"   face mesh on the photo ({seconds * 1e3:.1f} ms a photo): "
                  f"{summary(point_errors(reference, boxes, points))}")

        # 4. Threads.
        if "threads" not in skip:
            print("\n4. two processes at once, BlazeFace photos/s together:")
            for threads in (1, 2):
                rate = two_processes(threads, images[:100], passes=2)
                print(f"   {threads} TFLite thread(s) each: {rate:6.1f} photos/s")

        # 5. The faces pipeline.
        if "pipeline" not in skip:
            files = sorted((folder / "samples").iterdir())
            rates = pipeline_rates(files, {"MTCNN": mtcnn, "BlazeFace": blaze}, args.repeat)
            print(f"\n5. faces pipeline (decode, detect at 640 px, crop 128, mesh, regions), "
                  f"{len(files)} files as made (240-800 px), one process, file by file "
                  f"alternating, best of {args.repeat} each:")
            print(f"   MTCNN {rates['MTCNN']:.1f} inputs/s, BlazeFace {rates['BlazeFace']:.1f} inputs/s"
                  f" = {rates['BlazeFace'] / rates['MTCNN']:.1f}x (goal: 8x)")
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
