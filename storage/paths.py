"""Resolve a checkpoint location (path or URL) to an fsspec filesystem and a root path."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from dcpbridge.storage.errors import InvalidArgumentError, UnsafePathError

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class Location:
    """A checkpoint directory (or object-store prefix) on one fsspec filesystem."""

    url: str
    fs: Any = field(compare=False, repr=False)
    root: str

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def path(self, name: str) -> str:
        """Full path of ``name`` inside the checkpoint; ``name`` must be a plain file name."""
        check_file_name(name)
        return f"{self.root.rstrip('/')}/{name}"


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
    fs, root = fsspec.core.url_to_fs(text, **(storage_options or {}))
    if isinstance(fs, LocalFileSystem):
        root = os.path.abspath(root)
    return Location(url=text, fs=fs, root=root.rstrip("/") or "/")


def check_file_name(name: str) -> str:
    """Reject names that could escape the checkpoint directory (separators, '..', hidden)."""
    if not _SAFE_NAME.match(name) or ".." in name:
        raise UnsafePathError(
            f"refusing file name {name!r}: checkpoint files must be plain names "
            "without path separators or '..'"
        )
    return name
