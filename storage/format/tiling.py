"""Box geometry over arrays: element counts without overflow and disjointness of many chunks.

Used by the metadata validation of a load and by the save planner's coverage check, so a
million chunks cost a few sorts instead of a Python loop per chunk.
"""

from __future__ import annotations

import numpy as np

from dcpbridge.storage.format.checksum import MAX_COLUMN_GROUPS, MIN_SEGMENT, MIN_TILE

DISJOINT, OVERLAP, UNKNOWN = 0, 1, 2


def distinct(values: np.ndarray) -> int:
    """How many distinct values a 1-d array holds (without ``np.unique``, whose first call
    imports ``numpy.ma``)."""
    if values.size == 0:
        return 0
    ordered = np.sort(values)
    return int(np.count_nonzero(ordered[1:] != ordered[:-1])) + 1


def products(values: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Row products of a non-negative ``(n, d)`` int64 array, and where they exceed ``limit``.

    Products above ``limit`` (and the rows that would overflow int64) read as 0 in the
    first array and True in the second; ``limit`` must be below 2**63.
    """
    n = values.shape[0]
    out = np.ones(n, dtype=np.int64)
    over = np.zeros(n, dtype=bool)
    zero = (values == 0).any(axis=1) if values.size else np.zeros(n, dtype=bool)
    for d in range(values.shape[1]):
        v = values[:, d]
        over |= (v > 0) & (out > limit // np.maximum(v, 1))
        out = np.where(over, 0, out * np.where(over, 1, v))
    over &= ~zero  # a zero anywhere makes the product 0, whatever came before
    out[zero] = 0
    return out, over


def disjointness(
    tid: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, tensors: int
) -> np.ndarray:
    """Per tensor: DISJOINT, OVERLAP or UNKNOWN for its non-empty boxes (rows of ``tid``).

    Exact for grid-like tilings (every split of Megatron, DTensor or FSDP layouts): dims are
    taken in order, and within each class of boxes that agree on the earlier dims, the
    distinct intervals along the next dim must be pairwise disjoint. Boxes that end in the
    same class on every dim are identical, hence overlap. Tensors whose intervals interleave
    in another way are UNKNOWN: the caller checks those with an exact sweep.
    """
    status = np.zeros(tensors, dtype=np.int8)
    if tid.size == 0:
        return status
    group = tid.astype(np.int64)
    unknown = np.zeros(tensors, dtype=bool)
    for d in range(offsets.shape[1]):
        start = offsets[:, d]
        end = start + sizes[:, d]
        order = np.lexsort((end, start, group))
        g, s, e = group[order], start[order], end[order]
        new = np.empty(len(order), dtype=bool)
        new[0] = True
        new[1:] = (g[1:] != g[:-1]) | (s[1:] != s[:-1]) | (e[1:] != e[:-1])
        firsts = np.flatnonzero(new)
        cg, cs, ce = g[firsts], s[firsts], e[firsts]
        clash = (cg[1:] == cg[:-1]) & (ce[:-1] > cs[1:])
        if clash.any():
            rows = order[firsts[1:][clash]]
            unknown[tid[rows]] = True
        group = np.empty_like(group)
        group[order] = np.cumsum(new) - 1
    counts = np.bincount(group)
    repeated = counts[group] > 1
    status[tid[repeated]] = OVERLAP
    status[unknown & (status != OVERLAP)] = UNKNOWN
    return status


def tile_counts(
    sizes: np.ndarray, ndim: np.ndarray, itemsize: np.ndarray, block: int
) -> np.ndarray:
    """Format 4 checksum tiles of many chunks at once: ``checksum.tensor_grid(...).count`` of
    each row (``sizes`` padded with 1s past its ``ndim``), as array operations.

    Follows ``checksum.tensor_tiles`` step by step (column groups on dim 1, then the tile
    filled from the innermost dimension outward), so a million chunks of any mix of shapes
    cost a few passes instead of a sort or a Python call per distinct shape.
    """
    n, width = sizes.shape
    if width == 0:
        return np.ones(n, dtype=np.int64)
    numel, over = products(sizes, 1 << 62)
    nbytes = numel * itemsize  # rows past 2**62 elements are refused before their checksums
    tile = sizes.copy()
    if width >= 2:
        s1 = sizes[:, 1]
        inner = products(sizes[:, 2:], 1 << 62)[0] * itemsize
        groups = np.full(n, MAX_COLUMN_GROUPS, dtype=np.int64)
        while True:
            fewer = (groups > 1) & (
                (s1 % groups != 0)
                | (nbytes // groups < MIN_TILE)
                | (s1 // groups * inner < MIN_SEGMENT)
            )
            if not fewer.any():
                break
            groups = np.where(fewer, groups // 2, groups)
        tile[:, 1] = np.maximum(1, s1 // groups)
        target = np.maximum(1, block // groups)
        size = itemsize.astype(np.int64, copy=True)
        open_ = np.ones(n, dtype=bool)
        for d in range(width - 1, -1, -1):
            step = np.maximum(1, np.minimum(tile[:, d], target // size))
            cut = open_ & (step < tile[:, d])
            tile[cut, d] = step[cut]
            tile[cut, :d] = 1
            size = np.where(open_ & ~cut, size * step, size)
            open_ &= ~cut
    flat = ndim <= 1  # 1-d chunks: block-sized runs of elements; 0-d: one tile
    tile[flat, 0] = np.maximum(1, block // itemsize[flat])
    per_dim = -(-sizes // np.maximum(tile, 1))
    per_dim[ndim == 0, 0] = 1
    counts = products(per_dim, 1 << 62)[0]
    counts[(numel == 0) | over] = 1
    return np.maximum(1, counts)
