"""The on-disk format: file names and the JSON metadata (commit) document, with no pickle.

The document keeps the checkpoint-wide facts, the tensors' names, dtypes and shapes and the
objects' names as plain JSON; large ones (version 3 and 4) store every item (chunk boxes,
file, byte offset, size, rank, checksums) as packed columns (``dcpbridge.storage.format.table``),
so a million chunks take a few MiB and decode in well under a second; small ones list one
JSON object per item. Since version 4 a chunk's checksums cover tiles of its shape
(``dcpbridge.storage.format.checksum``). Versions 1 to 3 still load; every layout ends in the same
``ItemTable`` and the same validation.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcpbridge.storage.errors import CorruptCheckpointError, InvalidArgumentError, UnsafePathError
from dcpbridge.storage.format.fields import (
    _dict,
    _field,
    _int,
    _list,
    check_names,
    check_tensor_headers,
    dtype_name,
    tensor_headers,
)
from dcpbridge.storage.format.paths import MAX_PREFIXES, check_file_name
from dcpbridge.storage.format.references import check_reference, is_reference
from dcpbridge.storage.format.rows import rows_table
from dcpbridge.storage.format.table import (
    ITEM_ALIGN,
    MAX_ROWS,
    ChunkList,
    ItemKey,
    ItemTable,
    PlannedBoxes,
    StoredItem,
    TensorHeader,
    describe_item,
    pack_column,
    shown_value,
    table_from_rows,
    unpack_column,
)
from dcpbridge.storage.format.table_checks import check_ranges, check_table, check_values

__all__ = [
    "FORMAT_VERSION",
    "ITEM_ALIGN",
    "METADATA_FILE",
    "ItemKey",
    "ItemTable",
    "StorageIndex",
    "StoredItem",
    "check_stored_ranges",
    "decode_metadata",
    "describe_item",
    "encode_metadata",
    "rows_document",
    "sign_document",
]

FORMAT_NAME = "dcpbridge"
# 5: version 4 whose ``files`` may also name data files of a sibling checkpoint
#    (``../<dir>/<file>``, storage/format/references.py): written only by incremental saves.
# 4: a tensor chunk's checksums cover tiles chosen from its shape (storage/format/checksum.py), so
#    a column slice verifies without reading whole rows; items as packed columns ("items"),
#    or one JSON object per item in small documents.
# 3: items as packed columns, flat checksum blocks (3 with one object per item: version 4's
#    tiles, written before they were named 4). 2: one JSON object per item, and the
#    document ends with a digest of itself. 1: version 2 without the digest. All load.
FORMAT_VERSION = 5
# Documents with at most this many items list one JSON object per item (easy to read by
# eye); larger ones pack the items as columns.
ROWS_AS_OBJECTS = 1024
METADATA_FILE = "dcpbridge.json"
DATA_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.([0-9a-f]+)\.bin\Z")
TEMP_METADATA_PREFIX = f"{METADATA_FILE}.tmp-"
MAX_WORLD_SIZE = 1 << 31
DIGEST_ALGORITHM = "xxh3_128"
CHECKSUM_ALGORITHMS = ("xxh3_64",)
_DIGEST_KEY = "digest"
_TRAILER = re.compile(rb',"digest":"([0-9a-z_]{1,16}):([0-9a-f]{1,128})"\}\Z')
_SAVE_ID = re.compile(r"^[0-9a-f]{1,64}\Z")
_MAX_TIME = 1 << 62  # largest integer created_unix (seconds): far below a float's range
# The item columns of a packed document; each holds one value per row unless noted.
_COLUMNS = ("offsets", "sizes", "file", "offset", "nbytes", "rank")  # offsets/sizes: per dim


def data_file_name(rank: int, index: int, save_id: str) -> str:
    return f"__{rank}_{index}.{save_id}.bin"


def temp_metadata_name(save_id: str) -> str:
    return f"{TEMP_METADATA_PREFIX}{save_id}"


def item_key(index: MetadataIndex) -> ItemKey:
    """Plain-tuple key of a DCP ``MetadataIndex`` (fqn, chunk offsets or None for objects)."""
    return index.fqn, None if index.offset is None else tuple(index.offset)


@dataclass(slots=True)
class StorageIndex:
    """``Metadata.storage_data`` of a dcpbridge checkpoint: item locations plus format facts.

    ``items`` is an ``ItemTable`` for decoded documents and fresh saves, or any mapping
    (offline writers, other sources)."""

    items: Mapping[ItemKey, StoredItem]
    save_id: str
    files: tuple[str, ...]
    checksum_algorithm: str | None = None
    checksum_block_size: int = 0
    world_size: int = 1
    created_unix: float = field(default_factory=time.time)
    tiled_checksums: bool = True  # format 4 checksum tiles (False: the flat blocks of 1 to 3)
    prefixes: int = 1  # data files spread over this many hashed folders (paths.spread_dir)

    def get(self, index: MetadataIndex) -> StoredItem | None:
        return self.items.get(item_key(index))


# -- encoding -----------------------------------------------------------------------------------


def item_table(
    metadata: Metadata, items: Mapping[ItemKey, StoredItem], *, checksums: bool = False
) -> ItemTable:
    """The item table of ``metadata`` whose chunks and objects are stored at ``items``;
    ``checksums``: whether it records checksums where it has no item to tell (empty tensors
    only, an empty state)."""
    tensors, objects, rows, object_rows = [], [], [], []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            t = len(tensors)
            tensors.append(TensorHeader(fqn, md.properties.dtype, tuple(md.size)))
            for chunk in md.chunks:
                offsets = tuple(chunk.offsets)
                item = items.get((fqn, offsets))
                if item is None:
                    raise InvalidArgumentError(
                        f"no stored bytes for tensor {fqn!r} chunk {list(offsets)}"
                    )
                rows.append((t, offsets, tuple(chunk.sizes), item))
        else:
            item = items.get((fqn, None))
            if item is None:
                raise InvalidArgumentError(f"no stored bytes for object {fqn!r}")
            objects.append(fqn)
            object_rows.append(item)
    files = sorted({it.file for _, _, _, it in rows} | {it.file for it in object_rows})
    if rows or object_rows:
        checksums = any(it.checksums is not None for _, _, _, it in rows) or any(
            it.checksums is not None for it in object_rows
        )
    return table_from_rows(tensors, objects, files, rows, object_rows, checksums=checksums)


def planned_boxes(metadata: Metadata) -> PlannedBoxes | None:
    """The one ``PlannedBoxes`` every tensor of ``metadata`` takes its chunks from, in
    order (as ``build_metadata`` makes them), or None."""
    boxes = None
    t = 0
    for md in metadata.state_dict_metadata.values():
        if not isinstance(md, TensorStorageMetadata):
            continue
        chunks = md.chunks
        if not isinstance(chunks, ChunkList) or chunks.t != t:
            return None
        if boxes is None and isinstance(chunks.table, PlannedBoxes):
            boxes = chunks.table
        if chunks.table is not boxes:
            return None
        t += 1
    return boxes if boxes is not None and len(boxes.shapes) == t else None


def encode_metadata(metadata: Metadata, *, columns: bool = False) -> bytes:
    """Serialize DCP ``Metadata`` whose ``storage_data`` is a ``StorageIndex`` to JSON bytes
    (items as packed columns where there are more than ``ROWS_AS_OBJECTS``, or always with
    ``columns``: they decode about 3x faster than objects).

    The item table is validated as a load would, so a save never commits metadata that its
    own loader refuses, and the document ends with its digest (``sign_document``). Chunk
    boxes equal to the ``PlannedBoxes`` the save planner already checked for coverage (its
    ``build_metadata``) are not checked for coverage twice; everything else is.
    """
    index = metadata.storage_data
    if not isinstance(index, StorageIndex):
        raise TypeError("metadata.storage_data must be a StorageIndex")
    table = index.items
    if not isinstance(table, ItemTable):
        table = item_table(metadata, table, checksums=bool(index.checksum_algorithm))
    boxes = planned_boxes(metadata)
    _check_against(metadata, table, boxes)
    block = index.checksum_block_size if index.checksum_algorithm else 0
    doc: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": _tiled_version(table.files),
        "save_id": index.save_id,
        "created_unix": index.created_unix,
        "world_size": index.world_size,
        "torch_version": torch.__version__,
        "checksum": (
            {"algorithm": index.checksum_algorithm, "block_size": block} if block else None
        ),
        "files": list(table.files),
    } | ({"prefixes": index.prefixes} if index.prefixes > 1 else {})
    table.tiled = index.tiled_checksums
    if not table.tiled:  # flat blocks: what format 2 (rows) and 3 (columns) record
        doc["version"] = 2 if len(table) <= ROWS_AS_OBJECTS else 3
    covered = boxes is not None and boxes.checked and boxes.same_boxes(table)
    try:
        _check_header(_decode_header(doc), table)
        shapes = [list(shape) for shape in table.shapes]
        dtypes = [dtype_name(d) for d in table.dtypes]
        check_tensor_headers(table.tensors, dtypes, shapes)
        check_names(table.tensors, table.objects)
        check_values(table)
        check_table(table, world_size=index.world_size, block=block, covered=covered)
    except CorruptCheckpointError as e:
        raise InvalidArgumentError(f"refusing to commit invalid metadata: {e}") from None
    if len(table) <= ROWS_AS_OBJECTS and not (columns and table.tiled):
        doc.update(_item_objects(table, block))
    else:
        doc["tensors"] = {
            "names": table.tensors,
            "dtypes": dtypes,
            "shapes": shapes,
            "chunks": table.counts.tolist(),
        }
        doc["objects"] = table.objects
        doc["items"] = _pack_items(table)
    doc["planner_data"] = _jsonable(metadata.planner_data)
    return sign_document(doc)


def _tiled_version(files: tuple[str, ...] | list[str]) -> int:
    """The version a document with tiled checksums and ``files`` is written as: 5 only when
    it references another checkpoint's files (older readers refuse it by its version)."""
    return FORMAT_VERSION if any(map(is_reference, files)) else 4


def _item_objects(table: ItemTable, block: int) -> dict[str, Any]:
    """The ``tensors`` and ``objects`` sections of a version 2 document: one object per item."""

    def item(row: int, out: dict[str, Any]) -> dict[str, Any]:
        stored = table.stored(row, block)
        out.update(file=stored.file, offset=stored.offset, nbytes=stored.nbytes)
        out["rank"] = stored.rank
        if stored.checksums is not None:
            out["checksums"] = list(stored.checksums)
        return out

    tensors = {}
    starts = table.starts.tolist()
    for t, fqn in enumerate(table.tensors):
        nd = len(table.shapes[t])
        offsets = table.offsets[starts[t] : starts[t + 1], :nd].tolist()
        sizes = table.sizes[starts[t] : starts[t + 1], :nd].tolist()
        tensors[fqn] = {
            "dtype": dtype_name(table.dtypes[t]),
            "shape": list(table.shapes[t]),
            "chunks": [
                item(starts[t] + i, {"offsets": o, "sizes": s})
                for i, (o, s) in enumerate(zip(offsets, sizes))
            ],
        }
    base = table.tensor_rows
    objects = {fqn: item(base + i, {}) for i, fqn in enumerate(table.objects)}
    return {"tensors": tensors, "objects": objects}


def _check_against(metadata: Metadata, table: ItemTable, boxes: PlannedBoxes | None) -> None:
    """The table stores exactly the tensors (with their dtypes, shapes and chunk counts) and
    objects of ``metadata`` (``boxes``: its ``planned_boxes``)."""
    state = metadata.state_dict_metadata
    names = [k for k, md in state.items() if isinstance(md, TensorStorageMetadata)]
    if names != table.tensors or len(state) != len(names) + len(table.objects):
        stored = set(table.tensors) | set(table.objects)
        missing = sorted(set(state) - stored) or sorted(stored - set(state))
        raise InvalidArgumentError(f"no stored bytes for {missing[:5]} (or stored unplanned)")
    dtypes, shapes = table.dtypes, table.shapes
    # chunk lists of the plan: their counts compared at once
    counted = boxes is not None and np.array_equal(boxes.counts, table.counts)
    counts = None if counted else table.counts.tolist()
    for t, fqn in enumerate(names):
        md = state[fqn]
        assert isinstance(md, TensorStorageMetadata)
        if md.properties.dtype != dtypes[t] or tuple(md.size) != shapes[t]:
            raise InvalidArgumentError(f"tensor {fqn!r}: stored dtype or shape differs")
        if counts is not None and len(md.chunks) != counts[t]:
            raise InvalidArgumentError(
                f"no stored bytes for some chunks of tensor {fqn!r}: {len(md.chunks)} "
                f"planned, {counts[t]} written"
            )
    for fqn in table.objects:
        if not isinstance(state.get(fqn), BytesStorageMetadata):
            raise InvalidArgumentError(f"object {fqn!r} is stored but not planned")


def _pack_items(table: ItemTable) -> dict[str, Any]:
    """The table's rows as packed columns (offsets and sizes without padding)."""
    ndims = table.ndims()
    width = table.offsets.shape[1]
    keep = np.arange(width)[None, :] < np.repeat(ndims, table.counts)[:, None]
    columns = {
        "offsets": pack_column(table.offsets[keep]),
        "sizes": pack_column(table.sizes[keep]),
        "file": pack_column(table.file),
        "offset": pack_column(table.offset),
        "nbytes": pack_column(table.nbytes),
        "rank": pack_column(table.rank),
    }
    if table.checksums is not None:
        # always 8 bytes, as the load requires (the narrowest width of none would be 1)
        columns["checksums"] = pack_column(table.checksums, compress=False, width="<u8")
    return columns


def sign_document(doc: Mapping[str, Any]) -> bytes:
    """Compact JSON of ``doc`` whose last member is ``"digest": "xxh3_128:<hex>"``.

    The digest covers the exact bytes of the document without that member (its closing
    brace included), so any changed byte anywhere in the file is detected, and the file
    stays plain JSON that any reader can parse.
    """
    fields = {k: v for k, v in doc.items() if k != _DIGEST_KEY}
    body = json.dumps(fields, separators=(",", ":"), allow_nan=False).encode()
    digest = xxhash.xxh3_128_hexdigest(body)
    return body[:-1] + f',"{_DIGEST_KEY}":"{DIGEST_ALGORITHM}:{digest}"}}'.encode()


def _verify_digest(raw: bytes) -> None:
    m = _TRAILER.search(raw)
    if m is None:
        raise CorruptCheckpointError(
            "the metadata digest is missing or malformed (it must close the document)"
        )
    algorithm, recorded = m.group(1).decode(), m.group(2).decode()
    if algorithm != DIGEST_ALGORITHM:
        raise CorruptCheckpointError(f"unknown metadata digest algorithm {algorithm!r}")
    actual = xxhash.xxh3_128_hexdigest(raw[: m.start()] + b"}")
    if actual != recorded:
        raise CorruptCheckpointError(
            f"metadata digest mismatch (recorded {DIGEST_ALGORITHM} {recorded}, computed "
            f"{actual}): the file was modified or corrupted after the save"
        )


_SCALARS = frozenset({type(None), bool, int, float, str})


def _jsonable(value: Any) -> Any:
    """Planner data must be plain JSON (tuples become lists); anything else is refused.
    Exact scalar types and flat sequences of them (DCP's key paths) take the short way."""
    if type(value) in _SCALARS:
        return value
    if isinstance(value, (list, tuple)):  # before the Mapping check, an ABC's slow one
        for v in value:  # a plain loop: no generator per value (DCP keeps one per key)
            if type(v) not in _SCALARS:
                return [_jsonable(v) for v in value]
        return list(value)
    if isinstance(value, Mapping):
        return {k if type(k) is str else str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"planner_data must be JSON-serializable (dicts, lists, numbers, strings); "
        f"got {type(value).__name__}"
    )


# -- decoding -----------------------------------------------------------------------------------


def decode_metadata(raw: bytes, *, where: str) -> Metadata:
    """Parse and fully validate a metadata document before anything is read or allocated.

    Checks the digest (format >= 2), every field's type and range, that each tensor's chunks
    lie inside it, are pairwise disjoint and cover it exactly, that byte sizes match shapes,
    and that items of one file do not overlap. Errors name ``where`` and the bad entry.
    """
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: metadata is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a {FORMAT_NAME} metadata document")
    version = doc.get("version")
    if type(version) is not int or version < 1:
        raise CorruptCheckpointError(f"{where}: format version {shown_value(version)} is not valid")
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: format version {version!r} is newer than this dcpbridge reads "
            f"({FORMAT_VERSION}); upgrade dcpbridge"
        )
    try:
        if version >= 2 or _DIGEST_KEY in doc:
            _verify_digest(raw)
        return _decode(doc, version)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from None
    except UnsafePathError as e:
        raise UnsafePathError(f"{where}: {e}") from None


@dataclass(frozen=True, slots=True)
class _Header:
    """The document header: checkpoint-wide facts every item is checked against."""

    save_id: str
    files: tuple[str, ...]
    world_size: int
    block: int
    algorithm: str | None
    created: float
    tiled: bool  # format 4 checksum tiles (else flat blocks)
    prefixes: int


def _decode_header(doc: dict[str, Any]) -> _Header:
    save_id = _field(doc, "save_id", "document")
    if not isinstance(save_id, str) or not _SAVE_ID.match(save_id):
        raise CorruptCheckpointError(f"save_id must be lowercase hex, got {shown_value(save_id)}")
    world_size = _int(doc.get("world_size", 1), "world_size", 1, MAX_WORLD_SIZE)
    created = doc.get("created_unix", 0.0)
    # an integer beyond a float's range (10**400) is no time either: float() would overflow
    if (
        type(created) not in (int, float)
        or (type(created) is int and abs(created) > _MAX_TIME)
        or not math.isfinite(created)
    ):
        raise CorruptCheckpointError(f"created_unix must be a number, got {shown_value(created)}")
    checksum = doc.get("checksum")
    block, algorithm = 0, None
    if checksum is not None:
        checksum = _dict(checksum, "checksum")
        algorithm = checksum.get("algorithm")
        if algorithm not in CHECKSUM_ALGORITHMS:
            raise CorruptCheckpointError(f"unknown checksum algorithm {shown_value(algorithm)}")
        block = _int(checksum.get("block_size"), "checksum block_size", 1)
    files = _field(doc, "files", "document")
    if type(files) is not list:
        raise CorruptCheckpointError(f"files must be a list, got {shown_value(files)}")
    version = doc.get("version", 1)
    for name in files:
        if not isinstance(name, str):
            raise CorruptCheckpointError(f"files: {shown_value(name)} is not a file name")
        if is_reference(name) and type(version) is int and version >= 5:
            check_reference(name)  # another checkpoint's file: its own save id
            continue
        check_file_name(name)
        m = DATA_FILE_RE.match(name)
        if m is None or m.group(3) != save_id:
            raise CorruptCheckpointError(f"files: {name!r} is not a data file of save {save_id!r}")
    if len(set(files)) != len(files):
        raise CorruptCheckpointError("files: a file is listed twice")
    # storageio's version 3 (874c9bc to 7089f2d, before the merge that made it version 4)
    # listed one object per item with tiled checksums; main's version 3 always packs "items"
    tiled = version >= 4 or (version == 3 and "items" not in doc)
    prefixes = _int(doc.get("prefixes", 1), "prefixes", 1, MAX_PREFIXES)
    return _Header(
        save_id, tuple(files), world_size, block, algorithm, float(created), tiled, prefixes
    )


def _check_header(header: _Header, table: ItemTable) -> None:
    if header.files != table.files:
        raise CorruptCheckpointError("files: the list differs from the item table's")


def _decode(doc: dict[str, Any], version: int) -> Metadata:
    header = _decode_header(doc)
    if version >= 3 and "items" in doc:
        table = _columns_table(doc, header)
    else:
        table = rows_table(doc, header.files, header.block, header.world_size, tiled=header.tiled)
    table.tiled = header.tiled
    check_table(table, world_size=header.world_size, block=header.block)
    table.block_size = header.block
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    properties = {d: TensorProperties(dtype=d) for d in set(table.dtypes)}  # shared, read-only
    for t, (fqn, dtype, shape) in enumerate(zip(table.tensors, table.dtypes, table.shapes)):
        state[fqn] = TensorStorageMetadata(
            properties[dtype], torch.Size(shape), ChunkList(table, t)
        )  # type: ignore[arg-type]
    for fqn in table.objects:
        state[fqn] = BytesStorageMetadata()
    index = StorageIndex(
        items=table,
        save_id=header.save_id,
        files=header.files,
        checksum_algorithm=header.algorithm,
        checksum_block_size=header.block,
        world_size=header.world_size,
        created_unix=header.created,
        tiled_checksums=header.tiled,
        prefixes=header.prefixes,
    )
    return Metadata(
        state_dict_metadata=state,
        planner_data=doc.get("planner_data"),
        storage_data=index,
        version=f"{FORMAT_NAME}-{version}",
    )


def _columns_table(doc: dict[str, Any], header: _Header) -> ItemTable:
    """The item table of a packed document (types and ranges checked, meaning not yet)."""
    section = _dict(_field(doc, "tensors", "document"), "tensors")
    names = _list(_field(section, "names", "tensors"), "tensors names")
    dtypes = _list(_field(section, "dtypes", "tensors"), "tensors dtypes")
    shapes = _list(_field(section, "shapes", "tensors"), "tensors shapes")
    counts = _list(_field(section, "chunks", "tensors"), "tensors chunks")
    if not len(names) == len(dtypes) == len(shapes) == len(counts):
        raise CorruptCheckpointError("tensors: names, dtypes, shapes and chunks differ in length")
    if not all(type(c) is int and 0 <= c <= MAX_ROWS for c in counts):
        raise CorruptCheckpointError("tensors chunks must be integers in [0, 2**28]")
    headers = tensor_headers(names, dtypes, shapes)
    objects = _list(_field(doc, "objects", "document"), "objects")
    check_names(names, objects)
    items = _dict(_field(doc, "items", "document"), "items")
    expected = set(_COLUMNS) | ({"checksums"} if header.block else set())
    if set(items) != expected:
        raise CorruptCheckpointError(
            f"items: columns {sorted(items)} are not the expected {sorted(expected)}"
        )
    cols = {k: unpack_column(items[k], f"items {k}", checksums=k == "checksums") for k in items}
    count = np.array(counts, dtype=np.int64)
    ndims = np.array([len(h.shape) for h in headers], dtype=np.int64)
    tensor_rows = int(count.sum())
    rows = tensor_rows + len(objects)
    if rows > MAX_ROWS:
        raise CorruptCheckpointError(f"{rows} stored items are too many (at most {MAX_ROWS})")
    per_row = np.repeat(ndims, count)
    values = int(per_row.sum())
    for k in ("file", "offset", "nbytes", "rank"):
        if len(cols[k]) != rows:
            raise CorruptCheckpointError(f"items {k}: {len(cols[k])} values for {rows} items")
    for k in ("offsets", "sizes"):
        if len(cols[k]) != values:
            raise CorruptCheckpointError(f"items {k}: {len(cols[k])} values, {values} expected")
    width = int(ndims.max()) if ndims.size else 0
    offsets = np.zeros((tensor_rows, width), dtype=np.int64)
    sizes = np.ones((tensor_rows, width), dtype=np.int64)
    if values:
        keep = np.arange(width)[None, :] < per_row[:, None]
        offsets[keep] = cols["offsets"]
        sizes[keep] = cols["sizes"]
    return ItemTable(
        tensors=list(names),
        dtypes=[h.dtype for h in headers],
        shapes=[h.shape for h in headers],
        counts=count,
        objects=list(objects),
        files=header.files,
        file=cols["file"],
        offset=cols["offset"],
        nbytes=cols["nbytes"],
        rank=cols["rank"],
        offsets=offsets,
        sizes=sizes,
        checksums=cols.get("checksums"),
    )


def rows_document(raw: bytes | Mapping[str, Any]) -> dict[str, Any]:
    """A document (bytes or parsed) with one JSON object per item (version 2, or 4 when its
    checksums are tiles).

    For people and tests that read or craft items by hand (sign it with ``sign_document``).
    """
    doc = dict(json.loads(raw) if isinstance(raw, (bytes, bytearray, str)) else raw)
    if "items" not in doc:
        return doc
    md = decode_metadata(sign_document(doc), where="document")
    index = md.storage_data
    assert isinstance(index.items, ItemTable)
    doc.update(_item_objects(index.items, index.checksum_block_size))
    doc["version"] = _tiled_version(index.files) if index.tiled_checksums else 2
    doc.pop("items", None)
    doc.pop(_DIGEST_KEY, None)
    return doc


def check_stored_ranges(
    items: Mapping[ItemKey, StoredItem], sizes: Mapping[str, int], where: str
) -> None:
    """Every item's bytes must lie inside its data file (``sizes``: file name -> bytes)."""
    if isinstance(items, ItemTable):
        check_ranges(items, sizes, where, METADATA_FILE)
        return
    for key, item in items.items():
        size = sizes.get(item.file)
        if size is None:
            raise CorruptCheckpointError(
                f"{where}: data file {item.file} of {describe_item(key)}, named in "
                f"{METADATA_FILE}, is missing"
            )
        if item.offset + item.nbytes > size:
            raise CorruptCheckpointError(
                f"{where}: {METADATA_FILE} places {describe_item(key)} at bytes "
                f"{item.offset}..{item.offset + item.nbytes} of {item.file}, which has only "
                f"{size} bytes (a truncated file or damaged metadata)"
            )
