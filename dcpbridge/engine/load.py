"""``load`` with Megatron-Core's meaning, from any sharded format, plus the one-process readers.

A load sorts the template (``dcpbridge.model.intake.for_load``), with ``fully_parallel``
splits it into boxes this rank reads and boxes it receives (``dcpbridge.engine.ownership``),
opens the checkpoint once (``dcpbridge.formats.checkpoint.open_checkpoint``) inside DCP's first
load step, and hands the result back in the template's structure.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.storage import StorageReader

from dcpbridge.engine import fully_parallel as fp
from dcpbridge.engine import protocol
from dcpbridge.engine.bridge import BridgeLoadPlanner
from dcpbridge.engine.collectives import Group
from dcpbridge.engine.drive import read_planned, run_load
from dcpbridge.engine.gc_pause import gc_paused
from dcpbridge.engine.ownership import read_owners
from dcpbridge.engine.save import parallel_group
from dcpbridge.engine.strict import Policy, decide, load_result, parse_strict
from dcpbridge.errors import InvalidArgumentError
from dcpbridge.formats.checkpoint import Checkpoint, Format, open_checkpoint
from dcpbridge.formats.config import resolve_storage_options
from dcpbridge.formats.metadata import load_tensors_metadata
from dcpbridge.model.intake import LoadParts, for_load
from dcpbridge.model.mapping import (
    LocalNonpersistentObject,
    ShardedStateDict,
    StateDict,
)
from dcpbridge.model.per_rank import (
    RESHARD_MODES,
    DataStateDroppedWarning,
    Dropped,
    PerRankState,
    check_per_rank,
    count_requests,
    drop_message,
)
from dcpbridge.model.stateful import load_into, state_dicts
from dcpbridge.planners import StrictMode
from dcpbridge.storage import FsspecCheckpointReader

PathLike = str | os.PathLike[str]


@gc_paused
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
    reshard_data_state: str = "raise",
) -> StateDict | tuple[StateDict, set[str], set[str]]:
    """Load into a template state dict, in any parallel layout, from any format it reads.

    Tensor-like leaves are requests, filled in place: dcpbridge's and Megatron-Core's
    ShardedTensors (returned as their tensors), DTensors, torch ShardedTensors and plain
    tensors (returned as the same objects). ShardedObjects are replaced by their objects,
    factories merged, LocalNonpersistentObjects unwrapped. Plain values are common state, as
    in Megatron: the result holds the checkpoint's whole common state, template values replaced
    by the stored ones. ``strict`` takes dcpbridge's and Megatron's policies
    (``dcpbridge.planners.strict``); ``"return_all"`` returns Megatron's ``(state_dict, missing,
    unexpected)``. With ``fully_parallel``, a box several ranks of ``parallelization_group``
    need is read from storage by one of them and sent to the others. Plain DCP and
    Megatron-Core torch_dist directories load too: their pickled ``.metadata`` is read without
    running code (DCP's own classes only; ``allow_pickle=True`` for metadata that needs others,
    and for objects ``weights_only`` loading refuses); ``profile`` names a storage profile of
    the configuration file. Top-level ``PerRankState`` values saved by another number of ranks
    raise ``DataLayoutError``, or with ``reshard_data_state="drop"`` start fresh with a
    ``DataStateDroppedWarning``.
    """
    group = Group.resolve(process_group)
    return _load(
        sharded_state_dict,
        checkpoint_dir,
        group,
        strict=parse_strict(strict),
        storage_options=resolve_storage_options(storage_options, profile, url=checkpoint_dir),
        allow_pickle=allow_pickle,
        allow_dtype_cast=allow_dtype_cast,
        verify_checksums=verify_checksums,
        thread_count=thread_count,
        parallel=parallel_group(fully_parallel, parallelization_group, group),
        reshard_data_state=reshard_data_state,
    )


def load_opened(
    template: ShardedStateDict,
    checkpoint: Checkpoint,
    group: Group,
    *,
    strict: Policy,
    allow_pickle: bool = False,
    allow_dtype_cast: bool = False,
    thread_count: int = 4,
    reshard_data_state: str = "raise",
) -> Any:
    """``load`` from a checkpoint the caller opened (the local tier's peer view) over ``group``."""
    return _load(
        template,
        checkpoint,
        group,
        strict=strict,
        storage_options=None,
        allow_pickle=allow_pickle,
        allow_dtype_cast=allow_dtype_cast,
        thread_count=thread_count,
        reshard_data_state=reshard_data_state,
    )


def _load(
    template: ShardedStateDict,
    checkpoint_dir: PathLike | Checkpoint,
    group: Group,
    *,
    strict: Policy,
    storage_options: dict[str, Any] | None,
    allow_pickle: bool,
    allow_dtype_cast: bool = False,
    verify_checksums: bool = True,
    thread_count: int = 4,
    parallel: Group | None = None,
    reshard_data_state: str = "raise",
) -> Any:
    stateful = template
    parts = LoadParts(template)
    error: BaseException | None = None  # raised inside the first load step, on every rank
    warned: list[str] = []  # dropped per-rank states, reported once the load succeeded
    try:
        if reshard_data_state not in RESHARD_MODES:
            raise InvalidArgumentError(
                f"reshard_data_state must be 'raise' or 'drop', got {reshard_data_state!r}"
            )
        if isinstance(template, dict) and any(
            isinstance(v, PerRankState) for v in template.values()
        ):
            if not isinstance(checkpoint_dir, Checkpoint):
                checkpoint_dir = open_checkpoint(
                    checkpoint_dir, storage_options=storage_options, allow_pickle=allow_pickle
                )
            stateful, requests, warned = _per_rank_layout(
                template, checkpoint_dir, reshard_data_state
            )
            template = state_dicts({**stateful, **requests})
        else:
            template = state_dicts(template)
        parts = for_load(template)
    except BaseException as e:  # an interrupt too (a Stateful's state_dict): raised inside the
        error = e  # first load step, where the peers learn of it instead of waiting for it
    share = None
    if parallel is not None:
        exchanged: list[Any] = []  # this rank's exchangeable shards, found once

        def boxes() -> list[Any]:
            exchanged[:] = fp.exchangeable(_or_raise(error, parts.shards))
            return exchanged

        try:
            owners = read_owners(parallel, boxes)
            share = fp.share_load(parallel.rank, owners, parts.shards, exchanged)
        except BaseException as e:  # raised on ``parallel`` only: carried to the whole group
            error = error or e

    checkpoint: Checkpoint | None = None
    planner: BridgeLoadPlanner | None = None

    def prepare() -> tuple[Any, BridgeLoadPlanner, StorageReader]:
        nonlocal checkpoint, planner
        _or_raise(error, None)
        if isinstance(checkpoint_dir, Checkpoint):  # already opened by the caller
            checkpoint = checkpoint_dir
        else:
            checkpoint = open_checkpoint(
                checkpoint_dir, storage_options=storage_options, allow_pickle=allow_pickle
            )
        reader = checkpoint.reader(thread_count=thread_count, verify_checksums=verify_checksums)
        if share is not None:  # boxes storage does not fill as asked: each rank plans its own
            fp.exchanged(share, reader.read_metadata().state_dict_metadata)
            fp.allocate(parallel, share)  # its failure fails the load on every rank
        if isinstance(reader, FsspecCheckpointReader):  # the planner may allocate
            reader.check_ranges()  # common tensors by their recorded sizes
        legacy_common = checkpoint.format == Format.TORCH_DIST
        planner = BridgeLoadPlanner(
            parts,
            share.read if share else parts.shards,
            legacy_common=legacy_common,
            common=checkpoint.read_common() if legacy_common else None,
            strict=strict,
            allow_pickle=allow_pickle,
            allow_dtype_cast=allow_dtype_cast,
        )
        return None, planner, reader

    result: list[Any] = []

    def deliver() -> None:
        assert isinstance(planner, BridgeLoadPlanner) and checkpoint is not None
        result.append(_deliver(planner, checkpoint))

    if share is None:  # handed back inside the read step: a merge_fn failure fails every rank
        run_load(prepare, group, then=deliver)
    else:  # boxes arrive after the read step: one more vote carries a failure to every rank
        run_load(prepare, group)
        assert parallel is not None
        fp.hand_off(parallel, share)
        protocol.agree(group, "hand back", deliver)
    for message in warned:
        warnings.warn(message, DataStateDroppedWarning, stacklevel=2)
    assert planner is not None
    return load_result(planner, load_into(stateful, result[0]))


def load_planned(
    template: Any,
    checkpoint: Checkpoint,
    group: Group,
    planner: BridgeLoadPlanner,
    plan: LoadPlan,
    reader: StorageReader,
) -> Any:
    """``load`` of a plan the caller made with ``planner`` and ``reader`` (set up for
    ``checkpoint``) and checked on every rank in an earlier collective step (the local
    tier's): no planning step, one read step."""
    result: list[Any] = []

    def deliver() -> None:
        result.append(_deliver(planner, checkpoint))

    read_planned(planner, reader, plan, group, metadata=reader.read_metadata(), then=deliver)
    return load_result(planner, load_into(template, result[0]))


def _deliver(planner: BridgeLoadPlanner, checkpoint: Checkpoint) -> Any:
    """The loaded values in the template's structure, run once every read is done inside a
    collective step: a ``merge_fn`` failing on one rank fails the load on every rank instead
    of leaving the others training on. Stateful values get their ``load_state_dict`` after
    that step, as in DCP (user code, which may run collectives of its own)."""
    blob = planner.common  # torch_dist's common.pt, read before planning
    if blob is None:
        blob = checkpoint.common_state(planner.values)  # older checkpoints' one common object
    objects = checkpoint.loaded_objects(planner.shard_objects())
    result, late = planner.result(objects, blob)
    if late:  # plain tensors the common blob of an older checkpoint lacks
        planner.requested_not_stored |= late
        late_error = decide(planner.policy, late, ()).error
        if late_error is not None:
            raise late_error
    return result


def _per_rank_layout(
    template: dict[str, Any], checkpoint: Checkpoint, mode: str
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(``template`` with the per-rank states that start fresh left out of the load, the cells
    the others request, the warnings of the dropped); raises where one cannot follow."""
    states = {k: v for k, v in template.items() if isinstance(v, PerRankState)}
    stored = checkpoint.reader().read_metadata().state_dict_metadata
    dropped = check_per_rank(states, stored, mode)
    out = dict(template)
    for d in dropped:
        out[d.path] = LocalNonpersistentObject(d.state)
    requests = {k: v.request() for k, v in states.items() if k not in {d.path for d in dropped}}
    return out, requests, [drop_message(d, _counts(checkpoint, d)) for d in dropped]


def _counts(checkpoint: Checkpoint, dropped: Dropped) -> dict[str, Any] | None:
    """The sample counts every saved rank recorded for a dropped state (read here alone)."""
    requests = count_requests(dropped)
    if not requests:
        return None
    out = _load(
        requests,
        checkpoint,
        Group(None, 0, 1, 0),
        strict=parse_strict("raise_missing"),
        storage_options=None,
        allow_pickle=checkpoint.allow_pickle,
    )
    return {k: out[k] for k in requests}  # without the common state every load returns


def _or_raise(error: BaseException | None, value: Any) -> Any:
    if error is not None:
        raise error
    return value


def load_common_state_dict(
    checkpoint_dir: PathLike,
    *,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
    profile: str | None = None,
) -> StateDict:
    """The checkpoint's common (non-sharded) state, read in this process alone."""
    options = resolve_storage_options(storage_options, profile, url=checkpoint_dir)
    checkpoint = open_checkpoint(checkpoint_dir, storage_options=options, allow_pickle=allow_pickle)
    return common_state_of(checkpoint, allow_pickle=allow_pickle)


def common_state_of(checkpoint: Checkpoint, *, allow_pickle: bool = False) -> StateDict:
    """The common state of an opened dcpbridge checkpoint, read in this process alone."""
    return _load(
        {},
        checkpoint,
        Group(None, 0, 1, 0),
        strict=parse_strict("raise_missing"),
        storage_options=None,
        allow_pickle=allow_pickle,
    )


def load_plain_tensors(
    checkpoint_dir: PathLike, *, process_group: Any = None, **load_options: Any
) -> StateDict:
    """Every stored tensor, whole, as ``{key: tensor}`` (no common state, no objects).

    A collective ``load`` over ``process_group``: every rank reads every tensor.
    """
    keep = ("storage_options", "profile", "allow_pickle")
    options = {k: v for k, v in load_options.items() if k in keep}
    templates = load_tensors_metadata(checkpoint_dir, **options)
    out = load(templates, checkpoint_dir, process_group=process_group, **load_options)
    return {k: out[k] for k in templates}


def load_common(
    checkpoint_dir: PathLike,
    *,
    storage_options: dict[str, Any] | None = None,
    profile: str | None = None,
    allow_pickle: bool = False,
) -> StateDict:
    """The common (non-sharded) state of a dcpbridge or torch_dist checkpoint ({} for plain
    DCP, which has none), read in this process alone."""
    options = resolve_storage_options(storage_options, profile, url=checkpoint_dir)
    checkpoint = open_checkpoint(checkpoint_dir, storage_options=options, allow_pickle=allow_pickle)
    if checkpoint.format == Format.TORCH_DIST:
        return checkpoint.read_common()
    if checkpoint.format == Format.DCP:
        return {}
    return common_state_of(checkpoint, allow_pickle=allow_pickle)
