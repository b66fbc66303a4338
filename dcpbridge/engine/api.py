"""``save`` / ``load`` with Megatron-Core's meaning, plus metadata-only readers."""

from __future__ import annotations

import functools
import gc
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from dcpbridge.engine import fully_parallel as fp
from dcpbridge.engine import stats
from dcpbridge.engine.async_save import AsyncSaveHandle, AsyncSaver
from dcpbridge.engine.bridge import BridgeLoadPlanner, BridgeSavePlanner
from dcpbridge.engine.collectives import Group
from dcpbridge.engine.drive import Reuse, SaveCache, agree_to_reuse, run_load, run_save
from dcpbridge.engine.staging import stage
from dcpbridge.engine.strict import Policy, decide, load_result, parse_strict
from dcpbridge.errors import InvalidArgumentError
from dcpbridge.model.intake import LoadParts, SaveParts, for_load, for_save, normalize
from dcpbridge.model.mapping import ShardedStateDict, ShardedTensor, StateDict
from dcpbridge.model.state import (
    HOLE,
    apply_factories,
    extract,
    fill_holes,
    is_nonpersistent,
    is_sharded,
    leaves,
)
from dcpbridge.planners import ShardedSavePlanner, StrictMode
from dcpbridge.planners.leaves import refuse
from dcpbridge.planners.protocol import leaf_kind
from dcpbridge.planners.walk import iter_leaves
from dcpbridge.storage import (
    FsspecCheckpointReader,
    FsspecCheckpointWriter,
    read_checkpoint_metadata,
    resolve,
)
from dcpbridge.tools.config import resolve_storage_options
from dcpbridge.tools.formats import Format, LoadSource, open_for_load
from dcpbridge.tools.metadata import tensors_metadata
from dcpbridge.tools.torch_dist import TorchDistSavePlanner, TorchDistWriter

PathLike = str | os.PathLike[str]
F = TypeVar("F", bound=Callable[..., Any])


def _gc_paused(fn: F) -> F:
    """Run ``fn`` with the cyclic GC paused.

    Planning allocates a few objects per shard; with a training process's many live objects
    each triggered full collection is costly (2-3x the CPU time of a 20,000-tensor save or
    load). Those objects are acyclic, so nothing accumulates; the GC resumes afterwards.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return wrapper  # type: ignore[return-value]


# Save caches per (process group and this rank's place in it, validation flag, format): reused
# while the structure holds. The place guards against a new group reusing a freed group's id.
_SAVE_CACHES: dict[tuple[int, int, int, int, bool, str], SaveCache] = {}


def save_cache(group: Group, validate: bool, format: str = "dcpbridge") -> SaveCache:
    """The cache of saves on ``group``; a writer that cannot re-target a plan never fills it."""
    key = (id(group.pg), group.rank, group.size, group.coordinator, validate, format)
    return _SAVE_CACHES.setdefault(key, SaveCache())


def structure_of(shards: list[Any], parallel: Group | None, common: Any = ()) -> int:
    """Fingerprint of what the shards declare (keys, boxes, dtypes, replicas) and of the
    common state's keys, not their data."""
    parts = [
        (
            s.key,
            s.global_shape,
            s.global_offset,
            s.local_shape,
            str(s.dtype),
            s.replica_id,
            s.prepend_axis_num,
        )
        if isinstance(s, ShardedTensor)
        else (s.unique_key, s.replica_id)
        for s in shards
    ]
    where = None if parallel is None else (id(parallel.pg), parallel.rank)
    return hash((tuple(parts), tuple(common), where))


@dataclass
class _PlannedSave:
    """A save after the collective decisions taken before planning (or the error it hit)."""

    parts: SaveParts = field(default_factory=SaveParts)
    shards: list[Any] = field(default_factory=list)
    structure: int | None = None
    reuse: Reuse | None = None
    writers: Any = None
    error: BaseException | None = None


def _plan_save(
    group: Group,
    cache: SaveCache,
    sharded_state_dict: ShardedStateDict,
    fully_parallel: bool,
    parallelization_group: dist.ProcessGroup | None,
) -> _PlannedSave:
    """Collect the shards, vote on reusing the cache and (fully parallel) assign writers.

    Never raises for a local failure: it is kept in ``error`` and raised inside the engine's
    first step, so every rank sees it instead of some ranks waiting in a collective.
    """
    parallel = _parallel_group(fully_parallel, parallelization_group, group)
    planned = _PlannedSave()
    try:
        planned.parts = for_save(sharded_state_dict, group.rank)
        planned.shards = planned.parts.shards
        planned.structure = structure_of(planned.shards, parallel, planned.parts.common_layout())
    except Exception as e:
        planned.error = e
    planned.reuse = agree_to_reuse(group, cache, planned.structure)
    if parallel is not None:
        if planned.reuse is not None:
            planned.writers = planned.reuse.entry.extra
        else:
            try:
                planned.writers = fp.writers(parallel, planned.error or planned.shards)
            except Exception as e:
                planned.error = planned.error or e
        if planned.error is None:
            planned.shards = fp.assign_writers(planned.shards, planned.writers, parallel.rank)
    return planned


@dataclass(frozen=True)
class _WriteOptions:
    """Where and how a save writes; the writer itself is built in the engine's first step."""

    checkpoint_dir: PathLike
    storage_options: dict[str, Any] | None
    profile: str | None
    thread_count: int
    sync_files: bool
    checksums: bool
    validate: bool
    format: str = "dcpbridge"

    def prepare(
        self, planned: _PlannedSave, rank: int
    ) -> tuple[Any, ShardedSavePlanner, StorageWriter]:
        """(state dict, planner, writer) for ``planned``; re-raises its local failure."""
        if planned.error is not None:
            raise planned.error
        options = resolve_storage_options(
            self.storage_options, self.profile, url=self.checkpoint_dir
        )
        parts = planned.parts
        if self.format == "torch_dist":  # the common state, tensors too, goes to common.pt
            writer: StorageWriter = TorchDistWriter(
                self.checkpoint_dir,
                parts.nested_common(),
                storage_options=options,
                thread_count=self.thread_count,
                sync_files=self.sync_files,
            )
            shards = [s for s in planned.shards if s.key not in parts.plain]
            return {"shards": shards}, TorchDistSavePlanner(validate=self.validate), writer
        writer = FsspecCheckpointWriter(
            self.checkpoint_dir,
            storage_options=options,
            thread_count=self.thread_count,
            sync_files=self.sync_files,
            checksums=self.checksums,
        )
        planner = BridgeSavePlanner(
            planned.shards, parts.objects, parts.common_table(), validate=self.validate
        )
        return None, planner, writer


def _run_planned(
    group: Group, cache: SaveCache, planned: _PlannedSave, options: _WriteOptions
) -> None:
    run_save(
        lambda: options.prepare(planned, group.rank),
        group,
        cache,
        structure=planned.structure,
        reuse=planned.reuse,
        extra=planned.writers,
    )


def _parallel_group(
    fully_parallel: bool, parallelization_group: dist.ProcessGroup | None, group: Group
) -> Group | None:
    if not fully_parallel:
        return None
    return Group.resolve(parallelization_group) if parallelization_group is not None else group


@_gc_paused
def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
    storage_options: dict[str, Any] | None = None,
    validate_access_integrity: bool = True,
    fully_parallel: bool = False,
    parallelization_group: dist.ProcessGroup | None = None,
    thread_count: int = 2,
    sync_files: bool = True,
    checksums: bool = True,
    profile: str | None = None,
    format: str = "dcpbridge",
) -> None:
    """Save a sharded state dict; every rank of ``process_group`` calls it.

    ShardedTensors and ShardedObjects are written by their main replica only, factories are
    built first, LocalNonpersistentObjects are skipped, and everything else is common state
    written once by the group's rank 0. With ``fully_parallel``, each shard held by several
    ranks of ``parallelization_group`` (default: ``process_group``) is written by one of them,
    balancing bytes. The checkpoint is committed (``dcpbridge.json`` published) only after
    every rank's data is durable and the sharding validated. ``format="torch_dist"`` writes a
    Megatron-Core torch_dist checkpoint instead (no checksums); ``profile`` names a storage
    profile of the configuration file.
    """
    if format not in ("dcpbridge", "torch_dist"):
        raise InvalidArgumentError(f"format must be 'dcpbridge' or 'torch_dist', got {format!r}")
    group = Group.resolve(process_group)
    cache = save_cache(group, validate_access_integrity, format)
    planned = _plan_save(group, cache, sharded_state_dict, fully_parallel, parallelization_group)
    options = _WriteOptions(
        checkpoint_dir,
        storage_options,
        profile,
        thread_count,
        sync_files,
        checksums,
        validate_access_integrity,
        format,
    )
    _run_planned(group, cache, planned, options)


@_gc_paused
def async_save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
    storage_options: dict[str, Any] | None = None,
    validate_access_integrity: bool = True,
    fully_parallel: bool = False,
    parallelization_group: dist.ProcessGroup | None = None,
    thread_count: int = 2,
    sync_files: bool = True,
    checksums: bool = True,
    max_in_flight: int = 1,
    profile: str | None = None,
) -> AsyncSaveHandle:
    """``save`` that returns once the data is staged in host memory; the rest runs behind.

    The caller may modify its tensors as soon as this returns. The small decisions taken
    before planning (cache vote, fully-parallel writers) are collective and run here; writing
    and the commit run on a background thread whose exchanges never touch the caller's
    process groups. Failures surface on every rank at ``handle.result()`` (or ``wait()``),
    or else at the async_save that has to wait for that save because ``max_in_flight`` saves
    are outstanding (that call raises and starts nothing). A failed save never commits.
    """
    group = Group.resolve(process_group)
    saver = AsyncSaver.for_group(group, max_in_flight)
    saver.wait_for_capacity()
    cache = save_cache(group, validate_access_integrity)
    planned = _plan_save(group, cache, sharded_state_dict, fully_parallel, parallelization_group)
    buffers = None
    if planned.error is None:
        try:
            planned.shards, buffers = stats.timed(
                "staged",
                os.fspath(checkpoint_dir),
                lambda: stage(planned.shards, saver.area),
                lambda out: stats.tensor_bytes(out[0]),
            )
            planned.parts = planned.parts.staged(planned.shards)
        except Exception as e:
            planned.error = e
    options = _WriteOptions(
        checkpoint_dir,
        storage_options,
        profile,
        thread_count,
        sync_files,
        checksums,
        validate_access_integrity,
    )

    def job() -> None:
        _run_planned(saver.group, cache, planned, options)

    return saver.submit(os.fspath(checkpoint_dir), job, buffers)


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


@_gc_paused
def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
    strict: StrictMode | str | Any = StrictMode.RAISE_MISSING,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
    allow_dtype_cast: bool = False,
    verify_checksums: bool = True,
    thread_count: int = 4,
    fully_parallel: bool = False,
    parallelization_group: dist.ProcessGroup | None = None,
    profile: str | None = None,
) -> StateDict | tuple[StateDict, set[str], set[str]]:
    """Load into a template state dict, in any parallel layout, from any format it reads.

    Tensor-like leaves are requests, filled in place: dcpbridge's and Megatron-Core's
    ShardedTensors (returned as their tensors), DTensors, torch ShardedTensors and plain
    tensors (returned as the same objects). ShardedObjects are replaced by their objects,
    factories merged, LocalNonpersistentObjects unwrapped. Plain values are common state, as
    in Megatron: the result holds the checkpoint's whole common state, template values replaced
    by the stored ones. ``strict`` takes dcpbridge's and Megatron's policies
    (``dcpbridge.engine.strict``); ``"return_all"`` returns Megatron's ``(state_dict, missing,
    unexpected)``. With ``fully_parallel``, a box several ranks of ``parallelization_group``
    need is read from dcpbridge.storage by one of them and sent to the others. Plain DCP and Megatron-Core
    torch_dist directories load too, with ``allow_pickle=True`` (their metadata is a pickle);
    ``profile`` names a storage profile of the configuration file.
    """
    return _load(
        sharded_state_dict,
        checkpoint_dir,
        Group.resolve(process_group),
        strict=parse_strict(strict),
        storage_options=resolve_storage_options(storage_options, profile, url=checkpoint_dir),
        allow_pickle=allow_pickle,
        allow_dtype_cast=allow_dtype_cast,
        verify_checksums=verify_checksums,
        thread_count=thread_count,
        fully_parallel=fully_parallel,
        parallelization_group=parallelization_group,
    )


def _load(
    template: ShardedStateDict,
    checkpoint_dir: PathLike,
    group: Group,
    *,
    strict: Policy,
    storage_options: dict[str, Any] | None,
    allow_pickle: bool,
    allow_dtype_cast: bool = False,
    verify_checksums: bool = True,
    thread_count: int = 4,
    fully_parallel: bool = False,
    parallelization_group: dist.ProcessGroup | None = None,
) -> Any:
    parallel = _parallel_group(fully_parallel, parallelization_group, group)
    parts = LoadParts(template)
    error: BaseException | None = None
    try:
        parts = for_load(template)
    except Exception as e:  # raised inside the engine's first step, on every rank
        error = e
    share = None
    if parallel is not None:
        try:
            share = fp.share_load(parallel, error or parts.shards)
        except Exception as e:
            error = error or e

    source: LoadSource | None = None

    def prepare() -> tuple[Any, BridgeLoadPlanner, StorageReader]:
        nonlocal source
        if error is not None:
            raise error
        source = open_for_load(
            checkpoint_dir,
            storage_options=storage_options,
            allow_pickle=allow_pickle,
            thread_count=thread_count,
            verify_checksums=verify_checksums,
        )
        if isinstance(source.reader, FsspecCheckpointReader):  # the planner may allocate
            source.reader.check_ranges()  # common tensors by their recorded sizes
        planner = BridgeLoadPlanner(
            parts,
            share.read if share else parts.shards,
            legacy_common=source.format == Format.TORCH_DIST,
            strict=strict,
            allow_pickle=allow_pickle,
            allow_dtype_cast=allow_dtype_cast,
        )
        return None, planner, source.reader

    _, planner, _ = run_load(prepare, group)
    assert isinstance(planner, BridgeLoadPlanner) and source is not None
    if share is not None and parallel is not None:
        fp.hand_off(parallel, share)
    blob = source.common_state(planner.values)  # older checkpoints' one common object
    objects = source.objects(planner.shard_objects())
    result, late = planner.result(objects, blob)
    if late:  # plain tensors the common blob of an older checkpoint lacks
        planner.requested_not_stored |= late
        error = decide(strict, late, ()).error
        if error is not None:
            raise error
    return load_result(planner, result)


def load_tensors_metadata(
    checkpoint_dir: PathLike,
    *,
    storage_options: dict[str, Any] | None = None,
    profile: str | None = None,
) -> dict[str, ShardedTensor]:
    """Each stored tensor as a whole-tensor ShardedTensor on the meta device (no process group)."""
    options = resolve_storage_options(storage_options, profile, url=checkpoint_dir)
    return tensors_metadata(read_checkpoint_metadata(resolve(checkpoint_dir, options)))


def load_common_state_dict(
    checkpoint_dir: PathLike,
    *,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
    profile: str | None = None,
) -> StateDict:
    """The checkpoint's common (non-sharded) state, read in this process alone."""
    return _load(
        {},
        checkpoint_dir,
        Group(None, 0, 1, 0),
        strict=parse_strict("raise_missing"),
        storage_options=resolve_storage_options(storage_options, profile, url=checkpoint_dir),
        allow_pickle=allow_pickle,
    )
