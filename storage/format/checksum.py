"""Checksums of stored items: one xxh3-64 digest per tile of a grid over the item's array.

An item is an array (a tensor chunk of ``sizes`` elements, or an object's bytes) cut into
boxes of ``tile`` elements, the last ones along each dimension shorter; tiles are numbered
in C order and a tile's digest covers its elements in C order. Format 4 picks tiles from a
chunk's shape (``tensor_tiles``) so that a column slice of a 2-D chunk is verified without
reading the rest of each row; formats 1 to 3 cut each item's bytes into flat blocks, which
is the grid ``flat_grid`` (and, where rows fit blocks, an equivalent grid over the elements).
Writer, reader and ``validate`` all hash and verify through this module.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from dcpbridge.storage.errors import ChecksumMismatchError

ALGORITHM = "xxh3_64"
DEFAULT_BLOCK_SIZE = 1 << 20
# Format 4 tiles: at most this many column groups on dim 1, each tile at least MIN_TILE bytes
# and each row piece of a tile at least MIN_SEGMENT bytes (finer tiles cost more metadata than
# the reads they save).
MAX_COLUMN_GROUPS = 8
MIN_TILE = 64 << 10
MIN_SEGMENT = 1 << 10
_MAX_SLAB = 16 << 20  # a streamed item buffers at most this much to hash tile rows at once

Box = tuple[tuple[int, ...], tuple[int, ...]]
What = str | Callable[[], str]  # what an error names: text, or a function making it on need


@dataclass(frozen=True, slots=True)
class Grid:
    """The checksum tiles of one item: an array of ``sizes`` x ``itemsize`` bytes in C order
    cut into boxes of ``tile`` elements (the last ones along a dimension may be shorter)."""

    sizes: tuple[int, ...]
    itemsize: int
    tile: tuple[int, ...]
    count: int = field(init=False, compare=False, repr=False)
    """Digests recorded for the item (an empty item has one, of no bytes)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "count", max(1, math.prod(self.counts)))

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(-(-s // t) for s, t in zip(self.sizes, self.tile))

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.itemsize

    def widen(self, offsets: Sequence[int], lengths: Sequence[int]) -> Box:
        """The smallest box on tile edges that holds box ``offsets``+``lengths``."""
        lo = [o // t * t for o, t in zip(offsets, self.tile)]
        hi = [
            min(-(-(o + n) // t) * t, s)
            for o, n, t, s in zip(offsets, lengths, self.tile, self.sizes)
        ]
        return tuple(lo), tuple(h - low for h, low in zip(hi, lo))

    def tiles(self, offsets: Sequence[int], lengths: Sequence[int]) -> Iterator[tuple[int, Box]]:
        """``(digest index, tile box relative to the box)`` of every tile in an aligned box."""
        if not self.sizes:
            yield 0, ((), ())
            return
        counts = self.counts
        ranges = [range(o // t, -(-(o + n) // t)) for o, n, t in zip(offsets, lengths, self.tile)]
        for idx in itertools.product(*ranges):
            flat = 0
            for i, c in zip(idx, counts):
                flat = flat * c + i
            lo = tuple(i * t - o for i, t, o in zip(idx, self.tile, offsets))
            n = tuple(min(t, s - i * t) for i, t, s in zip(idx, self.tile, self.sizes))
            yield flat, (lo, n)


def flat_grid(nbytes: int, block: int) -> Grid:
    """Blocks of ``block`` bytes over an item's bytes (objects; every item before format 4)."""
    return Grid((nbytes,), 1, (max(1, block),))


def tensor_tiles(sizes: Sequence[int], itemsize: int, block: int) -> tuple[int, ...]:
    """Format 4's tile for a chunk: up to ``MAX_COLUMN_GROUPS`` equal column groups on dim 1,
    then filled from the innermost dimension outward to ``block`` / groups bytes."""
    sizes = tuple(sizes)
    nbytes = math.prod(sizes) * itemsize
    if len(sizes) <= 1:
        return (max(1, block // itemsize),) if sizes else ()
    tile = list(sizes)
    groups = MAX_COLUMN_GROUPS
    inner = math.prod(sizes[2:]) * itemsize
    while groups > 1 and (
        sizes[1] % groups or nbytes // groups < MIN_TILE or sizes[1] // groups * inner < MIN_SEGMENT
    ):
        groups //= 2
    tile[1] = max(1, sizes[1] // groups)
    target = max(1, block // groups)
    size = itemsize
    for d in range(len(sizes) - 1, -1, -1):
        n = max(1, min(tile[d], target // size))
        if n < tile[d]:
            tile[d] = n
            tile[:d] = [1] * d
            break
        size *= n
    return tuple(tile)


@functools.lru_cache(maxsize=4096)
def tensor_grid(sizes: tuple[int, ...], itemsize: int, block: int, *, tiled: bool) -> Grid:
    """The grid of a tensor chunk: format 4's tiles, or the flat blocks over its bytes of
    formats 1 to 3 (cached: a checkpoint has few distinct chunk shapes)."""
    nbytes = math.prod(sizes) * itemsize
    if nbytes == 0:
        return Grid(sizes, itemsize, (1,) * len(sizes))
    if tiled:
        return Grid(sizes, itemsize, tensor_tiles(sizes, itemsize, block))
    # A flat block that is a run of whole rows of some dimension is that tile of the elements.
    for d in range(len(sizes) - 1, -1, -1):
        row = math.prod(sizes[d + 1 :]) * itemsize
        outer = row * sizes[d]
        if block % row == 0 and (d == 0 or outer % block == 0):
            n = min(block // row, sizes[d]) if d else block // row
            return Grid(sizes, itemsize, (1,) * d + (max(1, n),) + sizes[d + 1 :])
    if not sizes:
        return Grid((), itemsize, ())
    return flat_grid(nbytes, block)


def item_grid(
    nbytes: int,
    sizes: Sequence[int] | None,
    dtype: torch.dtype | None,
    block: int,
    *,
    tiled: bool = True,
) -> Grid:
    """The grid of a stored item: a tensor chunk's (``sizes``, ``dtype``), else flat blocks."""
    if sizes is None or dtype is None:
        return flat_grid(nbytes, block)
    return tensor_grid(tuple(sizes), dtype.itemsize, block, tiled=tiled)


def byte_array(data: memoryview | np.ndarray, shape: Sequence[int], itemsize: int) -> np.ndarray:
    """``data`` as a uint8 array of ``shape`` (the last dimension counted in bytes)."""
    flat = np.frombuffer(data, dtype=np.uint8)
    if not shape:
        return flat
    return flat.reshape(*shape[:-1], shape[-1] * itemsize)


def _tile_bytes(arr: np.ndarray, box: Box, itemsize: int) -> memoryview | np.ndarray:
    lo, n = box
    if not lo:
        return arr
    part = arr[box_index(lo, n, itemsize)]
    return part if part.flags.c_contiguous else np.ascontiguousarray(part)


def _box_digests(
    grid: Grid, data: memoryview, offsets: Sequence[int], lengths: Sequence[int]
) -> Iterator[tuple[int, str, Box]]:
    """``(digest index, digest, tile box in the box)`` of each tile of a tile-aligned box
    whose bytes (C order of the box) are ``data``."""
    groups = column_groups(grid)
    if groups and offsets[0] % grid.tile[0] == 0 and tuple(lengths[1:]) == grid.sizes[1:]:
        yield from _row_digests(grid, data, offsets[0], lengths[0], groups)
        return
    arr = byte_array(data, lengths, grid.itemsize)
    for index, box in grid.tiles(offsets, lengths):
        yield index, xxhash.xxh3_64_hexdigest(_tile_bytes(arr, box, grid.itemsize)), box


@functools.lru_cache(maxsize=4096)
def column_groups(grid: Grid) -> int:
    """The tiles side by side in each tile row where tiles cut dim 0 and dim 1 only, dim 1
    into equal groups (format 4's usual tiles, not contiguous in the chunk); else 0."""
    sizes, tile = grid.sizes, grid.tile
    if len(sizes) < 2 or tile[1] >= sizes[1] or sizes[1] % tile[1] or tile[2:] != sizes[2:]:
        return 0
    return sizes[1] // tile[1]


_SCRATCH = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """This thread's scratch buffer of at least ``nbytes`` (reused: no page faults per tile)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _SCRATCH.buf = np.empty(nbytes, np.uint8)
    return buf


def _row_digests(
    grid: Grid, data: memoryview, first: int, rows: int, groups: int
) -> list[tuple[int, str, Box]]:
    """``_box_digests`` of whole rows ``first`` (on a tile edge) to ``first + rows`` of a
    chunk with ``groups`` column groups, hashed one tile at a time (``_tiles_of_rows``)."""
    if rows == 0:
        return []
    width, rest = grid.tile[1], tuple(grid.sizes[2:])
    out = []
    for r, n, j, tile, index in _tiles_of_rows(grid, data, first, rows, groups):
        box = ((r, j * width) + (0,) * len(rest), (n, width, *rest))
        out.append((index, xxhash.xxh3_64_hexdigest(tile), box))
    return out


def _tiles_of_rows(
    grid: Grid, data: memoryview, first: int, rows: int, groups: int
) -> Iterator[tuple[int, int, int, np.ndarray, int]]:
    """The tiles of whole rows ``first`` (on a tile edge) to ``first + rows`` of a chunk with
    ``groups`` column groups (``data``: their bytes), each gathered by one copy into this
    thread's scratch of one tile, which stays in the core's cache for its hash (a whole tile
    row at once did not: measured 2-3% more CPU for 8 ranks on 2 cores): ``(row in data, rows,
    column group, tile bytes, digest index)``; the scratch is reused once the next is asked."""
    arr = np.frombuffer(data, np.uint8).reshape(rows, groups, len(data) // rows // groups)
    piece = arr.shape[2]
    step, across = grid.tile[0], grid.counts[1]
    scratch = _scratch(min(step, rows) * piece)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        tile = scratch[: n * piece].reshape(n, piece)
        base = (first + r) // step * across
        for j in range(groups):
            np.copyto(tile, arr[r : r + n, j])
            yield r, n, j, tile, base + j


def _tile_rows(
    grid: Grid, arr: np.ndarray, first: int, first_group: int
) -> Iterator[tuple[int, int, np.ndarray, int]]:
    """The tile rows of ``arr`` (rows x tiles x bytes of a tile's row: whole tiles of a grid
    with column groups, rows from ``first``, on a tile edge, tiles from column group
    ``first_group``), each regrouped tile by tile by one copy into this thread's scratch:
    ``(row in arr, rows, tiles x rows x bytes, digest index of its first tile)``; a tile
    row's scratch is reused once the next is asked for."""
    rows, tiles, piece = arr.shape
    step, across = grid.tile[0], grid.counts[1]
    scratch = _scratch(min(step, rows) * tiles * piece)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        part = scratch[: n * tiles * piece].reshape(tiles, n, piece)
        np.copyto(part, arr[r : r + n].transpose(1, 0, 2))
        yield r, n, part, (first + r) // step * across + first_group


def digests(grid: Grid, data: memoryview) -> list[str]:
    """The digest of every tile of an item whose bytes (C order) are ``data``."""
    if grid.nbytes == 0:
        return [xxhash.xxh3_64_hexdigest(b"")]
    if grid.count == 1 and grid.nbytes == len(data):  # one tile: no array, no tile walk
        return [xxhash.xxh3_64_hexdigest(data)]
    return [d for _, d, _ in _box_digests(grid, data, (0,) * len(grid.sizes), grid.sizes)]


def same_digests(grid: Grid, data: memoryview, expected: Sequence[str]) -> bool:
    """Whether every tile of ``data`` (an item's bytes in C order) hashes to ``expected``;
    stops at the first tile that differs, so a changed item costs about one tile's hash."""
    if len(expected) != grid.count and grid.nbytes:
        return False
    if grid.nbytes == 0 or (grid.count == 1 and grid.nbytes == len(data)):
        return xxhash.xxh3_64_hexdigest(data) == expected[0]
    zeros = (0,) * len(grid.sizes)
    return all(d == expected[i] for i, d, _ in _box_digests(grid, data, zeros, grid.sizes))


def item_digests(
    data: memoryview, sizes: Sequence[int] | None, dtype: torch.dtype | None, block: int
) -> tuple[str, ...]:
    """The digests a save records for an item (format 4): ``data`` is its bytes in C order."""
    return tuple(digests(item_grid(len(data), sizes, dtype, block), data))


def chunk_digests(
    data: memoryview, sizes: torch.Size, dtype: torch.dtype, block: int
) -> tuple[str, ...]:
    """``item_digests`` of a tensor chunk whose bytes are ``data``, its grid found once per
    shape (``torch.Size`` keys): a small item costs one hash, not a grid lookup larger than it."""
    return tuple(digests(_chunk_grid(sizes, dtype, block), data))


tile_digest = xxhash.xxh3_64_hexdigest  # the recorded digest of one tile's bytes


def chunk_grid_is_one_tile(sizes: torch.Size, dtype: torch.dtype, block: int) -> bool:
    """Whether a chunk of ``sizes`` and ``dtype`` has one checksum tile, its whole bytes
    (then ``chunk_digests`` of it is ``(tile_digest(its bytes),)``)."""
    grid = _chunk_grid(sizes, dtype, block)
    return grid.count == 1 and grid.nbytes > 0


@functools.lru_cache(maxsize=4096)
def _chunk_grid(sizes: torch.Size, dtype: torch.dtype, block: int) -> Grid:
    return item_grid(math.prod(sizes) * dtype.itemsize, sizes, dtype, block)


def verify(
    grid: Grid,
    data: memoryview,
    offsets: Sequence[int],
    lengths: Sequence[int],
    expected: Sequence[str],
    *,
    what: str | Callable[[], str],
) -> None:
    """Check every tile of the tile-aligned box ``offsets``+``lengths`` whose bytes (C order of
    the box) are ``data`` against ``expected``; raise ``ChecksumMismatchError`` naming it."""
    if grid.nbytes == 0 or (grid.count == 1 and len(data) == grid.nbytes):
        got = xxhash.xxh3_64_hexdigest(data)  # one tile, the whole item: no array, no walk
        if got != expected[0]:
            raise_mismatch(0, got, expected, what, "the item")
        return
    groups = column_groups(grid)
    if (
        groups
        and lengths[0]
        and offsets[0] % grid.tile[0] == 0
        and tuple(lengths[1:]) == grid.sizes[1:]
    ):
        # whole rows of column-group tiles (a slab of a whole-chunk read): no boxes unless bad
        for r, n, j, tile, index in _tiles_of_rows(grid, data, offsets[0], lengths[0], groups):
            got = xxhash.xxh3_64_hexdigest(tile)
            if got != expected[index]:
                where = _group_tile(grid, offsets[0] + r, j * grid.tile[1], n)
                raise_mismatch(index, got, expected, what, where)
        return
    for index, got, (lo, n) in _box_digests(grid, data, offsets, lengths):
        if got != expected[index]:
            at = [o + b for o, b in zip(offsets, lo)]
            raise_mismatch(index, got, expected, what, _span(grid, at, n))


def copy_verified(
    grid: Grid,
    item: np.ndarray,
    out: memoryview,
    offsets: Sequence[int],
    lengths: Sequence[int],
    expected: Sequence[str],
    *,
    what: str | Callable[[], str],
) -> None:
    """Copy the tile-aligned box ``offsets``+``lengths`` of an item (``item``: its bytes in C
    order, a mapped file) into ``out`` (the box's bytes in C order) one tile at a time through
    a scratch buffer that is hashed before it lands: the bytes delivered are the bytes checked,
    whatever happens to ``item`` meanwhile; raise ``ChecksumMismatchError`` naming the tile."""
    if column_groups(grid) and offsets[0] % grid.tile[0] == 0:
        _copy_tile_rows(grid, item, out, (tuple(offsets), tuple(lengths)), expected, what)
        return
    src = byte_array(item, grid.sizes, grid.itemsize)
    dst = byte_array(out, lengths, grid.itemsize)
    scratch = _scratch(math.prod(grid.tile) * grid.itemsize)
    for index, (lo, n) in grid.tiles(offsets, lengths):
        at = tuple(o + b for o, b in zip(offsets, lo))
        shape = (*n[:-1], n[-1] * grid.itemsize)
        part = scratch[: math.prod(shape)].reshape(shape)
        np.copyto(part, src[box_index(at, n, grid.itemsize)])
        got = xxhash.xxh3_64_hexdigest(part)
        if got != expected[index]:
            raise_mismatch(index, got, expected, what, _span(grid, at, n))
        dst[box_index(lo, n, grid.itemsize)] = part


def _copy_tile_rows(
    grid: Grid, item: np.ndarray, out: memoryview, box: Box, expected: Sequence[str], what: What
) -> None:
    """``copy_verified`` where tiles cut dims 0 and 1 only: one tile row of the box at a time
    (one copy gathers its tiles into scratch, one places them), every tile of it hashed before
    any of it lands; a box of 2048 rows of 4 tiles makes 32 rounds of Python, not 128."""
    offsets, lengths = box
    row = grid.nbytes // grid.sizes[0]  # bytes of a chunk row, and of a tile's row:
    piece = row // grid.sizes[1] * grid.tile[1]
    tiles = lengths[1] // grid.tile[1]
    first = offsets[1] // grid.tile[1]
    src = np.frombuffer(item, np.uint8, grid.nbytes).reshape(grid.sizes[0], row // piece, piece)
    cut = src[offsets[0] : offsets[0] + lengths[0], first : first + tiles]
    dst = np.frombuffer(out, np.uint8).reshape(lengths[0], tiles, piece)
    for r, n, part, base in _tile_rows(grid, cut, offsets[0], first):
        for j in range(tiles):
            got = xxhash.xxh3_64_hexdigest(part[j])
            if got != expected[base + j]:
                where = _group_tile(grid, offsets[0] + r, offsets[1] + j * grid.tile[1], n)
                raise_mismatch(base + j, got, expected, what, where)
        np.copyto(dst[r : r + n], part.transpose(1, 0, 2))


def _group_tile(grid: Grid, row: int, column: int, rows: int) -> str:
    """Where the column-group tile of ``rows`` rows at (``row``, ``column``) lies."""
    rest = grid.sizes[2:]
    return _span(grid, (row, column, *(0,) * len(rest)), (rows, grid.tile[1], *rest))


def _span(grid: Grid, at: Sequence[int], n: Sequence[int]) -> str:
    """Where a tile lies, for an error message."""
    if grid.itemsize == 1 and len(grid.sizes) == 1:
        return f"bytes {at[0]}..{at[0] + n[0]} of the item"
    return f"elements {list(at)}+{list(n)} of the chunk"


def box_index(lo: Sequence[int], n: Sequence[int], itemsize: int) -> tuple[slice, ...]:
    """Index of box ``lo``+``n`` in a ``byte_array`` (its last dimension counts bytes)."""
    if not lo:
        return ()
    index = tuple(slice(o, o + k) for o, k in zip(lo[:-1], n[:-1]))
    return (*index, slice(lo[-1] * itemsize, (lo[-1] + n[-1]) * itemsize))


def raise_mismatch(
    index: int, got: str, expected: Sequence[str], what: str | Callable[[], str], span: str
) -> None:
    """Raise ``ChecksumMismatchError`` for tile ``index`` (``span`` says where it lies)."""
    where = what() if callable(what) else what
    raise ChecksumMismatchError(
        f"checksum mismatch in {where}, block {index} ({span}): expected {ALGORITHM} "
        f"{expected[index]}, got {got}. The data file, or the checksum recorded in "
        "dcpbridge.json, was modified or corrupted after the save."
    )


class Hasher:
    """``digests`` of an item fed in pieces of any size, in C order (for streamed writes).

    The item is walked as runs: each run is the part of one tile that is contiguous in the
    item (a tile's row piece, or a whole tile where tiles span whole rows).
    """

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        sizes, tile = grid.sizes, grid.tile
        # Tiles several rows tall with short row pieces: hash whole slabs of tile rows at once
        # (one tile row of dim 0 is about one block).
        self._slab = tile[0] * (grid.nbytes // sizes[0]) if len(sizes) > 1 and sizes[0] else 0
        if not (tile and tile[0] > 1 and self._slab <= _MAX_SLAB):
            self._slab = 0
        self._buf = bytearray()
        self._slab_row = 0
        # the innermost dimension that tiles cut; runs are tile-wide along it
        cut = max((d for d in range(len(sizes)) if tile[d] < sizes[d]), default=-1)
        self._cut = cut
        inner = math.prod(sizes[cut + 1 :]) * grid.itemsize if sizes else grid.itemsize
        self._along = sizes[cut] if cut >= 0 else 1
        self._step = tile[cut] if cut >= 0 else 1
        self._inner = inner  # bytes of one index along the cut dimension
        self._outer = math.prod(sizes[:cut]) if cut > 0 else 1
        self._tile_bytes: dict[int, int] = {}
        self._open: dict[int, xxhash.xxh3_64] = {}
        self._done: dict[int, str] = {}
        self._row = 0  # index over the outer dimensions
        self._col = 0  # index along the cut dimension within the current row
        self._fill = 0  # bytes of the current run already fed
        self._total = 0

    def _tile_of(self) -> tuple[int, int]:
        """(digest index, bytes of that tile) for the run at the current position."""
        g = self.grid
        cut = self._cut
        if cut < 0:
            return 0, g.nbytes
        idx: list[int] = []
        rem = self._row
        for d in range(cut - 1, -1, -1):
            idx.append(rem % g.sizes[d])
            rem //= g.sizes[d]
        coords = [i // t for i, t in zip(reversed(idx), g.tile)] + [self._col // self._step]
        coords += [0] * (len(g.sizes) - cut - 1)
        flat = 0
        for i, c in zip(coords, g.counts):
            flat = flat * c + i
        n = math.prod(min(t, s - c * t) for c, t, s in zip(coords, g.tile, g.sizes)) * g.itemsize
        return flat, n

    def _hash_slab(self, data: memoryview) -> None:
        g = self.grid
        rows = len(data) * g.sizes[0] // g.nbytes
        offsets = (self._slab_row,) + (0,) * (len(g.sizes) - 1)
        for index, digest, _ in _box_digests(g, data, offsets, (rows, *g.sizes[1:])):
            self._done[index] = digest
        self._slab_row += rows

    def update(self, data: memoryview) -> None:
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        self._total += len(data)
        if self._slab:
            if not self._buf and len(data) >= self._slab:  # whole slabs straight from the input
                whole = len(data) // self._slab * self._slab
                self._hash_slab(data[:whole])
                data = data[whole:]
            self._buf += data
            while len(self._buf) >= self._slab:
                self._hash_slab(memoryview(self._buf)[: self._slab])
                del self._buf[: self._slab]
            return
        while len(data):
            run = min(self._step, self._along - self._col) * self._inner
            index, size = self._tile_of()
            h = self._open.get(index)
            if h is None:
                h = self._open[index] = xxhash.xxh3_64()
                self._tile_bytes[index] = 0
            take = min(len(data), run - self._fill)
            h.update(data[:take])
            data = data[take:]
            self._fill += take
            self._tile_bytes[index] += take
            if self._tile_bytes[index] == size:
                self._done[index] = self._open.pop(index).hexdigest()
                del self._tile_bytes[index]
            if self._fill == run:
                self._fill = 0
                self._col += self._step
                if self._col >= self._along:
                    self._col = 0
                    self._row += 1

    def finish(self) -> tuple[str, ...]:
        if not self._total:
            return (xxhash.xxh3_64_hexdigest(b""),)
        if self._buf and self._total == self.grid.nbytes:  # the last, shorter slab
            self._hash_slab(memoryview(self._buf))
            self._buf = bytearray()
        if self._open or len(self._done) != self.grid.count:
            raise ValueError(f"item fed {self._total} bytes, its grid covers {self.grid.nbytes}")
        return tuple(self._done[i] for i in range(self.grid.count))
