"""An item table's checks, as array operations: value ranges, geometry, tiling of each tensor,
distinct keys, checksum counts and byte ranges inside the files (a decoded document is
hostile input until these pass; a save runs them on the table it is about to commit)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dcpbridge.storage.errors import CorruptCheckpointError
from dcpbridge.storage.format.table import (
    ITEM_ALIGN,
    MAX_ROWS,
    MAX_SIZE,
    ItemTable,
    describe_item,
    first_true,
)
from dcpbridge.storage.format.tiling import disjointness, products


def check_values(table: ItemTable) -> None:
    """Every column value in ``[0, MAX_SIZE]``: what the decoder requires of a document
    (checked before a save encodes a table it built itself)."""
    for what, values in (
        ("file", table.file),
        ("offset", table.offset),
        ("nbytes", table.nbytes),
        ("rank", table.rank),
        ("offsets", table.offsets),
        ("sizes", table.sizes),
    ):
        if values.size and (int(values.min()) < 0 or int(values.max()) > MAX_SIZE):
            raise CorruptCheckpointError(f"items {what}: a value lies outside [0, {MAX_SIZE}]")


def check_table(table: ItemTable, *, world_size: int, block: int, covered: bool = False) -> None:
    """Refuse a table unless every row is consistent (see ``document.decode_metadata``).

    Types and value ranges are the decoder's job (columns hold only integers in range);
    this checks what rows mean: files, alignment, ranks, checksum counts, each chunk inside
    its tensor with the byte size of its box, chunks of a tensor pairwise disjoint and
    covering it, and items of one file never sharing bytes. ``covered``: the chunks are
    known to lie inside their tensors and tile them exactly once (they equal the
    ``PlannedBoxes`` the save planner checked), so that is not checked again.
    """
    rows = len(table.nbytes)
    nt = table.tensor_rows
    if rows > MAX_ROWS:
        raise CorruptCheckpointError(f"{rows} stored items are too many (at most {MAX_ROWS})")
    if int(table.counts.sum()) != nt or rows != nt + len(table.objects):
        raise CorruptCheckpointError("the item table's row counts do not add up")

    def name(row: int) -> str:
        return describe_item(table.key(row))

    if (row := first_true(table.file >= len(table.files))) is not None:
        raise CorruptCheckpointError(
            f"{name(row)}: file #{int(table.file[row])} is not among the checkpoint's files"
        )
    if (row := first_true(table.offset % ITEM_ALIGN != 0)) is not None:
        raise CorruptCheckpointError(
            f"{name(row)}: offset {int(table.offset[row])} is not {ITEM_ALIGN}-byte aligned"
        )
    if (row := first_true(table.rank >= world_size)) is not None:
        raise CorruptCheckpointError(
            f"{name(row)} rank must be an integer in [0, {world_size - 1}], "
            f"got {int(table.rank[row])}"
        )
    if nt:
        _check_geometry(table, name, covered=covered)
    _check_checksum_counts(table, block, name)
    _check_file_ranges(table, name)


def _check_checksum_counts(table: ItemTable, block: int, name: Any) -> None:
    if not block:
        if table.checksums is not None:
            raise CorruptCheckpointError("checksums recorded, but no checksum algorithm")
        return
    if table.checksums is None:
        raise CorruptCheckpointError("no block checksums recorded")
    have = len(table.checksums)
    need = table.blocks(block)
    if need.size and int(need.max()) > have:
        row = int(np.argmax(need > have))
        raise CorruptCheckpointError(
            f"{name(row)}: {int(need[row])} block checksums expected, found {have} in all"
        )
    starts = table.sum_starts(block)
    if int(starts[-1]) != have:
        # name the first row whose checksums cannot line up
        raise CorruptCheckpointError(
            f"{int(starts[-1])} block checksums expected for {len(need)} items, found {have}"
        )


def _check_geometry(table: ItemTable, name: Any, *, covered: bool) -> None:
    nt = table.tensor_rows
    tid = table.row_tensor()
    ndims = table.ndims()
    if not covered:
        _check_inside(table, tid, ndims, name)
    itemsize = np.array([d.itemsize for d in table.dtypes], dtype=np.int64)[tid]
    numel, over = products(table.sizes, MAX_SIZE)
    nbytes, over2 = products(np.stack([numel, itemsize], axis=1), MAX_SIZE)
    if (row := first_true(over | over2)) is not None:
        raise CorruptCheckpointError(
            f"{name(row)}: {table.sizes[row].tolist()} elements are too many"
        )
    if (row := first_true(table.nbytes[:nt] != nbytes)) is not None:
        t = int(tid[row])
        raise CorruptCheckpointError(
            f"{name(row)}: {int(table.nbytes[row])} bytes recorded, {int(nbytes[row])} expected "
            f"for sizes {table.sizes[row, : int(ndims[t])].tolist()} of {table.dtypes[t]}"
        )
    _check_distinct_keys(table, tid, numel, name)
    if not covered:
        _check_tiling(table, tid, numel)


def _check_inside(table: ItemTable, tid: np.ndarray, ndims: np.ndarray, name: Any) -> None:
    """Each chunk inside its tensor."""
    shapes = np.ones((len(table.tensors), table.offsets.shape[1]), dtype=np.int64)
    for t, shape in enumerate(table.shapes):
        shapes[t, : len(shape)] = shape
    shape_rows = shapes[tid]
    outside = ((table.sizes > shape_rows) | (table.offsets > shape_rows - table.sizes)).any(axis=1)
    if (row := first_true(outside)) is not None:
        t, nd = int(tid[row]), int(ndims[tid[row]])
        raise CorruptCheckpointError(
            f"{name(row)}: sizes {table.sizes[row, :nd].tolist()} exceed shape "
            f"{list(table.shapes[t])}"
        )


def _check_distinct_keys(table: ItemTable, tid: np.ndarray, numel: np.ndarray, name: Any) -> None:
    """No two chunks of a tensor at the same offsets (non-empty ones would also overlap)."""
    empty = numel == 0
    if not empty.any():
        return
    marked = np.zeros(len(table.tensors), dtype=bool)
    marked[tid[empty]] = True
    suspects = marked[tid]
    rows = np.flatnonzero(suspects)
    keys = np.column_stack([tid[rows], table.offsets[rows]])
    order = np.lexsort(keys.T[::-1])
    same = (keys[order][1:] == keys[order][:-1]).all(axis=1)
    if same.any():
        row = int(rows[order][1:][same][0])
        raise CorruptCheckpointError(f"{name(row)} is recorded twice")


def _check_tiling(table: ItemTable, tid: np.ndarray, numel: np.ndarray) -> None:
    """Each tensor's non-empty chunks pairwise disjoint and covering it exactly."""
    tensors = len(table.tensors)
    full = [math.prod(s) for s in table.shapes]
    nonempty = numel > 0
    status = disjointness(tid[nonempty], table.offsets[nonempty], table.sizes[nonempty], tensors)
    ok = status == 0
    counted = np.where(nonempty & ok[tid], numel, 0)
    running = np.zeros(len(counted) + 1, dtype=np.int64)
    np.cumsum(counted, out=running[1:])  # may wrap; each tensor's difference is exact
    starts = table.starts
    sums = running[starts[1:]] - running[starts[:-1]]
    for t in np.flatnonzero(~ok | (sums != np.array(full, dtype=np.int64))):
        t = int(t)
        what = f"tensor {table.tensors[t]!r}"
        if not ok[t]:  # overlapping, or a tiling the array check cannot decide: sweep it
            lo, hi = int(table.starts[t]), int(table.starts[t + 1])
            nd = len(table.shapes[t])
            sweep_tiling(what, table.shapes[t], table.offsets[lo:hi, :nd], table.sizes[lo:hi, :nd])
            continue
        raise CorruptCheckpointError(
            f"{what}: chunks cover {int(sums[t])} of {full[t]} elements (the checkpoint is "
            "incomplete)"
        )


def sweep_tiling(what: str, shape: Sequence[int], offsets: np.ndarray, sizes: np.ndarray) -> None:
    """The exact check for one tensor: a sweep along the dimension with the most distinct
    chunk starts; each chunk is compared only with chunks still open at its start."""
    boxes = [(tuple(o), tuple(s)) for o, s in zip(offsets.tolist(), sizes.tolist()) if math.prod(s)]
    numel = math.prod(shape)
    covered = sum(math.prod(s) for _, s in boxes)
    if boxes and len(shape):
        d = max(range(len(shape)), key=lambda i: len({o[i] for o, _ in boxes}))
        boxes.sort(key=lambda b: b[0][d])
        open_: list[tuple[int, int]] = []
        for i, (off, size) in enumerate(boxes):
            while open_ and open_[0][0] <= off[d]:
                heapq.heappop(open_)
            for _, j in open_:
                o2, s2 = boxes[j]
                if all(a < b + m and b < a + n for a, n, b, m in zip(off, size, o2, s2)):
                    raise CorruptCheckpointError(
                        f"{what}: chunks {list(o2)}+{list(s2)} and {list(off)}+{list(size)} overlap"
                    )
            heapq.heappush(open_, (off[d] + size[d], i))
    elif len(boxes) > 1:  # 0-dim tensor: every chunk is the whole tensor
        raise CorruptCheckpointError(f"{what}: {len(boxes)} chunks of a 0-dim tensor overlap")
    if covered != numel:
        raise CorruptCheckpointError(
            f"{what}: chunks cover {covered} of {numel} elements (the checkpoint is incomplete)"
        )


def _check_file_ranges(table: ItemTable, name: Any) -> None:
    """Items stored in one file must not share bytes."""
    rows = np.flatnonzero(table.nbytes > 0)
    if rows.size < 2:
        return
    order = rows[np.lexsort((table.offset[rows], table.file[rows]))]
    f, start, size = table.file[order], table.offset[order], table.nbytes[order]
    clash = (f[1:] == f[:-1]) & (start[1:] - start[:-1] < size[:-1])
    if clash.any():
        i = int(np.argmax(clash))
        a, b = int(order[i]), int(order[i + 1])
        raise CorruptCheckpointError(
            f"{table.files[int(f[i])]}: the bytes of {name(a)} and {name(b)} overlap"
        )


def check_ranges(
    table: ItemTable, sizes: Mapping[str, int], where: str, metadata_file: str
) -> None:
    """Every item's bytes must lie inside its data file (``sizes``: file name -> bytes)."""
    file_sizes = np.array([sizes.get(f, -1) for f in table.files], dtype=np.int64)
    have = file_sizes[table.file] if table.file.size else table.file
    if (row := first_true(have < 0)) is not None:
        raise CorruptCheckpointError(
            f"{where}: data file {table.files[int(table.file[row])]} of "
            f"{describe_item(table.key(row))}, named in {metadata_file}, is missing"
        )
    bad = (table.offset > have) | (table.nbytes > have - table.offset)
    if (row := first_true(bad)) is not None:
        start, n = int(table.offset[row]), int(table.nbytes[row])
        raise CorruptCheckpointError(
            f"{where}: {metadata_file} places {describe_item(table.key(row))} at bytes "
            f"{start}..{start + n} of {table.files[int(table.file[row])]}, which has only "
            f"{int(have[row])} bytes (a truncated file or damaged metadata)"
        )
