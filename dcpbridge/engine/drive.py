"""Drives planners and storage through DCP's save/load protocol, raising failures on every rank.

The steps and their order are DCP's (``state_dict_saver``/``state_dict_loader``); the
differences are that any rank's failure is re-raised on every rank as an ordinary
``Exception`` naming the rank, and that plans travel without the items the coordinator does
not change (load plans, and save plans on the way back).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import pickle
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from dcpbridge.engine import stats
from dcpbridge.engine.collectives import Group
from dcpbridge.errors import CheckpointError, DistributedCheckpointError
from dcpbridge.storage.writer import new_save_id

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Failure:
    """One rank's exception, in a form that survives pickling between processes."""

    rank: int
    step: str
    exc: BaseException | None
    type_name: str
    message: str
    trace: str

    @staticmethod
    def capture(rank: int, step: str, exc: BaseException) -> Failure:
        try:
            pickle.loads(pickle.dumps(exc))
            portable: BaseException | None = exc
        except Exception:
            portable = None
        trace = "" if isinstance(exc, CheckpointError) else "".join(traceback.format_exception(exc))
        return Failure(rank, step, portable, type(exc).__name__, str(exc), trace)


def attempt(rank: int, step: str, fn: Callable[[], T]) -> T | Failure:
    try:
        return fn()
    except Exception as e:
        return Failure.capture(rank, step, e)


def raise_failures(failures: list[Failure], own: Any = None, *, world_size: int) -> None:
    """Raise one exception describing every failed rank (same type if all failed alike)."""
    if not failures:
        return
    if world_size == 1 and len(failures) == 1 and failures[0].exc is not None:
        raise failures[0].exc
    by_message: dict[tuple[str, str], list[Failure]] = {}
    for f in failures:
        by_message.setdefault((f.type_name, f.message), []).append(f)
    lines = []
    for (type_name, message), fs in by_message.items():
        ranks = sorted({f.rank for f in fs})
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        prefix = "" if isinstance(fs[0].exc, CheckpointError) else f"{type_name}: "
        lines.append(f"{who}: {prefix}{message}")
    traces = [f"--- rank {f.rank} traceback ---\n{f.trace}" for f in failures if f.trace][:2]
    text = "\n".join(lines + traces)
    types = {type(f.exc) for f in failures}
    error: BaseException = DistributedCheckpointError(text)
    if len(types) == 1 and failures[0].exc is not None:
        with contextlib.suppress(Exception):
            error = type(failures[0].exc)(text)
    raise error from (own.exc if isinstance(own, Failure) else None)


def _coordinate(
    group: Group, local: Any, global_step: Callable[[list[Any]], list[Any]], step: str
) -> Any:
    """Gather ``local`` results, run ``global_step`` on the coordinator, scatter its replies.

    If any rank failed, or the global step raises, every rank receives the failures.
    """
    gathered = group.gather(local)
    replies = None
    if gathered is not None:
        failures = [x for x in gathered if isinstance(x, Failure)]
        if not failures:
            try:
                replies = global_step(gathered)
            except Exception as e:
                failures = [Failure.capture(group.rank, step, e)]
        if failures:
            replies = [failures] * group.size
    reply = group.scatter(replies)
    if isinstance(reply, list) and reply and all(isinstance(f, Failure) for f in reply):
        raise_failures(reply, local, world_size=group.size)
    return reply


@dataclass(frozen=True)
class CacheEntry:
    """What a full save of one sharded structure decided (replaced whole, never mutated).

    ``structure`` fingerprints the shards, ``planner_data`` is the coordinator's planner reply
    to this rank, ``metadata`` the validated global metadata (coordinator only), ``extra`` a
    caller's own decision for the same structure (e.g. the fully-parallel writer assignment).
    """

    structure: int
    planner_data: Any
    metadata: Metadata | None
    extra: Any = None


@dataclass
class SaveCache:
    """The last full save's decisions, reused while every rank's structure is unchanged."""

    entry: CacheEntry | None = None


@dataclass(frozen=True)
class Reuse:
    """Agreement of all ranks to reuse ``entry`` for a new save named ``save_id``."""

    save_id: str
    entry: CacheEntry


def agree_to_reuse(group: Group, cache: SaveCache, structure: int | None) -> Reuse | None:
    """Whether every rank's structure still matches its cached entry (one tiny all_gather).

    Every rank votes on every save, even with an empty cache, so the decision is collective
    even when background saves fill the caches of different ranks at different times. The
    vote replaces the plan gather, validation and scatter, and any exchange whose result is
    cached in ``entry.extra``.
    """
    entry = cache.entry
    same = entry is not None and structure is not None and structure == entry.structure
    votes = group.all_gather((same, new_save_id()))
    if not all(v for v, _ in votes):
        return None
    assert entry is not None
    return Reuse(votes[0][1], entry)


SavePrepare = Callable[[], tuple[Any, SavePlanner, StorageWriter]]
LoadPrepare = Callable[[], tuple[Any, LoadPlanner, StorageReader]]


def run_save(
    prepare: SavePrepare,
    group: Group,
    cache: SaveCache | None = None,
    *,
    structure: int | None = None,
    reuse: Reuse | None = None,
    extra: Any = None,
) -> Metadata | None:
    """Plan, validate, write and commit; returns the metadata on the coordinator.

    ``prepare`` builds (state dict, planner, writer) inside the first protected step, so a
    rank that fails there fails every rank instead of leaving them in a collective. With
    ``reuse`` (from ``agree_to_reuse``) the plan exchange and the whole-checkpoint validation
    are skipped: the cached answer is reused under the new save id. A successful full save
    of ``structure`` replaces ``cache``'s entry (with ``extra`` attached).
    """
    planner: SavePlanner
    writer: StorageWriter | None = None

    def local_step() -> SavePlan:
        nonlocal planner, writer
        state_dict, planner, writer = prepare()
        planner.set_up_planner(
            state_dict=state_dict,
            storage_meta=writer.storage_meta(),
            is_coordinator=group.is_coordinator,
        )
        writer.set_up_storage_writer(group.is_coordinator, rank=group.rank)
        return writer.prepare_local_plan(planner.create_local_plan())

    def save_writer() -> Any:
        assert writer is not None
        return writer

    started = time.perf_counter()
    local = attempt(group.rank, "plan", local_step)
    metadata: Metadata | None = None
    reply: tuple[Any, Any] | None = None
    if reuse is not None:
        # Every rank voted its structure unchanged: no plan exchange. A rank whose local
        # planning failed reports it through the results gather below.
        if not isinstance(local, Failure):
            storage_data = save_writer().storage_data_for(group.rank, reuse.save_id)
            reply = (storage_data, reuse.entry.planner_data)
        metadata = copy.copy(reuse.entry.metadata)
    else:

        def global_step(plans: list[SavePlan]) -> list[Any]:
            nonlocal metadata
            plans, metadata = planner.create_global_plan(plans)
            plans = save_writer().prepare_global_plan(plans)
            return [(p.storage_data, p.planner_data) for p in plans]

        reply = _coordinate(group, local, global_step, "plan")

    def write_step() -> list[Any]:
        assert isinstance(local, SavePlan) and reply is not None
        storage_data, planner_data = reply
        plan = dataclasses.replace(local, storage_data=storage_data, planner_data=planner_data)
        return save_writer().write_data(planner.finish_plan(plan), planner).wait()

    planned = time.perf_counter()
    results = local if isinstance(local, Failure) else attempt(group.rank, "write", write_step)
    wrote = time.perf_counter()
    gathered = group.gather(results)
    outcome: list[Failure] | None = None
    if gathered is not None:
        outcome = [x for x in gathered if isinstance(x, Failure)]
        if not outcome:
            try:
                assert metadata is not None
                save_writer().finish(metadata=metadata, results=gathered)
            except Exception as e:
                outcome = [Failure.capture(group.rank, "commit", e)]
    outcome = group.broadcast(outcome)
    if outcome:
        abort_save(writer)
        raise_failures(outcome, results, world_size=group.size)
    if gathered is not None:
        phases = {"plan": planned - started, "write": wrote - planned}
        phases["commit"] = time.perf_counter() - wrote
        url = str(getattr(writer, "checkpoint_id", "?"))
        stats.report("saved", url, *stats.written(gathered), phases)
    reusable = hasattr(writer, "storage_data_for")  # a new save id can re-target its plan
    if cache is not None and reuse is None and structure is not None and reusable:
        assert reply is not None
        cache.entry = CacheEntry(structure, reply[1], metadata, extra)
    return metadata


def abort_save(writer: StorageWriter | None) -> None:
    """Let ``writer`` remove what it wrote for a failed save (writers without ``abort`` keep it)."""
    abort = getattr(writer, "abort", None)
    if abort is None:
        return
    try:
        abort()
    except Exception as e:  # the save's own failure is what the caller must see
        log.warning("cleaning up after a failed save failed: %s", e)


def run_load(prepare: LoadPrepare, group: Group) -> tuple[Any, LoadPlanner, StorageReader]:
    """Read metadata, plan reads (with the coordinator's global step), read, confirm on all.

    Returns what ``prepare`` built (state dict, planner, reader), now filled.
    """
    prepared: tuple[Any, LoadPlanner, StorageReader]
    metadata: Metadata | None = None

    def local_step() -> LoadPlan:
        nonlocal prepared, metadata
        prepared = prepare()
        state_dict, planner, reader = prepared
        metadata = reader.read_metadata()
        planner.set_up_planner(state_dict, metadata, group.is_coordinator)
        reader.set_up_storage_reader(metadata, group.is_coordinator)
        return reader.prepare_local_plan(planner.create_local_plan())

    started = time.perf_counter()
    local = attempt(group.rank, "plan", local_step)
    sent = dataclasses.replace(local, items=[]) if isinstance(local, LoadPlan) else local

    def global_step(plans: list[LoadPlan]) -> list[Any]:
        _, planner, reader = prepared
        plans = reader.prepare_global_plan(planner.create_global_plan(plans))
        return [(p.storage_data, p.planner_data) for p in plans]

    storage_data, planner_data = _coordinate(group, sent, global_step, "plan")
    assert isinstance(local, LoadPlan)
    plan = dataclasses.replace(local, storage_data=storage_data, planner_data=planner_data)

    def read_step() -> int:
        _, planner, reader = prepared
        final = planner.finish_plan(plan)
        reader.read_data(final, planner).wait()
        return stats.read_bytes(final, metadata)

    planned = time.perf_counter()
    done = attempt(group.rank, "read", read_step)
    statuses = group.all_gather(done)
    raise_failures([s for s in statuses if isinstance(s, Failure)], done, world_size=group.size)
    url = str(getattr(prepared[2], "checkpoint_id", "?"))
    phases = {"plan": planned - started, "read": time.perf_counter() - planned}
    stats.report("loaded", url, int(done), 0, phases)  # type: ignore[arg-type]
    return prepared
