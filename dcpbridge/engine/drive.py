"""Drives planners and storage through DCP's save/load steps, over failure-carrying collectives.

The steps and their order are DCP's (``state_dict_saver``/``state_dict_loader``); every
collective is a step of ``dcpbridge.engine.protocol``, so any rank's failure is raised on
every rank. Plans travel without the items the coordinator does not change (load plans, and
save plans on the way back), and a save whose structure every rank voted unchanged reuses
the cached plan instead of exchanging it. When the load planner and reader are dcpbridge's
own, requests that are whole stored chunks pass from one to the other as columns
(``dcpbridge.storage.read.whole_reads``) instead of one DCP ``ReadItem`` each.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from dcpbridge.engine import protocol, stats
from dcpbridge.engine.cache import CacheEntry, Reuse, SaveCache
from dcpbridge.engine.collectives import Group
from dcpbridge.errors import CollectiveError

log = logging.getLogger(__name__)

SavePrepare = Callable[[], tuple[Any, SavePlanner, StorageWriter]]
LoadPrepare = Callable[[], tuple[Any, LoadPlanner, StorageReader]]


def run_save(
    prepare: SavePrepare,
    group: Group,
    cache: SaveCache | None = None,
    *,
    structure: int | None = None,
    reuse: Reuse | None = None,
    owners: Any = None,
) -> Metadata | None:
    """Plan, validate, write and commit; returns the metadata on the coordinator.

    ``prepare`` builds (state dict, planner, writer) inside the first step, so a rank that
    fails there fails every rank. With ``reuse`` (from ``cache.agree_to_reuse``) the plan
    exchange and the whole-checkpoint validation are skipped: the cached answer is reused
    under the new save id. A successful full save of ``structure`` replaces ``cache``'s
    entry (with ``owners`` attached).
    """
    planner: SavePlanner
    writer: StorageWriter | None = None
    local: SavePlan
    metadata: Metadata | None = None
    reply: tuple[Any, Any] | None = None

    def plan_locally() -> SavePlan:
        nonlocal planner, writer, local
        state_dict, planner, writer = prepare()
        if reuse is not None and hasattr(planner, "reuse_tensor_writes"):
            planner.reuse_tensor_writes(reuse.entry.tensor_writes)  # same structure: same items
        planner.set_up_planner(
            state_dict=state_dict,
            storage_meta=writer.storage_meta(),
            is_coordinator=group.is_coordinator,
        )
        writer.set_up_storage_writer(group.is_coordinator, rank=group.rank)
        local = writer.prepare_local_plan(planner.create_local_plan())
        return local

    def plan_globally(plans: list[SavePlan]) -> list[tuple[Any, Any]]:
        nonlocal metadata
        assert writer is not None
        plans, metadata = planner.create_global_plan(plans)
        plans = writer.prepare_global_plan(plans)
        return [(p.storage_data, p.planner_data) for p in plans]

    started = time.perf_counter()
    committed = wrote = False
    planned = written = started

    def write() -> list[Any]:
        nonlocal reply, wrote
        if reply is None:  # reused: plan locally, re-targeted at the new save id
            plan_locally()
            assert reuse is not None and writer is not None
            storage_data = writer.storage_data_for(group.rank, reuse.save_id)  # type: ignore[attr-defined]
            reply = (storage_data, reuse.entry.planner_data)
        assert writer is not None
        plan = dataclasses.replace(local, storage_data=reply[0], planner_data=reply[1])
        nonlocal planned, written
        planned = time.perf_counter()
        results = writer.write_data(planner.finish_plan(plan), planner).wait()
        written = time.perf_counter()
        wrote = True
        return results

    def finish(results: list[Any]) -> None:
        nonlocal committed
        assert writer is not None and metadata is not None
        writer.finish(metadata=metadata, results=results)
        committed = True
        phases = {"plan": planned - started, "write": written - planned}
        phases["commit"] = time.perf_counter() - written
        url = str(getattr(writer, "checkpoint_id", "?"))
        stats.report("saved", url, phases, lambda: stats.written(results))

    try:
        if reuse is None:
            reply = protocol.decide(group, "plan", plan_locally, plan_globally)
        else:  # every rank voted its structure unchanged: no plan exchange
            metadata = copy.copy(reuse.entry.metadata)
        protocol.commit(group, "write", write, finish)
    except CollectiveError as e:
        # A rank is gone. The coordinator knows it did not commit; any other rank cannot tell
        # (a slow coordinator may still commit with its files), so it keeps what it wrote
        # unless its own write failed, which no commit can include.
        if (group.is_coordinator and not committed) or not wrote:
            abort_save(writer)
            raise
        raise CollectiveError(_commit_state(e, writer, committed)) from e
    except BaseException as e:  # an interrupted save removes its files too
        abort_save(writer)
        if _every_rank_cleans_up(group, e):
            _remove_made_folder(group, writer)
        raise
    reusable = hasattr(writer, "storage_data_for")  # a new save id can re-target its plan
    if cache is not None and reuse is None and structure is not None and reusable:
        assert reply is not None
        writes = getattr(planner, "tensor_writes", None)
        cache.entry = CacheEntry(structure, reply[1], metadata, owners, writes)
    return metadata


def _commit_state(error: CollectiveError, writer: StorageWriter | None, committed: bool) -> str:
    """``error``'s message with what it means for the checkpoint: the exchange that reports the
    commit failed, so the ranks cannot agree on it; each says what it knows."""
    url = str(getattr(writer, "checkpoint_id", "?"))
    if committed:
        return (
            f"{error}; the checkpoint {url} was committed before that: it is complete, though "
            "the other ranks may report this save as failed"
        )
    return (
        f"{error}; the coordinator may have committed the checkpoint {url} before that (then "
        "it is complete): check it before relying on it or saving it again"
    )


def abort_save(writer: StorageWriter | None) -> None:
    """Let ``writer`` remove what it wrote for a failed save (writers without ``abort`` keep it)."""
    abort = getattr(writer, "abort", None)
    if abort is None:
        return
    try:
        abort()
    except Exception as e:  # the save's own failure is what the caller must see
        log.warning("cleaning up after a failed save failed: %s", e)


def _every_rank_cleans_up(group: Group, error: BaseException) -> bool:
    """Whether every rank of ``group`` is cleaning up after ``error`` now, so all can meet once
    more: a failure the protocol raised on every rank, none of them interrupted (an interrupted
    rank raises at once, and a lost one is gone)."""
    return (
        group.size > 1
        and isinstance(error, Exception)
        and protocol.failed_ranks(error) is not None
        and not protocol.interrupted_ranks(error)
    )


def _remove_made_folder(group: Group, writer: StorageWriter | None) -> None:
    """Once every rank removed its files of the failed save, remove the folder the save made
    (where ``writer`` made it and it is empty): the rank that made it tried as it removed its
    own, when another rank's files may still have been there."""
    try:
        protocol.agree(group, "clean up", lambda: None)
    except CollectiveError as e:  # the save's own failure is what the caller must see
        log.warning("cleaning up after a failed save failed: %s", e)
        return
    remove = getattr(writer, "remove_made_folder", None)
    if remove is not None:
        remove()


def run_load(
    prepare: LoadPrepare, group: Group, then: Callable[[], None] | None = None
) -> tuple[Any, LoadPlanner, StorageReader]:
    """Read metadata, plan reads (with the coordinator's global step), read, confirm on all.

    Returns what ``prepare`` built (state dict, planner, reader), now filled. ``then`` runs
    once the reads are done, inside the read step (see ``read_planned``).
    """
    prepared: tuple[Any, LoadPlanner, StorageReader]
    local: LoadPlan
    reader_metadata: Metadata | None = None

    def plan_locally() -> LoadPlan:
        nonlocal prepared, local, reader_metadata
        prepared = prepare()
        state_dict, planner, reader = prepared
        metadata = reader_metadata = reader.read_metadata()
        planner.set_up_planner(state_dict, metadata, group.is_coordinator)
        reader.set_up_storage_reader(metadata, group.is_coordinator)
        if hasattr(planner, "collect_whole_reads") and getattr(reader, "reads_whole_columns", 0):
            planner.collect_whole_reads = True  # whole chunks as columns: no item per read
        local = reader.prepare_local_plan(planner.create_local_plan())
        return dataclasses.replace(local, items=[])

    def plan_globally(plans: list[LoadPlan]) -> list[tuple[Any, Any]]:
        _, planner, reader = prepared
        plans = reader.prepare_global_plan(planner.create_global_plan(plans))
        return [(p.storage_data, p.planner_data) for p in plans]

    started = time.perf_counter()
    storage_data, planner_data = protocol.decide(group, "plan", plan_locally, plan_globally)
    plan = dataclasses.replace(local, storage_data=storage_data, planner_data=planner_data)

    _, planner, reader = prepared
    read_planned(planner, reader, plan, group, metadata=reader_metadata, started=started, then=then)
    return prepared


def read_planned(
    planner: LoadPlanner,
    reader: StorageReader,
    plan: LoadPlan,
    group: Group,
    *,
    metadata: Metadata | None,
    started: float | None = None,
    then: Callable[[], None] | None = None,
) -> None:
    """Finish ``plan`` (the global step's, or one every rank made and checked in an earlier
    collective step) and read it, confirmed on all (one all-gather); then report the load.

    ``then`` (the caller's hand-back of what was read: factories' ``merge_fn``s) runs after the
    reads inside the same step: its failure on one rank raises on every rank, as a read's does.
    """
    final = plan

    def read() -> None:
        nonlocal final
        final = planner.finish_plan(plan)
        whole = getattr(planner, "whole_reads", None)
        if whole:
            reader.read_whole(whole)  # type: ignore[attr-defined]
        reader.read_data(final, planner).wait()
        after = getattr(planner, "after_reads", None)  # dcpbridge's checks of what was read
        if after is not None:
            after()
        if then is not None:
            then()

    planned = time.perf_counter()
    protocol.agree(group, "read", read)
    url = str(getattr(reader, "checkpoint_id", "?"))
    phases = {
        "plan": 0.0 if started is None else planned - started,  # planned in an earlier step
        "read": time.perf_counter() - planned,
    }

    def measure() -> tuple[int, int]:
        whole = getattr(planner, "whole_reads", None)
        return stats.read_bytes(final, metadata) + (whole.nbytes() if whole else 0), 0

    stats.report("loaded", url, phases, measure)
