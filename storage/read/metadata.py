"""Opening a checkpoint for reading: its commit file, decoded once per process and cached."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.backends.store import Storage
from dcpbridge.storage.errors import IncompleteCheckpointError, NotACheckpointError
from dcpbridge.storage.format.document import DATA_FILE_RE, METADATA_FILE, decode_metadata
from dcpbridge.storage.format.paths import Location

_CACHE: OrderedDict[tuple[str, tuple[Any, ...]], Metadata] = OrderedDict()
_CACHE_SIZE = 8
_LOCK = threading.Lock()


def diagnose_missing_metadata(store: Storage, url: str) -> Exception:
    """Explain why ``url`` has no commit file: absent, incomplete, or another format."""
    names = store.list_names()
    if not names and not store.fs.exists(store.location.root):
        return NotACheckpointError(f"{url}: no such checkpoint directory")
    data = sorted(n for n in names if DATA_FILE_RE.match(n))
    if data:
        return IncompleteCheckpointError(
            f"{url} is an incomplete checkpoint: {len(data)} data file(s) (e.g. {data[0]}) exist "
            f"but the commit file {METADATA_FILE} does not: the save that wrote them did not "
            "finish, or the checkpoint is being deleted (retention removes the commit file "
            "first). Re-save, or load another checkpoint."
        )
    if ".metadata" in names:
        return NotACheckpointError(
            f"{url} holds a plain torch.distributed.checkpoint checkpoint (.metadata), not a "
            f"dcpbridge one ({METADATA_FILE}); read it with torch.distributed.checkpoint"
        )
    return NotACheckpointError(f"{url} is not a dcpbridge checkpoint: {METADATA_FILE} is missing")


def _file_identity(info: dict[str, Any]) -> tuple[Any, ...]:
    """What changes whenever the commit file is replaced (size, mtime, inode, ETag...)."""
    keys = ("size", "mtime", "ino", "ETag", "etag", "LastModified", "created")
    return tuple(str(info.get(k)) for k in keys)


def read_checkpoint_metadata(location: Location) -> Metadata:
    """Read and decode the commit file at ``location`` (single process, no collectives).

    Decoded metadata is cached per process and reused while the commit file's identity
    (size, mtime and inode, or ETag) is unchanged, so repeated loads skip the JSON decode.
    """
    store = storage_for(location)
    path = location.path(METADATA_FILE)
    try:
        key = (f"{location.fs.protocol}:{path}", _file_identity(store.info(path)))
    except FileNotFoundError:
        raise diagnose_missing_metadata(store, location.url) from None
    with _LOCK:
        cached = _CACHE.get(key)
        if cached is not None:
            _CACHE.move_to_end(key)
            return cached
    try:
        raw = store.read_file(path)
    except FileNotFoundError:
        raise diagnose_missing_metadata(store, location.url) from None
    metadata = decode_metadata(raw, where=path)
    with _LOCK:
        _CACHE[key] = metadata
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return metadata
