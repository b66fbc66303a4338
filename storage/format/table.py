"""Stored items as columns: the commit document's item table (its checks: ``table_checks``).

One row per stored item: the chunks of every tensor (tensor by tensor, each tensor's chunks
sorted by offsets), then the objects. Where an item lives (file, byte offset, size, writing
rank, block checksums) and, for chunks, the box it holds are arrays, so building, encoding,
decoding and validating a million chunks costs array operations, not Python objects. The
table is also the ``StorageIndex.items`` mapping the reader queries; a ``StoredItem`` is
made only for the items a load asks for.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import operator
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from dcpbridge.storage.errors import CorruptCheckpointError
from dcpbridge.storage.format.tiling import tile_counts

ItemKey = tuple[str, "tuple[int, ...] | None"]

# Largest dimension, offset or byte count a document may state (far below int64 overflow).
MAX_SIZE = 1 << 62
MAX_NDIM = 64
# Rows and checksums a table may hold: a bound on what a document can make a load allocate.
MAX_ROWS = 1 << 28
ITEM_ALIGN = 64
_WIDTHS = ("<u1", "<u2", "<u4", "<u8")


@dataclass(slots=True, unsafe_hash=True)
class StoredItem:
    """Where one written item's bytes live, their block checksums and (tensors) chunk layout.

    Read-only by convention, hashable by value, not frozen: a frozen dataclass's ``__init__``
    sets each field through ``object.__setattr__`` (~6 us against ~1 us here), and a save
    makes one per item.
    """

    file: str
    offset: int
    nbytes: int
    rank: int
    checksums: tuple[str, ...] | None = None
    sizes: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None


def describe_item(key: ItemKey) -> str:
    """How errors name a stored item: ``tensor 'w' chunk [0, 4]`` or ``object 'o'``."""
    fqn, offsets = key
    return f"object {fqn!r}" if offsets is None else f"tensor {fqn!r} chunk {list(offsets)}"


def shown_value(value: Any) -> str:
    """``repr(value)`` cut to 60 characters, for error messages quoting hostile metadata."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- columns ------------------------------------------------------------------------------------


def pack_column(
    values: np.ndarray, *, compress: bool = True, width: str | None = None
) -> dict[str, Any]:
    """A JSON-embeddable column: little-endian ``width`` (default the narrowest that holds
    the values), zlib'd, base64 text."""
    if width is None:
        top = int(values.max()) if values.size else 0
        width = next(w for w in _WIDTHS if top <= np.iinfo(np.dtype(w)).max)
    data = np.ascontiguousarray(values, dtype=np.dtype(width)).tobytes()
    if compress:
        data = zlib.compress(data, 1)
    return {
        "type": width,
        "count": int(values.size),
        "zlib": compress,
        "data": base64.b64encode(data).decode("ascii"),
    }


def unpack_column(entry: Any, what: str, *, checksums: bool = False) -> np.ndarray:
    """The int64 values of a packed column (uint64 for ``checksums``), refused unless every
    field is well-formed and the data decodes to exactly ``count`` values in range."""
    if type(entry) is not dict or set(entry) != {"type", "count", "zlib", "data"}:
        raise CorruptCheckpointError(f"{what}: not a packed column ({shown_value(entry)})")
    width, count, packed, text = entry["type"], entry["count"], entry["zlib"], entry["data"]
    # checksums are 8 bytes wide; an empty column of any width holds none (item-less saves
    # written before the checksums column was always '<u8' carry an empty '<u1' one)
    if width not in _WIDTHS or (checksums and width != "<u8" and count != 0):
        raise CorruptCheckpointError(f"{what}: unknown column type {shown_value(width)}")
    if type(count) is not int or not 0 <= count <= MAX_ROWS * (MAX_NDIM if not checksums else 1):
        raise CorruptCheckpointError(f"{what}: column count {shown_value(count)} is not valid")
    if type(packed) is not bool or type(text) is not str:
        raise CorruptCheckpointError(f"{what}: column fields have the wrong types")
    expected = count * np.dtype(width).itemsize
    try:
        raw = base64.b64decode(text, validate=True)
        if packed:
            inflate = zlib.decompressobj()
            raw = inflate.decompress(raw, expected + 1)
            if not inflate.eof or inflate.unconsumed_tail or inflate.unused_data:
                raise CorruptCheckpointError(f"{what}: column data does not hold {count} values")
    except (binascii.Error, zlib.error, ValueError) as e:
        raise CorruptCheckpointError(f"{what}: column data is not valid: {e}") from None
    if len(raw) != expected:
        raise CorruptCheckpointError(f"{what}: column data does not hold {count} values")
    values = np.frombuffer(raw, dtype=np.dtype(width))
    if checksums:
        return values.astype(np.uint64)
    if width == "<u8" and values.size and values.max() > MAX_SIZE:
        raise CorruptCheckpointError(
            f"{what}: value {int(values.max())} exceeds {MAX_SIZE} (at most 2**62)"
        )
    return values.astype(np.int64)


def hex_to_ints(digests: Sequence[str]) -> np.ndarray:
    """16-digit hex digests (``xxh3_64_hexdigest``) as uint64 values."""
    return np.frombuffer(bytes.fromhex("".join(digests)), dtype=">u8").astype(np.uint64)


def ints_to_hex(values: np.ndarray) -> tuple[str, ...]:
    text = values.astype(">u8").tobytes().hex()
    return tuple(text[i : i + 16] for i in range(0, len(text), 16))


# -- the table ----------------------------------------------------------------------------------


class _ChunkIndex:
    """Find a tensor's chunk by its offsets in boxes stored as columns (tensor by tensor)."""

    shapes: list[tuple[int, ...]]
    offsets: np.ndarray
    _bounds: list[int] | None
    _firsts: tuple[list[list[int]], list[list[int]]] | None
    _chunk_rows: dict[int, dict[tuple[int, ...], int]]
    _only: list[tuple[tuple[int, ...], tuple[int, ...]] | None] | None

    starts: np.ndarray  # row where each tensor's chunks start (a property of the subclass)

    @property
    def bounds(self) -> list[int]:
        """``starts`` as a list, for per-key lookups."""
        if self._bounds is None:
            self._bounds = self.starts.tolist()
        return self._bounds

    def chunk_offsets(self, row: int, ndim: int) -> tuple[int, ...]:
        return tuple(self.offsets[row, :ndim].tolist())

    def first_boxes(self) -> tuple[list[list[int]], list[list[int]]]:
        """Every tensor's first chunk as (offsets, sizes) lists, padded: one bulk conversion,
        so asking about a one-chunk tensor (most tensors) touches no array."""
        if self._firsts is None:
            n = self.offsets.shape[0]
            rows = np.minimum(self.starts[:-1], max(n - 1, 0))  # a chunkless tensor: unused
            if n == 0:
                self._firsts = ([[]] * len(rows), [[]] * len(rows))
            else:
                self._firsts = (self.offsets[rows].tolist(), self.sizes[rows].tolist())
        return self._firsts

    def only_boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]] | None]:
        """Per tensor, the (offsets, sizes) tuples of its only chunk (None: several or none),
        built once: asking whether a one-chunk tensor's chunk is a box is one comparison."""
        if self._only is None:
            counts = self.counts.tolist()
            offsets, sizes = self.first_boxes()
            self._only = [
                (tuple(o[: len(shape)]), tuple(s[: len(shape)])) if c == 1 else None
                for o, s, c, shape in zip(offsets, sizes, counts, self.shapes)
            ]
        return self._only

    def chunk_row(self, t: int, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int | None:
        """The row of tensor ``t``'s chunk that is exactly the box ``offsets``+``sizes``
        (``sizes`` may be a ``torch.Size``), or None."""
        only = self.only_boxes()[t]
        if only is not None:
            return self.bounds[t] if only == (offsets, sizes) else None
        row = self.find_chunk(t, offsets)
        if row is None or self.sizes[row, : len(sizes)].tolist() != list(sizes):
            return None
        return row

    def find_chunk(self, t: int, offsets: tuple[int, ...]) -> int | None:
        """The row of tensor ``t``'s chunk at ``offsets``, or None."""
        lo, hi = self.bounds[t], self.bounds[t + 1]
        ndim = len(self.shapes[t])
        if hi - lo == 1:
            return lo if tuple(self.first_boxes()[0][t][:ndim]) == offsets else None
        rows = self._chunk_rows.get(t)
        if rows is None:
            block = self.offsets[lo:hi, :ndim].tolist()
            rows = self._chunk_rows[t] = {tuple(o): lo + i for i, o in enumerate(block)}
        return rows.get(offsets)


@dataclass(eq=False)
class ItemTable(_ChunkIndex, Mapping[ItemKey, StoredItem]):
    """Every stored item of a checkpoint as columns; a read-only mapping key -> StoredItem.

    ``offsets``/``sizes`` hold the boxes of the tensor rows, padded to the widest tensor's
    dims (offset 0, size 1); ``checksums`` the block checksums of all rows, in row order.
    """

    tensors: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    counts: np.ndarray  # chunks per tensor
    objects: list[str]
    files: tuple[str, ...]
    file: np.ndarray  # per row: index into ``files``
    offset: np.ndarray
    nbytes: np.ndarray
    rank: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    checksums: np.ndarray | None = None
    block_size: int = 0  # checksum block size the ``StoredItem``s are made for
    tiled: bool = True  # chunks' checksums cover tiles of their shape (format 4), else blocks
    _starts: np.ndarray | None = field(default=None, repr=False)
    _blocks: tuple[tuple[int, bool], np.ndarray] | None = field(default=None, repr=False)
    _sum_starts: tuple[tuple[int, bool], np.ndarray] | None = field(default=None, repr=False)
    _tensor_ids: dict[str, int] | None = field(default=None, repr=False)
    _object_rows: dict[str, int] | None = field(default=None, repr=False)
    _chunk_rows: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict, repr=False)
    _hex: dict[tuple[int, int, bool], tuple[str, ...]] = field(default_factory=dict, repr=False)
    _bounds: list[int] | None = field(default=None, repr=False)
    _firsts: tuple[list[list[int]], list[list[int]]] | None = field(default=None, repr=False)
    _only: list[tuple[tuple[int, ...], tuple[int, ...]] | None] | None = field(
        default=None, repr=False
    )

    # -- layout ---------------------------------------------------------------------------------

    @property
    def tensor_rows(self) -> int:
        return int(self.offsets.shape[0])

    @property
    def starts(self) -> np.ndarray:
        """Row where each tensor's chunks start (one more entry: the first object row)."""
        if self._starts is None:
            self._starts = np.zeros(len(self.tensors) + 1, dtype=np.int64)
            np.cumsum(self.counts, out=self._starts[1:])
        return self._starts

    def row_tensor(self) -> np.ndarray:
        """The tensor index of every tensor row."""
        return np.repeat(np.arange(len(self.tensors), dtype=np.int64), self.counts)

    def ndims(self) -> np.ndarray:
        return np.fromiter(map(len, self.shapes), dtype=np.int64, count=len(self.shapes))

    def blocks(self, block: int) -> np.ndarray:
        """Checksums each row has for ``block`` (at least one, even when empty): flat blocks
        of its bytes, or for a chunk of a tiled table the tiles of its shape."""
        if self._blocks is not None and self._blocks[0] == (block, self.tiled):
            return self._blocks[1]
        counts = np.maximum(1, -(-self.nbytes // block))
        nt = self.tensor_rows
        if self.tiled and nt:
            tid = self.row_tensor()
            itemsize = np.array([d.itemsize for d in self.dtypes], dtype=np.int64)[tid]
            counts[:nt] = tile_counts(self.sizes, self.ndims()[tid], itemsize, block)
        self._blocks = ((block, self.tiled), counts)
        return counts

    def sum_starts(self, block: int) -> np.ndarray:
        """Where each row's checksums start in ``checksums`` (one more entry: their count)."""
        if self._sum_starts is None or self._sum_starts[0] != (block, self.tiled):
            starts = np.zeros(len(self.nbytes) + 1, dtype=np.int64)
            np.cumsum(self.blocks(block), out=starts[1:])
            self._sum_starts = ((block, self.tiled), starts)
        return self._sum_starts[1]

    @property
    def tensor_ids(self) -> dict[str, int]:
        """Each stored tensor's index by name (built on first use)."""
        if self._tensor_ids is None:
            self._tensor_ids = {name: i for i, name in enumerate(self.tensors)}
        return self._tensor_ids

    def tensor_id(self, fqn: str) -> int | None:
        return self.tensor_ids.get(fqn)

    def key(self, row: int) -> ItemKey:
        if row >= self.tensor_rows:
            return self.objects[row - self.tensor_rows], None
        t = int(np.searchsorted(self.starts, row, side="right")) - 1
        return self.tensors[t], self.chunk_offsets(row, len(self.shapes[t]))

    def find(self, key: ItemKey) -> int | None:
        """The row of ``key`` (fqn, chunk offsets or None for an object), or None."""
        fqn, offsets = key
        if offsets is None:
            if self._object_rows is None:
                base = self.tensor_rows
                self._object_rows = {name: base + i for i, name in enumerate(self.objects)}
            return self._object_rows.get(fqn)
        t = self.tensor_id(fqn)
        if t is None:
            return None
        return self.find_chunk(t, tuple(offsets))

    def _sums(self, row: int, block: int) -> tuple[str, ...] | None:
        """Row ``row``'s checksums as hex (None without checksums), made on first use: a rank
        looks up its own items, not every item of the job."""
        if self.checksums is None:
            return None
        key = (row, block, self.tiled)
        got = self._hex.get(key)
        if got is None:
            starts = self.sum_starts(block)
            got = self._hex[key] = ints_to_hex(self.checksums[starts[row] : starts[row + 1]])
        return got

    def stored(self, row: int, block: int = 0, t: int | None = None) -> StoredItem:
        """The ``StoredItem`` of ``row`` (``block``: the checksum block size, if any; ``t``:
        the row's tensor, if known)."""
        sums = self._sums(row, block)
        sizes = dtype = None
        if row < self.tensor_rows:
            if t is None:
                t = int(np.searchsorted(self.starts, row, side="right")) - 1
            sizes = tuple(self.sizes[row, : len(self.shapes[t])].tolist())
            dtype = self.dtypes[t]
        return StoredItem(
            self.files[int(self.file[row])],
            int(self.offset[row]),
            int(self.nbytes[row]),
            int(self.rank[row]),
            sums,
            sizes,
            dtype,
        )

    def rows_of(self, keys: Sequence[ItemKey]) -> tuple[list[int], list[int]]:
        """The row of every key (-1 where absent) and its tensor (-1: an object), found in
        one pass: one-chunk tensors (most) are compared with their chunk's offsets in bulk."""
        bounds, shapes = self.bounds, self.shapes
        rows: list[int] = []
        tids: list[int] = []
        unsure: list[tuple[int, tuple[int, ...]]] = []  # (position, offsets) of one-chunk tensors
        ids = self.tensor_ids
        for fqn, offsets in keys:
            if offsets is None:
                row = self.find((fqn, None))
                rows.append(-1 if row is None else row)
                tids.append(-1)
                continue
            t = ids.get(fqn)
            if t is None:
                rows.append(-1)
                tids.append(-1)
                continue
            row = bounds[t]
            if bounds[t + 1] - row == 1:  # its only chunk: compared below, in bulk
                unsure.append((len(rows), tuple(offsets)))
            else:
                found = self.find_chunk(t, tuple(offsets))
                row = -1 if found is None else found
            rows.append(row)
            tids.append(t)
        if unsure:
            firsts = self.first_boxes()[0]
            for j, offsets in unsure:
                t = tids[j]
                nd = len(shapes[t])
                if len(offsets) != nd or firsts[t][:nd] != list(offsets):
                    rows[j] = -1  # no chunk at these offsets
        return rows, tids

    def get_many(self, keys: Sequence[ItemKey]) -> list[StoredItem | None]:
        """``get`` of many keys at once (None where absent): each column is read once for
        all of them instead of element by element (a load looks up every item it reads)."""
        out: list[StoredItem | None] = [None] * len(keys)
        shapes = self.shapes
        all_rows, all_tids = self.rows_of(keys)
        where = [i for i, row in enumerate(all_rows) if row >= 0]  # found rows' key positions
        rows = [all_rows[i] for i in where]
        tids = [all_tids[i] for i in where]
        if not rows:
            return out
        at = np.asarray(rows, dtype=np.int64)
        nt = self.tensor_rows
        tensor_at = np.minimum(at, max(nt - 1, 0))
        file, offset = self.file[at].tolist(), self.offset[at].tolist()
        nbytes, rank = self.nbytes[at].tolist(), self.rank[at].tolist()
        sizes = self.sizes[tensor_at].tolist() if nt else []
        block = self.block_size
        files, dtypes = self.files, self.dtypes
        for j, row in enumerate(rows):
            if row < 0:
                continue
            sums = self._sums(row, block)
            t = tids[j]
            size = dtype = None
            if row < nt:
                size, dtype = tuple(sizes[j][: len(shapes[t])]), dtypes[t]
            out[where[j]] = StoredItem(
                files[file[j]], offset[j], nbytes[j], rank[j], sums, size, dtype
            )
        return out

    # -- Mapping ----------------------------------------------------------------------------

    def __getitem__(self, key: ItemKey) -> StoredItem:
        item = self.get(key)
        if item is None:
            raise KeyError(key)
        return item

    def get(self, key: ItemKey, default: Any = None) -> Any:  # type: ignore[override]
        fqn, offsets = key
        if offsets is None:
            row = self.find(key)
            return default if row is None else self.stored(row, self.block_size)
        t = self.tensor_id(fqn)
        row = None if t is None else self.find_chunk(t, tuple(offsets))
        return default if row is None else self.stored(row, self.block_size, t)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and len(key) == 2 and self.find(key) is not None  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[ItemKey]:
        return (self.key(row) for row in range(len(self.nbytes)))

    def __len__(self) -> int:
        return len(self.nbytes)


@dataclass(frozen=True, slots=True, eq=False)
class Sources:
    """Where each planned chunk comes from: which rank's write item, at which position of
    that rank's plan."""

    digests: tuple[bytes, ...]  # per rank: the fingerprint of the plan it sent
    starts: np.ndarray  # per rank: where its items start in ``row`` (one more: the total)
    row: np.ndarray  # per item of every plan, rank by rank: its chunk row (-1: an object)


@dataclass(eq=False)
class PlannedBoxes(_ChunkIndex):
    """The chunk boxes of a save plan as columns: every tensor's chunks, tensor by tensor and
    sorted by offsets, padded like an ``ItemTable``'s (offset 0, size 1).

    ``checked`` says the save planner verified that they tile every tensor of ``shapes``
    exactly once. The arrays are read-only, so a table whose boxes equal them needs no second
    coverage check when it is encoded (a load still checks everything it decodes).
    """

    shapes: list[tuple[int, ...]]
    counts: np.ndarray  # chunks per tensor
    offsets: np.ndarray
    sizes: np.ndarray
    checked: bool
    sources: Sources | None = None  # which rank's item each row is (write results by position)
    _starts: np.ndarray | None = field(default=None, repr=False)
    _bounds: list[int] | None = field(default=None, repr=False)
    _firsts: tuple[list[list[int]], list[list[int]]] | None = field(default=None, repr=False)
    _only: list[tuple[tuple[int, ...], tuple[int, ...]] | None] | None = field(
        default=None, repr=False
    )
    _chunk_rows: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for a in (self.counts, self.offsets, self.sizes):
            a.flags.writeable = False

    @property
    def starts(self) -> np.ndarray:
        """Row where each tensor's chunks start (one more entry: the number of rows)."""
        if self._starts is None:
            self._starts = np.zeros(len(self.shapes) + 1, dtype=np.int64)
            np.cumsum(self.counts, out=self._starts[1:])
        return self._starts

    def same_boxes(self, table: ItemTable) -> bool:
        """Whether ``table`` stores exactly these boxes for exactly these tensors."""
        return (
            self.shapes == table.shapes
            and np.array_equal(self.counts, table.counts)
            and self.offsets.shape == table.offsets.shape
            and np.array_equal(self.offsets, table.offsets)
            and np.array_equal(self.sizes, table.sizes)
        )


class ChunkList(Sequence[ChunkStorageMetadata]):
    """DCP ``TensorStorageMetadata.chunks`` of one tensor, made on first use from the table
    (a decoded ``ItemTable``, or the ``PlannedBoxes`` of a save plan)."""

    def __init__(self, table: ItemTable | PlannedBoxes, t: int) -> None:
        self.table, self.t = table, t
        self._made: list[ChunkStorageMetadata] | None = None

    @property
    def rows(self) -> tuple[int, int]:
        starts = self.table.starts
        return int(starts[self.t]), int(starts[self.t + 1])

    def holds(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
        """Whether one of these chunks is exactly the box ``offsets``+``sizes``."""
        return self.table.chunk_row(self.t, offsets, sizes) is not None

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, sizes) of this tensor's chunks, ``(n, ndim)`` int64 each."""
        lo, hi = self.rows
        nd = len(self.table.shapes[self.t])
        return self.table.offsets[lo:hi, :nd], self.table.sizes[lo:hi, :nd]

    def box(self, i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) of chunk ``i`` as tuples."""
        row = int(self.table.starts[self.t]) + i
        nd = len(self.table.shapes[self.t])
        return (
            tuple(self.table.offsets[row, :nd].tolist()),
            tuple(self.table.sizes[row, :nd].tolist()),
        )

    def _all(self) -> list[ChunkStorageMetadata]:
        if self._made is None:
            offsets, sizes = (a.tolist() for a in self.arrays())
            self._made = [
                ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in zip(offsets, sizes)
            ]
        return self._made

    def __len__(self) -> int:
        return int(self.table.counts[self.t])

    def __getitem__(self, i: Any) -> Any:
        if self._made is None and isinstance(i, int):
            n = len(self)
            if not -n <= i < n:
                raise IndexError(i)
            lo, _ = self.rows
            nd = len(self.table.shapes[self.t])
            row = lo + (i % n)
            return ChunkStorageMetadata(
                torch.Size(self.table.offsets[row, :nd].tolist()),
                torch.Size(self.table.sizes[row, :nd].tolist()),
            )
        return self._all()[i]

    def __iter__(self) -> Iterator[ChunkStorageMetadata]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, ChunkList)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._all())

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as the plain list DCP's own planner makes, so a ``.metadata`` that torch's
        writer pickles from a dcpbridge planner's metadata names no dcpbridge class."""
        return (list, (self._all(),))


# -- building -----------------------------------------------------------------------------------


@dataclass(slots=True)
class TensorHeader:
    """A tensor's entry in the table's header: name, dtype and global shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def table_from_rows(
    tensors: Sequence[TensorHeader],
    objects: Sequence[str],
    files: Sequence[str],
    tensor_rows: Sequence[tuple[int, tuple[int, ...], tuple[int, ...], StoredItem]],
    object_rows: Sequence[StoredItem],
    *,
    checksums: bool,
    tiled: bool = True,
) -> ItemTable:
    """A table from rows ``(tensor index, offsets, sizes, item)`` in any order, and the
    objects' items in ``objects`` order. Each tensor's chunks end up sorted by offsets."""
    ndim = [len(h.shape) for h in tensors]
    width = max(ndim, default=0)
    order = sorted(range(len(tensor_rows)), key=lambda i: (tensor_rows[i][0], tensor_rows[i][1]))
    rows = [tensor_rows[i] for i in order]
    pad_o = [(*r[1], *(0,) * (width - len(r[1]))) for r in rows]
    pad_s = [(*r[2], *(1,) * (width - len(r[2]))) for r in rows]
    items = [r[3] for r in rows] + list(object_rows)
    return _assemble(
        tensors,
        np.bincount(np.array([r[0] for r in rows], dtype=np.int64), minlength=len(tensors))
        if rows
        else np.zeros(len(tensors), dtype=np.int64),
        objects,
        files,
        np.array(pad_o, dtype=np.int64).reshape(len(rows), width),
        np.array(pad_s, dtype=np.int64).reshape(len(rows), width),
        items,
        checksums=checksums,
        tiled=tiled,
    )


def _assemble(
    tensors: Sequence[TensorHeader],
    counts: np.ndarray,
    objects: Sequence[str],
    files: Sequence[str],
    offsets: np.ndarray,
    sizes: np.ndarray,
    items: Sequence[StoredItem],
    *,
    checksums: bool,
    tiled: bool,
) -> ItemTable:
    file_ids = {name: i for i, name in enumerate(files)}
    n = len(items)
    sums = None
    if checksums:
        sums = hex_to_ints(list(itertools.chain.from_iterable(it.checksums or () for it in items)))
    return ItemTable(
        tensors=[h.name for h in tensors],
        dtypes=[h.dtype for h in tensors],
        shapes=[tuple(h.shape) for h in tensors],
        counts=counts.astype(np.int64),
        objects=list(objects),
        files=tuple(files),
        file=np.fromiter((file_ids[it.file] for it in items), dtype=np.int64, count=n),
        offset=np.fromiter((it.offset for it in items), dtype=np.int64, count=n),
        nbytes=np.fromiter((it.nbytes for it in items), dtype=np.int64, count=n),
        rank=np.fromiter((it.rank for it in items), dtype=np.int64, count=n),
        offsets=offsets,
        sizes=sizes,
        checksums=sums,
        tiled=tiled,
    )


def first_true(mask: np.ndarray) -> int | None:
    """The index of the first True in ``mask``, or None."""
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def table_from_written(
    tensors: Sequence[TensorHeader],
    objects: Sequence[str],
    files: Sequence[str],
    fqns: Sequence[str],
    offsets: Sequence[Sequence[int] | None],
    items: Sequence[StoredItem],
    *,
    checksums: bool,
    planned: PlannedBoxes | None = None,
) -> ItemTable:
    """A table from what writers report: item ``i`` is ``fqns[i]`` at chunk ``offsets[i]``
    (None for an object), stored as ``items[i]``, in any order. Each column is one pass of
    C-level iteration over the items and the rows are put in order as arrays, so a million
    items stay cheap. When the chunks' keys are exactly those of ``planned`` (the boxes of
    the save plan), their sizes are the planned ones (the writers copied them from the plan;
    the byte counts still have to match them).

    Raises ``KeyError`` naming an item whose tensor or object is not in the header, and
    ``ValueError`` for a chunk whose offsets or sizes do not have its tensor's dims.
    """
    n, nt_head = len(items), len(tensors)
    ids = {name: i for i, name in enumerate(objects, nt_head)}
    ids.update((h.name, i) for i, h in enumerate(tensors))
    slot = np.fromiter(map(ids.__getitem__, fqns), dtype=np.int64, count=n)
    is_chunk = slot < nt_head
    chunk_rows = np.flatnonzero(is_chunk)
    nt = len(chunk_rows)
    all_chunks = nt == n
    if not all_chunks and any(offsets[i] is not None for i in np.flatnonzero(~is_chunk).tolist()):
        raise KeyError(
            next(f for f, c, o in zip(fqns, is_chunk, offsets) if not c and o is not None)
        )
    width = max((len(h.shape) for h in tensors), default=0)
    ndim = np.fromiter(map(len, (h.shape for h in tensors)), np.int64, nt_head)[slot[chunk_rows]]
    picked = offsets if all_chunks else list(itertools.compress(offsets, is_chunk))
    try:
        box_o = _boxes(picked, ndim, width, 0, lambda row: f"{fqns[int(chunk_rows[row])]!r}")
    except TypeError as e:  # an object's key (offsets None) for a tensor
        fqn = next((f for f, c, o in zip(fqns, is_chunk, offsets) if c and o is None), None)
        if fqn is None:
            raise ValueError(f"chunk offsets are not integers: {e}") from None
        raise KeyError(fqn) from None
    if all_chunks:
        order = np.lexsort((*box_o.T[::-1], slot))  # tensors' chunks by offsets
        place = order
    else:
        keys = np.zeros((n, width), dtype=np.int64)
        keys[chunk_rows] = box_o
        order = np.lexsort((*keys.T[::-1], slot))  # tensors' chunks by offsets, then objects
        place = _positions(chunk_rows, order[:nt])
    counts = np.bincount(slot[is_chunk], minlength=nt_head).astype(np.int64)
    box_o = box_o[place]
    if (
        planned is not None
        and np.array_equal(planned.counts, counts)
        and np.array_equal(planned.offsets, box_o)
    ):
        box_s = planned.sizes
    else:
        chosen = items if all_chunks else list(itertools.compress(items, is_chunk))
        sizes = list(map(_SIZES, chosen))
        if None in sizes:
            row = sizes.index(None)
            raise ValueError(f"{fqns[int(chunk_rows[row])]!r}: a chunk without sizes")
        box_s = _boxes(sizes, ndim, width, 1, lambda row: f"{fqns[int(chunk_rows[row])]!r}")
        box_s = box_s[place]
    file_ids = {name: i for i, name in enumerate(files)}
    sums = None
    if checksums:
        recorded = list(map(_CHECKSUMS, items))
        try:
            lens = np.fromiter(map(len, recorded), dtype=np.int64, count=n)
        except TypeError:  # items without checksums: refused by the checksum count check
            recorded = [r or () for r in recorded]
            lens = np.fromiter(map(len, recorded), dtype=np.int64, count=n)
        flat = hex_to_ints(list(itertools.chain.from_iterable(recorded)))
        sums = flat[ragged_order(lens, order)]
    places = np.fromiter(itertools.chain.from_iterable(map(_PLACE, items)), np.int64, 3 * n)
    places = places.reshape(n, 3)[order]
    return ItemTable(
        tensors=[h.name for h in tensors],
        dtypes=[h.dtype for h in tensors],
        shapes=[tuple(h.shape) for h in tensors],
        counts=counts,
        objects=list(objects),
        files=tuple(files),
        file=np.fromiter(map(file_ids.__getitem__, map(_FILE, items)), np.int64, count=n)[order],
        offset=places[:, 0].copy(),
        nbytes=places[:, 1].copy(),
        rank=places[:, 2].copy(),
        offsets=box_o,
        sizes=box_s,
        checksums=sums,
    )


def _boxes(
    values: Sequence[Sequence[int]], ndim: np.ndarray, width: int, pad: int, name: Any
) -> np.ndarray:
    """``(n, width)`` int64 array of per-row tuples that must have ``ndim`` entries each,
    padded with ``pad``; ``name(row)`` names a row of the wrong length in the ValueError."""
    out = np.full((len(values), width), pad, dtype=np.int64)
    if not len(values) or not width:
        return out
    lens = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    if (row := first_true(lens != ndim)) is not None:
        raise ValueError(
            f"{name(row)}: chunk {list(values[row])} does not have the tensor's "
            f"{int(ndim[row])} dimensions"
        )
    total = int(lens.sum())
    if total == len(values) * width:
        out[:] = np.fromiter(itertools.chain.from_iterable(values), np.int64, total).reshape(
            -1, width
        )
    else:
        keep = np.arange(width)[None, :] < lens[:, None]
        out[keep] = np.fromiter(itertools.chain.from_iterable(values), np.int64, total)
    return out


_FILE, _PLACE = operator.attrgetter("file"), operator.attrgetter("offset", "nbytes", "rank")
_SIZES, _CHECKSUMS = operator.attrgetter("sizes"), operator.attrgetter("checksums")


def _positions(chunk_rows: np.ndarray, ordered: np.ndarray) -> np.ndarray:
    """Index into the chunk-only arrays of each ordered chunk row."""
    where = np.empty(int(chunk_rows.max()) + 1 if chunk_rows.size else 0, dtype=np.int64)
    where[chunk_rows] = np.arange(len(chunk_rows))
    return where[ordered]


def ragged_order(counts: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Indices that gather the ragged segments (``counts`` long each) in ``order``."""
    starts = np.cumsum(counts) - counts
    lens = counts[order]
    total = int(lens.sum())
    new_starts = np.cumsum(lens) - lens
    return np.arange(total, dtype=np.int64) + np.repeat(starts[order] - new_starts, lens)
