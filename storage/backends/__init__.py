"""Byte movers: one Storage over fsspec (store: local disk, memory, any URL), S3 with bounded requests (s3, deadlines), device tensors through pinned host slabs (device_copy)."""

from __future__ import annotations

from dcpbridge.storage.backends.store import LocalStorage, Storage, is_s3
from dcpbridge.storage.format.paths import Location


def storage_for(location: Location) -> Storage:
    """The byte operations of ``location``: local disk, S3 (s3fs imported only then) or any
    other fsspec URL."""
    if location.is_local:
        return LocalStorage(location)
    if is_s3(location.fs):
        from dcpbridge.storage.backends.s3 import S3Storage

        return S3Storage(location)
    return Storage(location)
