"""A shuffled order of ``range(n)`` computed position by position, for samplers over caches too
large to shuffle up front.

NumPy's ``permutation`` of 25 million indices takes 1.0-1.6 s here (a random swap per index over
a 200 MB array, a cache miss each): the whole order exists before the first batch can be read,
and that wait was most of a first batch past RAM (issue 23). ``LazyOrder`` is a keyed
pseudo-random permutation instead: a 4-round Feistel network over the smallest even number of
bits that holds ``n - 1``, with cycle walking (a value that lands at or past ``n`` is permuted
again until it falls inside, which keeps the map a bijection on ``range(n)``). Any positions cost
in proportion to their number, in a few vectorised NumPy passes, so a batch's indices are ready in
microseconds; a whole order costs ~4x NumPy's shuffle, spread over the epoch. No library offers
this for NumPy arrays, hence the few lines here.
"""

from __future__ import annotations

import numpy as np

__all__ = ["LazyOrder"]

_ROUNDS = 4  # Luby-Rackoff: 4 rounds of a random-looking function give a random-looking permutation
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1, _MUL2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: 64 well-mixed bits from any 64 (uint64 arithmetic wraps)."""
    z = z + _GOLDEN
    z = (z ^ (z >> _S30)) * _MUL1
    z = (z ^ (z >> _S27)) * _MUL2
    return z ^ (z >> _S31)


class LazyOrder:
    """A permutation of ``range(n)`` from ``seed`` (a sequence of ints, as ``default_rng``
    takes): ``order[positions]`` gives the indices at those positions.

    Args:
        n: the number of indices (at least 1).
        seed: e.g. ``[seed, epoch]``; the same seed gives the same order on every rank.
    """

    def __init__(self, n: int, seed: list[int]) -> None:
        if n < 1:
            raise ValueError(f"n must be at least 1, not {n}")
        bits = max(2, int(n - 1).bit_length())
        bits += bits % 2
        self.n = int(n)
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        self._keys = np.random.default_rng(seed).integers(0, 2**63, _ROUNDS).astype(np.uint64)

    def _permute(self, values: np.ndarray) -> np.ndarray:
        """One pass of the Feistel network over ``values`` (uint64, all below 2**bits)."""
        left, right = values >> self._half, values & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        """The indices at ``positions`` (integers in ``[0, n)``), as int64."""
        positions = np.asarray(positions)
        if positions.size and (positions.min() < 0 or positions.max() >= self.n):
            raise IndexError(f"positions must be in [0, {self.n})")
        values = self._permute(positions.astype(np.uint64))
        outside = np.flatnonzero(values >= self.n)
        while len(outside):  # cycle walking: on average fewer than 4 more passes for those
            values[outside] = self._permute(values[outside])
            outside = outside[values[outside] >= self.n]
        return values.astype(np.int64)
