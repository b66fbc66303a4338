"""DCP ``StorageWriter`` over fsspec: raw bytes, a few files per rank, JSON metadata written last."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import io
import json
import logging
import math
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import torch
import xxhash
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcpbridge.storage.backends import device_copy
from dcpbridge.storage.backends.location_mixin import LocationMixin
from dcpbridge.storage.backends.referenced import sizes_with_references
from dcpbridge.storage.backends.store import Storage
from dcpbridge.storage.errors import (
    ConcurrentSaveError,
    InvalidArgumentError,
    StorageFileNotFoundError,
    storage_faults,
)
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.document import (
    DATA_FILE_RE,
    ITEM_ALIGN,
    METADATA_FILE,
    TEMP_METADATA_PREFIX,
    ItemKey,
    ItemTable,
    StorageIndex,
    StoredItem,
    data_file_name,
    encode_metadata,
    temp_metadata_name,
)
from dcpbridge.storage.format.paths import resolve
from dcpbridge.storage.format.references import is_reference, reference_dir
from dcpbridge.storage.write.reuse import Previous, check_siblings, split_reused
from dcpbridge.storage.write.written import written_columns, written_table

log = logging.getLogger(__name__)

_SMALL_ITEM = 256 << 10
_COALESCE_BYTES = 8 << 20
# The most one write() call hands the kernel. Larger writes make ext4 (6.x) fill the page
# cache with 2 MiB folios; on VMs whose balloon reports free memory to the host (these
# machines: virtio_balloon), such folios are often memory the host took back and refaults
# page by page. Measured, 320 MiB written + fsynced: 2 MiB writes 0.55-0.68 s, 1 MiB 0.15-0.19 s.
_WRITE_PIECE = 1 << 20
ALIGN = ITEM_ALIGN
_PADDING = memoryview(bytes(ALIGN))


_UNFINISHED: dict[str, set[str]] = {}
"""Per location URL, the ids of the saves this process coordinated whose ``write_data`` ran
but whose ``finish`` has not started. DCP calls no writer hook when a rank's ``write_data``
fails (it skips ``finish``): the other ranks' data files of that save stay, and the next save
this process coordinates at that location removes them (``_remove_unfinished``)."""
_UNFINISHED_LOCK = threading.Lock()  # a save's removal of such files and their ``finish``


def _forget_unfinished(url: str, save_id: str) -> bool:
    """Drop ``save_id`` from ``_UNFINISHED`` (caller holds its lock); whether it was there."""
    pending = _UNFINISHED.get(url)
    if pending is None or save_id not in pending:
        return False
    pending.discard(save_id)
    if not pending:
        del _UNFINISHED[url]
    return True


class _ViewsKept(StateDictStager):
    """torch's staging copy (``DefaultStager``'s), except that a conjugate or negative view
    stays one: torch's sets the copied memory under a fresh tensor, dropping the flag, so the
    memory was stored instead of the values the tensor shows."""

    def _offload_tensor(self, x: Any, memo: dict[int, Any], non_blocking: bool = False) -> Any:
        if type(x) not in _PLAIN or not (x.is_conj() or x.is_neg()):
            return super()._offload_tensor(x, memo, non_blocking)
        conj, neg = x.is_conj(), x.is_neg()
        memory = torch._neg_view(x) if neg else x  # the same memory, without the flags
        copy = (memory.conj() if conj else memory).to("cpu", copy=True)
        copy = torch._neg_view(copy) if neg else copy
        memo[id(x)] = copy = copy.conj() if conj else copy
        return copy


@dataclasses.dataclass(frozen=True, slots=True)
class _RankTarget:
    """What the coordinator tells each rank: the save id and its rank number for file names."""

    save_id: str
    rank: int


def new_save_id() -> str:
    """A fresh id that names this save's data files (so re-saves never overwrite them)."""
    return uuid.uuid4().hex[:16]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements in C order as bytes (copies only if not contiguous on the CPU)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()  # flat by its run of elements: a size-1 dim may have any stride
    return memoryview(t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy()).cast("B")


def tensor_digest(tensor: torch.Tensor) -> int:
    """xxh3-64 of the tensor's elements in C order (a device tensor's through a host copy)."""
    return xxhash.xxh3_64_intdigest(tensor_bytes(tensor))


def item_nbytes(item: WriteItem) -> int:
    """Bytes this item writes: the chunk's size, not the global tensor's (unlike DCP's helper)."""
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


_FILE_BYTES = 128 << 20  # automatic: one more data file per this many bytes of a rank's save
MOST_FILES = 8  # automatic: at most this many data files (writer threads) per rank


def cores_per_rank() -> int:
    """CPU cores this process may use, shared with the other ranks of its node (torchrun's
    ``LOCAL_WORLD_SIZE``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return max(1, cores // max(1, local))


def data_files(total: int, threads: int | None) -> int:
    """Data files (one writer thread each) for a rank's ``total`` bytes: ``threads`` where the
    caller chose, else 2, and one more per 128 MiB where the rank has a core for it (at most
    ``MOST_FILES``): one thread's writes to tmpfs or fast disks stop well short of the device
    (H100 host, /dev/shm: 2.2 GB/s from one file, 6.1 GB/s from 8)."""
    if threads is not None:
        return threads
    return max(2, min(MOST_FILES, cores_per_rank(), total // _FILE_BYTES))


def _mostly_small(sizes: list[int]) -> bool:
    """Whether items under ``_SMALL_ITEM`` hold most of these bytes: then writing is per-item
    Python work, which threads serialize on the GIL rather than share (measured on local disk,
    20,000 x 16 KiB, medians of 7 alternated saves: 0.44 s with one thread, 0.51 s with two)."""
    small = sum(n for n in sizes if n < _SMALL_ITEM)
    return 2 * small >= sum(sizes)


def split_into_files(items: list[WriteItem], files: int, sizes: list[int]) -> list[list[WriteItem]]:
    """Spread items (of ``sizes`` bytes) over ``files`` buckets, largest first, keeping plan
    order inside."""
    if files <= 1 or len(items) <= 1:
        return [items] if items else []
    loads = [0] * files
    owner: dict[int, int] = {}
    for pos in sorted(range(len(items)), key=lambda i: -sizes[i]):
        b = min(range(files), key=loads.__getitem__)
        owner[pos] = b
        loads[b] += sizes[pos]
    buckets: list[list[WriteItem]] = [[] for _ in range(files)]
    for pos, item in enumerate(items):
        buckets[owner[pos]].append(item)
    return [b for b in buckets if b]


class CoalescingFile:
    """Writes many small items as few large writes; large items go straight through.

    Small items are copied into one reused buffer (``copy_in`` takes a raw address, so a
    tensor's bytes arrive with a single memmove and no Python objects per item). With
    ``background``, a full buffer is written (and ``written`` told) on a writer thread while
    the next one fills: the write's kernel copy and the storage's write-behind overlap the
    per-item work. ``flush`` waits for it; ``close`` must follow, also after a failure.
    """

    def __init__(
        self,
        f: BinaryIO,
        written: Callable[[int, int], None] | None = None,
        *,
        background: bool = False,
    ) -> None:
        self._f = f
        self._written = written  # told (start, nbytes) of each write that went out
        self._out = 0  # bytes handed to ``f`` so far
        self._buf, self._view, self._addr = _coalescing_buffer()
        self._spare: tuple[bytearray, memoryview, int] | None = None  # the writer thread's
        self._background = background
        self._writes: ThreadPoolExecutor | None = None
        self._pending: ThreadFuture[None] | None = None
        self._fill = 0
        self.pos = 0

    def align(self) -> int:
        """Pad with zeros to the next ``ALIGN`` boundary and return that position."""
        pad = -self.pos % ALIGN
        if pad:
            self.write(_PADDING[:pad])
        return self.pos

    def write(self, data: memoryview) -> None:
        n = len(data)
        self.pos += n
        if n < _SMALL_ITEM:
            self._view[self._fill : self._fill + n] = data
            self._advance(n)
            return
        self.flush()
        self._emit(data)

    def copy_in(self, address: int, n: int) -> memoryview:
        """Append ``n`` (< ``_SMALL_ITEM``) bytes at ``address``; a view of the copy, valid
        until the next call."""
        start = self._fill
        if n:
            ctypes.memmove(self._addr + start, address, n)
        self.pos += n
        view = self._view[start : start + n]
        self._advance(n)
        return view

    def _advance(self, n: int) -> None:
        self._fill += n
        if self._fill >= _COALESCE_BYTES:
            if self._background:
                self._hand_off()
            else:
                self.flush()

    def _hand_off(self) -> None:
        """Write the full buffer on the writer thread; fill the other one meanwhile."""
        self._wait()  # the previous hand-off is out: its buffer is free again
        if self._writes is None:
            self._writes = ThreadPoolExecutor(1, thread_name_prefix="dcpb-coalesce")
            self._spare = _coalescing_buffer()
        assert self._spare is not None
        self._pending = self._writes.submit(self._emit, self._view[: self._fill])
        self._spare, (self._buf, self._view, self._addr) = (
            (self._buf, self._view, self._addr),
            self._spare,
        )
        self._fill = 0

    def _wait(self) -> None:
        """Wait for the writer thread's write; raise its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def flush(self) -> None:
        self._wait()
        if self._fill:
            self._emit(self._view[: self._fill])
            self._fill = 0

    def close(self, *, failed: bool = False) -> None:
        """Wait for a write still on the writer thread and end it (after ``failed``, that
        write's own failure is not raised: the first one is what the caller reports)."""
        try:
            self._wait()
        except Exception:
            if not failed:
                raise
        finally:
            if self._writes is not None:
                self._writes.shutdown()
                self._writes = None

    def _emit(self, data: memoryview) -> None:
        _write_all(self._f, data)
        if self._written is not None:
            self._written(self._out, len(data))
        self._out += len(data)


def _coalescing_buffer() -> tuple[bytearray, memoryview, int]:
    """A coalescing buffer, a view of it and its address."""
    buf = bytearray(_COALESCE_BYTES + _SMALL_ITEM)
    return buf, memoryview(buf), ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _write_all(f: BinaryIO, data: memoryview) -> None:
    for at in range(0, len(data), _WRITE_PIECE):
        piece = data[at : at + _WRITE_PIECE]
        while len(piece):
            n = f.write(piece)
            if n is None:  # buffered/remote writers consume everything
                break
            piece = piece[n:]


class ItemAppender:
    """Appends one item to ``out`` from its bytes in parts (at the next aligned position),
    checksumming them as they pass; for items whose bytes arrive in pieces."""

    def __init__(
        self,
        out: CoalescingFile,
        nbytes: int,
        sizes: tuple[int, ...] | None,
        dtype: torch.dtype | None,
        block: int,
    ) -> None:
        self._out = out
        self.start = out.align()
        self.written = 0
        grid = checksum.item_grid(nbytes, sizes, dtype, block) if block else None
        self._hasher = checksum.Hasher(grid) if grid is not None else None

    def add(self, part: memoryview) -> None:
        part = part.cast("B") if part.format != "B" or part.ndim != 1 else part
        if self._hasher is not None:
            self._hasher.update(part)
        self._out.write(part)
        self.written += len(part)

    def digests(self) -> tuple[str, ...] | None:
        return self._hasher.finish() if self._hasher is not None else None


class FsspecCheckpointWriter(LocationMixin, StorageWriter):
    """Writes a checkpoint to any fsspec location; usable with ``torch.distributed.checkpoint.save``.

    Each rank writes raw tensor bytes into up to ``thread_count`` files (one thread each; None:
    by its bytes and cores, see ``data_files``), records
    block checksums, and syncs its files; the coordinator then publishes ``dcpbridge.json``
    atomically. Until that file exists the directory is not a loadable checkpoint.

    It is also DCP's ``AsyncStager`` for ``dcp.async_save`` (as torch's ``FileSystemWriter``
    is): torch's ``DefaultStager``, used for writers that are not one, drops a conjugate or
    negative view's flag and stores the memory, not the values the tensor shows.
    """

    _synchronize_after_execute = False  # staging blocks: nothing to wait for afterwards

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        thread_count: int | None = None,
        sync_files: bool = True,
        checksums: bool = True,
        checksum_block_size: int = checksum.DEFAULT_BLOCK_SIZE,
        reuse_from: str | os.PathLike[str] | None = None,
    ) -> None:
        if thread_count is not None and thread_count < 1:
            raise InvalidArgumentError(f"thread_count must be >= 1, got {thread_count}")
        if checksum_block_size <= 0:
            raise InvalidArgumentError(
                f"checksum_block_size must be > 0, got {checksum_block_size}"
            )
        LocationMixin.__init__(self, storage_options)
        self.thread_count = thread_count
        self.sync_files = sync_files
        self.checksums = checksums
        self.checksum_block_size = checksum_block_size
        self.columns = False  # the document's items as packed columns however few
        # every data file the document names is checked to be there before the commit; off
        # where they stay with the ranks that wrote them (the local tier's node directories)
        self.check_files = True
        # The coordinator's own local files synced on a thread while ``finish`` encodes the
        # commit (joined before it); only for a caller whose ``finish`` runs on this object
        # after its ``write_data`` (dcpbridge's engine without a writer process)
        self.sync_in_finish = False
        self._late: _LateSyncs | None = None
        self._save_id = ""
        self._is_coordinator = False
        self._written: set[str] = set()
        self._registered: str | None = None  # the save whose write this coordinator counted
        self._made_folder = False  # this rank's save made its (local) folder
        # incremental: chunks equal to this sibling checkpoint's are referenced (write/reuse.py)
        self.reuse_from = None if reuse_from is None else os.fspath(reuse_from)
        if path is not None:
            self.reset(path)

    # -- DCP StorageWriter protocol -------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self._relocate(checkpoint_id)
            if self.reuse_from is not None:
                check_siblings(resolve(self.reuse_from, self.storage_options), self._loc)
        self._save_id = ""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._check_process()
        self._is_coordinator = is_coordinator
        if self._io is not None:
            self._io.new_operation()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self._loc.url) if self.location else None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of ``state_dict`` for ``dcp.async_save`` to write while training goes
        on (torch's ``DefaultStager`` copy, views kept: see ``_ViewsKept``), saved as the state
        itself would be: a plain tensor's view as the values it shows, a ShardedTensor over one
        refused."""
        return _ViewsKept(pin_memory=False, share_memory=False).stage(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once the copy is made."""

    def close(self) -> None:
        """Nothing held between saves (``AsyncStager``'s last call)."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._made_folder = self._store.makedirs()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save_id = new_save_id()
        return [
            dataclasses.replace(p, storage_data=self.storage_data_for(rank, save_id))
            for rank, p in enumerate(plans)
        ]

    def storage_data_for(self, rank: int, save_id: str) -> Any:
        """What ``prepare_global_plan`` gives ``rank`` for save ``save_id``; lets a caller that
        cached the global plan start a new save without another exchange."""
        self._save_id = save_id
        return _RankTarget(save_id, rank)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        target = plan.storage_data
        if not isinstance(target, _RankTarget):
            raise InvalidArgumentError(
                "plan has no storage target: the writer's prepare_global_plan did not run"
            )
        self._save_id = target.save_id
        self._written = set()
        self._drop_late()
        if self._is_coordinator:
            self._remove_unfinished(target.save_id)
            self._registered = target.save_id
        late = (
            _LateSyncs(self._store, self._loc.url)
            if self.sync_in_finish
            and self._is_coordinator
            and self.sync_files
            and self._loc.is_local
            else None
        )
        device_copy.settle_device_work()  # GPU tensors are copied from writer threads
        reused, reused_results, items = self._split_reused(plan.items, planner, target.rank)
        sizes = [item_nbytes(item) for item in items]
        buckets = split_into_files(items, data_files(sum(sizes), self.thread_count), sizes)

        def write_file(index: int) -> list[WriteResult]:
            name = data_file_name(target.rank, index, target.save_id)
            return self._write_file(name, buckets[index], planner, target.rank, late, len(buckets))

        try:
            if len(buckets) <= 1 or (self._loc.is_local and _mostly_small(sizes)):
                results = [r for i in range(len(buckets)) for r in write_file(i)]
            else:
                with ThreadPoolExecutor(len(buckets), thread_name_prefix="dcpb-write") as pool:
                    results = [r for rs in pool.map(write_file, range(len(buckets))) for r in rs]
        except BaseException:
            if late is not None:
                late.close()
            # plain ``dcp.save`` has no abort step: a failed write removes its own files here
            # (the others' stay until the next save this coordinator makes here)
            self._remove_written()
            self.remove_made_folder()
            raise
        if late is not None:
            self._late = late.start()
        if reused:
            results, buckets = reused_results + results, [reused, *buckets]
        digest_of = getattr(planner, "plan_digest", None)  # dcpbridge's planners have one
        digest = digest_of(plan) if digest_of is not None else None
        if digest is not None:
            results = written_columns(results, _positions(plan.items, buckets), digest)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        late = self._late
        try:
            self._claim_finish()
            publish(
                self._store,
                metadata,
                results_table(metadata, results, checksums=self.checksums),
                save_id=self._save_id,
                world_size=len(results),
                checksums=self.checksums,
                checksum_block_size=self.checksum_block_size,
                sync=self.sync_files,
                columns=self.columns,
                synced=None if late is None else late.wait,
                check_files=self.check_files,
            )
        except BaseException:
            self._remove_save()
            raise
        finally:
            self._drop_late()  # also when the encoding failed before the wait

    def _remove_save(self) -> None:
        """After a failed commit (``finish`` raised, on the coordinator): remove every rank's
        data files of this save (best effort).

        Plain ``dcp.save`` calls no abort step: without this the other ranks' files stayed.
        ``finish`` runs once every rank's ``write_data`` returned, so no rank still writes
        them; nothing is removed if the commit did land (or cannot be read).
        """
        self._written = set()
        self._remove_uncommitted(
            lambda present: [n for n in present if _save_id_of(n) == self._save_id]
        )
        self.remove_made_folder()

    def abort(self) -> None:
        """Remove the data files this rank wrote for a save that failed (best effort).

        The engine calls it on every rank when any rank's write or the commit failed. Only
        files named with this save's id are touched, so the previous checkpoint at the same
        location stays intact; nothing is removed if the commit did land.
        """
        with _UNFINISHED_LOCK:  # every rank removes its own: nothing left for a later save
            _forget_unfinished(self._loc.url, self._save_id)
        self._remove_written()
        self.remove_made_folder()

    def remove_made_folder(self) -> None:
        """Remove the local folder this rank's save made, if it is empty by now (a folder that
        was there before the save stays; so does one another rank still writes into: the
        engine calls this again once every rank's cleanup is done)."""
        if self._made_folder:
            self._store.remove_empty_folder()

    def _remove_written(self) -> None:
        """Remove the data files this rank wrote for the failed save (best effort)."""
        self._drop_late()
        names, self._written = sorted(self._written), set()
        if names:
            self._remove_uncommitted(lambda present: [n for n in names if n in present])

    def _remove_uncommitted(self, pick: Callable[[set[str]], list[str]]) -> None:
        """Remove ``pick(the names present)`` unless this save's commit landed (best effort:
        cleanup must not hide the failure being reported)."""
        try:
            if committed_save_id(self._store) == self._save_id:
                return
            self._store.remove(sorted(pick(set(self._store.list_names()))))
        except Exception as e:
            log.warning("could not remove data files of failed save in %s: %s", self._loc.url, e)

    def _remove_unfinished(self, save_id: str) -> None:
        """Coordinator, as save ``save_id`` starts its write: remove the data files of the
        earlier saves here that this process coordinated and whose ``finish`` never started
        (DCP skipped it: a rank's ``write_data`` failed, and every rank's write had returned
        before that save raised), then count ``save_id`` as such until its ``finish``. Only
        files of those save ids go, which no commit names; best effort (logged)."""
        url = self._loc.url
        with _UNFINISHED_LOCK:  # a ``finish`` of one of them waits, then refuses to commit
            dead = _UNFINISHED.pop(url, set()) - {save_id}
            _UNFINISHED[url] = {save_id}  # (one entry per location with a save in flight)
            if not dead:
                return
            try:
                if committed_save_id(self._store) in dead:  # cannot be: no finish ran
                    return
                names = [n for n in self._store.list_names() if _save_id_of(n) in dead]
                self._store.remove(sorted(names))
            except Exception as e:
                log.warning(
                    "could not remove data files of failed saves in %s: %s", self._loc.url, e
                )

    def _claim_finish(self) -> None:
        """Coordinator: this save's ``finish`` starts, so a later save here must not remove
        its files; ``ConcurrentSaveError`` where one already did (a save started here before
        this one's commit: its data files are gone, it must not commit)."""
        if self._registered != self._save_id:  # its write ran elsewhere (a writer process)
            return
        with _UNFINISHED_LOCK:
            if not _forget_unfinished(self._loc.url, self._save_id):
                raise ConcurrentSaveError(
                    f"{self._loc.url}: a later save to this location started before this one "
                    "committed and removed its data files as those of a failed save: it did "
                    "not commit"
                )

    # -- helpers --------------------------------------------------------------------------

    def _drop_late(self) -> None:
        """Wait for syncs a save left behind (one whose ``finish`` did not run) and close
        their files; their failure is no longer anyone's to report."""
        late, self._late = self._late, None
        if late is not None:
            late.close()

    def _split_reused(
        self, items: list[WriteItem], planner: SavePlanner, rank: int
    ) -> tuple[list[WriteItem], list[WriteResult], list[WriteItem]]:
        """(items the previous checkpoint already stores, their results, items to write)."""
        if self.reuse_from is None or not self.checksums:
            return [], [], items
        previous = Previous.open(resolve(self.reuse_from, self.storage_options))
        block = self.checksum_block_size
        return split_reused(
            items, shown_data(planner), previous, rank=rank, block=block, tensor_bytes=tensor_bytes
        )

    def _write_file(
        self,
        name: str,
        items: list[WriteItem],
        planner: SavePlanner,
        rank: int,
        late: _LateSyncs | None = None,
        files: int = 1,
    ) -> list[WriteResult]:
        """Write ``items`` to file ``name`` (one of ``files`` written at once) and sync it (with
        ``late``: hand it there open, to be synced and closed later)."""
        self._written.add(name)
        with (
            storage_faults(lambda: f"{self._loc.url}: write {name}"),
            contextlib.ExitStack() as stack,
        ):
            raw = stack.enter_context(self._store.open_write(self._loc.data_path(name)))
            behind = functools.partial(self._store.write_behind, raw) if self.sync_files else None
            # on local disk, full buffers are written on a thread (kernel copy, write-behind)
            out = CoalescingFile(raw, behind, background=self._loc.is_local)
            try:
                block = self.checksum_block_size if self.checksums else 0
                datas = list(map(shown_data(planner), items))
                stage = device_copy.on_device
                if any(map(stage, datas)):
                    # pinned slabs ahead of each file's writes: 4 for up to 2 files, 2 beyond
                    slabs = max(2, 2 * device_copy.SLABS // files)
                    results = _write_carried(out, name, items, datas, rank, block, stage, slabs)
                else:  # host data only: one pass, nothing staged
                    results = _append_items(out, name, items, datas, rank, block)
                out.flush()
            except BaseException:
                out.close(failed=True)  # nothing still writes once the file closes
                raise
            out.close()
            if late is not None:
                late.add(name, raw, stack.pop_all())
            elif self.sync_files:
                self._store.sync(raw)
        return results


class _LateSyncs:
    """Written local files whose sync runs on a thread (``start``) while the caller goes on;
    ``wait`` joins it, raising the first failure (naming the file); ``close`` joins it
    without raising. Each file is closed once synced or when the syncs end."""

    def __init__(self, store: Storage, url: str) -> None:
        self._store, self._url = store, url
        self._files: list[tuple[str, BinaryIO, contextlib.ExitStack]] = []
        self._lock = threading.Lock()
        self._thread: ThreadPoolExecutor | None = None
        self._done: ThreadFuture[None] | None = None

    def add(self, name: str, f: BinaryIO, closing: contextlib.ExitStack) -> None:
        with self._lock:  # write threads hand their files in concurrently
            self._files.append((name, f, closing))

    def start(self) -> _LateSyncs:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="dcpb-sync")
        self._done = self._thread.submit(self._sync_all)
        return self

    def _sync_all(self) -> None:
        try:
            for name, f, _ in self._files:
                with storage_faults(lambda name=name: f"{self._url}: write {name}"):
                    self._store.sync(f)
        finally:
            self._close_files()

    def _close_files(self) -> None:
        files, self._files = self._files, []
        with contextlib.ExitStack() as stack:
            for _, _, closing in files:
                stack.push(closing)

    def wait(self) -> None:
        try:
            if self._done is not None:
                self._done.result()
        finally:
            self.close()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self._close_files()


def _positions(items: list[WriteItem], buckets: list[list[WriteItem]]) -> list[int] | range:
    """Each bucketed item's position in ``items``, bucket by bucket."""
    if len(buckets) == 1 and buckets[0] is items:
        return range(len(items))
    where = {id(item): i for i, item in enumerate(items)}
    return [where[id(item)] for bucket in buckets for item in bucket]


def _write_carried(
    out: CoalescingFile,
    name: str,
    items: list[WriteItem],
    datas: list[Any],
    rank: int,
    block: int,
    stage: Callable[[Any], bool],
    slabs: int | None = None,
) -> list[WriteResult]:
    """Append the items in order, the data ``stage`` picks (device tensors) carried through
    ``slabs`` host slabs (``device_copy.carry``), the rest as ``_append_item`` does."""
    results: list[WriteResult] = []
    carried = _Carried(out, block)
    for piece in device_copy.carry(zip(items, datas), stage=stage, slabs=slabs):
        item = piece.tag
        if piece.view is None:
            results.append(_append_item(out, name, item, piece.data, rank, block))
            continue
        done = carried.add(item, piece)  # a device tensor, carried in host slices
        if done is not None:
            start, nbytes, digests = done
            results.append(_result(item, name, start, nbytes, rank, digests))
    return results


def _append_item(
    out: CoalescingFile, name: str, item: WriteItem, data: Any, rank: int, block: int
) -> WriteResult:
    """Append one item's host bytes at the next aligned position of ``out``; its result.

    A small, plain, contiguous CPU tensor is copied straight from its memory into the
    coalescing buffer; any other tensor goes through ``tensor_bytes``.
    """
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise InvalidArgumentError(f"{item.index.fqn!r}: BYTE_IO item resolved to {type(data)}")
        mv = data.getbuffer()
        start = out.align()
        out.write(mv)
        digests = checksum.item_digests(mv, None, None, block) if block else None
        return _result(item, name, start, len(mv), rank, digests)
    td = item.tensor_data
    assert td is not None  # DCP's tensor write items always describe their chunk
    expected = item_nbytes(item)
    start = out.align()
    if _copyable(data, expected):
        mv = out.copy_in(data.data_ptr(), expected)
    else:
        mv = tensor_bytes(data)
        _check_size(item, len(mv))
        out.write(mv)
    digests = (
        checksum.chunk_digests(mv, td.chunk.sizes, td.properties.dtype, block) if block else None
    )
    return _result(item, name, start, len(mv), rank, digests)


def shown_data(planner: SavePlanner) -> Callable[[WriteItem], Any]:
    """``planner.resolve_data``, a conjugate or negative view made a copy of the values it
    shows: its memory holds others, and DCP's default planner hands such a view over as it is
    (the values stored were the memory's)."""
    resolve = planner.resolve_data

    def shown(item: WriteItem) -> Any:
        data = resolve(item)
        if isinstance(data, torch.Tensor) and (data.is_neg() or data.is_conj()):
            return data.resolve_conj().resolve_neg()
        return data

    return shown


def _copyable(data: Any, expected: int) -> bool:
    """Whether ``data`` is a plain, contiguous CPU tensor of ``expected`` bytes, small enough
    to be copied straight from its memory into the coalescing buffer."""
    return (
        expected < _SMALL_ITEM
        and type(data) in _PLAIN
        and data.is_cpu
        and data.is_contiguous()
        and data.nbytes == expected
    )


def _append_items(
    out: CoalescingFile,
    name: str,
    items: list[WriteItem],
    datas: list[Any],
    rank: int,
    block: int,
) -> list[WriteResult]:
    """``_append_item`` of every item in order, with small plain CPU tensor chunks (a save of
    many small tensors) appended here: their byte count and whether they are one checksum
    tile found once per (sizes, dtype), not per item; any other item goes to ``_append_item``.
    """
    results: list[WriteResult] = []
    shapes: dict[tuple[torch.Size, torch.dtype], tuple[int, bool]] = {}
    for item, data in zip(items, datas):
        td = item.tensor_data
        if td is None or type(data) not in _PLAIN or item.type == WriteItemType.BYTE_IO:
            results.append(_append_item(out, name, item, data, rank, block))
            continue
        sizes, dtype = td.chunk.sizes, td.properties.dtype
        known = shapes.get((sizes, dtype))
        if known is None:
            one = not block or checksum.chunk_grid_is_one_tile(sizes, dtype, block)
            known = shapes[(sizes, dtype)] = (item_nbytes(item), one)
        expected, one_tile = known
        if not one_tile or not _copyable(data, expected):
            results.append(_append_item(out, name, item, data, rank, block))
            continue
        start = out.align()
        mv = out.copy_in(data.data_ptr(), expected)
        digests = (checksum.tile_digest(mv),) if block else None
        results.append(_result(item, name, start, expected, rank, digests))
    return results


class _Carried:
    """Appends a carried tensor's slices to ``out``, one item at a time."""

    def __init__(self, out: CoalescingFile, block: int) -> None:
        self._out, self._block = out, block
        self._item: ItemAppender | None = None
        self._expected = 0

    def add(self, item: WriteItem, piece: device_copy.Piece[Any]) -> tuple[int, int, Any] | None:
        """Write one slice; after the item's last: (position, bytes, digests)."""
        mv = piece.view
        assert mv is not None
        if piece.first:
            td = item.tensor_data
            assert td is not None
            self._expected = item_nbytes(item)
            self._item = ItemAppender(
                self._out, self._expected, tuple(td.chunk.sizes), td.properties.dtype, self._block
            )
        appender = self._item
        assert appender is not None
        if appender.written + len(mv) > self._expected:  # more bytes than planned: refuse now
            _check_size(item, appender.written + len(mv))
        appender.add(mv)
        if not piece.last:
            return None
        _check_size(item, appender.written)
        self._item = None
        return appender.start, appender.written, appender.digests()


def _check_size(item: WriteItem, nbytes: int) -> None:
    expected = item_nbytes(item)
    if nbytes != expected:
        raise InvalidArgumentError(
            f"{item.index.fqn!r} at offsets {list(item.index.offset or ())}: resolved "
            f"data has {nbytes} bytes, the plan expects {expected}"
        )


def _result(
    item: WriteItem, file: str, start: int, nbytes: int, rank: int, digests: Any
) -> WriteResult:
    """What the writer reports for one written item: where its bytes are and their digests."""
    td = item.tensor_data
    return WriteResult(
        index=item.index,
        size_in_bytes=nbytes,
        storage_data=StoredItem(
            file,
            start,
            nbytes,
            rank,
            digests,
            None if td is None else tuple(td.chunk.sizes),
            None if td is None else td.properties.dtype,
        ),
    )


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def publish(
    store: Storage,
    metadata: Metadata,
    items: Mapping[ItemKey, StoredItem],
    *,
    save_id: str,
    world_size: int,
    checksums: bool,
    checksum_block_size: int,
    sync: bool,
    makedirs: bool = False,
    columns: bool = False,
    synced: Callable[[], None] | None = None,
    check_files: bool = True,
) -> None:
    """Index ``items`` into ``metadata``, commit ``dcpbridge.json`` last, then drop the files of
    the checkpoint it replaced (``columns``: as ``encode_index``; ``synced``: waits until the
    data files are durable, called once the document is encoded, before it is committed;
    ``check_files``: ``check_present`` first)."""
    raw = encode_index(
        metadata,
        items,
        save_id=save_id,
        world_size=world_size,
        checksums=checksums,
        checksum_block_size=checksum_block_size,
        prefixes=store.location.prefixes,
        columns=columns,
    )
    if synced is not None:
        synced()
    if makedirs:
        store.makedirs()
    index = metadata.storage_data
    assert isinstance(index, StorageIndex)
    if check_files:
        check_present(store, index.files, index.prefixes)
    current = store.read_committed(METADATA_FILE)
    replaced = files_of(json_object(current.data))
    # Conditional: if another save committed since ``current`` was read, this one raises
    # (and its caller removes its files) instead of replacing a commit it never saw.
    store.commit_file(METADATA_FILE, raw, temp_metadata_name(save_id), sync=sync, replaces=current)
    own = _referenced_here(store.location.root, index.files)
    remove_replaced_files(store, [n for n in replaced if n not in own], save_id)


def check_present(store: Storage, files: Iterable[str], prefixes: int) -> None:
    """Raise ``StorageFileNotFoundError`` naming the data files among ``files`` (a commit
    document's, references included) that are not there: a commit never names missing data
    (another job's cleanup of the same root may remove a save's files while it writes). One
    listing of the location and of each referenced folder; a file a listing lacks is looked
    up once more (a store whose listings lag behind its writes)."""
    files = list(files)
    store.fs.invalidate_cache(store.location.root.rstrip("/"))
    present = sizes_with_references(store, files)
    missing = [f for f in files if f not in present and not _found(store, f, prefixes)]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise StorageFileNotFoundError(
            f"{store.location.url}: data files of this save are missing at its commit "
            f"({', '.join(missing[:5])}{more}; removed by another job's cleanup of the same "
            "root?): it did not commit"
        )


def _found(store: Storage, name: str, prefixes: int) -> bool:
    """Whether data file (or reference) ``name`` is there, looked up by its own path (not
    answered from a cached listing of its folder)."""
    path = store.location.data_path(name, prefixes)
    store.fs.invalidate_cache(path.rsplit("/", 1)[0])
    try:
        store.info(path)
    except FileNotFoundError:
        return False
    return True


def _referenced_here(root: str, files: Iterable[str]) -> set[str]:
    """Names of the files of checkpoint folder ``root`` that its own document ``files``
    references (``../<this folder>/...``: an incremental save over the checkpoint its
    ``reuse_from`` references): replacing the old commit must keep them."""
    here = root.rstrip("/").rsplit("/", 1)[-1]
    return {f.rsplit("/", 1)[-1] for f in files if is_reference(f) and reference_dir(f) == here}


def json_object(raw: bytes | None) -> dict[str, Any] | None:
    """``raw`` as a JSON object, or None if absent or unreadable."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def encode_index(
    metadata: Metadata,
    items: Mapping[ItemKey, StoredItem],
    *,
    save_id: str,
    world_size: int,
    checksums: bool,
    checksum_block_size: int = checksum.DEFAULT_BLOCK_SIZE,
    prefixes: int = 1,
    columns: bool = False,
) -> bytes:
    """The commit document of ``metadata`` with ``items`` (a mapping or an ``ItemTable``) as
    its storage index (data files spread over ``prefixes`` folders; ``columns``: items packed
    as columns however few)."""
    files = (
        items.files if isinstance(items, ItemTable) else sorted({i.file for i in items.values()})
    )
    metadata.storage_data = StorageIndex(
        items=items,
        save_id=save_id,
        files=tuple(files),
        checksum_algorithm=checksum.ALGORITHM if checksums else None,
        checksum_block_size=checksum_block_size if checksums else 0,
        world_size=world_size,
        prefixes=prefixes,
    )
    return encode_metadata(metadata, columns=columns)


def results_table(
    metadata: Metadata, results: list[list[WriteResult]], *, checksums: bool
) -> ItemTable:
    """Every rank's write results as the item table of ``metadata``."""
    return written_table(metadata, results, checksums=checksums)


def index_results(
    metadata: Metadata, results: list[list[WriteResult]], *, save_id: str, checksums: bool
) -> bytes:
    """The commit document of ``metadata`` for every rank's write ``results``."""
    return encode_index(
        metadata,
        results_table(metadata, results, checksums=checksums),
        save_id=save_id,
        world_size=len(results),
        checksums=checksums,
    )


def _committed_document(store: Storage) -> dict[str, Any] | None:
    """The JSON of the commit file at ``store``'s location, or None if absent or not a JSON
    object; a failure to read it raises (the caller cannot tell whether a save committed)."""
    try:
        return json_object(store.read_file(store.location.path(METADATA_FILE)))
    except FileNotFoundError:
        return None


def committed_save_id(store: Storage) -> str | None:
    """The save id the location's commit file names (None if there is none). Raises where
    the commit file cannot be read: a failed save's cleanup then removes nothing (its
    commit may have landed with its answer lost, and its data files are then needed)."""
    doc = _committed_document(store)
    save_id = doc.get("save_id") if doc is not None else None
    return save_id if isinstance(save_id, str) else None


def files_of(doc: dict[str, Any] | None) -> list[str]:
    """Data files a commit document names ([] if none or malformed)."""
    files = doc.get("files") if doc is not None else None
    if not isinstance(files, list):
        return []
    return [f for f in files if isinstance(f, str) and DATA_FILE_RE.match(f)]


def _save_id_of(name: str) -> str | None:
    m = DATA_FILE_RE.match(name)
    return m.group(3) if m else None


def remove_replaced_files(store: Storage, replaced: list[str], save_id: str) -> None:
    """After ``save_id`` committed: delete the files of the commit it replaced (local temp
    files of killed commits go in the commit itself, under its lock).

    Data files of other save ids are left alone: they may belong to a save to this location
    that is still running (deleting them would break its commit). A failed save removes its
    own files; only a killed process leaves some behind.
    """
    try:
        names = set(store.list_names())
        stale = [n for n in replaced if n in names and _save_id_of(n) != save_id]
        if not store.location.is_local:  # no commit writes temp files there: all are stale
            stale += [n for n in names if n.startswith(TEMP_METADATA_PREFIX)]
        store.remove(sorted(set(stale)))
    except OSError as e:  # the checkpoint is committed; leftovers are only wasted space
        log.warning("could not remove replaced files in %s: %s", store.location.url, e)


def remove_stale_files(store: Storage, save_id: str) -> None:
    """Delete every data file not of ``save_id`` (and temp files) at ``store``'s location."""
    try:
        stale = [
            n
            for n in store.list_names()
            if ((m := DATA_FILE_RE.match(n)) and m.group(3) != save_id)
            or n.startswith(TEMP_METADATA_PREFIX)
        ]
        store.remove(stale)
    except OSError as e:  # the checkpoint is committed; leftovers are only wasted space
        log.warning("could not remove stale files in %s: %s", store.location.url, e)
