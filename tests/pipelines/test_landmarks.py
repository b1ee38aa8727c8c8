"""Where the face trainers decode JPEG crops (``--decode-on``, ``--augment-on``): on a GPU with a
GPU decoder the crops travel as bytes unless the loader is asked to decode or augment them."""

from __future__ import annotations

import pytest

from precache.pipelines.faces import landmarks


@pytest.fixture
def gpu_decoder(monkeypatch):
    """A CUDA device with a GPU decoder installed (as on an H100 with torchvision)."""
    monkeypatch.setattr(landmarks, "decodes_on", lambda device: str(device).startswith("cuda"))


def test_on_a_gpu_with_a_decoder_the_loader_decodes_only_when_asked(gpu_decoder):
    assert not landmarks.decode_in_loader("cuda", "device", augment_in_loader=False)
    assert landmarks.decode_in_loader("cuda", "loader", augment_in_loader=False)
    assert landmarks.decode_in_loader("cuda", "device", augment_in_loader=True)


def test_on_a_cpu_the_loader_always_decodes(gpu_decoder):
    assert landmarks.decode_in_loader("cpu", "device", augment_in_loader=False)


def test_an_unknown_place_is_refused():
    with pytest.raises(ValueError, match="decode_on must be one of"):
        landmarks.decode_in_loader("cpu", "gpu", augment_in_loader=False)
