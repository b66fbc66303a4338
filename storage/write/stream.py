"""Write a dcpbridge checkpoint item by item, outside DCP's protocol (offline jobs, conversion).

Each worker appends items (tensor chunks or object bytes) to its own data files, with the same
alignment, naming and block checksums as ``FsspecCheckpointWriter``; one process then commits
the gathered items with ``commit``. The result is indistinguishable from a ``save``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import BinaryIO

import torch
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, Metadata, MetadataIndex

from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.errors import InvalidArgumentError, storage_faults
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.document import (
    DATA_FILE_RE,
    ItemKey,
    StoredItem,
    data_file_name,
    item_key,
)
from dcpbridge.storage.format.paths import Location
from dcpbridge.storage.write.coalesce import CoalescingFile, ItemAppender
from dcpbridge.storage.write.commit import committed_save_id, publish
from dcpbridge.storage.write.writer import new_save_id

__all__ = ["StreamWriter", "commit", "discard_save", "new_save_id"]

log = logging.getLogger(__name__)


class StreamWriter:
    """Appends items to data files ``__{worker}_{i}.{save_id}.bin`` of one checkpoint location.

    Items are written in order, each starting on an aligned offset; a new file is started once
    the current one holds ``max_file_bytes``. ``items`` maps each written item to where it lives.
    Leaving its ``with`` block with an exception removes every file it wrote (``abort``).
    """

    def __init__(
        self,
        location: Location,
        *,
        save_id: str,
        worker: int = 0,
        checksums: bool = True,
        checksum_block_size: int = checksum.DEFAULT_BLOCK_SIZE,
        sync_files: bool = True,
        max_file_bytes: int | None = None,
    ) -> None:
        self.location = location
        self.save_id = save_id
        self.worker = worker
        self.checksums = checksums
        self.checksum_block_size = checksum_block_size
        self.sync_files = sync_files
        self.max_file_bytes = max_file_bytes
        self.items: dict[ItemKey, StoredItem] = {}
        self._io = storage_for(location)
        self._io.makedirs()
        self._raw: BinaryIO | None = None
        self._out: CoalescingFile | None = None
        self._name = ""
        self.files: list[str] = []  # every data file this writer created, in order

    def write_item(
        self,
        index: MetadataIndex,
        parts: Iterable[memoryview],
        *,
        nbytes: int,
        rank: int,
        sizes: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
    ) -> StoredItem:
        """Append one item from its byte ``parts`` (in order); they must total ``nbytes``.

        A tensor chunk also gives its ``sizes`` and ``dtype``."""
        key = item_key(index)
        if key in self.items:
            raise InvalidArgumentError(
                f"{index.fqn!r} at {list(index.offset or ())} was written twice"
            )
        block = self.checksum_block_size if self.checksums else 0
        with storage_faults(self._where):
            appender = ItemAppender(self._file_for_next_item(), nbytes, sizes, dtype, block)
            for part in parts:
                appender.add(part)
        start, written = appender.start, appender.written
        if written != nbytes:
            raise InvalidArgumentError(
                f"{index.fqn!r} at {list(index.offset or ())}: {written} bytes written, "
                f"{nbytes} expected"
            )
        digests = appender.digests()
        item = StoredItem(self._name, start, written, rank, digests, sizes, dtype)
        self.items[key] = item
        return item

    def close(self) -> None:
        """Flush and (if ``sync_files``) sync the open data file."""
        if self._raw is None:
            return
        assert self._out is not None
        with storage_faults(self._where):
            try:
                self._out.flush()
                if self.sync_files:
                    self._io.sync(self._raw)
            finally:
                self._raw.close()
                self._raw = self._out = None

    def _where(self) -> str:
        return f"{self.location.url}: write {self._name}"

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def discard(self) -> None:
        """Drop the open data file after a failure (object stores abort the upload)."""
        raw, self._raw, self._out = self._raw, None, None
        if raw is not None:
            abort = getattr(raw, "abort", None)
            abort() if abort is not None else raw.close()

    def abort(self) -> None:
        """After a failure: drop the open file and remove every file written (best effort)."""
        try:
            self.discard()
            names, self.files = self.files, []
            present = set(self._io.list_names())
            self._io.remove([n for n in names if n in present])
        except Exception as e:  # cleanup must not hide the failure being reported
            log.warning("could not remove the files written to %s: %s", self.location.url, e)

    def _file_for_next_item(self) -> CoalescingFile:
        if self._out is not None and (
            self.max_file_bytes is None or self._out.pos < self.max_file_bytes
        ):
            return self._out
        self.close()
        self._name = data_file_name(self.worker, len(self.files), self.save_id)
        self.files.append(self._name)
        self._raw = self._io.open_write(self.location.data_path(self._name))
        self._out = CoalescingFile(self._raw)
        return self._out


def commit(
    location: Location,
    state: Mapping[str, STORAGE_TYPES],
    items: Mapping[ItemKey, StoredItem],
    *,
    save_id: str,
    world_size: int,
    checksums: bool = True,
    checksum_block_size: int = checksum.DEFAULT_BLOCK_SIZE,
    planner_data: object = None,
    sync: bool = True,
) -> Metadata:
    """Publish ``dcpbridge.json`` for items written by ``StreamWriter``s, then drop stale files."""
    metadata = Metadata(state_dict_metadata=dict(state), planner_data=planner_data)
    publish(
        storage_for(location),
        metadata,
        dict(items),
        save_id=save_id,
        world_size=world_size,
        checksums=checksums,
        checksum_block_size=checksum_block_size,
        sync=sync,
        makedirs=True,
    )
    return metadata


def discard_save(location: Location, save_id: str) -> None:
    """Remove every data file of save ``save_id`` at ``location`` (all workers' files) unless
    that save committed. Best effort: a failure to clean up is logged, never raised over the
    original error."""
    store = storage_for(location)
    try:
        if committed_save_id(store) == save_id:
            return
        store.remove(
            [
                n
                for n in store.list_names()
                if (m := DATA_FILE_RE.match(n)) is not None and m.group(3) == save_id
            ]
        )
    except Exception as e:
        log.warning(
            "could not remove the files of failed save %s in %s: %s", save_id, location.url, e
        )
