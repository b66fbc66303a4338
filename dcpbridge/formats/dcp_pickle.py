"""torch's DCP ``.metadata`` pickle, read through the restricted unpickler without running code.

The allow-list is what torch 2.4 to 2.13 and Megatron-Core write into ``.metadata`` (checked
by disassembling real files): DCP's metadata dataclasses and ``_StorageInfo``, the save plans
Megatron-Core keeps in ``Metadata.all_local_plans`` (``SavePlan``, ``WriteItem``,
``WriteItemType``, ``TensorWriteData``, ``BytesIOWriteData``, ``_StoragePrefix``),
``torch.Size``, dtypes, layouts (``torch.serialization._get_layout``), the memory-format
encoding of ``TensorProperties``, ``collections.OrderedDict`` and the ``pathlib`` path of
``StorageMeta.checkpoint_id`` (read as a string), and ``builtins.list`` (a list of chunks as
dcpbridge's planners pickle it under torch's writer). Anything else is refused with a
``PickleRefusedError`` naming it; ``allow_pickle=True`` reads such metadata with ``pickle``.
"""

from __future__ import annotations

import collections
import functools
import pathlib
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
    WriteItemType,
)

from dcpbridge.errors import CorruptCheckpointError, PickleRefusedError
from dcpbridge.formats.unpickler import (
    Buildable,
    Constant,
    Entry,
    Factory,
    Malformed,
    Refused,
    restricted_loads,
)
from dcpbridge.storage.format.table import MAX_NDIM, MAX_SIZE

_DCP = "torch.distributed.checkpoint.metadata"
# Fields each class may carry; Metadata's ``all_local_plans`` (Megatron-Core 0.16) and
# ``mcore_data`` (earlier Megatron-Core) are Megatron's additions.
_FIELDS: dict[type, tuple[str, ...]] = {
    Metadata: (
        "state_dict_metadata",
        "planner_data",
        "storage_data",
        "storage_meta",
        "version",
        "all_local_plans",
        "mcore_data",
    ),
    TensorStorageMetadata: ("properties", "size", "chunks"),
    BytesStorageMetadata: (),
    ChunkStorageMetadata: ("offsets", "sizes"),
    TensorProperties: ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"),
    MetadataIndex: ("fqn", "offset", "index"),
    StorageMeta: ("checkpoint_id", "save_id", "load_id", "modules"),
    _StorageInfo: ("relative_path", "offset", "length", "transform_descriptors"),
    _StoragePrefix: ("prefix",),
    SavePlan: ("items", "storage_data", "planner_data", "usable"),
    WriteItem: ("index", "type", "bytes_io_data", "tensor_data"),
    TensorWriteData: ("chunk", "properties", "size"),
    BytesIOWriteData: ("nbytes",),
}
_MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.preserve_format)
_PATHS = {
    "PosixPath": pathlib.PurePosixPath,
    "PurePosixPath": pathlib.PurePosixPath,
    "WindowsPath": pathlib.PureWindowsPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
}


def _size(values: Any) -> torch.Size:
    """``torch.Size`` of at most MAX_NDIM ints in ``[0, MAX_SIZE]``."""
    if type(values) is not tuple or len(values) > MAX_NDIM:
        raise Malformed(f"a torch.Size of more than {MAX_NDIM} dimensions, or not a tuple")
    for v in values:
        if type(v) is not int or not 0 <= v <= MAX_SIZE:
            raise Malformed(f"a torch.Size holds a value that is not an int in [0, {MAX_SIZE}]")
    return torch.Size(values)


def _layout(name: Any) -> torch.layout:
    layouts = _torch_values(torch.layout)
    if type(name) is not str or not name.startswith("torch.") or name[6:] not in layouts:
        raise Malformed("an unknown torch layout")
    return layouts[name[6:]]


def _memory_format(code: Any) -> torch.memory_format:
    """DCP's ``_MEM_FORMAT_ENCODING`` member, read as the memory format it encodes."""
    if type(code) is not int or not 0 <= code < len(_MEMORY_FORMATS):
        raise Malformed("an unknown memory format encoding")
    return _MEMORY_FORMATS[code]


def _write_item_type(value: Any) -> WriteItemType:
    members = {m.value: m for m in WriteItemType}
    if type(value) is not int or value not in members:
        raise Malformed("an unknown WriteItemType")
    return members[value]


def _ordered_dict(*args: Any) -> collections.OrderedDict[Any, Any]:
    if args:
        raise Malformed("OrderedDict with constructor arguments")
    return collections.OrderedDict()


def _list(*args: Any) -> list[Any]:
    """``list()`` or ``list(items)`` of a list the pickle holds (nothing else is iterated)."""
    if args == ():
        return []
    if len(args) != 1 or type(args[0]) is not list:
        raise Malformed("builtins.list of something other than a list")
    return list(args[0])


def _path(kind: type[pathlib.PurePath]) -> Factory:
    def make(*parts: Any) -> str:
        if not all(type(p) is str for p in parts):
            raise Malformed("a path made of something other than strings")
        return str(kind(*parts))

    return Factory(make)


def _properties(state: tuple[Any, ...]) -> dict[str, Any]:
    """``TensorProperties.__getstate__``'s tuple as fields."""
    if len(state) != 5:
        raise Malformed(f"TensorProperties state has {len(state)} values, not 5")
    return dict(zip(_FIELDS[TensorProperties], state))


@functools.cache
def _torch_values(kind: type) -> dict[str, Any]:
    return {n: v for n in dir(torch) if isinstance(v := getattr(torch, n), kind)}


@functools.cache
def allow_list() -> dict[tuple[str, str], Entry]:
    """Every global a DCP ``.metadata`` may name, and what the reader makes of it."""
    allowed: dict[tuple[str, str], Entry] = {}
    for cls, fields in _FIELDS.items():
        allowed[(cls.__module__, cls.__name__)] = Buildable(
            cls,
            frozenset(fields),
            from_tuple=_properties if cls is TensorProperties else None,
            hashable=cls is MetadataIndex,
        )
    allowed[("torch", "Size")] = Factory(_size)
    allowed[("torch.serialization", "_get_layout")] = Factory(_layout)
    allowed[(_DCP, "_MEM_FORMAT_ENCODING")] = Factory(_memory_format)
    allowed[(WriteItemType.__module__, "WriteItemType")] = Factory(_write_item_type)
    allowed[("collections", "OrderedDict")] = Factory(_ordered_dict)
    allowed[("builtins", "list")] = Factory(_list)
    for name, kind in _PATHS.items():
        allowed[("pathlib", name)] = _path(kind)
    for name, dtype in _torch_values(torch.dtype).items():
        allowed[("torch", name)] = Constant(dtype)
    return allowed


def loads_dcp_metadata(raw: bytes, where: str) -> Metadata:
    """Unpickle DCP metadata ``raw`` (read from ``where``) without running code; the result
    is unchecked: pass it to ``dcp_checks.check_metadata``."""
    try:
        metadata = restricted_loads(raw, allow_list())
    except Refused as e:
        raise PickleRefusedError(
            f"{where}: this DCP metadata pickle needs {e.what}, which is not one of the "
            "classes torch's DCP metadata is made of, so dcpbridge will not build it (that "
            "could run code); if you trust this checkpoint, pass allow_pickle=True "
            "(CLI: --allow-pickle)"
        ) from e
    except Malformed as e:
        raise CorruptCheckpointError(f"{where}: not a readable DCP metadata pickle: {e}") from e
    if type(metadata) is not Metadata:
        raise CorruptCheckpointError(
            f"{where}: holds a {type(metadata).__name__}, not DCP Metadata"
        )
    return metadata
