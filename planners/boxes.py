"""Box geometry for shards: intersections, overlap and gap detection (pure, no process group)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dcpbridge.storage.format.tiling import disjointness, products

Shape = tuple[int, ...]

# Gap localisation marks a compressed grid; beyond this many cells it only reports counts.
_MAX_GAP_CELLS = 4_000_000
# Element counts the array checks compute exactly; beyond this the worded check decides.
MAX_ELEMENTS = 1 << 62


@dataclass(frozen=True, slots=True)
class Placed:
    """A chunk ``offsets``+``sizes`` of a global tensor, written by ``rank``."""

    offsets: Shape
    sizes: Shape
    rank: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def fmt_box(offsets: Sequence[int], sizes: Sequence[int]) -> str:
    """``[0:4, 8:16]`` style slice notation of a box."""
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes)) + "]"


def intersect(
    a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int], b_size: Sequence[int]
) -> tuple[Shape, Shape] | None:
    """The overlap of two boxes as (offsets, sizes), or None if it is empty."""
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(a_off, a_size, b_off, b_size))
    if any(h <= s for s, h in zip(lo, hi)):
        return None
    return lo, tuple(h - s for s, h in zip(lo, hi))


class HasOffsets(Protocol):
    """Anything placed at ``offsets`` in a global tensor (``Placed``, DCP chunk metadata)."""

    @property
    def offsets(self) -> Sequence[int]: ...


def sweep_dim(chunks: Sequence[HasOffsets]) -> int:
    """The dimension with the most distinct chunk offsets: sweeping it keeps few boxes active."""
    ndim = len(chunks[0].offsets)
    return max(range(ndim), key=lambda d: len({c.offsets[d] for c in chunks}))


def find_overlaps(chunks: Sequence[Placed], limit: int = 3) -> list[tuple[Placed, Placed]]:
    """Pairs of non-empty chunks that share elements (sweep line: near-linear for grids)."""
    boxes = [c for c in chunks if c.numel > 0]
    if len(boxes) < 2:
        return []
    if not boxes[0].offsets:  # 0-d tensors: every chunk is the whole tensor
        return [(boxes[0], boxes[1])]
    d = sweep_dim(boxes)
    found: list[tuple[Placed, Placed]] = []
    active: list[Placed] = []
    for c in sorted(boxes, key=lambda c: (c.offsets[d], c.rank)):
        start = c.offsets[d]
        active = [a for a in active if a.offsets[d] + a.sizes[d] > start]
        for a in active:
            if intersect(a.offsets, a.sizes, c.offsets, c.sizes) is not None:
                found.append((a, c))
                if len(found) >= limit:
                    return found
        active.append(c)
    return found


def find_gap(shape: Shape, chunks: Sequence[Placed]) -> tuple[Shape, Shape] | None:
    """A box of ``shape`` no chunk covers, on a grid compressed to the chunk edges.

    Returns None when everything is covered, or when the grid is too large to mark
    (the caller then reports element counts only).
    """
    if math.prod(shape) == 0:
        return None
    if not shape:
        return None if any(c.numel for c in chunks) else ((), ())
    edges = []
    for d, n in enumerate(shape):
        cuts = {0, n}
        for c in chunks:
            cuts.add(min(c.offsets[d], n))
            cuts.add(min(c.offsets[d] + c.sizes[d], n))
        edges.append(np.array(sorted(cuts), dtype=np.int64))
    cells = math.prod(len(e) - 1 for e in edges)
    if cells > _MAX_GAP_CELLS:
        return None
    covered = np.zeros([len(e) - 1 for e in edges], dtype=bool)
    for c in chunks:
        if c.numel == 0:
            continue
        index = tuple(
            slice(int(np.searchsorted(e, o)), int(np.searchsorted(e, min(o + s, len_))))
            for e, o, s, len_ in zip(edges, c.offsets, c.sizes, shape)
        )
        covered[index] = True
    holes = np.argwhere(~covered)
    if len(holes) == 0:
        return None
    cell = holes[0]
    offsets = tuple(int(e[i]) for e, i in zip(edges, cell))
    sizes = tuple(int(e[i + 1] - e[i]) for e, i in zip(edges, cell))
    return offsets, sizes


def coverage_problems(key: str, shape: Shape, chunks: Sequence[Placed]) -> list[str]:
    """Why ``chunks`` do not tile ``shape`` exactly once (empty list: they do)."""
    if len(chunks) == 1 and chunks[0].sizes == shape and not any(chunks[0].offsets):
        return []  # the common case: one rank holds the whole tensor
    problems = []
    for c in chunks:
        if len(c.offsets) != len(shape) or any(
            o < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, shape)
        ):
            problems.append(
                f"{key!r}: rank {c.rank} shard {fmt_box(c.offsets, c.sizes)} lies outside "
                f"the global shape {shape}"
            )
    if problems:
        return problems
    for a, b in find_overlaps(chunks):
        both = intersect(a.offsets, a.sizes, b.offsets, b.sizes)
        assert both is not None
        problems.append(
            f"{key!r}: shards overlap: rank {a.rank} {fmt_box(a.offsets, a.sizes)} and "
            f"rank {b.rank} {fmt_box(b.offsets, b.sizes)} both write {fmt_box(*both)} "
            "(two main replicas of one shard? check replica_id; DTensors whose data-parallel "
            "copies are off their mesh: save with fully_parallel=True)"
        )
    if problems:
        return problems
    total = math.prod(shape)
    covered = sum(c.numel for c in chunks)
    if covered != total:
        gap = find_gap(shape, chunks)
        where = f" elements {fmt_box(*gap)} are not written by any rank;" if gap else ""
        ranks = sorted({c.rank for c in chunks})
        problems.append(
            f"{key!r} (global shape {shape}):{where} main replicas cover {covered} of "
            f"{total} elements (ranks writing it: {ranks or 'none'}; is replica_id 0 on "
            "exactly one holder of each shard?)"
        )
    return problems


def chunk_arrays(
    offsets: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets, sizes, dims) of many boxes as ``(n, width)`` int64 arrays padded with
    offset 0 and size 1; raises OverflowError for values beyond int64."""
    n = len(offsets)
    dims = np.fromiter(map(len, offsets), dtype=np.int64, count=n)
    if not np.array_equal(dims, np.fromiter(map(len, sizes), dtype=np.int64, count=n)):
        raise OverflowError("offsets and sizes differ in length")
    out_o = np.zeros((n, width), dtype=np.int64)
    out_s = np.ones((n, width), dtype=np.int64)
    if n and width:
        total = int(dims.sum())
        keep = np.arange(width)[None, :] < dims[:, None]
        out_o[keep] = np.fromiter(itertools.chain.from_iterable(offsets), np.int64, total)
        out_s[keep] = np.fromiter(itertools.chain.from_iterable(sizes), np.int64, total)
    return out_o, out_s, dims


def untiled_keys(
    shapes: Sequence[Shape],
    kid: np.ndarray,
    offsets: np.ndarray,
    sizes: np.ndarray,
    dims: np.ndarray,
) -> list[int]:
    """Indices of the keys whose chunks may not tile their shape exactly once.

    Array checks decide the common case (every chunk inside, grid-like and disjoint, element
    counts adding up); the keys returned get ``coverage_problems``' exact, worded check.
    """
    keys = len(shapes)
    ndim = np.fromiter(map(len, shapes), dtype=np.int64, count=keys)
    width = max(offsets.shape[1], int(ndim.max(initial=0)))
    if width > offsets.shape[1]:  # a key of more dims than any chunk (an empty tensor's)
        grow = ((0, 0), (0, width - offsets.shape[1]))
        offsets = np.pad(offsets, grow, constant_values=0)
        sizes = np.pad(sizes, grow, constant_values=1)
    padded = np.ones((keys, width), dtype=np.int64)
    for k, shape in enumerate(shapes):
        padded[k, : len(shape)] = shape
    full, full_over = products(padded, MAX_ELEMENTS)
    bad = np.zeros(keys, dtype=bool)
    bad |= full_over
    limits = padded[kid]
    wrong = (dims != ndim[kid]) | (offsets < 0).any(axis=1) | (sizes < 0).any(axis=1)
    wrong |= ((sizes > limits) | (offsets > limits - sizes)).any(axis=1)
    numel, over = products(np.maximum(sizes, 0), MAX_ELEMENTS)
    bad[kid[wrong | over]] = True
    nonempty = numel > 0
    status = disjointness(kid[nonempty], offsets[nonempty], sizes[nonempty], keys)
    bad |= status != 0
    counted = np.where(nonempty & ~bad[kid], numel, 0)
    order = np.argsort(kid, kind="stable")
    running = np.zeros(len(kid) + 1, dtype=np.int64)
    np.cumsum(counted[order], out=running[1:])
    starts = np.zeros(keys + 1, dtype=np.int64)
    np.cumsum(np.bincount(kid, minlength=keys), out=starts[1:])
    sums = running[starts[1:]] - running[starts[:-1]]
    bad |= sums != full
    return np.flatnonzero(bad).tolist()
