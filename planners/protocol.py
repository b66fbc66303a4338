"""The small protocol the planners plan from; dcpbridge's ShardedTensor/ShardedObject satisfy it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
from torch.distributed.tensor import DTensor

from dcpbridge.planners.errors import InvalidRequestError

ReplicaId = int | tuple[int, ...]


@runtime_checkable
class TensorShard(Protocol):
    """A box of a global tensor held by this rank (Megatron ``ShardedTensor`` semantics)."""

    key: str
    data: torch.Tensor | None
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    prepend_axis_num: int
    replica_id: ReplicaId
    allow_shape_mismatch: bool


@runtime_checkable
class ObjectShard(Protocol):
    """One picklable object of a grid of objects (Megatron ``ShardedObject`` semantics)."""

    key: str
    data: Any
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId

    @property
    def unique_key(self) -> str: ...


# offsets and shape are "."-joined integers, both empty for a grid of shape ()
_OBJECT_NAME = re.compile(
    r"^(?P<key>.+)/shard_(?P<offset>(?:\d+(?:\.\d+)*)?)_(?P<shape>(?:\d+(?:\.\d+)*)?)\Z"
)


def parse_object_name(name: str) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """(key, global_offset, global_shape) of a ShardedObject storage name, or None."""
    m = _OBJECT_NAME.match(name)
    if m is None:
        return None
    offset = tuple(int(x) for x in m["offset"].split(".") if x)
    shape = tuple(int(x) for x in m["shape"].split(".") if x)
    if len(offset) != len(shape):
        return None
    return m["key"], offset, shape


def object_key(name: str) -> str:
    """The ShardedObject key a storage name belongs to (other names are returned unchanged)."""
    if "/shard_" not in name:  # no cell name (most names): no pattern match
        return name
    parsed = parse_object_name(name)
    return name if parsed is None else parsed[0]


LeafKind = Literal[
    "tensor_shard",
    "object_shard",
    "tensor",
    "dtensor",
    "torch_sharded",
    "factory",
    "nonpersistent",
    "unknown_sharded",
    "object",
]
_KINDS: dict[type, LeafKind] = {}
# Attributes that mark a value as sharding metadata of some library (never to be pickled).
_SHARDING_ATTRS = ("placements", "device_mesh", "local_shards", "sharding_spec", "flattened_range")


def _classify(leaf: Any) -> LeafKind:
    if isinstance(leaf, DTensor):
        return "dtensor"
    if isinstance(leaf, TorchShardedTensor):
        return "torch_sharded"
    if isinstance(leaf, torch.Tensor):
        plain = type(leaf) in (torch.Tensor, torch.nn.Parameter)
        return "tensor" if plain else "unknown_sharded"
    if isinstance(leaf, ObjectShard):
        return "object_shard"
    if isinstance(leaf, TensorShard):
        return "tensor_shard"
    if callable(getattr(leaf, "build", None)) and hasattr(leaf, "merge_fn"):
        return "factory"  # dcpbridge's or Megatron-Core's ShardedTensorFactory
    if type(leaf).__name__ == "LocalNonpersistentObject" and callable(
        getattr(leaf, "unwrap", None)
    ):
        return "nonpersistent"
    if (
        any(hasattr(leaf, a) for a in _SHARDING_ATTRS)
        or (hasattr(leaf, "global_shape") and hasattr(leaf, "global_offset"))
        or "Shard" in type(leaf).__name__
    ):
        return "unknown_sharded"
    return "object"


def leaf_kind(leaf: Any) -> LeafKind:
    """Classify a state-dict leaf (cached per type: Protocol isinstance checks are slow)."""
    cls = type(leaf)
    kind = _KINDS.get(cls)
    if kind is None:
        kind = _KINDS[cls] = _classify(leaf)
    return kind


def is_sharded_meta(value: Any) -> bool:
    """Sharding metadata that is not itself a tensor (ShardedTensor/Object, factories...)."""
    return not isinstance(value, torch.Tensor) and leaf_kind(value) not in ("object",)


def keeps_list_recursing(value: Any) -> bool:
    """DCP recurses into a list holding a tensor; we also do for any sharded value."""
    return isinstance(value, torch.Tensor) or leaf_kind(value) != "object"


@dataclass(frozen=True, slots=True)
class LocalBox:
    """A ``TensorShard`` made from a plain tensor, a DTensor or a torch ShardedTensor shard."""

    key: str
    data: torch.Tensor | None
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False


def chunk_sizes(shard: TensorShard) -> tuple[int, ...]:
    """The shard's box size in global coordinates: 1 along each prepended axis."""
    return (1,) * shard.prepend_axis_num + tuple(shard.local_shape)


def chunk_view(shard: TensorShard) -> torch.Tensor:
    """The shard's data with its prepended axes as leading unit dimensions."""
    if shard.data is None:
        raise InvalidRequestError(f"ShardedTensor {shard.key!r} has no data")
    data = shard.data.detach()  # Parameters are filled in place, also from reader threads
    for _ in range(shard.prepend_axis_num):
        data = data.unsqueeze(0)
    return data
