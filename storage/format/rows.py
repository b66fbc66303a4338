"""Metadata documents with one JSON object per stored item (versions 1, 2 and small version 4
documents) as an item table."""

from __future__ import annotations

from typing import Any

import torch

from dcpbridge.storage.errors import CorruptCheckpointError
from dcpbridge.storage.format.checksum import item_grid
from dcpbridge.storage.format.fields import (
    _dict,
    _field,
    _int,
    _ints,
    check_names,
    tensor_headers,
)
from dcpbridge.storage.format.paths import check_file_name
from dcpbridge.storage.format.references import check_reference, is_reference
from dcpbridge.storage.format.table import ItemTable, StoredItem, shown_value, table_from_rows

_HEX_DIGITS = b"0123456789abcdef"


def _only_hex(text: str) -> bool:
    """Whether ``text`` holds lowercase hex digits only."""
    try:
        raw = text.encode("ascii")
    except UnicodeEncodeError:
        return False
    return not raw.translate(None, _HEX_DIGITS)


def _item(
    entry: Any,
    what: str,
    files: frozenset[str],
    world_size: int,
    block: int,
    chunk: tuple[tuple[int, ...], torch.dtype] | None = None,
) -> StoredItem:
    """One item object, every field's type and range checked (meaning is checked later);
    ``chunk``: a tensor chunk's sizes and dtype where its checksums cover tiles."""
    entry = _dict(entry, what)
    name = _field(entry, "file", what)
    if not isinstance(name, str):
        raise CorruptCheckpointError(f"{what}: file must be a string, got {shown_value(name)}")
    if is_reference(name):  # its shape here; whether this version may hold it: the header
        check_reference(name)
    else:
        check_file_name(name)
    if name not in files:
        raise CorruptCheckpointError(f"{what}: file {name!r} is not among the checkpoint's files")
    offset = _int(_field(entry, "offset", what), f"{what} offset")
    nbytes = _int(_field(entry, "nbytes", what), f"{what} nbytes")
    rank = _int(_field(entry, "rank", what), f"{what} rank", 0, world_size - 1)
    checksums = entry.get("checksums")
    if block:
        sizes, dtype = chunk if chunk is not None else (None, None)
        expected = item_grid(nbytes, sizes, dtype, block).count
        if type(checksums) is not list or len(checksums) != expected:
            raise CorruptCheckpointError(
                f"{what}: {expected} block checksums expected, found {shown_value(checksums)}"
            )
        # each a string of 16 characters, and all of them together hex digits (what is left
        # once the digits are deleted: nothing; a quarter of the time of a regex match)
        if not (
            set(map(type, checksums)) <= {str}  # subsets: as all() would, for any length
            and set(map(len, checksums)) <= {16}
            and _only_hex("".join(checksums))
        ):
            raise CorruptCheckpointError(f"{what}: checksums must be 16 hex digits each")
    elif checksums is not None:
        raise CorruptCheckpointError(f"{what}: checksums recorded, but no checksum algorithm")
    return StoredItem(name, offset, nbytes, rank, tuple(checksums) if block else None)


def rows_table(
    doc: dict[str, Any], files: tuple[str, ...], block: int, world_size: int, *, tiled: bool
) -> ItemTable:
    """The item table of a document with one object per item (types and ranges checked);
    ``tiled``: its chunks' checksums cover tiles (version 4), else flat blocks."""
    tensors = _dict(_field(doc, "tensors", "document"), "tensors")
    objects = _dict(_field(doc, "objects", "document"), "objects")
    entries = [_dict(e, f"tensor {fqn!r}") for fqn, e in tensors.items()]
    headers = tensor_headers(
        list(tensors),
        [_field(e, "dtype", f"tensor {fqn!r}") for fqn, e in zip(tensors, entries)],
        [_field(e, "shape", f"tensor {fqn!r}") for fqn, e in zip(tensors, entries)],
    )
    check_names(list(tensors), list(objects))
    known = frozenset(files)
    rows = []
    for t, (header, entry) in enumerate(zip(headers, entries)):
        what = f"tensor {header.name!r}"
        raw_chunks = _field(entry, "chunks", what)
        if type(raw_chunks) is not list:
            raise CorruptCheckpointError(
                f"{what}: chunks must be a list, got {shown_value(raw_chunks)}"
            )
        nd = len(header.shape)
        for c in raw_chunks:
            c = _dict(c, f"{what} chunk")
            offsets = _ints(_field(c, "offsets", f"{what} chunk"), f"{what} chunk offsets", nd)
            sizes = _ints(_field(c, "sizes", f"{what} chunk"), f"{what} chunk sizes", nd)
            chunk = (tuple(sizes), header.dtype) if tiled else None
            item = _item(c, f"{what} chunk {offsets}", known, world_size, block, chunk)
            rows.append((t, tuple(offsets), tuple(sizes), item))
    object_rows = [
        _item(entry, f"object {fqn!r}", known, world_size, block) for fqn, entry in objects.items()
    ]
    return table_from_rows(
        headers, list(objects), files, rows, object_rows, checksums=bool(block), tiled=tiled
    )
