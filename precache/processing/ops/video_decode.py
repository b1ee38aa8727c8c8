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
decoded, and each becomes a warning stored with the rows. A video whose decoding takes longer
than ``timeout_s`` (decoding alone: what a consumer does between two frames is not counted)
fails alone with ``VideoTimeout``.

``VideoReader`` hands the sampled frames over one by one as they are decoded, so a consumer that
keeps only what it needs of each (``precache.processing.ops.video_faces``: boxes and crops) holds a few full
frames, not the whole video; ``read_frames`` collects them all in a list. ``max_frames`` caps
``every=``/``fps=`` sampling: the first ``max_frames`` sampled frames are kept, decoding stops
there, and a warning says so (the frames keep the spacing asked for, which tracking and clips
rely on; an even spread over a long video would put them seconds apart).
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterator

import numpy as np

__all__ = ["VideoError", "VideoTimeout", "SampledFrames", "Frame", "VideoInfo", "VideoReader",
           "read_frames", "VIDEO_EXTENSIONS", "sample_targets"]

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mov", ".mkv", ".webm")

MAX_BAD_PACKETS = 200
"""Packets that may fail to decode before a video is given up as unreadable."""


class VideoError(ValueError):
    """The bytes are not a decodable video (empty, not a container, no video stream, ...)."""


class VideoTimeout(TimeoutError):
    """Decoding one video took longer than its time limit."""


@dataclass
class Frame:
    """One sampled frame: its decoded frame number, its time in seconds from the first frame and
    its RGB uint8 image (upright)."""

    index: int
    time: float
    image: np.ndarray


@dataclass
class VideoInfo:
    """What is known of a video once a decoding pass is over.

    ``fps``: the stream's average rate; ``duration_s``: the time span that decoded;
    ``frame_count``: frames decoded; ``header_duration_s``: the duration the container claims
    (None if it says none); ``warnings``: what was wrong with the video but did not stop it;
    ``sampled``: frames handed over; ``capped``: ``max_frames`` stopped the sampling (and the
    decoding) early, and ``duration_s`` and ``frame_count`` are then the header's where it has
    them.
    """

    fps: float
    duration_s: float
    frame_count: int
    header_duration_s: float | None = None
    warnings: list[str] = field(default_factory=list)
    sampled: int = 0
    capped: bool = False


@dataclass
class SampledFrames:
    """The sampled frames of one video and what is known of the video.

    ``images``: RGB uint8 arrays (upright); ``indices``: their decoded frame numbers;
    ``times``: their times in seconds from the first frame; the rest as ``VideoInfo``.
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


def _drain(container) -> None:  # noqa: ANN001 - PyAV's type
    """Finish the frames still in the decoder's threads before the container is closed early
    (``max_frames``, an error, a consumer that stopped): freeing a codec context waits for its
    threads while holding the GIL, and a thread that logs an error then waits for the GIL
    (PyAV passes FFmpeg's errors to Python): a deadlock, seen when ``max_frames`` stopped a
    video's decoding."""
    try:
        container.streams.video[0].codec_context.decode(None)
    except Exception:  # noqa: BLE001 - a broken stream: its threads are done anyway
        pass


class _Budget:
    """Seconds of decoding a video may take (the consumer's time between frames not counted)."""

    def __init__(self, limit: float) -> None:
        self.limit, self.spent = limit, 0.0


class VideoReader:
    """The sampled frames of one video, decoded as they are consumed.

    ``passes()`` yields one or two iterables of ``Frame``; consume each fully before taking the
    next. A second pass comes for ``frames=N`` when the header has no duration or claims more
    than decoded: the N frames are then sampled again over the frames' real times, and a
    consumer starts over with it. ``info`` (a ``VideoInfo``) is set once the last pass is over.
    ``replay()`` decodes the final pass again, giving the same frames (for a consumer that needs
    them twice rather than keep them all).

    ``max_frames`` (0: no cap) caps ``every=``/``fps=`` sampling: the first ``max_frames``
    sampled frames are handed over, decoding stops at the next one, ``info.capped`` is set and
    a warning says how much of the video was left out. ``frames=N`` is not capped (N is the cap).
    ``timeout_s`` bounds the time spent decoding, over both passes (``replay`` has its own).
    """

    def __init__(self, data: bytes, *, frames: int = 32, every: int = 0, fps: float = 0.0,
                 timeout_s: float = 120.0, max_pixels: int = 150_000_000,
                 max_frames: int = 0) -> None:
        if frames < 1 and not every and not fps:
            raise ValueError("give frames >= 1, every >= 1 or fps > 0")
        if max_frames < 0:
            raise ValueError(f"max_frames must be >= 0 (0: no cap), not {max_frames}")
        self.data, self.frames, self.every, self.fps = data, frames, every, fps
        self.timeout_s, self.max_pixels = timeout_s, max_pixels
        self.max_frames = max_frames if (every or fps) else 0
        self.info: VideoInfo | None = None
        self._span: float | None = None  # the duration the final pass sampled over

    def passes(self) -> Iterator[Iterator[Frame]]:
        budget = _Budget(self.timeout_s)
        box: list[VideoInfo] = []
        yield self._decode(None, budget, box)
        if not box:
            raise RuntimeError("VideoReader: consume a pass before taking the next")
        first = box.pop()
        claimed = first.header_duration_s
        if self.every or self.fps or (claimed is not None
                                      and first.duration_s >= 0.9 * claimed):
            self.info = first
            return
        # No duration in the header, or a header longer than the stream: sample again over the
        # frames' real times.
        self._span = first.duration_s
        yield self._decode(first.duration_s, budget, box)
        if not box:
            raise RuntimeError("VideoReader: consume a pass before taking the next")
        second = box.pop()
        second.warnings = first.warnings
        if first.frame_count != second.frame_count:
            second.warnings.append("the two decoding passes gave different frame counts")
        self.info = second

    def replay(self) -> Iterator[Frame]:
        """The final pass's frames again (call after ``passes()`` is over)."""
        if self.info is None:
            raise RuntimeError("VideoReader: replay() comes after the passes")
        return self._decode(self._span, _Budget(self.timeout_s), [])

    def _decode(self, span: float | None, budget: _Budget, box: list[VideoInfo]
                ) -> Iterator[Frame]:
        """One pass: the sampled frames as RGB (``frames`` evenly over ``span`` seconds, or over
        the header's duration when ``span`` is None); its ``VideoInfo`` goes into ``box`` at the
        end. FFmpeg conceals damaged packets (garbled blocks until the next keyframe) and only
        logs it; its error log is captured (from every decoding thread, printed nowhere) while
        the pass lasts and becomes a warning."""
        import av.logging

        level = av.logging.get_level()
        av.logging.set_level(av.logging.ERROR)
        try:
            with av.logging.Capture(local=False) as logs:
                info = yield from self._decode_pass(span, budget)
        finally:
            av.logging.set_level(level)
        errors = [message.strip() for lvl, _, message in logs if lvl <= av.logging.ERROR]
        if errors:
            info.warnings.append(f"FFmpeg reported {len(errors)} decoding error(s); frames "
                                 f"near them may be damaged (first: {errors[0]})")
        box.append(info)

    def _decode_pass(self, span: float | None, budget: _Budget):  # noqa: ANN202 - a generator
        import av

        resumed = time.monotonic()
        container = _open(self.data)
        try:
            header_duration, rate, header_frames = _header(container)
            picker = _Picker(self.frames, self.every, self.fps, span or header_duration, rate)
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            bad, first_error, start, last, index, sampled = 0, "", None, 0.0, 0, 0
            capped = finished = False
            for packet in container.demux(stream):
                if budget.spent + (time.monotonic() - resumed) > budget.limit:
                    raise VideoTimeout(f"decoding took longer than {budget.limit:g} s "
                                       f"(decode_timeout_s); stopped at frame {index}")
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
                    if frame.width * frame.height > self.max_pixels:
                        raise VideoError(f"frames of {frame.width}x{frame.height} exceed "
                                         f"max_pixels={self.max_pixels}")
                    t = frame.time if frame.time is not None else index / rate
                    start = t if start is None else start
                    wanted = picker.wants(index, t - start)
                    if wanted and self.max_frames and sampled == self.max_frames:
                        capped = True  # one frame more than the cap: stop here
                        break
                    last = t - start
                    if wanted:
                        sampled += 1
                        budget.spent += time.monotonic() - resumed
                        yield Frame(index, last, _rotate(frame.to_ndarray(format="rgb24"),
                                                         frame.rotation or 0))
                        resumed = time.monotonic()
                    index += 1
                if capped:
                    break
            else:
                finished = True
        finally:
            if not finished:
                _drain(container)
            container.close()
            budget.spent += time.monotonic() - resumed
        if index == 0:
            reason = f": {first_error}" if first_error else ""
            raise VideoError(f"no frame decoded{reason}")
        warnings = []
        if bad:
            warnings.append(f"{bad} packet(s) failed to decode and were skipped "
                            f"(first: {first_error})")
        decoded_span = last + 1.0 / rate
        if capped:
            total = header_frames or (round(header_duration * rate) if header_duration else 0)
            warnings.append(self._cap_warning(sampled, decoded_span, header_duration, total))
            return VideoInfo(rate, header_duration or decoded_span, total or index,
                             header_duration, warnings, sampled, capped=True)
        if header_frames and abs(header_frames - index) > max(2, index // 20):
            warnings.append(f"header says {header_frames} frames, {index} decoded")
        if header_duration and decoded_span < 0.9 * header_duration:
            warnings.append(f"header says {header_duration:.2f} s, frames decoded for "
                            f"{decoded_span:.2f} s")
        return VideoInfo(rate, decoded_span, index, header_duration, warnings, sampled)

    def _cap_warning(self, sampled: int, span: float, header_duration: float | None,
                     header_frames: int) -> str:
        rule = f"every={self.every}" if self.every else f"fps={self.fps:g}"
        wanted = ""
        if self.every and header_frames:
            wanted = f" of about {math.ceil(header_frames / self.every):,}"
        elif self.fps and header_duration:
            wanted = f" of about {max(sampled + 1, round(header_duration * self.fps)):,}"
        of = f"{header_duration:.1f} s" if header_duration else "a longer video"
        return (f"sampled {sampled:,}{wanted} frames ({rule}): max_frames={self.max_frames} "
                f"kept the first {span:.1f} s of {of}; raise max_frames, or sample sparser "
                "(fps=, frames=)")


def read_frames(data: bytes, *, frames: int = 32, every: int = 0, fps: float = 0.0,
                timeout_s: float = 120.0, max_pixels: int = 150_000_000,
                max_frames: int = 0) -> SampledFrames:
    """Decode ``data`` (a whole video file) and return its sampled frames, all in memory (for a
    long video, iterate a ``VideoReader`` instead).

    Exactly one of ``frames`` (N evenly spaced), ``every`` (every k-th) and ``fps`` (per second)
    is used: ``every`` or ``fps`` when set, else ``frames``. ``max_frames`` (0: none) caps
    ``every``/``fps`` sampling to the first ``max_frames`` frames, with a warning.

    Raises:
        VideoError: the bytes are not a video, have no video stream, or no frame decodes.
        VideoTimeout: decoding took longer than ``timeout_s``.
    """
    reader = VideoReader(data, frames=frames, every=every, fps=fps, timeout_s=timeout_s,
                         max_pixels=max_pixels, max_frames=max_frames)
    kept: list[Frame] = []
    for sampled in reader.passes():
        kept = list(sampled)
    info = reader.info
    assert info is not None
    return SampledFrames([f.image for f in kept], np.asarray([f.index for f in kept], np.int64),
                         np.asarray([f.time for f in kept], np.float64), info.fps,
                         info.duration_s, info.frame_count, info.header_duration_s,
                         info.warnings)
