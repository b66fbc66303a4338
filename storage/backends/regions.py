"""Which byte ranges of a stored C-contiguous chunk hold a requested sub-box (pure functions)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dcpbridge.storage.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class Extent:
    """Elements ``[start, stop)`` of a stored chunk that hold one sub-box of the request.

    ``box_offsets`` and ``box_lengths`` place that sub-box inside the requested region; the
    sub-box's element ``i`` sits at ``start + sum(i_d * stride_d)`` in the chunk.
    """

    start: int
    stop: int
    box_offsets: tuple[int, ...]
    box_lengths: tuple[int, ...]

    @property
    def contiguous(self) -> bool:
        return self.stop - self.start == math.prod(self.box_lengths)


def c_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(sizes[d + 1], 1)
    return tuple(strides)


def narrow_box(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The view of box ``offsets``+``lengths`` of ``t`` (``t`` itself for the whole tensor)."""
    if lengths == t.shape:
        return t
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.shape[d]:
            t = t.narrow(d, o, n)
    return t


def plan_extents(
    sizes: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
    itemsize: int,
    *,
    min_piece_bytes: int,
    slack: float = 1.02,
    join_gap: int = 0,
    max_span_bytes: int = 0,
    max_amplification: float = 1.0,
) -> list[Extent]:
    """Cover the box ``offsets``+``lengths`` of a chunk of ``sizes`` with few, tight extents.

    A box is read as one span when the span wastes at most ``slack`` or when splitting it
    along its outermost non-trivial dimension would give pieces under ``min_piece_bytes``
    (many tiny reads cost more than the wasted bytes). Where the pieces would lie at most
    ``join_gap`` bytes apart (reading the gap costs less than a request) and the span reads
    at most ``max_amplification`` times the bytes needed, it is read as spans of at most
    ``max_span_bytes`` (whole pieces, one at least). Otherwise it is split and each piece
    planned again, so a dim-1 slice of a row-major chunk becomes one read per row.
    """
    ndim = len(sizes)
    if len(offsets) != ndim or len(lengths) != ndim:
        raise InvalidArgumentError(
            f"box rank mismatch: sizes {sizes}, offsets {offsets}, lengths {lengths}"
        )
    if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, sizes)):
        raise InvalidArgumentError(f"box {offsets}+{lengths} outside chunk of sizes {sizes}")
    if math.prod(lengths) == 0:
        return []
    strides = c_strides(sizes)
    out: list[Extent] = []

    def plan(first_dim: int, chunk_off: list[int], box_off: list[int], lens: list[int]) -> None:
        start = sum(o * s for o, s in zip(chunk_off, strides))
        stop = sum((o + n - 1) * s for o, n, s in zip(chunk_off, lens, strides)) + 1
        need = math.prod(lens)
        d = first_dim
        while d < ndim and lens[d] == 1:
            d += 1
        span = stop - start
        if span <= need * slack or d >= ndim or need * itemsize // lens[d] < min_piece_bytes:
            out.append(Extent(start, stop, tuple(box_off), tuple(lens)))
            return
        piece = lens.copy()
        piece[d] = 1
        one = sum((n - 1) * s for n, s in zip(piece, strides)) + 1  # one piece's span
        gap = (strides[d] - one) * itemsize
        if 0 <= gap <= join_gap and span <= need * max_amplification:
            group = max(1, (max_span_bytes // itemsize - one) // strides[d] + 1)
            for i in range(0, lens[d], group):
                n = min(group, lens[d] - i)
                c, b, g = chunk_off.copy(), box_off.copy(), lens.copy()
                c[d] += i
                b[d] += i
                g[d] = n
                first = sum(o * s for o, s in zip(c, strides))
                out.append(Extent(first, first + (n - 1) * strides[d] + one, tuple(b), tuple(g)))
            return
        if one * lens[d] == need:  # every piece one contiguous run: no need to plan each again
            first, step, shape = start, strides[d], tuple(piece)
            for i in range(lens[d]):
                b = box_off.copy()
                b[d] += i
                at = first + i * step
                out.append(Extent(at, at + one, tuple(b), shape))
            return
        for i in range(lens[d]):
            c = chunk_off.copy()
            b = box_off.copy()
            c[d] += i
            b[d] += i
            plan(d + 1, c, b, piece)

    plan(0, list(offsets), [0] * ndim, list(lengths))
    return out
