"""The on-disk format: file names and the JSON metadata (commit) document, with no pickle."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from storage.errors import CorruptCheckpointError
from storage.paths import check_file_name

FORMAT_NAME = "dcpbridge"
FORMAT_VERSION = 1
METADATA_FILE = "dcpbridge.json"
DATA_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.([0-9a-f]+)\.bin$")
TEMP_METADATA_PREFIX = f"{METADATA_FILE}.tmp-"


def data_file_name(rank: int, index: int, save_id: str) -> str:
    return f"__{rank}_{index}.{save_id}.bin"


def temp_metadata_name(save_id: str) -> str:
    return f"{TEMP_METADATA_PREFIX}{save_id}"


ItemKey = tuple[str, "tuple[int, ...] | None"]


def item_key(index: MetadataIndex) -> ItemKey:
    """Plain-tuple key of a DCP ``MetadataIndex`` (fqn, chunk offsets or None for objects)."""
    return index.fqn, None if index.offset is None else tuple(index.offset)


@dataclass(frozen=True, slots=True)
class StoredItem:
    """Where one written item's bytes live, their block checksums and (tensors) chunk layout."""

    file: str
    offset: int
    nbytes: int
    rank: int
    checksums: tuple[str, ...] | None = None
    sizes: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None


@dataclass(slots=True)
class StorageIndex:
    """``Metadata.storage_data`` of a dcpbridge checkpoint: item locations plus format facts."""

    items: dict[ItemKey, StoredItem]
    save_id: str
    files: tuple[str, ...]
    checksum_algorithm: str | None = None
    checksum_block_size: int = 0
    world_size: int = 1
    created_unix: float = field(default_factory=time.time)

    def get(self, index: MetadataIndex) -> StoredItem | None:
        return self.items.get(item_key(index))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _item_json(item: StoredItem, out: dict[str, Any] | None = None) -> dict[str, Any]:
    out = {} if out is None else out
    out["file"] = item.file
    out["offset"] = item.offset
    out["nbytes"] = item.nbytes
    out["rank"] = item.rank
    if item.checksums is not None:
        out["checksums"] = item.checksums  # tuples encode as JSON arrays
    return out


def encode_metadata(metadata: Metadata) -> bytes:
    """Serialize DCP ``Metadata`` whose ``storage_data`` is a ``StorageIndex`` to JSON bytes."""
    index = metadata.storage_data
    if not isinstance(index, StorageIndex):
        raise TypeError("metadata.storage_data must be a StorageIndex")
    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            chunks = []
            for chunk in md.chunks:
                offsets = tuple(chunk.offsets)
                item = index.items.get((fqn, offsets))
                if item is None:
                    raise ValueError(f"no stored bytes for tensor {fqn!r} chunk {list(offsets)}")
                chunks.append(_item_json(item, {"offsets": offsets, "sizes": tuple(chunk.sizes)}))
            tensors[fqn] = {
                "dtype": dtype_name(md.properties.dtype),
                "shape": list(md.size),
                "chunks": chunks,
            }
        else:
            item = index.items.get((fqn, None))
            if item is None:
                raise ValueError(f"no stored bytes for object {fqn!r}")
            objects[fqn] = _item_json(item)
    doc = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "save_id": index.save_id,
        "created_unix": index.created_unix,
        "world_size": index.world_size,
        "torch_version": torch.__version__,
        "checksum": (
            {"algorithm": index.checksum_algorithm, "block_size": index.checksum_block_size}
            if index.checksum_algorithm
            else None
        ),
        "files": list(index.files),
        "tensors": tensors,
        "objects": objects,
        "planner_data": _jsonable(metadata.planner_data),
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _jsonable(value: Any) -> Any:
    """Planner data must be plain JSON (tuples become lists); anything else is refused."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    raise TypeError(
        f"planner_data must be JSON-serializable (dicts, lists, numbers, strings); "
        f"got {type(value).__name__}"
    )


def decode_metadata(raw: bytes, *, where: str) -> Metadata:
    """Parse and validate a metadata document; errors name ``where`` and the bad entry."""
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: metadata is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a {FORMAT_NAME} metadata document")
    version = doc.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: format version {version!r} is newer than this dcpbridge reads "
            f"({FORMAT_VERSION}); upgrade dcpbridge"
        )
    try:
        return _decode(doc)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(
            f"{where}: malformed metadata ({type(e).__name__}: {e})"
        ) from None


def _nonneg_ints(values: Any, what: str) -> list[int]:
    if type(values) is not list or not all(type(v) is int and v >= 0 for v in values):
        raise CorruptCheckpointError(f"{what} must be a list of non-negative integers")
    return values


def _decode_item(
    entry: dict[str, Any],
    what: str,
    sizes: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> StoredItem:
    checksums = entry.get("checksums")
    if checksums is not None and not all(type(c) is str for c in checksums):
        raise CorruptCheckpointError(f"{what}: checksums must be strings")
    offset, nbytes, rank = _nonneg_ints([entry["offset"], entry["nbytes"], entry["rank"]], what)
    return StoredItem(
        file=check_file_name(entry["file"]),
        offset=offset,
        nbytes=nbytes,
        rank=rank,
        checksums=tuple(checksums) if checksums is not None else None,
        sizes=sizes,
        dtype=dtype,
    )


def _decode(doc: dict[str, Any]) -> Metadata:
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    items: dict[ItemKey, StoredItem] = {}
    checksum = doc.get("checksum") or {}
    block = int(checksum.get("block_size", 0))
    for fqn, entry in doc["tensors"].items():
        dtype = parse_dtype(entry["dtype"])
        shape = _nonneg_ints(entry["shape"], f"tensor {fqn!r} shape")
        chunks = []
        for c in entry["chunks"]:
            offsets = _nonneg_ints(c["offsets"], f"tensor {fqn!r} chunk offsets")
            sizes = _nonneg_ints(c["sizes"], f"tensor {fqn!r} chunk sizes")
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                raise CorruptCheckpointError(f"tensor {fqn!r}: chunk rank differs from shape")
            if any(o + n > d for o, n, d in zip(offsets, sizes, shape)):
                raise CorruptCheckpointError(
                    f"tensor {fqn!r}: chunk {offsets}+{sizes} exceeds shape {shape}"
                )
            what = f"tensor {fqn!r} chunk {offsets}"
            item = _decode_item(c, what, tuple(sizes), dtype)
            expected = math.prod(sizes) * dtype.itemsize
            if item.nbytes != expected:
                raise CorruptCheckpointError(
                    f"{what}: {item.nbytes} bytes recorded, {expected} expected for sizes "
                    f"{sizes} of {dtype}"
                )
            _check_checksum_count(item, block, what)
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            items[(fqn, tuple(offsets))] = item
        state[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype), size=torch.Size(shape), chunks=chunks
        )
    for fqn, entry in doc["objects"].items():
        state[fqn] = BytesStorageMetadata()
        item = _decode_item(entry, f"object {fqn!r}")
        _check_checksum_count(item, block, f"object {fqn!r}")
        items[(fqn, None)] = item
    index = StorageIndex(
        items=items,
        save_id=str(doc["save_id"]),
        files=tuple(check_file_name(f) for f in doc["files"]),
        checksum_algorithm=checksum.get("algorithm"),
        checksum_block_size=block,
        world_size=int(doc.get("world_size", 1)),
        created_unix=float(doc.get("created_unix", 0.0)),
    )
    return Metadata(
        state_dict_metadata=state,
        planner_data=doc.get("planner_data"),
        storage_data=index,
        version=f"{FORMAT_NAME}-{doc['version']}",
    )


def _check_checksum_count(item: StoredItem, block: int, what: str) -> None:
    if item.checksums is None or not block:
        return
    expected = max(1, -(-item.nbytes // block))
    if len(item.checksums) != expected:
        raise CorruptCheckpointError(
            f"{what}: {len(item.checksums)} checksums recorded, {expected} expected"
        )
