"""DCP ``StorageReader`` over fsspec that fetches only the byte ranges each read needs.

The work is split three ways: ``metadata`` opens the checkpoint (commit file, cached),
``read_plan`` decides which bytes each read needs (pure functions), and ``delivery`` fetches
them into the destination tensors, verifies and hands them over. This module is the glue
DCP calls.
"""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcpbridge.storage.backends import device_copy, storage_for
from dcpbridge.storage.backends.location_mixin import LocationMixin
from dcpbridge.storage.backends.referenced import sizes_with_references
from dcpbridge.storage.errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    MissingEntryError,
)
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.document import (
    ItemKey,
    ItemTable,
    StorageIndex,
    StoredItem,
    check_stored_ranges,
    item_key,
)
from dcpbridge.storage.format.paths import Location
from dcpbridge.storage.read.delivery import (
    BytesJob,
    Job,
    TensorJob,
    WholeJob,
    byte_view,
    read_bytes,
    run_jobs,
)
from dcpbridge.storage.read.metadata import diagnose_missing_metadata, read_checkpoint_metadata
from dcpbridge.storage.read.read_plan import ReadTuning, chunk_grid, plan_box_read
from dcpbridge.storage.read.span_reads import read_spans, small_entries
from dcpbridge.storage.read.whole_reads import WholeReads, whole_jobs

__all__ = [
    "FsspecCheckpointReader",
    "ReadTuning",
    "diagnose_missing_metadata",
    "read_checkpoint_metadata",
    "read_object_bytes",
]


def _index_of(location: Location, metadata: Metadata) -> StorageIndex:
    index = metadata.storage_data
    if not isinstance(index, StorageIndex):
        raise CorruptCheckpointError(f"{location.url}: metadata has no dcpbridge storage index")
    return index


def read_object_bytes(
    location: Location, metadata: Metadata, fqn: str, *, verify: bool = True
) -> bytes:
    """The stored bytes of object ``fqn`` (checksum-verified), without a process group."""
    index = _index_of(location, metadata)
    stored = index.items.get((fqn, None))
    if stored is None:
        raise MissingEntryError(f"{location.url}: the checkpoint has no object {fqn!r}")
    store = storage_for(location)
    path = location.data_path(stored.file, index.prefixes)
    try:
        sizes = {stored.file: store.file_size(path)}
    except FileNotFoundError:
        sizes = {}
    check_stored_ranges({(fqn, None): stored}, sizes, location.url)
    block = index.checksum_block_size if stored.checksums else 0
    what = f"object {fqn!r} in {stored.file}"
    return read_bytes(store, path, stored, block, verify=verify, describe=what)


class FsspecCheckpointReader(LocationMixin, StorageReader):
    """Reads a dcpbridge checkpoint; usable with ``torch.distributed.checkpoint.load``.

    For every ``ReadItem`` it fetches only the byte ranges of the stored chunk that hold the
    requested box (one range for a dim-0 slice, one per row for a dim-1 slice, widened to
    whole checksum tiles when verifying), joins nearby ranges of a file into one request,
    reads straight into the destination tensors when layouts allow, and verifies what it read.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        thread_count: int = 4,
        verify_checksums: bool = True,
    ) -> None:
        LocationMixin.__init__(self, storage_options)
        self.thread_count = max(1, thread_count)
        self.verify_checksums = verify_checksums
        self._metadata: Metadata | None = None
        self._file_sizes: dict[str, int] | None = None
        self._all_ranges_checked = False  # check_ranges ran for the current metadata
        self.bytes_read = 0
        if path is not None:
            self.reset(path)

    # -- DCP StorageReader protocol -------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and self._relocate(checkpoint_id):
            self._metadata = None
            self._file_sizes = None
            self._all_ranges_checked = False
        if self._io is not None:
            self._io.new_operation()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = read_checkpoint_metadata(self._loc)
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._check_process()
        _index_of(self._loc, metadata)
        if metadata is not self._metadata:
            self._file_sizes = None
            self._all_ranges_checked = False
        self._metadata = metadata

    def check_ranges(self) -> None:
        """Refuse the checkpoint unless every item's bytes lie inside its data file (one
        listing, kept for the reads): call it before sizing anything by the metadata."""
        self.read_metadata()
        self._file_sizes = sizes_with_references(self._store, self._index.files)
        check_stored_ranges(self._index.items, self._file_sizes, self._loc.url)
        self._all_ranges_checked = True

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        device_copy.settle_device_work()  # reads land in GPU tensors from fetch threads
        tuning = ReadTuning.for_storage(self._store)
        jobs: list[Job] = []
        index = self._index
        keys = [item_key(item.storage_index) for item in plan.items]
        found = self._stored_many(plan.items, keys, index)
        self._check_ranges(keys, found)
        for item, stored in zip(plan.items, found):
            job = (
                self._bytes_job(item, planner, stored)
                if item.type == LoadItemType.BYTE_IO
                else self._tensor_job(item, planner, tuning, index, stored)
            )
            if job is not None:
                jobs.append(job)
        self._run(jobs, index, tuning)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    reads_whole_columns = True  # ``read_whole`` takes a planner's ``WholeReads`` (our driver)

    def read_whole(self, reads: WholeReads) -> None:
        """Read whole stored chunks straight into their plain CPU destinations as one batch:
        every entry looked up at once, ranges checked, checksums verified as in ``read_data``.
        """
        if not len(reads):
            return
        index = self._index
        block = index.checksum_block_size if self.verify_checksums else 0
        tuning = ReadTuning.for_storage(self._store)
        if isinstance(index.items, ItemTable):  # small chunks: file spans, staged and verified
            reads = self._read_small(reads, index.items, index, block, tuning)
            if not len(reads):
                return
        found = self._lookup(reads.keys, index)
        self._check_ranges(reads.keys, found)
        jobs = whole_jobs(reads, found, block=block, tiled=index.tiled_checksums, url=self._loc.url)
        self._run(jobs, index, tuning)

    def _read_small(
        self,
        reads: WholeReads,
        table: ItemTable,
        index: StorageIndex,
        block: int,
        tuning: ReadTuning,
    ) -> WholeReads:
        """Read the small entries of ``reads`` through ``span_reads``; the others, left."""
        checked = reads.checked(table)
        if checked is None:  # not recorded against this table: every key looked up here
            rows, addresses = table.rows_of(reads.keys)[0], None
        else:
            rows, addresses = checked
        small = small_entries(table, rows, block, verify=bool(block)).tolist()
        if not small:
            return reads
        if not self._all_ranges_checked:
            self.check_ranges()  # every item inside its file, before anything is sized by them
        prefixes = index.prefixes
        every = len(small) == len(reads)  # the common case: no column copied

        def pick(column: Sequence[Any]) -> Sequence[Any]:
            return column if every else [column[i] for i in small]

        self.bytes_read += read_spans(
            table,
            pick(reads.keys),
            pick(rows),
            pick(reads.targets),
            addresses=None if addresses is None else pick(addresses),
            store=self._store,
            path=functools.cache(lambda name: self._loc.data_path(name, prefixes)),
            tuning=tuning,
            threads=self.thread_count,
            block=block,
            url=self._loc.url,
        )
        copies = reads.copies
        for i in small if copies else ():
            for view in copies.get(i, ()):
                view.copy_(reads.targets[i])
        return WholeReads() if every else reads.without(small)

    def _run(self, jobs: Sequence[Job], index: StorageIndex, tuning: ReadTuning) -> None:
        """Fetch, verify and hand over ``jobs``, counting the bytes read."""
        prefixes = index.prefixes
        path = functools.cache(lambda name: self._loc.data_path(name, prefixes))
        self.bytes_read += run_jobs(jobs, self._store, path, tuning, self.thread_count)

    # -- planning -------------------------------------------------------------------------

    @property
    def _index(self) -> StorageIndex:
        assert self._metadata is not None
        return _index_of(self._loc, self._metadata)

    def _stored(self, index: MetadataIndex, where: StorageIndex | None = None) -> StoredItem:
        item = (where or self._index).get(index)
        if item is None:
            raise CorruptCheckpointError(
                f"{self._loc.url}: metadata has no stored bytes for {index.fqn!r} "
                f"at offsets {list(index.offset or ())}"
            )
        return item

    @staticmethod
    def _lookup(keys: list[ItemKey], where: StorageIndex) -> list[StoredItem | None]:
        """The ``StoredItem`` of every key (None where absent), in one pass over the table."""
        table = where.items
        if isinstance(table, ItemTable):
            return table.get_many(keys)
        return [table.get(key) for key in keys]

    def _stored_many(
        self, items: list[ReadItem], keys: list[ItemKey], where: StorageIndex
    ) -> list[StoredItem]:
        """The ``StoredItem`` of every read item (``keys`` are theirs); raises naming the
        first one the metadata does not store."""
        found = self._lookup(keys, where)
        for item, stored in zip(items, found):
            if stored is None:
                self._stored(item.storage_index, where)  # raises, naming the item
        return found  # type: ignore[return-value]

    def _check_ranges(self, keys: list[ItemKey], found: list[StoredItem | None]) -> None:
        """Refuse items whose bytes lie outside their data file, before any buffer is sized
        by the metadata; file sizes come from one listing per reader."""
        if self._all_ranges_checked:
            return
        wanted = {key: stored for key, stored in zip(keys, found) if stored is not None}
        if not wanted:
            return
        if self._file_sizes is None:
            self._file_sizes = sizes_with_references(self._store, self._index.files)
        check_stored_ranges(wanted, self._file_sizes, self._loc.url)

    def _block(self, stored: StoredItem, where: StorageIndex | None = None) -> int:
        """The checksum block size if ``stored`` is to be verified, else 0."""
        block = (where or self._index).checksum_block_size
        return block if self.verify_checksums and stored.checksums and block else 0

    def _bytes_job(self, item: ReadItem, planner: LoadPlanner, stored: StoredItem) -> Job:
        block = self._block(stored)
        grid = checksum.flat_grid(stored.nbytes, block) if block else None
        what = f"object {item.storage_index.fqn!r} in {stored.file}"
        return BytesJob(stored, lambda data: planner.load_bytes(item, io.BytesIO(data)), grid, what)

    def _tensor_job(
        self,
        item: ReadItem,
        planner: LoadPlanner,
        tuning: ReadTuning,
        index: StorageIndex,
        stored: StoredItem,
    ) -> Job | None:
        sizes, dtype = stored.sizes, stored.dtype
        if sizes is None or dtype is None:
            raise CorruptCheckpointError(f"{item.storage_index.fqn!r} is stored as an object")
        dest = planner.resolve_tensor(item)
        if dest.shape != item.lengths or dest.dtype != dtype:
            raise InvalidArgumentError(
                f"{item.dest_index.fqn!r}: planner resolved a {dest.dtype} tensor of shape "
                f"{tuple(dest.shape)} for a read of {tuple(item.lengths)} {dtype}; this reader "
                "reads the stored dtype and shape (to convert, load with "
                "planner=db.ShardedLoadPlanner(allow_dtype_cast=True))"
            )
        block = self._block(stored, index)
        grid = chunk_grid(sizes, dtype.itemsize, block, tiled=index.tiled_checksums)

        def describe() -> str:
            offsets = list(item.storage_index.offset or ())
            return f"tensor {item.storage_index.fqn!r} chunk {offsets} in {stored.file}"

        def commit(t: torch.Tensor) -> None:
            planner.commit_tensor(item, t)

        if item.lengths == sizes and stored.nbytes and not any(item.storage_offsets):
            view = byte_view(dest)  # the whole chunk into plain memory: no plan, no staging
            if view is not None and len(view) == stored.nbytes:
                return WholeJob(stored, view, dest, commit, grid, describe)
        plan = plan_box_read(
            sizes, dtype.itemsize, item.storage_offsets, item.lengths, grid, tuning
        )
        if plan.empty:
            planner.commit_tensor(item, dest)
            return None
        return TensorJob(stored, plan, dest, commit, stored.checksums if grid else None, describe)
