"""Make labelled synthetic 3D volumes: NIfTI files in one folder per class, and a MedMNIST-style
``.npz`` (no download; the ``medmnist`` package fetches its data at run time, so nothing here
uses it).

    python data/make_volumes.py                                   # data/volumes/, 300 volumes
    python data/make_volumes.py --output data/volumes --count 300 --size 40 \
        --npz data/volumes.npz --npz-size 28
    precache run volumes --input data/volumes --output data/volcache --set spacing=1.5 --set shape=32
    precache run volumes --input data/volumes.npz --output data/npzcache --set shape=28

Three classes a small 3D network separates: ``ball`` (a sphere), ``box`` (a cube) and ``tube``
(a cylinder along a random axis), each of random size and position, with a low-frequency
texture, a bright rim or not, and Gaussian noise over a dim background. NIfTI files are int16
(CT-like intensities, gzip-compressed), with anisotropic voxels (1 x 1 x 1.5 mm, so ``spacing``
resampling does something) and, for every other file, the first axis flipped in the affine (an
LAS file, so reorientation does something). Every volume has its own seeded generator: the
output is the same bytes on every run, and the first N volumes do not depend on ``--count``.
The ``.npz`` holds the same kind of volumes at ``--npz-size`` (uint8, N x D x H x W) split
70/15/15 into ``train_`` / ``val_`` / ``test_`` images and labels (N x 1), as MedMNIST-3D does.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

CLASSES = ("ball", "box", "tube")
SPACING = (1.0, 1.0, 1.5)


def make_volume(index: int, size: int | tuple[int, int, int], seed: int = 0) -> tuple[np.ndarray, int]:
    """Volume ``index`` (float32, about 0..1000) and its class: deterministic in (seed, index)."""
    rng = np.random.default_rng([seed, index])
    label = index % len(CLASSES)
    shape = (size,) * 3 if isinstance(size, int) else tuple(size)
    grid = np.stack(np.meshgrid(*[np.linspace(-1, 1, n, dtype=np.float32) for n in shape],
                                indexing="ij"))
    centre = rng.uniform(-0.2, 0.2, 3).astype(np.float32)[:, None, None, None]
    radius = float(rng.uniform(0.3, 0.5))
    d = grid - centre
    if CLASSES[label] == "ball":
        distance = np.sqrt((d ** 2).sum(0)) / radius
    elif CLASSES[label] == "box":
        distance = np.abs(d).max(0) / (radius * 0.85)
    else:
        axis = int(rng.integers(3))
        across = np.sqrt(sum(d[a] ** 2 for a in range(3) if a != axis)) / (radius * 0.6)
        distance = np.maximum(across, np.abs(d[axis]) / 0.8)
    inside = np.clip(1.5 - distance * 1.0, 0, 1) * (distance < 1)
    low = rng.normal(size=tuple(max(2, n // 8) for n in shape)).astype(np.float32)
    texture = np.kron(low, np.ones((8, 8, 8), np.float32))[:shape[0], :shape[1], :shape[2]]
    texture = np.pad(texture, [(0, n - t) for n, t in zip(shape, texture.shape)], mode="edge")
    brightness = rng.uniform(500, 800)
    volume = (100 + inside * brightness * (1 + 0.15 * texture)
              + rng.normal(0, 40, shape).astype(np.float32))
    return volume.astype(np.float32), label


def write_nifti(path: Path, volume: np.ndarray, flip: bool) -> None:
    """``volume`` as a gzip-compressed int16 NIfTI-1 file, 1 x 1 x 1.5 mm voxels; ``flip``: the
    first axis runs right to left (LAS), stored reversed so the world picture is the same."""
    import nibabel as nib

    affine = np.diag([*SPACING, 1.0])
    data = np.rint(volume).astype(np.int16)
    if flip:
        affine[0, 0] = -SPACING[0]
        affine[0, 3] = SPACING[0] * (volume.shape[0] - 1)
        data = data[::-1].copy()
    image = nib.Nifti1Image(data, affine)
    image.header.set_xyzt_units("mm")
    nib.save(image, str(path))


def make_npz(path: Path, count: int, size: int, seed: int = 0) -> None:
    """A MedMNIST-style archive of ``count`` uint8 volumes of ``size``^3, split 70/15/15."""
    volumes, labels = [], []
    for i in range(count):
        volume, label = make_volume(i, size, seed + 1)
        volumes.append(np.clip(volume / 4, 0, 255).astype(np.uint8))
        labels.append(label)
    images, targets = np.stack(volumes), np.asarray(labels, dtype=np.uint8)[:, None]
    train, val = int(count * 0.7), int(count * 0.85)
    np.savez_compressed(path, train_images=images[:train], train_labels=targets[:train],
                        val_images=images[train:val], val_labels=targets[train:val],
                        test_images=images[val:], test_labels=targets[val:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, default=Path("data/volumes"),
                   help="folder of NIfTI files, one subfolder per class")
    p.add_argument("--count", type=int, default=300, help="volumes (NIfTI and .npz each)")
    p.add_argument("--size", type=int, default=40, help="NIfTI volumes' voxels per axis (the "
                   "last axis has 1.5 mm voxels, so it spans 1.5x)")
    p.add_argument("--npz", type=Path, default=None, help="also write a MedMNIST-style .npz")
    p.add_argument("--npz-size", type=int, default=28, help="the .npz volumes' size (28 or 64)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.count > 0:
        if args.output.exists():
            shutil.rmtree(args.output)
        for name in CLASSES:
            (args.output / name).mkdir(parents=True)
        for i in range(args.count):
            volume, label = make_volume(i, args.size, args.seed)
            write_nifti(args.output / CLASSES[label] / f"vol{i:05d}.nii.gz", volume, flip=i % 2 == 1)
    if args.npz is not None:
        args.npz.parent.mkdir(parents=True, exist_ok=True)
        make_npz(args.npz, args.count, args.npz_size, args.seed)
    print(f"wrote {args.count} volumes to {args.output}" +
          (f" and {args.npz}" if args.npz else ""))


if __name__ == "__main__":
    main()
