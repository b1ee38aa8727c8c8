"""Decode a batch of encoded crops (JPEG/WebP, stage 1's ``image_codec``) where the batch will be
used: on the GPU with nvJPEG when the training runs there, else on this CPU.

A JPEG crop is 5-10x smaller than its pixels, so a batch that travels encoded to the GPU copies
less, and nvJPEG decodes a whole batch in one call while the CPU cores stay free for the loop
(JPEG crops decode at ~8,000/s per core here). ``CachedDataset(..., decode_images=False)``
hands out the rows' encoded bytes (views of the mapped shards); ``decode_images(rows, device)``
turns them into one ``(n, h, w, 3)`` uint8 tensor on ``device``.

GPU decoding goes through TorchCodec (``torchcodec.decoders.decode_jpeg(..., device="cuda")``,
batched nvJPEG, on the hardware JPEG decoder of an A100/H100; torchvision's ``decode_jpeg``,
deprecated in its favour, uses only the CUDA cores and the CPU), with torchvision's
``decode_jpeg`` as a fallback for installs that have it; WebP and any row nvJPEG refuses are
decoded on the CPU and copied over. ``pip install 'precache[gpu]'`` installs TorchCodec (its PyPI
wheels are CUDA 13 builds for torch >= 2.11; a CPU-only torch needs none).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import torch

from precache.cache.image_codec import decode_image

__all__ = ["decode_images", "decodes_on", "gpu_decoder"]


def decode_images(rows: Sequence[Any], device: torch.device | str = "cpu",
                  where: str = "a batch") -> torch.Tensor:
    """The decoded images of ``rows`` (each a JPEG/WebP buffer: ``bytes``, a uint8 array or
    tensor) as one ``(n, h, w, 3)`` uint8 tensor on ``device`` (crops of one cache share a size);
    ``rows`` of clips (``n`` lists of ``t`` buffers, as ``collate_clips`` gives them) as one
    ``(n, t, h, w, 3)`` tensor.

    Raises:
        ValueError: a row is not a decodable image, or rows differ in size (naming ``where``
            and the row's position).
        RuntimeError: ``device`` is a GPU and no GPU decoder is installed (says which to install).
    """
    device = torch.device(device)
    if len(rows) and isinstance(rows[0], (list, tuple)):  # clips: B lists of T frames
        frames = [frame for clip in rows for frame in clip]
        return decode_images(frames, device, where).unflatten(0, (len(rows), len(rows[0])))
    if not len(rows):
        return torch.empty((0, 0, 0, 3), dtype=torch.uint8, device=device)
    if device.type == "cuda":
        decode = gpu_decoder()
        if decode is None:
            raise RuntimeError("decoding JPEG crops on the GPU needs TorchCodec (pip install "
                               "'precache[gpu]') or torchvision; "
                               "or decode on the CPU: CachedDataset(..., decode_images=True)")
        return decode(rows, device, where)
    return torch.from_numpy(_decode_on_cpu(rows, where))


def decodes_on(device: torch.device | str) -> bool:
    """Whether JPEG crops for a model on ``device`` should travel encoded and be decoded there
    (``CachedDataset(..., decode_images=not decodes_on(device))``): a CUDA device with a GPU
    decoder installed. The trainers choose so by default."""
    return torch.device(device).type == "cuda" and gpu_decoder() is not None


def decode_into_batch(rows: Sequence[Any], where: Callable[[int], str],
                      empty: Callable[..., np.ndarray] = np.empty) -> np.ndarray:
    """Each row decoded on this CPU straight into its slot of one preallocated ``(n, h, w, 3)``
    uint8 array (no list of arrays, no stack), made by ``empty(shape, dtype)`` (a thread
    loader's pinned memory: the copy to the GPU reads the decoded batch where it is).

    Raises:
        ValueError: row ``i`` is not a decodable image of the first row's size; the message
            starts with ``where(i)``.
    """
    batch: np.ndarray | None = None
    for i, row in enumerate(rows):
        data = _as_buffer(row)
        try:
            if batch is None:
                first = decode_image(data)
                batch = empty((len(rows), *first.shape), np.uint8)
                batch[0] = first
            else:
                decode_image(data, out=batch[i])
        except ValueError as error:
            raise ValueError(f"{where(i)}: {error}") from None
    return batch if batch is not None else np.empty((0, 0, 0, 3), np.uint8)


def _decode_on_cpu(rows: Sequence[Any], where: str) -> np.ndarray:
    return decode_into_batch(rows, lambda i: f"{where}, row {i}")


def _as_buffer(row: Any) -> Any:
    if isinstance(row, torch.Tensor):
        return row.numpy()
    return row


def gpu_decoder() -> Callable[[Sequence[Any], torch.device, str], torch.Tensor] | None:
    """The batched nvJPEG decoder of an installed library, or ``None``: TorchCodec first, then
    torchvision (whichever imports beside this torch)."""
    try:
        from torchcodec.decoders import decode_jpeg as codec_decode
    except (ImportError, OSError, RuntimeError):  # OSError: a build for another CUDA
        codec_decode = None
    if codec_decode is not None:
        return lambda rows, device, where: _on_gpu(
            rows, device, where, lambda tensors: codec_decode(tensors, mode="RGB", device=device))
    try:
        from torchvision.io import ImageReadMode, decode_jpeg as vision_decode
    except (ImportError, OSError, RuntimeError):
        return None
    return lambda rows, device, where: _on_gpu(
        rows, device, where,
        lambda tensors: vision_decode(tensors, mode=ImageReadMode.RGB, device=device))


def _on_gpu(rows: Sequence[Any], device: torch.device, where: str,
            decode: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> torch.Tensor:
    """JPEG rows decoded together on ``device`` (NHWC, as the cache stores crops); other rows
    (WebP) on the CPU, copied over."""
    arrays = [row.numpy() if isinstance(row, torch.Tensor) else np.frombuffer(row, np.uint8)
              for row in rows]
    # the JPEG check on the host arrays: on tensors it cost two indexing ops a row (~10 us)
    jpeg = [i for i, a in enumerate(arrays) if a[:2].tobytes() == b"\xff\xd8"]
    with warnings.catch_warnings():  # the rows view the read-only mapped shard; only read
        warnings.simplefilter("ignore", UserWarning)
        tensors = [torch.from_numpy(arrays[i]) for i in jpeg]
    if len(jpeg) == len(rows):  # the usual batch: one stack, one layout change (not one a row)
        decoded = _off_the_current_stream(decode, tensors, device)
        _check_one_size([tuple(image.shape) for image in decoded], where)
        return torch.stack(decoded).permute(0, 2, 3, 1).contiguous()  # NCHW -> NHWC
    images: list[torch.Tensor | None] = [None] * len(rows)
    if jpeg:
        for i, image in zip(jpeg, _off_the_current_stream(decode, tensors, device)):
            images[i] = image.permute(1, 2, 0)  # CHW -> HWC
    rest = [i for i, image in enumerate(images) if image is None]
    if rest:
        on_cpu = torch.from_numpy(_decode_on_cpu([rows[i] for i in rest], where)).to(device)
        for k, i in enumerate(rest):
            images[i] = on_cpu[k]
    _check_one_size([tuple(image.shape) for image in images if image is not None], where)
    return torch.stack([image for image in images if image is not None])


_streams = threading.local()  # each thread's decoding stream, by device


def _off_the_current_stream(decode: Callable[[list[torch.Tensor]], list[torch.Tensor]],
                            tensors: list[torch.Tensor], device: torch.device,
                            ) -> list[torch.Tensor]:
    """``decode(tensors)`` on a CUDA stream of this thread's own, which the current stream then
    waits for. TorchCodec synchronises the stream it decodes on, before (nvJPEG's hardware
    engine on an H100 does not wait for work queued on it) and after: on the training's stream
    that would hold this thread until the GPU had run every step queued so far, so the host
    could no longer work ahead of the GPU. On this stream it waits only for earlier decodes
    (the inputs are host bytes and the outputs new: nothing of the current stream's is read)."""
    if device.type != "cuda":
        return decode(tensors)
    by_device = getattr(_streams, "by_device", None)
    if by_device is None:
        by_device = _streams.by_device = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = by_device.get(index)
    if stream is None:
        stream = by_device[index] = torch.cuda.Stream(torch.device("cuda", index))
    current = torch.cuda.current_stream(torch.device("cuda", index))
    with torch.cuda.stream(stream):
        decoded = decode(tensors)
    current.wait_stream(stream)
    for image in decoded:  # made on the side stream, used on the current one
        image.record_stream(current)
    return decoded


def _check_one_size(shapes: list[tuple[int, ...]], where: str) -> None:
    if len(set(shapes)) > 1:
        raise ValueError(f"{where}: the crops differ in size ({sorted(set(shapes))}); a batch of "
                         "encoded crops must share one size (stage 1's --set size)")
