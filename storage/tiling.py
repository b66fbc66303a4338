"""Box geometry over arrays: element counts without overflow and disjointness of many chunks.

Used by the metadata validation of a load and by the save planner's coverage check, so a
million chunks cost a few sorts instead of a Python loop per chunk.
"""

from __future__ import annotations

import numpy as np

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
