"""Exceptions a user can cause; every dcpbridge error derives from ``CheckpointError``."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of all dcpbridge errors (an ordinary ``Exception``, unlike DCP's)."""


class NotACheckpointError(CheckpointError, FileNotFoundError):
    """The path holds no dcpbridge checkpoint at all."""


class IncompleteCheckpointError(CheckpointError):
    """Data files exist but the commit (metadata) file does not: the save never finished."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes or metadata do not match what the checkpoint recorded."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A stored item's bytes do not match its recorded checksum."""


class UnsafePathError(CheckpointError):
    """A key or file name would place data outside the checkpoint directory."""
