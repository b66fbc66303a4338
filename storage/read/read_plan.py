"""Which bytes a load reads (pure functions over plain data, no I/O and no process group).

A tensor read becomes a ``ChunkRead``: the box of the stored chunk to fetch into a target
buffer (the requested box, or that box widened to checksum tiles when verification is on,
so every tile it touches is verified without reading anything else), and the file byte
ranges that fill it. ``coalesce`` then joins ranges of one file into single requests where
the storage's cost model (``ReadCosts``: a price per request and per byte) says reading the
bytes between them is cheaper than another request, up to a bound on the bytes read per byte
needed; the skipped bytes land in scratch memory and are neither delivered nor verified.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from dcpbridge.storage.backends.costs import ReadCosts
from dcpbridge.storage.backends.regions import Extent, c_strides, plan_extents
from dcpbridge.storage.backends.store import Storage
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.checksum import Grid

T = TypeVar("T")
Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class ReadTuning:
    """How the reader cuts and joins byte ranges for one kind of storage."""

    min_piece_bytes: int
    """Row pieces smaller than this are read as one span with the bytes between them."""
    merge_gap: int
    """Ranges of one file at most this many bytes apart are fetched by one request..."""
    max_request: int
    """...of at most this many bytes; ranges this large or larger are requests of their own..."""
    max_amplification: float = 2.0
    """...that reads at most this many times the bytes its ranges need (the skipped bytes
    between them cost memory bandwidth, cache and, on a shared disk, other jobs' reads)."""
    verify_slab: int = 0
    """Whole chunks larger than this are read in slabs of about this size, each verified as
    it lands (``ReadCosts.verify_slab``); 0: in one request."""

    @staticmethod
    def for_costs(costs: ReadCosts) -> ReadTuning:
        """Join ranges whenever reading the gap between them is cheaper than a request."""
        return ReadTuning(
            min_piece_bytes=4 << 10,
            merge_gap=costs.break_even_gap,
            max_request=costs.max_request,
            verify_slab=costs.verify_slab,
        )

    @staticmethod
    def for_storage(store: Storage) -> ReadTuning:
        """The tuning for the read costs ``store`` states."""
        return ReadTuning.for_costs(store.read_costs())


@dataclass(frozen=True, slots=True)
class Piece:
    """Item bytes ``[start, stop)``: read straight into the target at byte ``at``, or (``at``
    is None) into a bounce buffer whose elements ``extent`` places in the target."""

    start: int
    stop: int
    at: int | None
    extent: Extent | None = None


@dataclass(frozen=True, slots=True)
class ChunkRead:
    """How one requested box of a stored chunk is read and verified."""

    request: Box
    """The requested box, in chunk coordinates."""
    box: Box
    """The box the target buffer holds: ``request``, or wider to cover whole checksum tiles."""
    grid: Grid | None
    """Checksum tiles to verify over ``verify_box`` of the target (None: no verification)."""
    verify_box: Box
    sizes: tuple[int, ...]
    """The stored chunk's shape..."""
    itemsize: int
    """...and element size."""
    joins: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """``plan_extents``' options for the pieces (the read costs' joins)."""
    _pieces: tuple[Piece, ...] | None = field(default=None, compare=False, repr=False)

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """The file ranges that fill the box, planned on first use (a mapped file needs none:
        a dim-1 slice plans one piece per row)."""
        if self._pieces is None:
            object.__setattr__(self, "_pieces", _plan_pieces(self))
        assert self._pieces is not None
        return self._pieces

    @property
    def empty(self) -> bool:
        return math.prod(self.request[1]) == 0

    @property
    def widened(self) -> bool:
        return self.box != self.request

    @property
    def contiguous(self) -> bool:
        """Whether the box is one contiguous run of the chunk's bytes."""
        (offsets, lengths), d = self.box, 0
        while d < len(lengths) and lengths[d] == 1:
            d += 1
        rest = zip(offsets[d + 1 :], lengths[d + 1 :], self.sizes[d + 1 :])
        return all(o == 0 and n == s for o, n, s in rest)

    @property
    def span(self) -> tuple[int, int]:
        """The item bytes from the box's first element to its last."""
        strides = c_strides(self.sizes)
        offsets, lengths = self.box
        first = sum(map(operator.mul, offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
        return first * self.itemsize, (last + 1) * self.itemsize

    @property
    def bounce_bytes(self) -> int:
        return sum(p.stop - p.start for p in self.pieces if p.at is None)


def chunk_grid(sizes: Sequence[int], itemsize: int, block: int, *, tiled: bool) -> Grid | None:
    """The checksum tiles a read of a stored chunk verifies (None: ``block`` 0, no checks)."""
    return checksum.tensor_grid(sizes, itemsize, block, tiled=tiled) if block else None


def plan_box_read(
    sizes: Sequence[int],
    itemsize: int,
    offsets: Sequence[int],
    lengths: Sequence[int],
    grid: Grid | None,
    tuning: ReadTuning,
) -> ChunkRead:
    """The reader's plan for box ``offsets``+``lengths`` of a stored chunk on storage tuned by
    ``tuning`` (a local-tier restore fetches from peers exactly the ranges it names)."""
    return plan_chunk_read(
        sizes,
        itemsize,
        offsets,
        lengths,
        grid=grid,
        min_piece_bytes=tuning.min_piece_bytes,
        tuning=tuning,
    )


def plan_chunk_read(
    sizes: Sequence[int],
    itemsize: int,
    offsets: Sequence[int],
    lengths: Sequence[int],
    *,
    grid: Grid | None,
    min_piece_bytes: int,
    tuning: ReadTuning | None = None,
) -> ChunkRead:
    """Plan the read of box ``offsets``+``lengths`` of a C-contiguous chunk of ``sizes``.

    With a ``tuning``, pieces close enough by its cost model are read as joined spans into a
    bounce buffer and copied out in one strided copy (``plan_extents``): the bytes between
    them are read but never delivered nor verified.

    With a ``grid`` the box is widened to its tiles' edges; a grid over the item's bytes
    rather than its elements (chunks of formats 1 to 3 whose blocks cut rows) widens to the chunk.
    """
    sizes, request = tuple(sizes), (tuple(offsets), tuple(lengths))
    if math.prod(lengths) == 0:
        return ChunkRead(request, request, None, request, sizes, itemsize, _pieces=())
    box, verify_box = request, request
    if grid is not None:
        if grid.itemsize == itemsize and len(grid.sizes) == len(sizes):
            box = verify_box = grid.widen(*request)
        else:
            box = ((0,) * len(sizes), sizes)
            verify_box = ((0,), (grid.sizes[0],))
    joins: dict[str, Any] = {"min_piece_bytes": min_piece_bytes}
    if tuning is not None:
        joins |= {
            "join_gap": tuning.merge_gap,
            "max_span_bytes": tuning.max_request,
            "max_amplification": tuning.max_amplification,
        }
    return ChunkRead(request, box, grid, verify_box, sizes, itemsize, joins)


def _plan_pieces(read: ChunkRead) -> tuple[Piece, ...]:
    """The pieces of ``read`` (``plan_chunk_read`` explains them)."""
    (offsets, lengths), itemsize = read.box, read.itemsize
    extents = plan_extents(read.sizes, offsets, lengths, itemsize, **read.joins)
    byte_strides = [s * itemsize for s in c_strides(lengths)]
    pieces = []
    for ext in extents:
        start, stop = ext.start * itemsize, ext.stop * itemsize
        if ext.contiguous:  # a run of whole inner rows: contiguous in the target box as well
            pieces.append(Piece(start, stop, sum(map(operator.mul, ext.box_offsets, byte_strides))))
        else:
            pieces.append(Piece(start, stop, None, ext))
    return tuple(pieces)


@dataclass(slots=True)
class Request(Generic[T]):
    """One request for bytes ``[start, stop)`` of ``file``, filling ``members`` in order;
    the bytes between members are skipped."""

    file: str
    start: int
    stop: int
    members: list[tuple[int, int, T]]
    """``(start, stop, token)`` of each range served, ascending and disjoint."""


def coalesce(
    ranges: Sequence[tuple[str, int, int, T]],
    *,
    merge_gap: int,
    max_request: int,
    max_amplification: float = math.inf,
) -> list[Request[T]]:
    """Join ranges ``(file, start, stop, token)`` of one file that are at most ``merge_gap``
    bytes apart into requests of at most ``max_request`` bytes that read at most
    ``max_amplification`` times the bytes their ranges need; larger ranges, and ranges
    overlapping a previous one, stay requests of their own."""
    out: list[Request[T]] = []
    cur: Request[T] | None = None
    needed = 0
    for file, start, stop, token in sorted(ranges, key=lambda r: (r[0], r[1], r[2])):
        if (
            cur is not None
            and cur.file == file
            and cur.stop <= start <= cur.stop + merge_gap
            and stop - cur.start <= max_request
            and stop - cur.start <= max_amplification * (needed + stop - start)
        ):
            cur.stop = stop
            cur.members.append((start, stop, token))
            needed += stop - start
            continue
        cur = Request(file, start, stop, [(start, stop, token)])
        needed = stop - start
        out.append(cur)
    return out
