"""The small protocol the planners plan from; dcpbridge's ShardedTensor/ShardedObject satisfy it."""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import torch

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


LeafKind = Literal["tensor_shard", "object_shard", "tensor", "object"]
_KINDS: dict[type, LeafKind] = {}


def leaf_kind(leaf: Any) -> LeafKind:
    """Classify a state-dict leaf (cached per type: Protocol isinstance checks are slow)."""
    cls = type(leaf)
    kind = _KINDS.get(cls)
    if kind is None:
        if isinstance(leaf, torch.Tensor):
            kind = "tensor"
        elif isinstance(leaf, ObjectShard):
            kind = "object_shard"
        elif isinstance(leaf, TensorShard):
            kind = "tensor_shard"
        else:
            kind = "object"
        _KINDS[cls] = kind
    return kind


def is_main_replica(replica_id: ReplicaId) -> bool:
    """The main replica (0, or all zeros) is the one that writes a shard."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


def chunk_sizes(shard: TensorShard) -> tuple[int, ...]:
    """The shard's box size in global coordinates: 1 along each prepended axis."""
    return (1,) * shard.prepend_axis_num + tuple(shard.local_shape)


def chunk_view(shard: TensorShard) -> torch.Tensor:
    """The shard's data with its prepended axes as leading unit dimensions."""
    if shard.data is None:
        raise ValueError(f"ShardedTensor {shard.key!r} has no data")
    data = shard.data.detach()  # Parameters are filled in place, also from reader threads
    for _ in range(shard.prepend_axis_num):
        data = data.unsqueeze(0)
    return data
