"""DCP ``StorageReader`` over fsspec that fetches only the byte ranges each read needs."""

from __future__ import annotations

import ctypes
import functools
import io
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcpbridge.storage import checksum
from dcpbridge.storage.backends import ByteIO, RangeRead
from dcpbridge.storage.errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MissingEntryError,
    NotACheckpointError,
    storage_faults,
)
from dcpbridge.storage.format import (
    DATA_FILE_RE,
    METADATA_FILE,
    ItemKey,
    StorageIndex,
    StoredItem,
    check_stored_ranges,
    decode_metadata,
    item_key,
)
from dcpbridge.storage.located import Located
from dcpbridge.storage.paths import Location
from dcpbridge.storage.regions import Extent, c_strides, expand_to_blocks, narrow_box, plan_extents

# Reads smaller than this are merged with their neighbours into one request.
_SMALL_READ = 1 << 20
_MAX_MERGED = 16 << 20
# Memory held by temporary read buffers at once (direct reads into tensors need none).
_STAGING_BUDGET = 256 << 20


@dataclass(frozen=True, slots=True)
class ReadTuning:
    """How finely the reader splits and merges byte ranges for one kind of storage."""

    min_piece_bytes: int
    merge_gap: int

    @staticmethod
    def for_location(location: Location) -> ReadTuning:
        if location.is_local:
            return ReadTuning(min_piece_bytes=4 << 10, merge_gap=0)
        # Object stores: a request costs ~ms, so prefer fewer, larger ranges.
        return ReadTuning(min_piece_bytes=1 << 20, merge_gap=256 << 10)


def diagnose_missing_metadata(byteio: ByteIO, url: str) -> Exception:
    """Explain why ``url`` has no commit file: absent, incomplete, or another format."""
    names = byteio.list_names()
    if not names and not byteio.fs.exists(byteio.location.root):
        return NotACheckpointError(f"{url}: no such checkpoint directory")
    data = sorted(n for n in names if DATA_FILE_RE.match(n))
    if data:
        return IncompleteCheckpointError(
            f"{url} is an incomplete checkpoint: {len(data)} data file(s) (e.g. {data[0]}) exist "
            f"but the commit file {METADATA_FILE} does not, so the save that wrote them did not "
            "finish. Re-save, or load an earlier checkpoint."
        )
    if ".metadata" in names:
        return NotACheckpointError(
            f"{url} holds a plain torch.distributed.checkpoint checkpoint (.metadata), not a "
            f"dcpbridge one ({METADATA_FILE}); read it with torch.distributed.checkpoint"
        )
    return NotACheckpointError(f"{url} is not a dcpbridge checkpoint: {METADATA_FILE} is missing")


_METADATA_CACHE: OrderedDict[tuple[str, tuple[Any, ...]], Metadata] = OrderedDict()
_METADATA_CACHE_SIZE = 8
_METADATA_LOCK = threading.Lock()


def _file_identity(info: dict[str, Any]) -> tuple[Any, ...]:
    """What changes whenever the commit file is replaced (size, mtime, inode, ETag...)."""
    keys = ("size", "mtime", "ino", "ETag", "etag", "LastModified", "created")
    return tuple(str(info.get(k)) for k in keys)


def read_checkpoint_metadata(location: Location) -> Metadata:
    """Read and decode the commit file at ``location`` (single process, no collectives).

    Decoded metadata is cached per process and reused while the commit file's identity
    (size, mtime and inode, or ETag) is unchanged, so repeated loads skip the JSON decode.
    """
    path = location.path(METADATA_FILE)
    try:
        with storage_faults(f"{location.url}: look up {path}"):
            key = (f"{location.fs.protocol}:{path}", _file_identity(location.fs.info(path)))
    except FileNotFoundError:
        raise diagnose_missing_metadata(ByteIO.for_location(location), location.url) from None
    with _METADATA_LOCK:
        cached = _METADATA_CACHE.get(key)
        if cached is not None:
            _METADATA_CACHE.move_to_end(key)
            return cached
    byteio = ByteIO.for_location(location)
    try:
        raw = byteio.read_file(path)
    except FileNotFoundError:
        raise diagnose_missing_metadata(byteio, location.url) from None
    metadata = decode_metadata(raw, where=path)
    with _METADATA_LOCK:
        _METADATA_CACHE[key] = metadata
        while len(_METADATA_CACHE) > _METADATA_CACHE_SIZE:
            _METADATA_CACHE.popitem(last=False)
    return metadata


def _block_checker(
    index: StorageIndex,
    stored: StoredItem,
    lo: int,
    what: str | Callable[[], str],
    enabled: bool = True,
) -> Callable[[memoryview], None] | None:
    """Checksum check of item bytes ``[lo, ...)`` (``lo`` on a block edge), or None if off."""
    bs, sums = index.checksum_block_size, stored.checksums
    if not (enabled and sums and bs):
        return None
    return lambda data: checksum.verify_blocks(data, lo // bs, sums, bs, what=what)


def read_object_bytes(
    location: Location, metadata: Metadata, fqn: str, *, verify: bool = True
) -> bytes:
    """The stored bytes of object ``fqn`` (checksum-verified), without a process group."""
    index = metadata.storage_data
    if not isinstance(index, StorageIndex):
        raise CorruptCheckpointError(f"{location.url}: metadata has no dcpbridge storage index")
    stored = index.items.get((fqn, None))
    if stored is None:
        raise MissingEntryError(f"{location.url}: the checkpoint has no object {fqn!r}")
    byteio = ByteIO.for_location(location)
    path = location.path(stored.file)
    try:
        sizes = {stored.file: byteio.file_size(path)}
    except FileNotFoundError:
        sizes = {}
    check_stored_ranges({(fqn, None): stored}, sizes, location.url)
    buf = memoryview(bytearray(stored.nbytes))
    byteio.fetch([RangeRead(path, stored.offset, buf)], threads=1)
    check = _block_checker(index, stored, 0, f"object {fqn!r} in {stored.file}", verify)
    if check is not None:
        check(buf)
    return bytes(buf)


class _TensorSink:
    """Counts a tensor ReadItem's outstanding extents and commits it when the last lands."""

    def __init__(self, planner: LoadPlanner, item: ReadItem, dest: torch.Tensor, parts: int):
        self.planner, self.item, self.dest = planner, item, dest
        self._left = parts
        self._lock = threading.Lock()

    def part_done(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.planner.commit_tensor(self.item, self.dest)


def _byte_view(t: torch.Tensor) -> memoryview | None:
    """Writable bytes of ``t`` if it is a plain, dense, contiguous CPU tensor, else None.

    Only then is ``data_ptr()`` the address of its elements: a tensor subclass (DTensor...)
    is filled through torch (``copy_``) from a bounce buffer instead. The view aliases ``t``'s
    memory; callers keep ``t`` alive while using it.
    """
    if (
        type(t) not in (torch.Tensor, torch.nn.Parameter)
        or t.layout != torch.strided
        or t.device.type != "cpu"
        or t.is_meta
        or not t.is_contiguous()
    ):
        return None
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


class FsspecCheckpointReader(Located, StorageReader):
    """Reads a dcpbridge checkpoint; usable with ``torch.distributed.checkpoint.load``.

    For every ``ReadItem`` it fetches only the byte ranges of the stored chunk that hold the
    requested box (one range for a dim-0 slice, one per row for a dim-1 slice), reads straight
    into the destination tensor when layouts allow, verifies block checksums of what it read,
    and runs the reads on ``thread_count`` threads.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        thread_count: int = 4,
        verify_checksums: bool = True,
    ) -> None:
        Located.__init__(self, storage_options)
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

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = read_checkpoint_metadata(self._loc)
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if not isinstance(metadata.storage_data, StorageIndex):
            raise CorruptCheckpointError(
                f"{self._loc.url}: metadata has no dcpbridge storage index"
            )
        if metadata is not self._metadata:
            self._file_sizes = None
            self._all_ranges_checked = False
        self._metadata = metadata

    def check_ranges(self) -> None:
        """Refuse the checkpoint unless every item's bytes lie inside its data file (one
        listing, kept for the reads): call it before sizing anything by the metadata."""
        self.read_metadata()
        self._file_sizes = self._byteio.file_sizes()
        check_stored_ranges(self._index.items, self._file_sizes, self._loc.url)
        self._all_ranges_checked = True

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        tuning = ReadTuning.for_location(self._loc)
        self._check_ranges(plan)
        reads: list[_Op] = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                reads.append(self._bytes_op(item, planner))
            else:
                reads.extend(self._tensor_ops(item, planner, tuning))
        path = functools.cache(self._loc.path)
        for batch in _merge_and_batch(reads, tuning.merge_gap):
            fetches = [m.to_range_read(path(m.file)) for m in batch]
            self._byteio.fetch(fetches, self.thread_count)
            self.bytes_read += sum(len(r.out) for r in fetches)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- planning byte ranges -------------------------------------------------------------

    @property
    def _index(self) -> StorageIndex:
        assert self._metadata is not None and isinstance(self._metadata.storage_data, StorageIndex)
        return self._metadata.storage_data

    def _stored(self, index: MetadataIndex) -> StoredItem:
        item = self._index.get(index)
        if item is None:
            raise CorruptCheckpointError(
                f"{self._loc.url}: metadata has no stored bytes for {index.fqn!r} "
                f"at offsets {list(index.offset or ())}"
            )
        return item

    def _check_ranges(self, plan: LoadPlan) -> None:
        """Refuse items whose bytes lie outside their data file, before any buffer is sized
        by the metadata; file sizes come from one listing per reader."""
        if self._all_ranges_checked:
            return
        wanted: dict[ItemKey, StoredItem] = {}
        for item in plan.items:
            wanted[item_key(item.storage_index)] = self._stored(item.storage_index)
        if not wanted:
            return
        if self._file_sizes is None:
            self._file_sizes = self._byteio.file_sizes()
        check_stored_ranges(wanted, self._file_sizes, self._loc.url)

    def _verifies(self, stored: StoredItem) -> bool:
        return _block_checker(self._index, stored, 0, "", self.verify_checksums) is not None

    def _checker(
        self, stored: StoredItem, lo: int, describe: Callable[[], str]
    ) -> Callable[[memoryview], None] | None:
        """Checksum check for item bytes ``[lo, ...)`` (``lo`` on a block edge), if enabled."""
        return _block_checker(self._index, stored, lo, describe, self.verify_checksums)

    def _bytes_op(self, item: ReadItem, planner: LoadPlanner) -> _Op:
        stored = self._stored(item.storage_index)
        verify = self._checker(
            stored, 0, lambda: f"object {item.storage_index.fqn!r} in {stored.file}"
        )

        def deliver(buf: memoryview) -> None:
            if verify is not None:
                verify(buf)
            planner.load_bytes(item, io.BytesIO(bytes(buf)))

        return _Op(stored.file, stored.offset, stored.offset + stored.nbytes, None, deliver)

    def _tensor_ops(self, item: ReadItem, planner: LoadPlanner, tuning: ReadTuning) -> list[_Op]:
        stored = self._stored(item.storage_index)
        sizes, dtype = stored.sizes, stored.dtype
        if sizes is None or dtype is None:
            raise CorruptCheckpointError(f"{item.storage_index.fqn!r} is stored as an object")
        dest = planner.resolve_tensor(item)
        if dest.shape != item.lengths or dest.dtype != dtype:
            raise RuntimeError(
                f"{item.dest_index.fqn!r}: planner resolved a {dest.dtype} tensor of shape "
                f"{tuple(dest.shape)} for a read of {tuple(item.lengths)} {dtype}"
            )

        def describe() -> str:
            offsets = list(item.storage_index.offset or ())
            return f"tensor {item.storage_index.fqn!r} chunk {offsets} in {stored.file}"

        itemsize = dtype.itemsize
        index = self._index
        block = index.checksum_block_size
        checking = self._verifies(stored)
        if item.lengths == sizes and not any(item.storage_offsets):  # the whole chunk
            extents = [Extent(0, math.prod(sizes), (0,) * len(sizes), sizes)]
        else:
            min_piece = max(tuning.min_piece_bytes, block) if checking else tuning.min_piece_bytes
            extents = plan_extents(
                sizes, item.storage_offsets, item.lengths, itemsize, min_piece_bytes=min_piece
            )
        if not extents or extents[0].stop == extents[0].start:
            planner.commit_tensor(item, dest)
            return []
        strides = c_strides(sizes)
        groups = _group_extents(extents, itemsize, stored.nbytes, block if checking else 0)
        sink = _TensorSink(planner, item, dest, len(groups))
        ops = []
        for lo, hi, members in groups:
            only = members[0]
            direct = None
            if len(members) == 1 and (lo, hi) == _byte_span(only, itemsize) and only.contiguous:
                direct = _byte_view(narrow_box(dest, only.box_offsets, only.box_lengths))
            delivery = _GroupDelivery(
                dest,
                members,
                strides,
                dtype,
                lo,
                direct is not None,
                _block_checker(index, stored, lo, describe, checking),
                sink,
            )
            ops.append(_Op(stored.file, stored.offset + lo, stored.offset + hi, direct, delivery))
        return ops


def _byte_span(ext: Extent, itemsize: int) -> tuple[int, int]:
    return ext.start * itemsize, ext.stop * itemsize


def _group_extents(
    extents: list[Extent], itemsize: int, total: int, block: int
) -> list[tuple[int, int, list[Extent]]]:
    """Byte ranges to fetch: each extent's span, widened to whole checksum blocks when
    ``block`` > 0; extents whose ranges overlap share one fetch (and one verification)."""
    groups: list[tuple[int, int, list[Extent]]] = []
    for ext in sorted(extents, key=lambda e: e.start):
        lo, hi = _byte_span(ext, itemsize)
        if block:
            lo, hi = expand_to_blocks(lo, hi, total, block)
        if groups and lo < groups[-1][1]:
            glo, ghi, members = groups[-1]
            groups[-1] = (glo, max(ghi, hi), [*members, ext])
        else:
            groups.append((lo, hi, [ext]))
    return groups


@dataclass(slots=True)
class _GroupDelivery:
    """Verifies fetched item bytes ``[lo, ...)`` and copies each extent's box into ``dest``."""

    dest: torch.Tensor
    extents: list[Extent]
    strides: tuple[int, ...]
    dtype: torch.dtype
    lo: int
    in_place: bool
    verify: Callable[[memoryview], None] | None
    sink: _TensorSink

    def __call__(self, buf: memoryview) -> None:
        if self.verify is not None:
            self.verify(buf)
        if not self.in_place:
            isz = self.dtype.itemsize
            for ext in self.extents:
                skip = ext.start * isz - self.lo
                raw = buf[skip : skip + (ext.stop - ext.start) * isz]
                src = torch.frombuffer(raw, dtype=torch.uint8).view(self.dtype)
                box = narrow_box(self.dest, ext.box_offsets, ext.box_lengths)
                box.copy_(src.as_strided(ext.box_lengths, self.strides))
        self.sink.part_done()


@dataclass(slots=True)
class _Op:
    """Bytes ``[start, stop)`` of ``file``: read into ``direct`` (or a staging buffer), then
    handed to ``deliver``."""

    file: str
    start: int
    stop: int
    direct: memoryview | None
    deliver: Callable[[memoryview], None]


@dataclass(slots=True)
class _Merged:
    """Adjacent ops of one file fetched by a single request."""

    file: str
    start: int
    stop: int
    ops: list[_Op]

    @property
    def staged_bytes(self) -> int:
        return 0 if self.ops[0].direct is not None else self.stop - self.start

    def to_range_read(self, path: str) -> RangeRead:
        if self.ops[0].direct is not None:
            op = self.ops[0]
            direct = op.direct
            return RangeRead(path, self.start, direct, lambda: op.deliver(direct))
        buf = memoryview(np.empty(self.stop - self.start, dtype=np.uint8)).cast("B")

        def done() -> None:
            for op in self.ops:
                op.deliver(buf[op.start - self.start : op.stop - self.start])

        return RangeRead(path, self.start, buf, done)


def _merge_and_batch(ops: list[_Op], merge_gap: int) -> list[list[_Merged]]:
    """Merge small neighbouring staged reads per file, then batch under the staging budget."""
    merged: list[_Merged] = []
    by_file: dict[str, list[_Op]] = {}
    for op in ops:
        by_file.setdefault(op.file, []).append(op)
    for file, file_ops in by_file.items():
        file_ops.sort(key=lambda o: o.start)
        cur: _Merged | None = None
        for op in file_ops:
            mergeable = op.direct is None and op.stop - op.start < _SMALL_READ
            if (
                mergeable
                and cur is not None
                and cur.ops[0].direct is None
                and cur.stop <= op.start <= cur.stop + merge_gap
                and op.stop - cur.start <= _MAX_MERGED
            ):
                cur.stop = op.stop
                cur.ops.append(op)
                continue
            cur = _Merged(file, op.start, op.stop, [op])
            merged.append(cur)
    batches: list[list[_Merged]] = []
    batch: list[_Merged] = []
    staged = 0
    for m in merged:
        if batch and staged + m.staged_bytes > _STAGING_BUDGET:
            batches.append(batch)
            batch, staged = [], 0
        batch.append(m)
        staged += m.staged_bytes
    if batch:
        batches.append(batch)
    return batches
