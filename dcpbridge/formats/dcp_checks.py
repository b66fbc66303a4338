"""Checks of DCP metadata read from storage, before anything trusts it.

An unpickled ``.metadata`` holds allowed types but any values: fields may be missing or of
another type, sizes absurd, chunks outside their tensor, byte ranges outside the files.
``check_metadata`` refuses all of that with a ``CorruptCheckpointError`` naming the key, and
bounds what a load can be made to allocate by the bytes really stored: each tensor's chunks
add up to its element count without overlapping (so they tile the tensor), each chunk fits in
its stored bytes (or in what they can decode to, through DCP's stream extensions), and each
stored byte range lies inside its file.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
)

from dcpbridge.errors import CorruptCheckpointError, UnsafePathError
from dcpbridge.formats.dcp_transforms import most_decoded
from dcpbridge.planners.boxes import Placed, find_overlaps, fmt_box
from dcpbridge.storage.format.paths import check_file_name
from dcpbridge.storage.format.table import MAX_NDIM, MAX_SIZE

MAX_DEPTH = 32  # nesting of plain values (planner_data, mcore_data)
# What Megatron-Core's ``all_local_plans`` are made of (kept, never used by dcpbridge).
_PLAN_RECORDS = (
    SavePlan,
    WriteItem,
    TensorWriteData,
    BytesIOWriteData,
    MetadataIndex,
    ChunkStorageMetadata,
    TensorProperties,
    _StoragePrefix,
)
_PLAIN = (str, int, float, bool, bytes, type(None))


def _missing(obj: Any, name: str) -> Any:
    """Field ``name`` of ``obj``: its own value, else the dataclass default, else an error."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise CorruptCheckpointError(f"{type(obj).__name__} lacks its field {name!r}") from None


def _optional(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if value is not None and not isinstance(value, kind):
        raise CorruptCheckpointError(f"{what} is a {type(value).__name__}")
    return value


def _int(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_SIZE:
        raise CorruptCheckpointError(f"{what} must be an int in [0, {MAX_SIZE}]")
    return value


def check_plain(value: Any, what: str, records: tuple[type, ...] = ()) -> None:
    """``value`` is made of None, bools, numbers, strings, bytes, lists, tuples, dicts (and
    instances of ``records``, their fields checked alike, with dtypes, layouts and enums)
    only, at most MAX_DEPTH deep, without cycles (a shared value is checked once)."""
    leaves = (torch.dtype, torch.layout, torch.memory_format, enum.Enum) if records else ()
    done: set[int] = set()
    todo: list[tuple[Any, int]] = [(value, 0)]
    while todo:
        v, depth = todo.pop()
        if type(v) in _PLAIN:
            continue
        if depth >= MAX_DEPTH:
            raise CorruptCheckpointError(f"{what} is nested deeper than {MAX_DEPTH} levels")
        if id(v) in done:
            continue
        done.add(id(v))
        if isinstance(v, dict):
            todo.extend((k, depth + 1) for k in v)
            todo.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, (list, tuple)) and type(v) in (list, tuple, torch.Size):
            todo.extend((x, depth + 1) for x in v)
        elif type(v) in records:
            todo.extend((x, depth + 1) for x in vars(v).values())
        elif not isinstance(v, leaves):
            raise CorruptCheckpointError(f"{what} holds a {type(v).__name__}")


def _properties(p: Any, key: str) -> None:
    if type(p) is not TensorProperties:
        raise CorruptCheckpointError(f"{key!r}: tensor properties are a {type(p).__name__}")
    checks = (
        ("dtype", torch.dtype),
        ("layout", torch.layout),
        ("requires_grad", bool),
        ("memory_format", torch.memory_format),
        ("pin_memory", bool),
    )
    for name, kind in checks:
        if not isinstance(_missing(p, name), kind):
            raise CorruptCheckpointError(f"{key!r}: tensor property {name} is not a {kind}")
    if p.layout != torch.strided:
        raise CorruptCheckpointError(f"{key!r}: layout {p.layout} (only strided tensors load)")


def _shape(value: Any, ndim: int | None, what: str) -> torch.Size:
    """``value`` if it is a ``torch.Size`` (ints only) of ``ndim`` dimensions in range."""
    if type(value) is not torch.Size or (ndim is not None and len(value) != ndim):
        raise CorruptCheckpointError(
            f"{what} must be a torch.Size" + (f" of {ndim} dimensions" if ndim is not None else "")
        )
    if value and (min(value) < 0 or max(value) > MAX_SIZE):
        raise CorruptCheckpointError(f"{what} {tuple(value)} holds a value outside [0, {MAX_SIZE}]")
    return value


def _storage_info(
    info: Any, where: str, file_sizes: Mapping[str, int] | None, names: set[str]
) -> None:
    if type(info) is not _StorageInfo:
        raise CorruptCheckpointError(f"{where}: stored as a {type(info).__name__}")
    path = _missing(info, "relative_path")
    if type(path) is not str:
        raise CorruptCheckpointError(f"{where}: its file name is not a string")
    if path not in names:
        try:
            check_file_name(path)
        except UnsafePathError as e:
            raise CorruptCheckpointError(f"{where}: {e}") from e
        names.add(path)
    offset = _int(_missing(info, "offset"), f"{where}: its byte offset")
    length = _int(_missing(info, "length"), f"{where}: its byte length")
    transforms = _missing(info, "transform_descriptors")
    if transforms is not None and (
        type(transforms) not in (list, tuple) or not all(type(t) is str for t in transforms)
    ):
        raise CorruptCheckpointError(f"{where}: its transform descriptors are not strings")
    if file_sizes is not None:
        size = file_sizes.get(path)
        if size is None:
            raise CorruptCheckpointError(f"{where}: its data file {path} is missing")
        if offset + length > size:
            raise CorruptCheckpointError(
                f"{where} is stored at bytes {offset}..{offset + length} of {path}, which has "
                f"only {size} bytes (a truncated file or damaged metadata)"
            )


def _storage_index(
    storage: Any, file_sizes: Mapping[str, int] | None
) -> dict[tuple[str, Any], _StorageInfo]:
    """torch's file-format index checked, by (key, offset)."""
    if not isinstance(storage, dict):
        raise CorruptCheckpointError(
            f"storage_data is a {type(storage).__name__}, not torch's file-format index"
        )
    places: dict[tuple[str, Any], _StorageInfo] = {}
    names: set[str] = set()
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(_missing(index, "fqn")) is not str:
            raise CorruptCheckpointError("storage_data has a key that is not a MetadataIndex")
        offset = _missing(index, "offset")
        if offset is not None:
            _shape(offset, None, f"{index.fqn!r}: storage offset")
        _optional(_missing(index, "index"), int, f"{index.fqn!r}: index hint")
        where = repr(index.fqn) if offset is None else f"{index.fqn!r} at {tuple(offset)}"
        _storage_info(info, where, file_sizes, names)
        places[(index.fqn, offset)] = info
    return places


def _tensor(key: str, md: Any, places: Mapping[Any, _StorageInfo], seen: set[int]) -> None:
    _properties(_missing(md, "properties"), key)
    size = _shape(_missing(md, "size"), None, f"{key!r}: size")
    if len(size) > MAX_NDIM:
        raise CorruptCheckpointError(f"{key!r}: more than {MAX_NDIM} dimensions")
    numel = math.prod(size)
    if numel > MAX_SIZE:
        raise CorruptCheckpointError(
            f"{key!r}: size {tuple(size)} has more than {MAX_SIZE} elements"
        )
    chunks = _missing(md, "chunks")
    if type(chunks) is not list or id(chunks) in seen:
        raise CorruptCheckpointError(f"{key!r}: chunks are not a list of its own")
    seen.add(id(chunks))
    itemsize = md.properties.dtype.itemsize
    covered = 0
    placed: list[Placed] = []
    for chunk in chunks:
        if type(chunk) is not ChunkStorageMetadata:
            raise CorruptCheckpointError(f"{key!r}: a chunk is a {type(chunk).__name__}")
        offsets = _shape(_missing(chunk, "offsets"), len(size), f"{key!r}: chunk offsets")
        sizes = _shape(_missing(chunk, "sizes"), len(size), f"{key!r}: chunk sizes")
        volume = math.prod(sizes)
        if volume == 0:  # an empty shard (a DTensor's last ranks): nothing to read or place
            continue
        if any(o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise CorruptCheckpointError(
                f"{key!r}: chunk at {tuple(offsets)} of size {tuple(sizes)} lies outside "
                f"{tuple(size)}"
            )
        covered += volume
        placed.append(Placed(tuple(offsets), tuple(sizes), len(placed)))
        info = places.get((key, offsets))
        if info is None:
            raise CorruptCheckpointError(
                f"{key!r}: no stored bytes for the chunk at {tuple(offsets)}"
            )
        stages = len(info.transform_descriptors or ())
        if volume * itemsize > most_decoded(info.length, stages):
            stored = (
                f"its {info.length} stored bytes decode to at most "
                f"{most_decoded(info.length, stages)} ({', '.join(info.transform_descriptors)})"
                if stages
                else f"{info.length} are stored"
            )
            raise CorruptCheckpointError(
                f"{key!r}: the chunk at {tuple(offsets)} needs {volume * itemsize} bytes, {stored}"
            )
    _check_tiling(key, size, placed, covered)


def check_tiling(key: str, size: tuple[int, ...], chunks: list[Any]) -> None:
    """Raise ``CorruptCheckpointError`` unless the non-empty ``chunks`` (DCP chunk metadata)
    of tensor ``key`` of ``size`` lie inside it and tile it exactly once."""
    placed = []
    for chunk in chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if math.prod(sizes) == 0:
            continue
        if len(offsets) != len(size) or any(
            o < 0 or o + n > m for o, n, m in zip(offsets, sizes, size)
        ):
            raise CorruptCheckpointError(
                f"{key!r}: chunk at {offsets} of size {sizes} lies outside {tuple(size)}"
            )
        placed.append(Placed(offsets, sizes, len(placed)))
    _check_tiling(key, size, placed, sum(p.numel for p in placed))


def _check_tiling(key: str, size: tuple[int, ...], placed: list[Placed], covered: int) -> None:
    numel = math.prod(size)
    if covered != numel:
        raise CorruptCheckpointError(
            f"{key!r}: its chunks hold {covered} elements, its size {tuple(size)} has {numel}"
        )
    # inside the tensor and as many elements as it has: they tile it unless two overlap (then
    # part of it is in no chunk, and a load would hand back the template's values there)
    for a, b in find_overlaps(placed, limit=1):
        raise CorruptCheckpointError(
            f"{key!r}: chunks {fmt_box(a.offsets, a.sizes)} and {fmt_box(b.offsets, b.sizes)} "
            "overlap"
        )


def check_metadata(
    metadata: Metadata, where: str, file_sizes: Mapping[str, int] | None = None
) -> Metadata:
    """``metadata`` if its structure is what torch's file format writes; raises
    ``CorruptCheckpointError`` naming ``where`` and the key otherwise. ``file_sizes`` (the
    checkpoint's files by name) bounds the stored byte ranges."""
    try:
        _check(metadata, file_sizes)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from e
    return metadata


def _check(metadata: Metadata, file_sizes: Mapping[str, int] | None) -> None:
    state = _missing(metadata, "state_dict_metadata")
    if not isinstance(state, dict):
        raise CorruptCheckpointError("state_dict_metadata is not a dict")
    places = _storage_index(_missing(metadata, "storage_data"), file_sizes)
    seen: set[int] = set()
    for key, md in state.items():
        if type(key) is not str:
            raise CorruptCheckpointError("a state_dict_metadata key is not a string")
        if type(md) is TensorStorageMetadata:
            _tensor(key, md, places, seen)
        elif type(md) is BytesStorageMetadata:
            if (key, None) not in places:
                raise CorruptCheckpointError(f"{key!r}: no stored bytes")
        else:
            raise CorruptCheckpointError(f"{key!r}: described by a {type(md).__name__}")
    check_plain(_missing(metadata, "planner_data"), "planner_data")
    check_plain(getattr(metadata, "mcore_data", None), "mcore_data")
    plans = getattr(metadata, "all_local_plans", None)
    if plans is not None and (
        type(plans) is not list or not all(type(p) is SavePlan for p in plans)
    ):
        raise CorruptCheckpointError("all_local_plans is not a list of SavePlans")
    check_plain(plans, "all_local_plans", _PLAN_RECORDS)
    _optional(_missing(metadata, "version"), str, "version")
    meta = _optional(_missing(metadata, "storage_meta"), StorageMeta, "storage_meta")
    if meta is not None:
        for name in ("checkpoint_id", "save_id", "load_id"):
            _optional(_missing(meta, name), str, f"storage_meta.{name}")
        modules = _missing(meta, "modules")
        if type(modules) is not list or not all(type(m) is str for m in modules):
            raise CorruptCheckpointError("storage_meta.modules is not a list of strings")
