"""All dcpbridge exceptions; each is an ordinary ``Exception`` deriving from ``CheckpointError``."""

from __future__ import annotations

from planners.errors import (
    DTypeMismatchError,
    MissingKeysError,
    PickleRefusedError,
    SerializationError,
    ShapeMismatchError,
    ShardingValidationError,
    UnexpectedKeysError,
)
from storage.errors import (
    CheckpointError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotACheckpointError,
    UnsafePathError,
)


class InvalidShardError(CheckpointError, ValueError):
    """A ShardedTensor/ShardedObject was built with inconsistent metadata."""


class DistributedCheckpointError(CheckpointError):
    """Several ranks failed with different errors; the message lists each rank's."""


__all__ = [
    "CheckpointError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "DTypeMismatchError",
    "DistributedCheckpointError",
    "IncompleteCheckpointError",
    "InvalidShardError",
    "MissingKeysError",
    "NotACheckpointError",
    "PickleRefusedError",
    "SerializationError",
    "ShapeMismatchError",
    "ShardingValidationError",
    "UnexpectedKeysError",
    "UnsafePathError",
]
