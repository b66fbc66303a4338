"""Megatron-Core's ``dist_checkpointing.mapping`` names: dcpbridge's types and helpers."""

from __future__ import annotations

from dcpbridge.dist_checkpointing.core import CheckpointingException
from dcpbridge.model.mapping import (
    LocalNonpersistentObject,
    ReplicaId,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)

CommonStateDict = StateDict

__all__ = [
    "CheckpointingException",
    "CommonStateDict",
    "LocalNonpersistentObject",
    "ReplicaId",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StateDict",
    "apply_factories",
    "apply_factory_merges",
    "is_main_replica",
]
