"""dcpbridge storage: DCP StorageWriter/StorageReader over fsspec (local disk, S3, any URL)."""

from __future__ import annotations

from dcpbridge.storage.errors import (
    CheckpointError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    MissingEntryError,
    NotACheckpointError,
    StorageError,
    StorageFileNotFoundError,
    UnsafePathError,
)
from dcpbridge.storage.format import FORMAT_VERSION, METADATA_FILE, StorageIndex, StoredItem
from dcpbridge.storage.paths import Location, resolve
from dcpbridge.storage.reader import FsspecCheckpointReader, read_checkpoint_metadata
from dcpbridge.storage.writer import FsspecCheckpointWriter

__all__ = [
    "FORMAT_VERSION",
    "METADATA_FILE",
    "CheckpointError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "FsspecCheckpointReader",
    "FsspecCheckpointWriter",
    "IncompleteCheckpointError",
    "InvalidArgumentError",
    "Location",
    "MissingEntryError",
    "NotACheckpointError",
    "StorageError",
    "StorageFileNotFoundError",
    "StorageIndex",
    "StoredItem",
    "UnsafePathError",
    "read_checkpoint_metadata",
    "resolve",
]
