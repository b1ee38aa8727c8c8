"""A test pipeline shaped like a video-faces cache, without decoding any video: each input is a
small JSON file ``{"label": "fake", "tracks": {"0": 12, "1": 5}}`` and gives one row per
(track, frame), keyed ``<video>#t<track>#f<frame>``.

Each row's 8 x 8 ``image`` encodes where it came from (see ``pixel_code``): channel 0 is the
video's number (the digits of its file name), channel 1 the track, channel 2 the frame index
(mod 256), so a test can tell which frame a loader returned.
"""

from __future__ import annotations

import json
import re

import numpy as np

from precache.processing.ops import FunctionOp, Op
from precache.processing.pipeline import Pipeline

FPS = 25.0  # time_s = frame / FPS


def video_number(video: str) -> int:
    """The number in a video key's file name (``fake/v03.json`` -> 3)."""
    digits = re.findall(r"\d+", video.rsplit("/", 1)[-1])
    return int(digits[-1]) if digits else 0


def pixel_code(video: str, track: int, frame: int) -> tuple[int, int, int]:
    """The RGB value every pixel of that row's image has."""
    return video_number(video) % 256, track % 256, frame % 256


def face_rows(sample: dict) -> list[dict]:
    spec = json.loads(sample["data"])
    rows = []
    for track_name, count in sorted(spec["tracks"].items(), key=lambda kv: int(kv[0])):
        track = int(track_name)
        for frame in range(int(count)):
            image = np.empty((8, 8, 3), dtype=np.uint8)
            image[...] = pixel_code(sample["key"], track, frame)
            landmarks = np.array([[2, 3], [5, 3], [4, 4], [3, 6], [5, 6]], dtype=np.float32)
            rows.append({**sample, "key": f"{sample['key']}#t{track}#f{frame}",
                         "video": sample["key"], "track": np.int32(track),
                         "frame_index": np.int64(frame), "time_s": frame / FPS,
                         "label": str(spec["label"]), "image": image,
                         "landmarks5": landmarks + np.float32(frame % 3)})
    return rows


def make_ops(codec: str = "raw") -> list[Op]:
    """``codec="jpeg"`` stores the images as JPEG, as ``--set image_codec=jpeg`` does."""
    from precache.processing.ops.image import EncodeImage

    return [FunctionOp(face_rows)] + ([EncodeImage(codec=codec, quality=95)] if codec != "raw"
                                      else [])


pipeline = Pipeline(name="clips", make_ops=make_ops, extensions=(".json",),
                    description="rows of a video-faces cache from tiny JSON descriptions")
