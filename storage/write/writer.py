"""DCP ``StorageWriter`` over fsspec: raw bytes, a few files per rank, JSON metadata written last."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcpbridge.storage.backends import device_copy
from dcpbridge.storage.backends.location_mixin import LocationMixin
from dcpbridge.storage.backends.store import Storage
from dcpbridge.storage.errors import ConcurrentSaveError, InvalidArgumentError, storage_faults
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.document import data_file_name
from dcpbridge.storage.format.paths import resolve
from dcpbridge.storage.write.coalesce import SMALL_ITEM, CoalescingFile
from dcpbridge.storage.write.commit import committed_save_id, publish, save_id_of
from dcpbridge.storage.write.items import (
    PLAIN,
    append_items,
    item_nbytes,
    shown_data,
    tensor_bytes,
    write_carried,
)
from dcpbridge.storage.write.reuse import Previous, check_siblings, split_reused
from dcpbridge.storage.write.written import written_columns, written_table

log = logging.getLogger(__name__)


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
        if type(x) not in PLAIN or not (x.is_conj() or x.is_neg()):
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
    """Whether items under ``SMALL_ITEM`` hold most of these bytes: then writing is per-item
    Python work, which threads serialize on the GIL rather than share (measured on local disk,
    20,000 x 16 KiB, medians of 7 alternated saves: 0.44 s with one thread, 0.51 s with two)."""
    small = sum(n for n in sizes if n < SMALL_ITEM)
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


class FsspecCheckpointWriter(LocationMixin, StorageWriter, AsyncStager):
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

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of ``state_dict`` for ``dcp.async_save`` to write while training goes
        on (torch's ``DefaultStager`` copy, views kept: see ``_ViewsKept``), saved as the state
        itself would be: a plain tensor's view as the values it shows, a ShardedTensor over one
        refused."""
        return _ViewsKept(pin_memory=False, share_memory=False).stage(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once the copy is made."""

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
                written_table(metadata, results, checksums=self.checksums),
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
            lambda present: [n for n in present if save_id_of(n) == self._save_id]
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
                names = [n for n in self._store.list_names() if save_id_of(n) in dead]
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
                    results = write_carried(out, name, items, datas, rank, block, stage, slabs)
                else:  # host data only: one pass, nothing staged
                    results = append_items(out, name, items, datas, rank, block)
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
