"""dcpbridge: Megatron-style sharded checkpoints saved and loaded through torch.distributed.checkpoint."""

from __future__ import annotations

from dcpbridge.api import load, load_common_state_dict, load_tensors_metadata, save
from dcpbridge.errors import (
    CheckpointError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    DTypeMismatchError,
    IncompleteCheckpointError,
    InvalidShardError,
    MissingKeysError,
    NotACheckpointError,
    PickleRefusedError,
    SerializationError,
    ShapeMismatchError,
    ShardingValidationError,
    UnexpectedKeysError,
    UnsafePathError,
)
from dcpbridge.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)
from dcpbridge.sharding import (
    DistModule,
    DistributedKeys,
    broadcast_and_shard_state_dict,
    load_state_dict,
    shard_broadcasted_state_dict,
)
from planners import ShardedLoadPlanner, ShardedSavePlanner, StrictMode
from storage import FsspecCheckpointReader, FsspecCheckpointWriter

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "DTypeMismatchError",
    "DistModule",
    "DistributedCheckpointError",
    "DistributedKeys",
    "FsspecCheckpointReader",
    "FsspecCheckpointWriter",
    "IncompleteCheckpointError",
    "InvalidShardError",
    "LocalNonpersistentObject",
    "MissingKeysError",
    "NotACheckpointError",
    "PickleRefusedError",
    "SerializationError",
    "ShapeMismatchError",
    "ShardedLoadPlanner",
    "ShardedObject",
    "ShardedSavePlanner",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "ShardingValidationError",
    "StateDict",
    "StrictMode",
    "UnexpectedKeysError",
    "UnsafePathError",
    "broadcast_and_shard_state_dict",
    "load",
    "load_common_state_dict",
    "load_state_dict",
    "load_tensors_metadata",
    "save",
    "shard_broadcasted_state_dict",
]
