"""The on-disk format: file names and the JSON metadata (commit) document, with no pickle."""

from __future__ import annotations

import heapq
import itertools
import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcpbridge.storage.checksum import item_grid
from dcpbridge.storage.errors import CorruptCheckpointError, InvalidArgumentError, UnsafePathError
from dcpbridge.storage.paths import MAX_PREFIXES, check_file_name

FORMAT_NAME = "dcpbridge"
# 3: tensor chunks' checksums cover tiles chosen from their shape (storage/checksum.py);
# 2: the document ends with a digest of itself. 1 and 2 (flat checksum blocks) still load.
FORMAT_VERSION = 3
METADATA_FILE = "dcpbridge.json"
DATA_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.([0-9a-f]+)\.bin$")
TEMP_METADATA_PREFIX = f"{METADATA_FILE}.tmp-"
# Items start on 64-byte boundaries so staged reads can be viewed as any dtype.
ITEM_ALIGN = 64
# Largest dimension, offset or byte count a document may state (far below int64 overflow).
MAX_SIZE = 1 << 62
MAX_NDIM = 64
MAX_WORLD_SIZE = 1 << 31
DIGEST_ALGORITHM = "xxh3_128"
CHECKSUM_ALGORITHMS = ("xxh3_64",)
_DIGEST_KEY = "digest"
_TRAILER = re.compile(rb',"digest":"([0-9a-z_]{1,16}):([0-9a-f]{1,128})"\}\Z')
_SAVE_ID = re.compile(r"^[0-9a-f]{1,64}$")
_HEX64 = re.compile(r"^[0-9a-f]{16}$")


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
    tiled_checksums: bool = True  # format 3 checksum tiles (False: format 2's flat blocks)
    prefixes: int = 1  # data files spread over this many hashed folders (paths.spread_dir)

    def get(self, index: MetadataIndex) -> StoredItem | None:
        return self.items.get(item_key(index))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (as ``dtype_name`` writes it); refuses anything else."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or dtype_name(dtype) != name or dtype.itemsize < 1:
        raise CorruptCheckpointError(f"unknown dtype {_show(name)}")
    return dtype


def _item_json(item: StoredItem, out: dict[str, Any] | None = None) -> dict[str, Any]:
    out = {} if out is None else out
    out["file"] = item.file
    out["offset"] = item.offset
    out["nbytes"] = item.nbytes
    out["rank"] = item.rank
    if item.checksums is not None:
        out["checksums"] = list(item.checksums)
    return out


def encode_metadata(metadata: Metadata) -> bytes:
    """Serialize DCP ``Metadata`` whose ``storage_data`` is a ``StorageIndex`` to JSON bytes.

    The document is validated exactly as a load would, so a save never commits metadata that
    its own loader refuses, and it ends with its digest (see ``sign_document``).
    """
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
                    raise InvalidArgumentError(
                        f"no stored bytes for tensor {fqn!r} chunk {list(offsets)}"
                    )
                chunks.append(
                    _item_json(item, {"offsets": list(offsets), "sizes": list(chunk.sizes)})
                )
            tensors[fqn] = {
                "dtype": dtype_name(md.properties.dtype),
                "shape": list(md.size),
                "chunks": chunks,
            }
        else:
            item = index.items.get((fqn, None))
            if item is None:
                raise InvalidArgumentError(f"no stored bytes for object {fqn!r}")
            objects[fqn] = _item_json(item)
    doc = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION if index.tiled_checksums else 2,
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
    } | ({"prefixes": index.prefixes} if index.prefixes > 1 else {})
    try:
        _decode(doc)
    except CorruptCheckpointError as e:
        raise InvalidArgumentError(f"refusing to commit invalid metadata: {e}") from None
    return sign_document(doc)


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
    """Parse and fully validate a metadata document before anything is read or allocated.

    Checks the digest (format 2), every field's type and range, that each tensor's chunks lie
    inside it, are pairwise disjoint and cover it exactly, that byte sizes match shapes, and
    that items of one file do not overlap. Errors name ``where`` and the bad entry.
    """
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: metadata is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a {FORMAT_NAME} metadata document")
    version = doc.get("version")
    if type(version) is not int or version < 1:
        raise CorruptCheckpointError(f"{where}: format version {_show(version)} is not valid")
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: format version {version!r} is newer than this dcpbridge reads "
            f"({FORMAT_VERSION}); upgrade dcpbridge"
        )
    try:
        if version >= 2 or _DIGEST_KEY in doc:
            _verify_digest(raw)
        return _decode(doc)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from None
    except UnsafePathError as e:
        raise UnsafePathError(f"{where}: {e}") from None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(value: Any, what: str, lo: int = 0, hi: int = MAX_SIZE) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise CorruptCheckpointError(
            f"{what} must be an integer in [{lo}, {hi}], got {_show(value)}"
        )
    return value


def _ints(values: Any, what: str, n: int | None = None) -> list[int]:
    if type(values) is not list or (n is not None and len(values) != n):
        need = f"{n} integers" if n is not None else "integers"
        raise CorruptCheckpointError(f"{what} must be a list of {need}, got {_show(values)}")
    if len(values) > MAX_NDIM:
        raise CorruptCheckpointError(f"{what} has {len(values)} dimensions (at most {MAX_NDIM})")
    return [_int(v, what) for v in values]


def _dict(value: Any, what: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise CorruptCheckpointError(f"{what} must be a JSON object, got {_show(value)}")
    return value


def _field(entry: dict[str, Any], name: str, what: str) -> Any:
    if name not in entry:
        raise CorruptCheckpointError(f"{what}: field {name!r} is missing")
    return entry[name]


def _product(values: list[int], itemsize: int, what: str) -> int:
    """``prod(values) * itemsize``, refused above ``MAX_SIZE`` (C code would overflow)."""
    total = itemsize
    for v in values:
        total *= v
        if total > MAX_SIZE:
            raise CorruptCheckpointError(f"{what}: {values} elements are too many")
    return total


@dataclass(frozen=True, slots=True)
class _Facts:
    """Document-wide facts every item is checked against."""

    save_id: str
    files: frozenset[str]
    world_size: int
    block: int
    tiled: bool


def _decode_item(
    entry: Any,
    what: str,
    facts: _Facts,
    sizes: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> StoredItem:
    entry = _dict(entry, what)
    name = _field(entry, "file", what)
    if not isinstance(name, str):
        raise CorruptCheckpointError(f"{what}: file must be a string, got {_show(name)}")
    check_file_name(name)
    if name not in facts.files:
        raise CorruptCheckpointError(f"{what}: file {name!r} is not among the checkpoint's files")
    offset = _int(_field(entry, "offset", what), f"{what} offset")
    if offset % ITEM_ALIGN:
        raise CorruptCheckpointError(f"{what}: offset {offset} is not {ITEM_ALIGN}-byte aligned")
    nbytes = _int(_field(entry, "nbytes", what), f"{what} nbytes")
    rank = _int(_field(entry, "rank", what), f"{what} rank", 0, facts.world_size - 1)
    checksums = entry.get("checksums")
    if facts.block:
        expected = item_grid(nbytes, sizes, dtype, facts.block, tiled=facts.tiled).count
        if type(checksums) is not list or len(checksums) != expected:
            raise CorruptCheckpointError(
                f"{what}: {expected} block checksums expected, found {_show(checksums)}"
            )
        if not all(type(c) is str and _HEX64.match(c) for c in checksums):
            raise CorruptCheckpointError(f"{what}: checksums must be 16 hex digits each")
    elif checksums is not None:
        raise CorruptCheckpointError(f"{what}: checksums recorded, but no checksum algorithm")
    return StoredItem(
        file=name,
        offset=offset,
        nbytes=nbytes,
        rank=rank,
        checksums=tuple(checksums) if checksums is not None else None,
        sizes=sizes,
        dtype=dtype,
    )


def _decode_facts(doc: dict[str, Any]) -> _Facts:
    save_id = _field(doc, "save_id", "document")
    if not isinstance(save_id, str) or not _SAVE_ID.match(save_id):
        raise CorruptCheckpointError(f"save_id must be lowercase hex, got {_show(save_id)}")
    world_size = _int(doc.get("world_size", 1), "world_size", 1, MAX_WORLD_SIZE)
    created = doc.get("created_unix", 0.0)
    if type(created) not in (int, float) or not math.isfinite(created):
        raise CorruptCheckpointError(f"created_unix must be a number, got {_show(created)}")
    checksum = doc.get("checksum")
    block = 0
    if checksum is not None:
        checksum = _dict(checksum, "checksum")
        algorithm = checksum.get("algorithm")
        if algorithm not in CHECKSUM_ALGORITHMS:
            raise CorruptCheckpointError(f"unknown checksum algorithm {_show(algorithm)}")
        block = _int(checksum.get("block_size"), "checksum block_size", 1)
    files = _field(doc, "files", "document")
    if type(files) is not list:
        raise CorruptCheckpointError(f"files must be a list, got {_show(files)}")
    for name in files:
        if not isinstance(name, str):
            raise CorruptCheckpointError(f"files: {_show(name)} is not a file name")
        check_file_name(name)
        m = DATA_FILE_RE.match(name)
        if m is None or m.group(3) != save_id:
            raise CorruptCheckpointError(f"files: {name!r} is not a data file of save {save_id!r}")
    if len(set(files)) != len(files):
        raise CorruptCheckpointError("files: a file is listed twice")
    return _Facts(save_id, frozenset(files), world_size, block, doc.get("version", 1) >= 3)


def _decode(doc: dict[str, Any]) -> Metadata:
    facts = _decode_facts(doc)
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    items: dict[ItemKey, StoredItem] = {}
    tensors = _dict(_field(doc, "tensors", "document"), "tensors")
    objects = _dict(_field(doc, "objects", "document"), "objects")
    for fqn, entry in tensors.items():
        state[fqn] = _decode_tensor(fqn, entry, facts, items)
    for fqn, entry in objects.items():
        if fqn in state:
            raise CorruptCheckpointError(f"{fqn!r} is both a tensor and an object")
        state[fqn] = BytesStorageMetadata()
        items[(fqn, None)] = _decode_item(entry, f"object {fqn!r}", facts)
    _check_file_ranges(items)
    checksum = doc.get("checksum") or {}
    index = StorageIndex(
        items=items,
        save_id=facts.save_id,
        files=tuple(doc["files"]),
        checksum_algorithm=checksum.get("algorithm"),
        checksum_block_size=facts.block,
        world_size=facts.world_size,
        created_unix=float(doc.get("created_unix", 0.0)),
        tiled_checksums=facts.tiled,
        prefixes=_int(doc.get("prefixes", 1), "prefixes", 1, MAX_PREFIXES),
    )
    return Metadata(
        state_dict_metadata=state,
        planner_data=doc.get("planner_data"),
        storage_data=index,
        version=f"{FORMAT_NAME}-{doc['version']}",
    )


def _decode_tensor(
    fqn: str, entry: Any, facts: _Facts, items: dict[ItemKey, StoredItem]
) -> TensorStorageMetadata:
    what = f"tensor {fqn!r}"
    entry = _dict(entry, what)
    dtype = parse_dtype(_field(entry, "dtype", what))
    shape = _ints(_field(entry, "shape", what), f"{what} shape")
    numel = _product(shape, 1, f"{what} shape")
    _product(shape, dtype.itemsize, f"{what} shape")
    raw_chunks = _field(entry, "chunks", what)
    if type(raw_chunks) is not list:
        raise CorruptCheckpointError(f"{what}: chunks must be a list, got {_show(raw_chunks)}")
    chunks: list[ChunkStorageMetadata] = []
    for c in raw_chunks:
        c = _dict(c, f"{what} chunk")
        offsets = _ints(_field(c, "offsets", f"{what} chunk"), f"{what} chunk offsets", len(shape))
        sizes = _ints(_field(c, "sizes", f"{what} chunk"), f"{what} chunk sizes", len(shape))
        cwhat = f"{what} chunk {offsets}"
        if any(o + n > d for o, n, d in zip(offsets, sizes, shape)):
            raise CorruptCheckpointError(f"{cwhat}: sizes {sizes} exceed shape {shape}")
        key = (fqn, tuple(offsets))
        if key in items:
            raise CorruptCheckpointError(f"{cwhat} is recorded twice")
        item = _decode_item(c, cwhat, facts, tuple(sizes), dtype)
        expected = _product(sizes, dtype.itemsize, cwhat)
        if item.nbytes != expected:
            raise CorruptCheckpointError(
                f"{cwhat}: {item.nbytes} bytes recorded, {expected} expected for sizes "
                f"{sizes} of {dtype}"
            )
        chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        items[key] = item
    _check_tiling(what, shape, numel, chunks)
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype), size=torch.Size(shape), chunks=chunks
    )


def _check_tiling(
    what: str, shape: list[int], numel: int, chunks: list[ChunkStorageMetadata]
) -> None:
    """Chunks (already inside ``shape``) must be pairwise disjoint and cover it exactly.

    A sweep along the dimension with the most distinct chunk starts: each chunk is compared
    only with chunks still open at its start, so typical tilings cost O(n log n).
    """
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks if math.prod(c.sizes)]
    covered = sum(math.prod(s) for _, s in boxes)
    if boxes and shape:
        d = max(range(len(shape)), key=lambda i: len({o[i] for o, _ in boxes}))
        boxes.sort(key=lambda b: b[0][d])
        open_: list[tuple[int, int]] = []  # (end along d, index into boxes)
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


def _check_file_ranges(items: dict[ItemKey, StoredItem]) -> None:
    """Items stored in one file must not share bytes."""
    by_file: dict[str, list[tuple[int, int, ItemKey]]] = {}
    for key, item in items.items():
        if item.nbytes:
            by_file.setdefault(item.file, []).append((item.offset, item.offset + item.nbytes, key))
    for name, ranges in by_file.items():
        ranges.sort()
        for (_, end, a), (start, _, b) in itertools.pairwise(ranges):
            if start < end:
                raise CorruptCheckpointError(
                    f"{name}: the bytes of {describe_item(a)} and {describe_item(b)} overlap"
                )


def describe_item(key: ItemKey) -> str:
    """How errors name a stored item: ``tensor 'w' chunk [0, 4]`` or ``object 'o'``."""
    fqn, offsets = key
    return f"object {fqn!r}" if offsets is None else f"tensor {fqn!r} chunk {list(offsets)}"


def check_stored_ranges(
    items: Mapping[ItemKey, StoredItem], sizes: Mapping[str, int], where: str
) -> None:
    """Every item's bytes must lie inside its data file (``sizes``: file name -> bytes)."""
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
