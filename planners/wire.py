"""A save plan's items as they travel to the coordinator: ``WireItems`` is the plan's own
list (a plain ``list`` where it is made), pickled as parallel lists of plain values; the
receiver gets ``ReceivedItems``, which makes the ``WriteItem`` at a position only when it is
asked for (the plan's columns carry what the coordinator validates).

DCP's ``WriteItem`` holds a ``MetadataIndex`` and three ``torch.Size``: pickling and
unpickling one took ~70 us, seconds per rank of 20,000 tensors at a first save, and the
coordinator unpickled every rank's in turn.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from dcpbridge.storage.format.packed import PackedRows, index_columns

_INDEX, _TENSOR, _BYTES = (
    operator.attrgetter(n) for n in ("index", "tensor_data", "bytes_io_data")
)
_KINDS = {kind.value: kind for kind in WriteItemType}


class WireItems(list):  # type: ignore[type-arg]
    """A local plan's ``WriteItem`` list; pickled, it travels as ``ReceivedItems``."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (ReceivedItems, packed(self))


class ReceivedItems(PackedRows[WriteItem]):
    """A plan's items as received: their fields as parallel lists (``packed``'s); each
    ``WriteItem`` is made the first time it is asked for and kept."""

    __slots__ = ()
    width = 9

    def _make(self, *row: Any) -> WriteItem:
        return _item(*row)


def packed(items: Sequence[WriteItem]) -> tuple[list[Any], ...]:
    """The fields of ``items`` as parallel lists of plain values (``ReceivedItems``' own)."""
    indexes = list(map(_INDEX, items))
    tensors = list(map(_TENSOR, items))
    chunks = [None if t is None else t.chunk for t in tensors]
    return (
        *index_columns(indexes),
        [item.type.value for item in items],
        [None if b is None else b.nbytes for b in map(_BYTES, items)],
        [None if c is None else tuple(c.offsets) for c in chunks],
        [None if c is None else tuple(c.sizes) for c in chunks],
        [None if t is None else t.properties for t in tensors],
        [None if t is None else tuple(t.size) for t in tensors],
    )


def _item(
    fqn: str,
    offset: tuple[int, ...] | None,
    hint: int | None,
    kind: int,
    nbytes: int | None,
    chunk_offsets: tuple[int, ...] | None,
    chunk_sizes: tuple[int, ...] | None,
    properties: Any,
    size: tuple[int, ...] | None,
) -> WriteItem:
    tensor = None
    if chunk_offsets is not None and chunk_sizes is not None and size is not None:
        chunk = ChunkStorageMetadata(torch.Size(chunk_offsets), torch.Size(chunk_sizes))
        tensor = TensorWriteData(chunk=chunk, properties=properties, size=torch.Size(size))
    return WriteItem(
        index=MetadataIndex(fqn, offset, hint),
        type=_KINDS[kind],
        bytes_io_data=None if nbytes is None else BytesIOWriteData(nbytes),
        tensor_data=tensor,
    )
