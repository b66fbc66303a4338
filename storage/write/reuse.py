"""Incremental saves: a chunk equal to the same chunk of the previous checkpoint is recorded as a
reference to that checkpoint's stored bytes instead of being written again.

Equality is decided from checksums only: the previous checkpoint's recorded digests against
the digests of the bytes about to be written (hashed before the write, stopping at the first
tile that differs), so nothing of the previous checkpoint but its commit document is read
(and, once an item is found equal, the size of the file holding it: bytes that are gone or cut
short are written again, never referenced).
A reference names the sibling checkpoint's file (``storage/format/references.py``); where that
item was itself a reference, the new one points straight at the original file: no chains.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.errors import InvalidArgumentError, NotACheckpointError
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.document import (
    METADATA_FILE,
    ItemKey,
    StorageIndex,
    StoredItem,
    decode_metadata,
    item_key,
)
from dcpbridge.storage.format.paths import Location, spread_dir
from dcpbridge.storage.format.references import is_reference, parent_of, reference_to


def check_siblings(previous: Location, target: Location) -> None:
    """An incremental save references only a sibling checkpoint under the same storage root
    (same filesystem and parent folder, another folder): never across roots."""
    same_fs = type(previous.fs) is type(target.fs) and previous.fs.protocol == target.fs.protocol
    if not same_fs or previous.root.rstrip("/") == target.root.rstrip("/"):
        raise InvalidArgumentError(
            f"reuse_from={previous.url!r} must be another checkpoint beside {target.url!r} "
            "(same storage, same parent folder)"
        )
    if parent_of(previous.root) != parent_of(target.root):
        raise InvalidArgumentError(
            f"reuse_from={previous.url!r} is not beside {target.url!r}: an incremental save "
            "references only checkpoints in the same parent folder (storage root)"
        )


@dataclass(frozen=True, slots=True)
class Previous:
    """The previous checkpoint's recorded items, as references from a sibling checkpoint."""

    dir_name: str
    index: StorageIndex
    location: Location | None = None
    _sizes: dict[str, int] = field(default_factory=dict)  # sizes of its files, looked up

    @classmethod
    def open(cls, location: Location) -> Previous:
        """Read and validate the commit document at ``location`` (nothing else is read)."""
        store = storage_for(location)
        path = location.path(METADATA_FILE)
        try:
            raw = store.read_file(path)
        except FileNotFoundError:
            raise NotACheckpointError(
                f"reuse_from={location.url!r} is not a complete checkpoint ({METADATA_FILE} "
                "is missing)"
            ) from None
        metadata = decode_metadata(raw, where=path)
        index = metadata.storage_data
        assert isinstance(index, StorageIndex)
        return cls(location.root.rstrip("/").rsplit("/", 1)[-1], index, location)

    def stored_whole(self, stored: StoredItem) -> bool:
        """Whether the file holding ``stored`` exists and holds its whole range (its size
        looked up once per save): bytes that are gone are never referenced again."""
        if self.location is None:
            return True
        size = self._sizes.get(stored.file)
        if size is None:
            size = self._sizes[stored.file] = self._size_of(stored.file)
        return size >= stored.offset + stored.nbytes

    def _size_of(self, file: str) -> int:
        """Size of data file ``file`` of the previous checkpoint (-1 where it is gone)."""
        assert self.location is not None
        path = self.location.data_path(file, self.index.prefixes)
        self.location.fs.invalidate_cache(path)  # another process may have removed it
        try:
            return storage_for(self.location).file_size(path)
        except FileNotFoundError:
            return -1

    def usable(self, block: int) -> bool:
        """Whether its digests compare with this save's (same algorithm, block and tiles)."""
        index = self.index
        return bool(
            block
            and index.checksum_algorithm == checksum.ALGORITHM
            and index.checksum_block_size == block
            and index.tiled_checksums
        )

    def lookup(self, keys: list[ItemKey]) -> list[StoredItem | None]:
        items = self.index.items
        get_many = getattr(items, "get_many", None)
        return get_many(keys) if get_many is not None else [items.get(k) for k in keys]

    def reference(self, stored: StoredItem, rank: int) -> StoredItem:
        """``stored`` as an item of the new checkpoint: the same bytes, named from beside."""
        file = stored.file
        spread = None if is_reference(file) else spread_dir(file, self.index.prefixes)
        return StoredItem(
            reference_to(self.dir_name, file, spread),
            stored.offset,
            stored.nbytes,
            rank,
            stored.checksums,
            stored.sizes,
            stored.dtype,
        )


def _host_bytes(data: Any, tensor_bytes: Callable[[torch.Tensor], memoryview]) -> memoryview:
    if isinstance(data, io.BytesIO):
        return data.getbuffer()
    return tensor_bytes(data)


def _same(item: WriteItem, stored: StoredItem, mv: memoryview, block: int) -> bool:
    """Whether ``mv`` (the item's bytes) equals what ``stored`` recorded, by checksums."""
    if stored.checksums is None or stored.nbytes != len(mv):
        return False
    td = item.tensor_data
    if td is None:
        grid = checksum.item_grid(len(mv), None, None, block)
    else:
        sizes = tuple(td.chunk.sizes)
        if stored.sizes != sizes or stored.dtype != td.properties.dtype:
            return False
        if math.prod(sizes) * td.properties.dtype.itemsize != len(mv):
            return False
        grid = checksum.item_grid(len(mv), sizes, td.properties.dtype, block)
    return checksum.same_digests(grid, mv, stored.checksums)


def split_reused(
    items: Sequence[WriteItem],
    resolve: Callable[[WriteItem], Any],
    previous: Previous,
    *,
    rank: int,
    block: int,
    tensor_bytes: Callable[[torch.Tensor], memoryview],
) -> tuple[list[WriteItem], list[WriteResult], list[WriteItem]]:
    """(items reused, their results, items still to write): an item is reused when the
    previous checkpoint stores the same key, box, dtype and size with the same digests."""
    if not previous.usable(block):
        return [], [], list(items)
    found = previous.lookup([item_key(item.index) for item in items])
    reused, results, rest = [], [], []
    for item, stored in zip(items, found):
        if stored is None or (item.type == WriteItemType.BYTE_IO) != (stored.sizes is None):
            rest.append(item)
            continue
        mv = _host_bytes(resolve(item), tensor_bytes)
        if not _same(item, stored, mv, block) or not previous.stored_whole(stored):
            rest.append(item)
            continue
        reused.append(item)
        results.append(
            WriteResult(
                index=item.index, size_in_bytes=0, storage_data=previous.reference(stored, rank)
            )
        )
    return reused, results, rest
