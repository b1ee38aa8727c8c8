"""Decode the sampled frames of a video with PyAV: by timestamp, upright, within a time limit.

PyAV's wheels bundle FFmpeg, so no system FFmpeg is needed. Frames are chosen by their
presentation time, not their number, so a variable-frame-rate video is sampled evenly in time:

* ``frames=N``: N frames evenly spaced over the duration (the middle of N equal slots);
* ``every=k``: every k-th decoded frame;
* ``fps=x``: one frame each 1/x seconds.

Every frame is decoded (H.264 needs its references) but only the sampled ones are converted to
RGB, which is most of the cost of ``cv2.VideoCapture.read()``. Rotation metadata (a phone's
display matrix) is applied. Damage is reported, not hidden: packets that fail to decode are
skipped and counted, a stream that ends before its header's duration is sampled again over what
decoded, and each becomes a warning stored with the rows. A video that takes longer than
``timeout_s`` to decode fails alone with ``VideoTimeout``.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

__all__ = ["VideoError", "VideoTimeout", "SampledFrames", "read_frames", "VIDEO_EXTENSIONS",
           "sample_targets"]

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mov", ".mkv", ".webm")

MAX_BAD_PACKETS = 200
"""Packets that may fail to decode before a video is given up as unreadable."""


class VideoError(ValueError):
    """The bytes are not a decodable video (empty, not a container, no video stream, ...)."""


class VideoTimeout(TimeoutError):
    """Decoding one video took longer than its time limit."""


@dataclass
class SampledFrames:
    """The sampled frames of one video and what is known of the video.

    ``images``: RGB uint8 arrays (upright); ``indices``: their decoded frame numbers;
    ``times``: their times in seconds from the first frame; ``fps``: the stream's average rate;
    ``duration_s``: the time span that decoded; ``frame_count``: frames decoded;
    ``header_duration_s``: the duration the container claims (None if it says none);
    ``warnings``: what was wrong with the video but did not stop it.
    """

    images: list[np.ndarray]
    indices: np.ndarray
    times: np.ndarray
    fps: float
    duration_s: float
    frame_count: int
    header_duration_s: float | None = None
    warnings: list[str] = field(default_factory=list)


def sample_targets(duration: float, frames: int) -> np.ndarray:
    """Times of ``frames`` samples evenly spaced over ``duration`` seconds (slot middles)."""
    return (np.arange(frames) + 0.5) * (duration / frames)


def _rotate(image: np.ndarray, degrees: float) -> np.ndarray:
    """Apply a display rotation (counter-clockwise degrees, as FFmpeg reports it)."""
    turns = int(round(degrees / 90.0)) % 4
    return np.ascontiguousarray(np.rot90(image, turns)) if turns else image


def _open(data: bytes):  # noqa: ANN202 - PyAV's container type
    import av

    if not data:
        raise VideoError("empty file (0 bytes)")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except av.error.FFmpegError as error:
        raise VideoError(f"not a readable video container: {error}") from None
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        container.close()
        raise VideoError(f"no video stream (streams: {', '.join(kinds)})")
    return container


class _Picker:
    """Chooses frames as they are decoded, for one of the three sampling rules."""

    def __init__(self, frames: int, every: int, fps: float, duration: float | None,
                 frame_rate: float = 25.0) -> None:
        self.every, self.fps = every, fps
        self.targets = sample_targets(duration, frames) if frames and duration else None
        self.next_target = 0
        # a frame within half a frame interval of a target time takes it (the nearest frame)
        self.slack = 0.5 / max(frame_rate, 1e-3)

    def wants(self, index: int, t: float) -> bool:
        """Whether frame ``index`` at ``t`` seconds is sampled (never, for ``frames=N`` of a
        video whose duration is unknown: the caller samples again once it is known)."""
        if self.every:
            return index % self.every == 0
        t += self.slack
        if self.fps:
            if t >= self.next_target / self.fps:
                while t >= self.next_target / self.fps:
                    self.next_target += 1
                return True
            return False
        if self.targets is None:
            return False
        if self.next_target < len(self.targets) and t >= self.targets[self.next_target]:
            while self.next_target < len(self.targets) and t >= self.targets[self.next_target]:
                self.next_target += 1
            return True
        return False


def _header(container) -> tuple[float | None, float, int]:  # noqa: ANN001 - PyAV's type
    """The video stream's claimed duration (None if none), average frame rate and frame count."""
    stream = container.streams.video[0]
    duration = (float(stream.duration * stream.time_base) if stream.duration
                else (container.duration / 1e6 if container.duration else None))
    rate = float(stream.average_rate or stream.guessed_rate or Fraction(25))
    return duration, rate, int(stream.frames or 0)


def _decode(data: bytes, frames: int, every: int, fps: float, span: float | None,
            deadline: float, timeout_s: float, max_pixels: int) -> SampledFrames:
    """One pass: the sampled frames as RGB (``frames`` evenly over ``span`` seconds, or over
    the header's duration when ``span`` is None). FFmpeg conceals damaged packets (garbled
    blocks until the next keyframe) and only logs it; its error log is captured (from every
    decoding thread, printed nowhere) and becomes a warning."""
    import av.logging

    level = av.logging.get_level()
    av.logging.set_level(av.logging.ERROR)
    try:
        with av.logging.Capture(local=False) as logs:
            sampled = _decode_pass(data, frames, every, fps, span, deadline, timeout_s,
                                   max_pixels)
    finally:
        av.logging.set_level(level)
    errors = [message.strip() for lvl, _, message in logs if lvl <= av.logging.ERROR]
    if errors:
        sampled.warnings.append(f"FFmpeg reported {len(errors)} decoding error(s); frames near "
                                f"them may be damaged (first: {errors[0]})")
    return sampled


def _decode_pass(data: bytes, frames: int, every: int, fps: float, span: float | None,
                 deadline: float, timeout_s: float, max_pixels: int) -> SampledFrames:
    import av

    container = _open(data)
    try:
        header_duration, rate, header_frames = _header(container)
        picker = _Picker(frames, every, fps, span or header_duration, rate)
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        images, indices, times = [], [], []
        bad, first_error, start, last, index = 0, "", None, 0.0, 0
        for packet in container.demux(stream):
            if time.monotonic() > deadline:
                raise VideoTimeout(f"decoding took longer than {timeout_s:g} s (decode_timeout_s); "
                                   f"stopped at frame {index}")
            try:
                decoded = packet.decode()
            except av.error.FFmpegError as error:
                bad += 1
                first_error = first_error or str(error)
                if bad > MAX_BAD_PACKETS:
                    raise VideoError(f"more than {MAX_BAD_PACKETS} packets failed to decode; "
                                     f"first: {first_error}") from None
                continue
            for frame in decoded:
                if frame.width * frame.height > max_pixels:
                    raise VideoError(f"frames of {frame.width}x{frame.height} exceed max_pixels="
                                     f"{max_pixels}")
                t = frame.time if frame.time is not None else index / rate
                start = t if start is None else start
                last = t - start
                if picker.wants(index, last):
                    images.append(_rotate(frame.to_ndarray(format="rgb24"), frame.rotation or 0))
                    indices.append(index)
                    times.append(last)
                index += 1
    finally:
        container.close()
    if index == 0:
        reason = f": {first_error}" if first_error else ""
        raise VideoError(f"no frame decoded{reason}")
    warnings = []
    if bad:
        warnings.append(f"{bad} packet(s) failed to decode and were skipped (first: {first_error})")
    if header_frames and abs(header_frames - index) > max(2, index // 20):
        warnings.append(f"header says {header_frames} frames, {index} decoded")
    decoded_span = last + 1.0 / rate
    if header_duration and decoded_span < 0.9 * header_duration:
        warnings.append(f"header says {header_duration:.2f} s, frames decoded for "
                        f"{decoded_span:.2f} s")
    return SampledFrames(images, np.asarray(indices, np.int64), np.asarray(times, np.float64),
                         rate, decoded_span, index, header_duration, warnings)


def read_frames(data: bytes, *, frames: int = 32, every: int = 0, fps: float = 0.0,
                timeout_s: float = 120.0, max_pixels: int = 150_000_000) -> SampledFrames:
    """Decode ``data`` (a whole video file) and return its sampled frames.

    Exactly one of ``frames`` (N evenly spaced), ``every`` (every k-th) and ``fps`` (per second)
    is used: ``every`` or ``fps`` when set, else ``frames``.

    Raises:
        VideoError: the bytes are not a video, have no video stream, or no frame decodes.
        VideoTimeout: decoding took longer than ``timeout_s``.
    """
    if frames < 1 and not every and not fps:
        raise ValueError("give frames >= 1, every >= 1 or fps > 0")
    deadline = time.monotonic() + timeout_s
    sampled = _decode(data, frames, every, fps, None, deadline, timeout_s, max_pixels)
    claimed = sampled.header_duration_s
    if not (every or fps) and (claimed is None or sampled.duration_s < 0.9 * claimed):
        # No duration in the header, or a header longer than the stream: sample again over the
        # frames' real times.
        first = sampled
        sampled = _decode(data, frames, 0, 0.0, first.duration_s, deadline, timeout_s,
                          max_pixels)
        sampled.warnings = first.warnings
        if first.frame_count != sampled.frame_count:
            sampled.warnings.append("the two decoding passes gave different frame counts")
    return sampled
