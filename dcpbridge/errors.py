"""All dcpbridge exceptions; each is an ordinary ``Exception`` deriving from ``CheckpointError``."""

from __future__ import annotations

from dcpbridge.planners.errors import (
    DTypeMismatchError,
    InvalidRequestError,
    KeyMismatchError,
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
    WriterProcessError,
)


class InvalidShardError(CheckpointError, ValueError):
    """A ShardedTensor/ShardedObject was built with inconsistent metadata."""


class OptimizerStateError(CheckpointError, ValueError):
    """Optimizer state that cannot be mapped onto, or restored from, the model's sharding."""


class HollowStateError(CheckpointError, RuntimeError):
    """A TensorAwareStateDict call needs the tensors that were popped (or finds them present)."""


class UnsupportedExtensionError(CheckpointError):
    """A checkpoint's bytes pass through a DCP extension (a stream transform such as
    ZStandard) that cannot be undone here: unknown to torch, or its package is missing."""


class DataStateError(CheckpointError, ValueError):
    """A saved data position that does not fit this job (dataset, seed, global batch size) or
    is not a valid position at all."""


class DataLayoutError(DataStateError):
    """Per-rank data state (loader, RNG, buffers) that cannot follow the loading job's layout:
    saved by another number of ranks, or missing a rank's cell."""


class TiedTensorsError(CheckpointError, ValueError):
    """Keys that share one tensor's memory in a load template (tied weights) are stored with
    different values, so no single tensor can hold both."""


class StagingError(CheckpointError, RuntimeError):
    """Copying state into buffers of its own failed: an async save's staging into host memory,
    a fully-parallel load's exchange buffers (the message names the key and the cause)."""


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
    "DataLayoutError",
    "DataStateError",
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
    "TiedTensorsError",
    "UnexpectedKeysError",
    "UnsafePathError",
    "UnsupportedExtensionError",
    "WriterProcessError",
]
