"""``save`` and ``async_save``: sort the state, vote on the cache, ask who writes, then drive DCP.

A save runs in two halves. ``plan_save`` takes the collective decisions (one vote on reusing
the cached plan; with ``fully_parallel``, the writers of replicated shards) on the caller's
process group. ``write_planned`` builds the format's planner and writer and drives DCP's
steps (``dcpbridge.engine.drive``); ``async_save`` runs that half in the background, after
staging what this rank writes.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter

from dcpbridge.engine import common_digest, protocol, stats
from dcpbridge.engine.async_save import AsyncSaveHandle, AsyncSaver
from dcpbridge.engine.bridge import BridgeSavePlanner
from dcpbridge.engine.cache import (
    Reuse,
    SaveCache,
    agree_to_reuse,
    members,
    save_cache,
    structure_of,
)
from dcpbridge.engine.collectives import Group
from dcpbridge.engine.drive import run_save
from dcpbridge.engine.gc_pause import gc_paused
from dcpbridge.engine.ownership import WriteOwners, check_copies, write_owners
from dcpbridge.engine.staging import (
    BufferSet,
    StagingArea,
    StreamMarks,
    copy_objects,
    mark_streams,
    stage,
    tensor_writes,
)
from dcpbridge.engine.staging_check import LiveMark, mark_live, verify_staged
from dcpbridge.engine.writer_process import attach, check_writer, choose_writer, process_of
from dcpbridge.errors import (
    CheckpointError,
    DistributedCheckpointError,
    InvalidArgumentError,
    StagingError,
    WriterProcessError,
)
from dcpbridge.formats.config import resolve_storage_options
from dcpbridge.formats.torch_dist import TorchDistSavePlanner, TorchDistWriter, sharded_part
from dcpbridge.model.intake import SaveParts, for_save, normalize
from dcpbridge.model.mapping import ShardedStateDict
from dcpbridge.model.state import (
    HOLE,
    apply_factories,
    extract,
    fill_holes,
    is_nonpersistent,
    is_sharded,
    leaves,
)
from dcpbridge.model.stateful import state_dicts
from dcpbridge.planners.leaves import refuse
from dcpbridge.planners.protocol import leaf_kind
from dcpbridge.planners.save_planner import check_shows_its_values
from dcpbridge.planners.walk import iter_leaves
from dcpbridge.storage import FsspecCheckpointWriter

PathLike = str | os.PathLike[str]
FORMATS = ("dcpbridge", "torch_dist")


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How ``save`` and ``async_save`` write; each field is a keyword argument of both."""

    storage_options: dict[str, Any] | None = None  # fsspec options (endpoint, credentials)
    profile: str | None = None  # a storage profile of the configuration file
    validate_access_integrity: bool = True  # check the shards tile every tensor exactly once
    fully_parallel: bool = False  # spread replicated shards' writes over the group
    parallelization_group: dist.ProcessGroup | None = None  # for fully_parallel (default: all)
    thread_count: int | None = None  # writer threads per rank (None: by its bytes and cores)
    sync_files: bool = True  # fsync data files before the commit
    checksums: bool = True  # xxh3 block checksums (format "dcpbridge")
    format: str = "dcpbridge"  # or "torch_dist", which Megatron-Core's load reads
    reuse_from: PathLike | None = None  # incremental: reference equal chunks of this checkpoint

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise InvalidArgumentError(
                f"format must be 'dcpbridge' or 'torch_dist', got {self.format!r}"
            )
        if self.reuse_from is not None and (self.format != "dcpbridge" or not self.checksums):
            raise InvalidArgumentError(
                "reuse_from needs format='dcpbridge' with checksums (they decide what is reused)"
            )
        count = self.thread_count
        if count is not None and (not isinstance(count, int) or count < 1):
            raise InvalidArgumentError(f"thread_count must be >= 1, got {self.thread_count!r}")


def parallel_group(
    fully_parallel: bool, parallelization_group: dist.ProcessGroup | None, group: Group
) -> Group | None:
    """The group that spreads writes or reads (None without ``fully_parallel``): a subgroup
    of ``group``, as a member beyond it takes part in another save or load (refused)."""
    if not fully_parallel:
        return None
    if parallelization_group is None:
        return group
    parallel = Group.resolve(parallelization_group)
    outside = sorted(set(members(parallel) or ()) - set(members(group) or ()))
    if outside:
        raise InvalidArgumentError(
            f"parallelization_group has ranks outside the process_group: {outside} (global "
            "ranks); it must be a subgroup of it"
        )
    return parallel


@dataclass
class PlannedSave:
    """A save after its collective decisions: what to write, who writes it, and a local
    failure met after them (raised inside the first step of the write, on every rank)."""

    parts: SaveParts = field(default_factory=SaveParts)
    structure: int | None = None
    reuse: Reuse | None = None
    owners: WriteOwners | None = None
    common: Any = None  # the nested common state for torch_dist's common.pt
    error: BaseException | None = None
    reports: list[Any] = field(default_factory=list)
    """What every rank's ``report`` of ``plan_save`` returned (rank order; None without)."""

    @property
    def shards(self) -> list[Any]:
        return self.parts.shards


def plan_save(
    group: Group,
    cache: SaveCache,
    sharded_state_dict: ShardedStateDict,
    options: SaveOptions,
    report: Callable[[SaveParts], Any] | None = None,
) -> PlannedSave:
    """Sort the state and take the collective decisions; a failure raises on every rank.
    ``report(parts)`` (of the sorted state) travels with the first vote: ``reports``."""
    parallel = parallel_group(options.fully_parallel, options.parallelization_group, group)
    planned = PlannedSave()

    source: list[Any] = []  # the state dict sorted (torch_dist keeps its dict keys)

    def sort() -> int:
        source[:] = [state_dicts(sharded_state_dict)]
        parts = for_save(source[0])
        if options.format == "torch_dist":  # plain tensors go to common.pt, not to shards
            parts.shards = sharded_part(parts)
        planned.parts = parts
        planned.structure = structure_of(parts.shards, parallel, parts.common_layout())
        return planned.structure

    per_key: dict[str, bytes] = {}

    def told() -> tuple[bytes, Any]:
        """This rank's common-state digest and ``report``: carried by the vote."""
        if group.distributed:
            per_key.update(common_digest.key_digests(planned.parts.objects))
        mine = common_digest.digest(per_key)
        return mine, None if report is None else report(planned.parts)

    planned.reuse, told_back = agree_to_reuse(group, cache, sort, told)
    planned.reports = [extra for _, extra in told_back]
    common_digest.check(group, [d for d, _ in told_back], per_key, "save")
    try:  # a failure is raised on ``parallel`` only: carried to the whole group
        if planned.reuse is not None:
            planned.owners = owners = planned.reuse.entry.owners
            if owners.copies and parallel is not None:  # still equal? (every save)
                check_copies(parallel, planned.shards, owners.copies, owners)
        else:
            common_tensors = () if options.format == "torch_dist" else planned.parts.plain
            placed = planned.parts.tensor_paths
            planned.owners = write_owners(group, parallel, planned.shards, common_tensors, placed)
    except Exception as e:
        planned.error = e
    if options.format == "torch_dist" and group.is_coordinator:
        planned.common = planned.parts.nested_common(source[0] if source else None)
    return planned


def _planner_and_writer(
    planned: PlannedSave, checkpoint_dir: PathLike, options: SaveOptions
) -> tuple[Any, SavePlanner, StorageWriter]:
    """(state dict, planner, writer) of ``options.format``; re-raises a carried failure."""
    if planned.error is not None:
        raise planned.error
    storage_options = resolve_storage_options(
        options.storage_options, options.profile, url=checkpoint_dir
    )
    validate, parts = options.validate_access_integrity, planned.parts
    if options.format == "torch_dist":
        writer: StorageWriter = TorchDistWriter(
            checkpoint_dir,
            planned.common,
            storage_options=storage_options,
            thread_count=2 if options.thread_count is None else options.thread_count,
            sync_files=options.sync_files,
        )
        planner: SavePlanner = TorchDistSavePlanner(validate=validate, owners=planned.owners)
        # no shards: an empty list would be stored as a bogus object "shards" (DCP's rule
        # for a list without tensors), which Megatron's format cannot hold
        return ({"shards": parts.shards} if parts.shards else {}), planner, writer
    writer = FsspecCheckpointWriter(
        checkpoint_dir,
        storage_options=storage_options,
        thread_count=options.thread_count,
        sync_files=options.sync_files,
        checksums=options.checksums,
        reuse_from=options.reuse_from,
    )
    planner = BridgeSavePlanner(
        parts.shards,
        parts.objects,
        parts.common_table(),
        validate=validate,
        owners=planned.owners,
        paths={**parts.tensor_paths, **parts.paths},
    )
    return None, planner, writer


def write_planned(
    group: Group,
    cache: SaveCache,
    planned: PlannedSave,
    checkpoint_dir: PathLike,
    options: SaveOptions,
    wrap: Callable[[StorageWriter], StorageWriter] | None = None,
) -> None:
    """Plan, validate, write and commit ``planned`` (collective over ``group``); ``wrap``
    may replace the storage writer (the writer process's)."""

    def prepare() -> tuple[Any, SavePlanner, StorageWriter]:
        state, planner, writer = _planner_and_writer(planned, checkpoint_dir, options)
        if wrap is not None:
            return state, planner, wrap(writer)
        if isinstance(writer, FsspecCheckpointWriter):  # its finish runs here, on this object
            writer.sync_in_finish = True
        return state, planner, writer

    run_save(
        prepare,
        group,
        cache,
        structure=planned.structure,
        reuse=planned.reuse,
        owners=planned.owners,
    )


def _options(given: dict[str, Any], caller: str) -> SaveOptions:
    unknown = sorted(set(given) - set(SaveOptions.__dataclass_fields__))
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword argument(s) {unknown}")
    return SaveOptions(**given)


@gc_paused
def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
    **options: Any,
) -> None:
    """Save a sharded state dict; every rank of ``process_group`` calls it.

    ShardedTensors and ShardedObjects are written by their main replica only, factories are
    built first, LocalNonpersistentObjects are skipped, and everything else is common state
    written once by the group's rank 0. With ``fully_parallel``, each shard held by several
    ranks of ``parallelization_group`` (default: ``process_group``) is written by one of them,
    balancing bytes. The checkpoint is committed (``dcpbridge.json`` published) only after
    every rank's data is durable and the sharding validated. ``options`` are the fields of
    ``SaveOptions``: ``format="torch_dist"`` writes a Megatron-Core torch_dist checkpoint
    instead (no checksums); ``profile`` names a storage profile of the configuration file.
    """
    opts = _options(options, "save")
    group = Group.resolve(process_group)
    cache = save_cache(group, opts.validate_access_integrity, opts.format)
    planned = plan_save(group, cache, sharded_state_dict, opts)
    write_planned(group, cache, planned, checkpoint_dir, opts)


@dataclass
class _Staging:
    """One async save's staging: ``begin`` runs in the call; ``finish`` in the call, or
    ``behind`` on the staging thread."""

    planned: PlannedSave
    area: StagingArea
    target: str
    verify: bool
    hold_caller: bool = True  # False: the caller's streams wait only at ``hold_streams``
    marks: StreamMarks | None = None
    live: list[LiveMark] = field(default_factory=list)

    def begin(self) -> None:
        """Mark the tensors' state at the call and copy everything else (objects, common.pt)."""
        planned = self.planned
        assert planned.owners is not None
        writes = tensor_writes(planned.shards, planned.owners)
        for shard in writes:  # as the planner refuses it in a sync save: staging resolves it
            check_shows_its_values(shard)
        self.live = mark_live(writes) if self.verify else []
        self.marks = mark_streams(writes)
        planned.parts = planned.parts.staged(copy_objects(planned.shards, planned.owners))
        planned.common = copy.deepcopy(planned.common)  # common.pt's tensors too

    def finish(self) -> BufferSet:
        """Copy the tensors this rank writes into host buffers (then verify them); the
        buffers, which the write releases (a failed check is carried into the write)."""
        planned, owners = self.planned, self.planned.owners
        assert owners is not None
        live = planned.shards
        shards, buffers = stats.timed(
            "staged",
            self.target,
            lambda: stage(
                live,
                self.area,
                owners,
                marks=self.marks,
                objects_copied=True,
                hold_caller=self.hold_caller,
            ),
            lambda out: stats.tensor_bytes(out[0]),
        )
        planned.parts = dataclasses.replace(planned.parts, shards=shards)
        if self.live:
            try:
                buffers.wait_ready()
                verify_staged(self.live, {id(a): b.data for a, b in zip(live, shards)})
            except Exception as e:
                planned.error = self.failed(e)
            except BaseException:  # interrupted: no save owns the buffers, give them back
                self.area.settle()
                self.area.release(buffers)
                raise
        return buffers

    def behind(self) -> BufferSet | None:
        """``finish`` on the staging thread; any failure is carried into the write."""
        try:
            return self.finish()
        except BaseException as e:  # no interrupt reaches this thread: any failure is the save's
            self.planned.error = self.failed(e)
        return None

    def failed(self, error: BaseException) -> CheckpointError:
        """``error`` of staging as the ``CheckpointError`` every rank will raise."""
        if isinstance(error, CheckpointError):
            return error
        wrapped = StagingError(
            f"async_save to {self.target}: staging failed: {type(error).__name__}: {error}"
        )
        wrapped.__cause__ = error
        return wrapped


@gc_paused
def async_save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
    max_in_flight: int = 1,
    background_staging: bool = False,
    verify_staging: bool = False,
    before_write: Callable[[], None] | None = None,
    writer: str = "auto",
    defer_stream_wait: bool = False,
    **options: Any,
) -> AsyncSaveHandle:
    """``save`` (same ``options``, any format) that returns once the data is staged in host
    memory (or at once, with ``background_staging``); the rest runs behind.

    By default the caller may modify its tensors as soon as this returns. With
    ``background_staging`` the tensors are copied on a background thread: the caller must not
    modify them before ``handle.wait_staged()`` returns (``CheckpointManager`` waits for it
    before its watched optimizers' next step); objects are copied in the call. With
    ``verify_staging``, once staged, each copy is checked against the live tensor (version
    counter and checksum): a tensor changed too early fails the save with
    ``StagingMutationError`` naming it. The small decisions taken before planning (cache vote,
    fully-parallel writers) are collective and run here; staging never communicates, and
    writing and the commit run on a background thread whose exchanges never touch the caller's
    process groups. Failures (of staging too) surface on every rank at ``handle.result()``
    (or ``wait()``), or else at the async_save that has to wait for that save because
    ``max_in_flight`` saves are outstanding (that call raises and starts nothing); a rank
    interrupted while the call sorts the state (a Stateful's ``state_dict``) raises it at
    once, and its peers a ``DistributedCheckpointError`` in the same call. A rank interrupted
    while staging raises the interrupt; the save fails on every rank, and that rank, which got
    no handle, raises the failure at its next ``async_save`` that waits for it, as a peer that
    did not call ``result()`` does (so the ranks' calls stay paired). A failed save
    never commits. ``before_write`` (CheckpointManager's) runs on the coordinator in the
    background before any rank writes; its failure fails the save on every rank. With
    ``writer="process"`` (format "dcpbridge", Linux), staging goes to shared memory and a
    long-lived writer process writes the data files, so writing never holds this process's
    GIL; ``"thread"`` writes them on this process's background thread; ``"auto"`` (the
    default) is the process where it can write the save (format "dcpbridge" on Linux, not to
    ``memory://``, storage options that pickle), from the first save that stages at least 64 MiB on this rank (smaller
    ones gain less than its start costs), else the thread. ``handle.writer`` says which wrote:
    where "auto" took a writer process whose child dies before taking the job, the thread
    writes the save (one warning), ``handle.writer`` says "thread", and so do later "auto"
    saves of this process, which spawn no new child.
    GPU tensors are copied on a side stream that the caller's streams wait for (on the GPU);
    with ``defer_stream_wait`` they do not, so the next forward and backward overlap the
    copies: the caller must then call ``handle.hold_streams()`` (after ``wait_staged``) before
    modifying the tensors, as ``CheckpointManager`` does before a watched optimizer's step.
    """
    opts = _options(options, "async_save")
    check_writer(writer, opts.format)
    group = Group.resolve(process_group)
    saver = AsyncSaver.for_group(group, max_in_flight)
    saver.wait_for_capacity()
    target = os.fspath(checkpoint_dir)
    cache = save_cache(group, opts.validate_access_integrity, opts.format)
    try:
        planned = plan_save(group, cache, sharded_state_dict, opts)
    except Exception as e:  # raised alike on every rank: reported where each waits
        if protocol.interrupted_ranks(e):  # an interrupted rank raised at once: so do its
            raise  # peers, or their next calls would no longer pair with its
        return saver.submit(target, _raiser(e), None)
    started = process_of(saver.area) is not None
    nbytes = _staged_bytes(planned)
    chosen = choose_writer(writer, opts.format, target, nbytes, started, opts.storage_options)
    try:
        writer, wrap = attach(saver.area, chosen, f"async_save to {target}", writer == "auto")
    except WriterProcessError as e:  # this rank's alone: carried to every rank's write
        writer, wrap = chosen, None
        planned.error = planned.error or e
    used = _WriterUsed()
    if wrap is not None:
        wrap = functools.partial(wrap, on_fallback=used.fell_back)
    job = functools.partial(
        _write_behind, saver.group, cache, planned, target, opts, before_write, wrap
    )
    staging = _Staging(planned, saver.area, target, verify_staging, not defer_stream_wait)
    buffers, later = None, None
    try:
        if planned.error is None:
            staging.begin()
            if background_staging:
                later = staging.behind
            else:
                buffers = staging.finish()
    except Exception as e:  # this rank's alone: carried into the write's first step
        planned.error = staging.failed(e)
    except BaseException as e:  # interrupted: the peers' background saves fail, not wait
        planned.error = DistributedCheckpointError(
            f"async_save to {target} was interrupted while staging ({type(e).__name__})"
        )
        planned.error.__cause__ = e
        # unreported, as on the peers: the next async_save that waits for it raises it here too
        behind = saver.submit(target, job, None, writer=writer)
        e.dcpbridge_pending = behind  # type: ignore[attr-defined]  # see ``interrupted_save``
        raise
    return used.bind(saver.submit(target, job, buffers, stage=later, writer=writer))


class _WriterUsed:
    """Sets an async save's ``handle.writer`` to "thread" when its writer process falls back
    to the thread writer: on the writer thread, before or after the handle exists."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handle: AsyncSaveHandle | None = None
        self._fell_back = False

    def fell_back(self) -> None:
        with self._lock:
            self._fell_back = True
            if self._handle is not None:
                self._handle.writer = "thread"

    def bind(self, handle: AsyncSaveHandle) -> AsyncSaveHandle:
        with self._lock:
            self._handle = handle
            if self._fell_back:
                handle.writer = "thread"
        return handle


def _staged_bytes(planned: PlannedSave) -> int:
    """The tensor bytes this rank stages for ``planned`` (0 if its planning failed)."""
    if planned.error is not None or planned.owners is None:
        return 0
    return stats.tensor_bytes(tensor_writes(planned.shards, planned.owners))


def _write_behind(
    group: Group,
    cache: SaveCache,
    planned: PlannedSave,
    target: str,
    options: SaveOptions,
    before_write: Callable[[], None] | None,
    wrap: Callable[[StorageWriter], StorageWriter] | None = None,
) -> None:
    """The background half of ``async_save``: ``before_write`` on the coordinator, then the
    write (each step collective over ``group``, the saver's own)."""
    if before_write is not None:
        protocol.on_coordinator(group, "prepare", before_write)
    write_planned(group, cache, planned, target, options, wrap)


def interrupted_save(error: BaseException) -> AsyncSaveHandle | None:
    """The save an ``async_save`` interrupted while staging left behind (its peers' saves fail
    in the background, and their next call that waits for it raises that): None if none."""
    handle = getattr(error, "dcpbridge_pending", None)
    return handle if isinstance(handle, AsyncSaveHandle) else None


def _raiser(error: BaseException) -> Any:
    def job() -> None:
        raise error

    return job


def split_for_save(sharded_state_dict: ShardedStateDict) -> tuple[Any, list[Any]]:
    """(common state, shards) in Megatron's split: factories built, non-persistent objects
    dropped, Megatron-Core's own types taken as dcpbridge's; sharded data that would be
    pickled in the common state (DTensors, ...) is refused."""
    tree = apply_factories(normalize(sharded_state_dict))
    _, tree = extract(tree, is_nonpersistent)
    sharded, common = extract(tree, is_sharded)
    common = fill_holes(common) if common is not HOLE else {}
    for leaf in iter_leaves(common):
        kind = leaf_kind(leaf.value)
        if kind not in ("object", "tensor"):
            raise refuse(leaf.path, leaf.value, kind)
    return common, leaves(sharded)
