"""Resolve a checkpoint location (path or URL) to an fsspec filesystem and a root path."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import fsspec
import xxhash
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from dcpbridge.storage.errors import InvalidArgumentError, UnsafePathError
from dcpbridge.storage.format.references import is_reference, reference_path

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*\Z")
# Storage options that are dcpbridge's own (the filesystem never sees them).
OWN_OPTIONS = ("request_timeout", "cleanup_timeout", "prefixes")
MAX_PREFIXES = 4096
# The folders data files are spread over (``prefixes`` > 1): "p" and a hash of the file name.
SPREAD_DIR = re.compile(r"^p[0-9a-f]{1,3}\Z")


@dataclass(frozen=True)
class Location:
    """A checkpoint directory (or object-store prefix) on one fsspec filesystem."""

    url: str
    fs: Any = field(compare=False, repr=False)
    root: str
    settings: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """dcpbridge's own storage options (``OWN_OPTIONS``), taken out of the fsspec ones."""

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def path(self, name: str) -> str:
        """Full path of ``name`` inside the checkpoint; ``name`` must be a plain file name."""
        check_file_name(name)
        return f"{self.root.rstrip('/')}/{name}"

    @property
    def process_local(self) -> bool:
        """Whether the files live in this process's own memory (``memory://``), which no
        other process sees."""
        return isinstance(self.fs, MemoryFileSystem)

    @property
    def prefixes(self) -> int:
        """Over how many hashed folders this location spreads the data files it writes."""
        return int(self.settings.get("prefixes", 1))

    def data_path(self, name: str, prefixes: int | None = None) -> str:
        """Full path of data file ``name`` of a checkpoint spread over ``prefixes`` folders
        (default: this location's setting); a reference (``../<dir>/...``, incremental
        saves) resolves inside the parent folder, checked."""
        if is_reference(name):
            return reference_path(self.root, name)
        folder = spread_dir(check_file_name(name), self.prefixes if prefixes is None else prefixes)
        return self.path(name) if folder is None else f"{self.root.rstrip('/')}/{folder}/{name}"


def spread_dir(name: str, prefixes: int) -> str | None:
    """The folder of data file ``name`` among ``prefixes`` hashed ones (None: not spread)."""
    if prefixes <= 1:
        return None
    width = len(f"{prefixes - 1:x}")
    return f"p{xxhash.xxh3_64_intdigest(name.encode()) % prefixes:0{width}x}"


def resolve(
    url: str | os.PathLike[str] | Location, storage_options: dict[str, Any] | None = None
) -> Location:
    """Turn a local path or fsspec URL plus its options into a ``Location`` (a ``Location``
    is already resolved: it is returned as it is)."""
    if isinstance(url, Location):
        return url
    text = os.fspath(url)
    if not text:
        raise InvalidArgumentError("checkpoint location is empty")
    options = dict(storage_options or {})
    settings = {k: options.pop(k) for k in OWN_OPTIONS if k in options}
    spread = settings.get("prefixes", 1)
    if isinstance(spread, bool) or not isinstance(spread, int) or not 1 <= spread <= MAX_PREFIXES:
        raise InvalidArgumentError(
            f"storage option prefixes must be an integer in [1, {MAX_PREFIXES}], got {spread!r}"
        )
    try:
        fs, root = fsspec.core.url_to_fs(text, **options)
    except (TypeError, ValueError, ImportError) as e:  # unknown protocol, options of wrong type
        raise InvalidArgumentError(
            f"{text}: cannot open this location with its storage options: {type(e).__name__}: {e}"
        ) from e
    if isinstance(fs, LocalFileSystem):
        root = os.path.abspath(root)
    return Location(url=text, fs=fs, root=root.rstrip("/") or "/", settings=settings)


def process_local_url(url: str | os.PathLike[str]) -> bool:
    """Whether ``url`` names files in this process's own memory (``memory://``, chained too),
    which no other process sees; decided from the URL alone, nothing is opened."""
    protocols = MemoryFileSystem.protocol
    names = {protocols} if isinstance(protocols, str) else set(protocols)
    parts = os.fspath(url).split("::")
    return any(fsspec.core.split_protocol(part)[0] in names for part in parts)


def fsspec_options(storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` without dcpbridge's own (for code that hands them to fsspec)."""
    return {k: v for k, v in (storage_options or {}).items() if k not in OWN_OPTIONS}


def check_file_name(name: str) -> str:
    """Reject names that could escape the checkpoint directory (separators, '..', hidden)."""
    if not _SAFE_NAME.match(name) or ".." in name:
        raise UnsafePathError(
            f"refusing file name {name!r}: checkpoint files must be plain names "
            "without path separators or '..'"
        )
    return name
