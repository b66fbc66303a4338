"""dcpbridge storage: DCP StorageWriter/StorageReader over fsspec (local disk, S3, any URL)."""

from __future__ import annotations

import sys

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
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.document import (
    FORMAT_VERSION,
    METADATA_FILE,
    StorageIndex,
    StoredItem,
)
from dcpbridge.storage.format.paths import Location, resolve
from dcpbridge.storage.read.reader import FsspecCheckpointReader, read_checkpoint_metadata
from dcpbridge.storage.write.writer import FsspecCheckpointWriter

# ``dcpbridge.storage.checksum`` (named by earlier READMEs) is the module in format/ now
sys.modules[f"{__name__}.checksum"] = checksum

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
