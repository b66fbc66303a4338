"""All dcpbridge exceptions; each is an ordinary ``Exception`` deriving from ``CheckpointError``."""

from __future__ import annotations

from dcpbridge.planners.errors import (
    DTypeMismatchError,
    InvalidRequestError,
    MissingKeysError,
    PickleRefusedError,
    SerializationError,
    ShapeMismatchError,
    ShardingValidationError,
    UnexpectedKeysError,
)
from dcpbridge.storage.errors import (
    CheckpointError,
    ChecksumMismatchError,
    ConcurrentSaveError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    MissingEntryError,
    NotACheckpointError,
    StorageError,
    StorageFileNotFoundError,
    UnsafePathError,
)


class InvalidShardError(CheckpointError, ValueError):
    """A ShardedTensor/ShardedObject was built with inconsistent metadata."""


class OptimizerStateError(CheckpointError, ValueError):
    """Optimizer state that cannot be mapped onto, or restored from, the model's sharding."""


class HollowStateError(CheckpointError, RuntimeError):
    """A TensorAwareStateDict call needs the tensors that were popped (or finds them present)."""


class KeyMismatchError(MissingKeysError, UnexpectedKeysError):
    """Keys requested but not in the checkpoint and keys in it but not requested, together."""


class StagingError(CheckpointError, RuntimeError):
    """Copying an async save's state into host memory failed (the message names the cause)."""


class StagingMutationError(StagingError):
    """A saved tensor changed before its async save had staged it (``verify_staging``)."""


class DistributedCheckpointError(CheckpointError):
    """Several ranks failed with different errors; the message lists each rank's."""


class CollectiveError(DistributedCheckpointError, RuntimeError):
    """An exchange with the other ranks failed: a rank died, hung past the group's timeout or
    left (still a ``RuntimeError``, as torch's own collective errors are)."""


__all__ = [
    "CheckpointError",
    "ChecksumMismatchError",
    "CollectiveError",
    "ConcurrentSaveError",
    "CorruptCheckpointError",
    "DTypeMismatchError",
    "DistributedCheckpointError",
    "HollowStateError",
    "IncompleteCheckpointError",
    "InvalidArgumentError",
    "InvalidRequestError",
    "InvalidShardError",
    "KeyMismatchError",
    "MissingEntryError",
    "MissingKeysError",
    "NotACheckpointError",
    "OptimizerStateError",
    "PickleRefusedError",
    "SerializationError",
    "ShapeMismatchError",
    "ShardingValidationError",
    "StagingError",
    "StagingMutationError",
    "StorageError",
    "StorageFileNotFoundError",
    "UnexpectedKeysError",
    "UnsafePathError",
]
