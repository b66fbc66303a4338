"""Exceptions a user can cause; every dcpbridge error derives from ``CheckpointError``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


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


class InvalidArgumentError(CheckpointError, ValueError):
    """An argument or setting is out of range or inconsistent (still a ``ValueError``)."""


class MissingEntryError(CheckpointError, KeyError):
    """A checkpoint lacks the entry asked for by name (still a ``KeyError``)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class StorageError(CheckpointError, OSError):
    """Storage I/O failed (disk, network, object store); ``__cause__`` is the original error."""


class StorageFileNotFoundError(StorageError, FileNotFoundError):
    """A storage operation found no file or object where it expected one."""


class WriterProcessError(StorageError):
    """dcpbridge's writer process died or failed outside storage I/O while writing a save's
    data; ``__cause__`` is what ended it."""


class ConcurrentSaveError(CheckpointError):
    """Another save committed to the same location while this one was committing; this one
    did not commit (the other's checkpoint is there, whole)."""


def is_storage_fault(exc: BaseException, *, foreign: bool = False) -> bool:
    """Whether ``exc`` is an I/O failure of the storage layer: an ``OSError``, or an error of
    a storage client library (botocore and aiohttp under s3fs: a body cut short mid-transfer
    surfaces as aiohttp's ``ClientPayloadError``; gcsfs's ``HttpError``, Azure's, ...). With
    ``foreign`` (``exc`` came out of a custom filesystem, see ``foreign_filesystem``), any
    ``Exception`` that is not dcpbridge's own: such a filesystem's errors may be of any class."""
    if isinstance(exc, CheckpointError):
        return False
    if isinstance(exc, OSError) or (foreign and isinstance(exc, Exception)):
        return True
    return any(c.__module__.split(".")[0] in _CLIENT_LIBRARIES for c in type(exc).__mro__)


def foreign_filesystem(fs: object) -> bool:
    """Whether the fsspec filesystem ``fs`` is a custom one, or wraps one (fsspec's
    ``DirFileSystem`` and caching filesystems keep what they wrap as ``.fs``): of neither
    fsspec nor a storage client library (``_CLIENT_LIBRARIES``), so any exception out of it
    is a storage fault."""
    for _ in range(_MOST_WRAPPERS):
        if type(fs).__module__.split(".")[0] not in _CLIENT_LIBRARIES:
            return True
        inner = getattr(fs, "fs", None)
        if inner is None or inner is fs or not hasattr(inner, "protocol"):
            return False
        fs = inner
    return False


_MOST_WRAPPERS = 8  # filesystems wrapping filesystems looked through (a cycle ends there)


_CLIENT_LIBRARIES = frozenset(
    {
        "botocore",
        "aiobotocore",
        "aiohttp",
        "s3fs",
        "gcsfs",
        "google",
        "azure",
        "adlfs",
        "fsspec",
        "requests",
        "urllib3",
        "httpx",
        "httpcore",
        "huggingface_hub",
        "paramiko",
        "smbprotocol",
        "ocifs",
        "ossfs",
    }
)


def storage_error(where: str, exc: BaseException) -> StorageError:
    """``exc`` as a ``StorageError`` whose message starts with ``where`` (a URL or file)."""
    kind = StorageFileNotFoundError if isinstance(exc, FileNotFoundError) else StorageError
    error = kind(f"{where}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


@contextlib.contextmanager
def storage_faults(where: str | Callable[[], str], fs: object = None) -> Iterator[None]:
    """Re-raise storage faults inside the block as ``StorageError`` naming ``where``; ``fs``:
    the filesystem the block calls, and nothing else (any exception of a custom one counts)."""
    foreign = fs is not None and foreign_filesystem(fs)
    try:
        yield
    except Exception as e:
        if not is_storage_fault(e, foreign=foreign):
            raise
        raise storage_error(where() if callable(where) else where, e) from e
