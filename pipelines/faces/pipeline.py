"""``faces``: everything training-time face augmentation needs, computed once per face.

    precache run faces --input photos/ --output cache/
    precache run faces --input frames.txt --output cache/ --set size=128 --set keep=all
    precache run faces -i photos/ -o cache/ --set labels=metadata.json --set image_codec=jpeg

Videos: the ``video-faces`` pipeline (``pipelines/faces/video.py``) shares these ops.

Ops: decode -> MTCNN detection -> square crop with a 30% margin -> MediaPipe face mesh on the
crop -> convex hulls of the facial regions. Columns (see ``precache.faces.topology``):
``image`` (size x size x 3 RGB uint8), ``box`` (x0, y0, x1, y1, source pixels, before the
margin), ``score``, ``landmarks5`` (5 x 2, crop pixels), ``crop_affine`` (2 x 3, source -> crop),
``mesh`` (468 x 2, crop pixels, NaN if missing), ``has_mesh``, ``regions`` (R x K x 2 hulls),
``region_sizes``, ``orig_height``, ``orig_width``, ``label`` (the first folder under the input,
``""`` at the top level, or from a metadata file: ``precache.processing.ops.labels``; none with
``labels=none``). A photo without a face is skipped (``no_face``). With ``image_codec=jpeg`` or
``webp`` the crop is stored encoded at ``quality`` and ``CachedDataset`` decodes it.
"""

from __future__ import annotations

from precache.processing.ops import (DEFAULT_MAX_PIXELS, IMAGE_EXTENSIONS, CropFace, DecodeImage,
                                     DetectFaces, EncodeImage, FaceMesh, FaceRegions, Labels, Op)
from precache.processing.pipeline import Pipeline


def make_ops(
    size: int = 224,
    margin: float = 0.3,
    min_face: int = 20,
    thresholds: tuple[float, float, float] = (0.6, 0.7, 0.7),
    keep: str = "largest",
    detect_size: int = 1024,
    mesh_confidence: float = 0.5,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    labels: str = "folder",
    image_codec: str = "raw",
    quality: int = 95,
    device: str = "auto",
    detector: str = "mtcnn",
    tile: int = 640,
    mesh_roi: str = "detect",
) -> list[Op]:
    """Label (``labels``), detect (``min_face`` pixels and up, on a copy at most ``detect_size``
    pixels long; ``keep`` = largest or all), crop ``size`` pixels with ``margin`` on each side,
    mesh and regions, store the crop as ``image_codec`` (raw, jpeg, webp). ``detector``: mtcnn
    or blazeface (~7x faster on a CPU, 0.96 of MTCNN's faces of 40 px and more); MTCNN runs on
    ``device`` (auto, cpu, cuda: ``DetectFaces``; not in the fingerprint). Opt-in speed, both
    CPU: ``tile=0`` (blazeface searches only the whole photo, not also its 640 px tiles) and
    ``mesh_roi=landmarks`` (the mesh placed by the detector's points: ``FaceMesh(roi=)``)."""
    return [
        Labels(labels=labels),
        DecodeImage(max_pixels=max_pixels),
        DetectFaces(min_face=min_face, thresholds=thresholds, keep=keep,
                    detect_size=detect_size, device=device, detector=detector,
                    tile=tile),
        CropFace(size=size, margin=margin),
        FaceMesh(min_confidence=mesh_confidence, roi=mesh_roi),
        FaceRegions(),
        EncodeImage(codec=image_codec, quality=quality),
    ]


pipeline = Pipeline(
    name="faces",
    make_ops=make_ops,
    extensions=IMAGE_EXTENSIONS,
    description="MTCNN face crops with a margin, 5-point and 468-point landmarks, region hulls",
)
