"""Sizes of the files an incremental checkpoint references in sibling checkpoints (one listing
per referenced folder), so reads check every range against a real file before sizing a buffer."""

from __future__ import annotations

from collections.abc import Iterable

from dcpbridge.storage.backends.store import Storage, storage_op
from dcpbridge.storage.format.references import folder_of, is_reference


class _Lister:
    """Lists folders of one filesystem, raising storage faults as ``StorageError``."""

    def __init__(self, store: Storage) -> None:
        self.location = store.location
        self.fs = store.fs  # the storage's own: on S3, every request bounded by its timeout
        self.foreign = store.foreign  # a custom filesystem: any exception of it is a fault

    @storage_op("list")
    def sizes(self, folder: str) -> dict[str, int]:
        """Size of every file directly in ``folder`` ({} if it does not exist)."""
        fs = self.fs
        fs.invalidate_cache(folder)
        try:
            entries = fs.ls(folder, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for e in entries:
            size = e.get("size", e.get("Size"))
            if e.get("type", "file") == "file" and size is not None:
                out[str(e["name"]).rstrip("/").rsplit("/", 1)[-1]] = int(size)
        return out


def referenced_sizes(store: Storage, files: Iterable[str]) -> dict[str, int]:
    """Size of every referenced file among ``files`` that exists, keyed by its reference name
    (a missing one is absent: the caller's range check names it)."""
    refs = [f for f in files if is_reference(f)]
    if not refs:
        return {}
    root, lister = store.location.root, _Lister(store)
    listed: dict[str, dict[str, int]] = {}
    out = {}
    for name in refs:
        folder = folder_of(root, name)
        if folder not in listed:
            listed[folder] = lister.sizes(folder)
        size = listed[folder].get(name.rsplit("/", 1)[-1])
        if size is not None:
            out[name] = size
    return out


def sizes_with_references(store: Storage, files: Iterable[str]) -> dict[str, int]:
    """The location's own file sizes plus those of the referenced ``files``."""
    return store.file_sizes() | referenced_sizes(store, files)
