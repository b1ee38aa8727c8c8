"""``video-faces``: tracked face crops from videos, with labels, one row per face frame.

    precache run video-faces --input data/videos --output data/video_cache --set size=128
    precache run video-faces -i dfdc/ -o cache/ --set labels=dfdc/metadata.json --set image_codec=jpeg
    precache run video-faces -i clips/ -o cache/ --set fps=2 --set keep=all --set track_box=smooth
    precache run video-faces -i lectures/ -o cache/ --set every=1 --set max_frames=2000

Inputs: ``.mp4 .avi .mov .mkv .webm`` (decoded with PyAV, no system FFmpeg). Ops: label ->
decode the sampled frames (``frames`` evenly spaced in time, or ``every`` k-th frame, or ``fps``
per second, at most ``max_frames`` of them) -> MTCNN on every ``detect_every``-th sampled frame,
O-Net between -> IoU tracks (``keep`` the largest or all) -> square crop with a 30% margin ->
MediaPipe face mesh (IMAGE mode, per frame) -> region hulls -> the crop stored ``raw``,
``jpeg`` or ``webp``.

Rows: one per (video, track, sampled frame), key ``<video>#t<track>#f<frame index>``. Columns:
those of ``faces`` (``image``, ``box`` and ``landmarks5`` and ``crop_affine``, ``mesh``,
``regions``, ...), plus ``video``, ``track``, ``frame_index``, ``time_s``, ``detected``,
``fps``, ``duration_s``, ``frame_count``, ``warning`` (see ``precache.processing.ops.video_faces``), and
``label`` (``original`` too with a metadata file). Stage 2: ``precache.loading.datasets.video_clips``.

Memory: a video is decoded, detected, tracked and cropped as a stream, so a worker holds
``detect_every`` + 3 full frames and the crops, however long the video. ``every``/``fps``
sampling keeps the first ``max_frames`` (512) sampled frames of a video and stops decoding
there, with a ``warning`` on its rows ("sampled 512 of about 15,000 frames (every=1):
max_frames=512 kept the first 20.5 s of 600.0 s; ..."); ``max_frames=0`` lifts the cap.
"""

from __future__ import annotations

from precache.processing.ops import (MAX_FRAMES, VIDEO_EXTENSIONS, EncodeImage, FaceMesh,
                                     FaceRegions, Labels, Op, VideoFaces)
from precache.processing.pipeline import Pipeline


def make_ops(
    frames: int = 32,
    every: int = 0,
    fps: float = 0.0,
    max_frames: int = MAX_FRAMES,
    detect_every: int = 8,
    keep: str = "largest",
    track_box: str = "frame",
    size: int = 224,
    margin: float = 0.3,
    min_face: int = 20,
    thresholds: tuple[float, float, float] = (0.6, 0.7, 0.7),
    detect_size: int = 640,
    mesh_confidence: float = 0.5,
    decode_timeout_s: float = 120.0,
    labels: str = "folder",
    image_codec: str = "raw",
    quality: int = 95,
    device: str = "auto",
    detector: str = "mtcnn",
    mesh_roi: str = "detect",
) -> list[Op]:
    """Label, sample ``frames`` (or ``every`` k-th frame, or ``fps`` per second, then at most
    ``max_frames`` per video: the first ones, with a warning; 0: no cap), detect every
    ``detect_every`` sampled frames, track (``keep`` largest or all; ``track_box`` frame,
    smooth or union), crop ``size`` px with ``margin``, mesh, regions, store as ``image_codec``.
    ``detector``: mtcnn or blazeface (``DetectFaces``); MTCNN runs on ``device`` (auto, cpu,
    cuda); ``mesh_roi=landmarks``: the mesh placed by the detector's points, faster
    (``FaceMesh(roi=)``). A video that takes over
    ``decode_timeout_s`` to decode fails alone."""
    return [
        Labels(labels=labels),
        VideoFaces(frames=frames, every=every, fps=fps, max_frames=max_frames,
                   detect_every=detect_every, keep=keep,
                   track_box=track_box, min_face=min_face, thresholds=thresholds,
                   detect_size=detect_size, size=size, margin=margin,
                   decode_timeout_s=decode_timeout_s, device=device, detector=detector),
        FaceMesh(min_confidence=mesh_confidence, roi=mesh_roi),
        FaceRegions(),
        EncodeImage(codec=image_codec, quality=quality),
    ]


pipeline = Pipeline(
    name="video-faces",
    make_ops=make_ops,
    extensions=VIDEO_EXTENSIONS,
    description="videos -> sampled frames, tracked MTCNN face crops with labels, landmarks, "
    "mesh and region hulls; one row per face frame",
)
