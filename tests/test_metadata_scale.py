"""Metadata of many chunks: array shortcuts agree with the per-item rules they replace.

The checksum tile counts of a table, the write results turned into an item table, and the
encoder's trust in a plan the save planner already checked, each compared with the exact,
per-item way on real layouts and on random or damaged ones.
"""

from __future__ import annotations

import math
import random

import numpy as np

from dcpbridge.storage.checksum import tensor_grid
from dcpbridge.storage.tiling import tile_counts


def _random_sizes(rng: random.Random) -> tuple[int, ...]:
    def dim() -> int:
        r = rng.random()
        if r < 0.05:
            return 0
        if r < 0.3:
            return rng.randint(1, 8)
        if r < 0.6:
            return rng.choice([16, 64, 128, 1000, 1024, 3072, 4096, 8192])
        return rng.randint(1, 70_000)

    return tuple(dim() for _ in range(rng.choice([0, 1, 1, 2, 2, 2, 3, 3, 4])))


def test_tile_counts_match_the_checksum_grid_of_every_shape():
    rng = random.Random(0)
    for block in (1, 7, 64, 4096, 1 << 16, 1 << 20, 1 << 22):
        rows = []
        while len(rows) < 3000:
            sizes, itemsize = _random_sizes(rng), rng.choice([1, 2, 4, 8, 16])
            if math.prod(sizes) * itemsize <= 1 << 62:  # larger chunks are refused first
                rows.append((sizes, itemsize))
        width = max(len(s) for s, _ in rows)
        padded = np.ones((len(rows), width), dtype=np.int64)
        for i, (sizes, _) in enumerate(rows):
            padded[i, : len(sizes)] = sizes
        ndim = np.array([len(s) for s, _ in rows], dtype=np.int64)
        itemsizes = np.array([i for _, i in rows], dtype=np.int64)
        got = tile_counts(padded, ndim, itemsizes, block).tolist()
        want = [tensor_grid(s, i, block, tiled=True).count for s, i in rows]
        assert got == want
    assert tile_counts(np.ones((3, 0), dtype=np.int64), np.zeros(3), np.ones(3), 64).tolist() == [
        1,
        1,
        1,
    ]
