"""A write item's bytes appended to a data file: small host tensors copied straight into the
coalescing buffer, device tensors carried through pinned host slabs, each item checksummed
and reported as DCP's ``WriteResult`` (where its bytes are)."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcpbridge.storage.backends import device_copy
from dcpbridge.storage.errors import InvalidArgumentError
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.document import StoredItem
from dcpbridge.storage.write.coalesce import SMALL_ITEM, CoalescingFile, ItemAppender

PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types whose memory is written as it is (subclasses go through ``tensor_bytes``)."""


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements in C order as bytes (copies only if not contiguous on the CPU)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()  # flat by its run of elements: a size-1 dim may have any stride
    return memoryview(t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy()).cast("B")


def tensor_digest(tensor: torch.Tensor) -> int:
    """xxh3-64 of the tensor's elements in C order (a device tensor's through a host copy)."""
    return xxhash.xxh3_64_intdigest(tensor_bytes(tensor))


def item_nbytes(item: WriteItem) -> int:
    """Bytes this item writes: the chunk's size, not the global tensor's (unlike DCP's helper)."""
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def write_carried(
    out: CoalescingFile,
    name: str,
    items: list[WriteItem],
    datas: list[Any],
    rank: int,
    block: int,
    stage: Callable[[Any], bool],
    slabs: int | None = None,
) -> list[WriteResult]:
    """Append the items in order, the data ``stage`` picks (device tensors) carried through
    ``slabs`` host slabs (``device_copy.carry``), the rest as ``append_item`` does."""
    results: list[WriteResult] = []
    carried = _Carried(out, block)
    for piece in device_copy.carry(zip(items, datas), stage=stage, slabs=slabs):
        item = piece.tag
        if piece.view is None:
            results.append(append_item(out, name, item, piece.data, rank, block))
            continue
        done = carried.add(item, piece)  # a device tensor, carried in host slices
        if done is not None:
            start, nbytes, digests = done
            results.append(_result(item, name, start, nbytes, rank, digests))
    return results


def append_item(
    out: CoalescingFile, name: str, item: WriteItem, data: Any, rank: int, block: int
) -> WriteResult:
    """Append one item's host bytes at the next aligned position of ``out``; its result.

    A small, plain, contiguous CPU tensor is copied straight from its memory into the
    coalescing buffer; any other tensor goes through ``tensor_bytes``.
    """
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise InvalidArgumentError(f"{item.index.fqn!r}: BYTE_IO item resolved to {type(data)}")
        mv = data.getbuffer()
        start = out.align()
        out.write(mv)
        digests = checksum.item_digests(mv, None, None, block) if block else None
        return _result(item, name, start, len(mv), rank, digests)
    td = item.tensor_data
    assert td is not None  # DCP's tensor write items always describe their chunk
    expected = item_nbytes(item)
    start = out.align()
    if _copyable(data, expected):
        mv = out.copy_in(data.data_ptr(), expected)
    else:
        mv = tensor_bytes(data)
        _check_size(item, len(mv))
        out.write(mv)
    digests = (
        checksum.chunk_digests(mv, td.chunk.sizes, td.properties.dtype, block) if block else None
    )
    return _result(item, name, start, len(mv), rank, digests)


def shown_data(planner: SavePlanner) -> Callable[[WriteItem], Any]:
    """``planner.resolve_data``, a conjugate or negative view made a copy of the values it
    shows: its memory holds others, and DCP's default planner hands such a view over as it is
    (the values stored were the memory's)."""
    resolve = planner.resolve_data

    def shown(item: WriteItem) -> Any:
        data = resolve(item)
        if isinstance(data, torch.Tensor) and (data.is_neg() or data.is_conj()):
            return data.resolve_conj().resolve_neg()
        return data

    return shown


def _copyable(data: Any, expected: int) -> bool:
    """Whether ``data`` is a plain, contiguous CPU tensor of ``expected`` bytes, small enough
    to be copied straight from its memory into the coalescing buffer."""
    return (
        expected < SMALL_ITEM
        and type(data) in PLAIN
        and data.is_cpu
        and data.is_contiguous()
        and data.nbytes == expected
    )


def append_items(
    out: CoalescingFile,
    name: str,
    items: list[WriteItem],
    datas: list[Any],
    rank: int,
    block: int,
) -> list[WriteResult]:
    """``append_item`` of every item in order, with small plain CPU tensor chunks (a save of
    many small tensors) appended here: their byte count and whether they are one checksum
    tile found once per (sizes, dtype), not per item; any other item goes to ``append_item``.
    """
    results: list[WriteResult] = []
    shapes: dict[tuple[torch.Size, torch.dtype], tuple[int, bool]] = {}
    for item, data in zip(items, datas):
        td = item.tensor_data
        if td is None or type(data) not in PLAIN or item.type == WriteItemType.BYTE_IO:
            results.append(append_item(out, name, item, data, rank, block))
            continue
        sizes, dtype = td.chunk.sizes, td.properties.dtype
        known = shapes.get((sizes, dtype))
        if known is None:
            one = not block or checksum.chunk_grid_is_one_tile(sizes, dtype, block)
            known = shapes[(sizes, dtype)] = (item_nbytes(item), one)
        expected, one_tile = known
        if not one_tile or not _copyable(data, expected):
            results.append(append_item(out, name, item, data, rank, block))
            continue
        start = out.align()
        mv = out.copy_in(data.data_ptr(), expected)
        digests = (checksum.tile_digest(mv),) if block else None
        results.append(_result(item, name, start, expected, rank, digests))
    return results


class _Carried:
    """Appends a carried tensor's slices to ``out``, one item at a time."""

    def __init__(self, out: CoalescingFile, block: int) -> None:
        self._out, self._block = out, block
        self._item: ItemAppender | None = None
        self._expected = 0

    def add(self, item: WriteItem, piece: device_copy.Piece[Any]) -> tuple[int, int, Any] | None:
        """Write one slice; after the item's last: (position, bytes, digests)."""
        mv = piece.view
        assert mv is not None
        if piece.first:
            td = item.tensor_data
            assert td is not None
            self._expected = item_nbytes(item)
            self._item = ItemAppender(
                self._out, self._expected, tuple(td.chunk.sizes), td.properties.dtype, self._block
            )
        appender = self._item
        assert appender is not None
        if appender.written + len(mv) > self._expected:  # more bytes than planned: refuse now
            _check_size(item, appender.written + len(mv))
        appender.add(mv)
        if not piece.last:
            return None
        _check_size(item, appender.written)
        self._item = None
        return appender.start, appender.written, appender.digests()


def _check_size(item: WriteItem, nbytes: int) -> None:
    expected = item_nbytes(item)
    if nbytes != expected:
        raise InvalidArgumentError(
            f"{item.index.fqn!r} at offsets {list(item.index.offset or ())}: resolved "
            f"data has {nbytes} bytes, the plan expects {expected}"
        )


def _result(
    item: WriteItem, file: str, start: int, nbytes: int, rank: int, digests: Any
) -> WriteResult:
    """What the writer reports for one written item: where its bytes are and their digests."""
    td = item.tensor_data
    return WriteResult(
        index=item.index,
        size_in_bytes=nbytes,
        storage_data=StoredItem(
            file,
            start,
            nbytes,
            rank,
            digests,
            None if td is None else tuple(td.chunk.sizes),
            None if td is None else td.properties.dtype,
        ),
    )
