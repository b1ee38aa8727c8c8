"""FaceAugment.same: one random draw for several samples (the frames of a clip, a real/fake pair),
on the astronaut's face (the ``face`` fixture of conftest.py: MediaPipe mesh, cached region hulls)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from precache.augment import FaceAugment

ALL = dict(flip_p=0.5, affine_p=0.9, color_p=0.8, blur_p=0.5, cutout_p=0.8, region_color_p=0.6,
           region_blur_p=0.5, occlude_p=0.5)
FACE_KEYS = ("image", "landmarks5", "mesh", "regions", "region_sizes")


def copy(sample: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = {k: np.array(v, copy=True) if isinstance(v, np.ndarray) else v for k, v in sample.items()}
    out.update(changes)
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any], keys=FACE_KEYS) -> None:
    for key in keys:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


def test_identical_samples_come_out_identical_and_calls_differ(face):
    aug = FaceAugment(**ALL, seed=0)
    outputs = []
    for _ in range(12):
        a, b, c = aug.same([face, copy(face), copy(face)])
        assert_same(a, b)
        assert_same(a, c)
        assert a["key"] == "astronaut"
        outputs.append(a)
    images = {o["image"].tobytes() for o in outputs}
    assert len(images) == 12  # each call is a new draw
    assert len({o["landmarks5"].tobytes() for o in outputs}) >= 10  # (no warp at all: 5 %)


def test_a_clip_is_flipped_whole_or_not_at_all(face):
    aug = FaceAugment(**{**{k: 0.0 for k in ALL}, "flip_p": 0.5}, seed=6)
    other = copy(face, image=255 - face["image"])
    outcomes = set()
    for _ in range(16):
        a, b = aug.same([face, other])
        mirror = np.array_equal(a["image"], face["image"][:, ::-1])
        assert mirror or np.array_equal(a["image"], face["image"])
        expected = other["image"][:, ::-1] if mirror else other["image"]
        np.testing.assert_array_equal(b["image"], expected)
        outcomes.add(mirror)
    assert outcomes == {True, False}


@pytest.mark.parametrize("flip_p", [1.0, 0.5])
def test_a_pair_of_different_images_gets_the_same_warp_and_the_same_holes(face, flip_p):
    """A real/fake pair: another picture at the same landmarks (with no black pixel, as holes
    are black) gets the same points out, and with no warp, black holes at the same places."""
    other = copy(face, image=np.clip(255 - face["image"], 1, 255).astype(np.uint8))
    real = copy(face, image=np.clip(face["image"], 1, 255).astype(np.uint8))
    aug = FaceAugment(**{**ALL, "flip_p": flip_p}, seed=1)
    for _ in range(6):
        a, b = aug.same([real, other])
        assert_same(a, b, ("landmarks5", "mesh", "regions", "region_sizes"))
        assert not np.array_equal(a["image"], b["image"])
        if flip_p == 1.0:  # flipped and re-indexed: the right eye (0) is still left of the left
            assert a["landmarks5"][0, 0] < a["landmarks5"][1, 0]
    holes = FaceAugment(**{**{k: 0.0 for k in ALL}, "flip_p": flip_p, "cutout_p": 1.0}, seed=1)
    for _ in range(6):
        a, b = holes.same([real, other])
        assert (a["image"] == 0).any()
        np.testing.assert_array_equal(a["image"] == 0, b["image"] == 0)


def test_frames_that_moved_get_one_matrix(face):
    """Frames of a clip whose points differ by a shift: the outputs differ by one shift too."""
    aug = FaceAugment(**ALL, seed=2)
    shifted = copy(face, landmarks5=face["landmarks5"] + np.float32([2, -1]),
                   mesh=face["mesh"] + np.float32([2, -1]))
    for _ in range(8):
        a, b = aug.same([face, shifted])
        for key in ("landmarks5", "mesh"):
            moved = b[key] - a[key]
            assert np.ptp(moved, axis=0).max() < 1e-3, key
            assert np.hypot(*moved[0]) == pytest.approx(np.hypot(2, -1), rel=0.2)  # |zoom| ~ 1


def test_a_region_missing_from_one_frame_does_not_change_its_warp(face):
    aug = FaceAugment(**{**ALL, "region_color_p": 1.0, "occlude_p": 1.0, "affine_p": 1.0}, seed=3)
    sizes = face["region_sizes"].copy()
    from precache.faces import topology

    sizes[topology.REGIONS.index("left_eye")] = 0
    no_eye = copy(face, region_sizes=sizes)
    no_mesh = copy(face, has_mesh=np.bool_(False))
    for _ in range(6):
        a, b, c = aug.same([face, no_eye, no_mesh])
        np.testing.assert_array_equal(a["landmarks5"], b["landmarks5"])
        np.testing.assert_array_equal(a["landmarks5"], c["landmarks5"])
        np.testing.assert_array_equal(a["mesh"], c["mesh"])


def test_same_leaves_the_stream_and_the_input_alone(face):
    aug = FaceAugment(**ALL, seed=4)
    twin = FaceAugment(**ALL, seed=4)
    before = copy(face)
    assert aug.same([]) == []  # no samples, no draw
    aug.same([face, face, face])
    twin(face)  # three samples in one same() use the stream as one sample does
    assert_same(face, before)
    assert_same(aug(face), twin(face))
    # one call of same() uses one draw of the stream: the next __call__s are as repeatable
    a, b = FaceAugment(**ALL, seed=5), FaceAugment(**ALL, seed=5)
    a.same([face])
    b.same([copy(face, image=face["image"][::-1].copy())])
    assert_same(a(face), b(face))
