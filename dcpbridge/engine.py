"""Drives planners and storage through DCP's save/load protocol, raising failures on every rank.

The steps and their order are DCP's (``state_dict_saver``/``state_dict_loader``); the
differences are that any rank's failure is re-raised on every rank as an ordinary
``Exception`` naming the rank, and that plans travel without the items the coordinator does
not change (load plans, and save plans on the way back).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from dcpbridge.collectives import Group
from dcpbridge.errors import CheckpointError, DistributedCheckpointError

T = TypeVar("T")


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
        trace = "" if isinstance(exc, CheckpointError) else traceback.format_exc()
        return Failure(rank, step, portable, type(exc).__name__, str(exc), trace)


def attempt(rank: int, step: str, fn: Callable[[], T]) -> T | Failure:
    try:
        return fn()
    except Exception as e:
        return Failure.capture(rank, step, e)


def raise_failures(failures: list[Failure], own: Any = None, *, world_size: int = 2) -> None:
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


def _check(reply: Any, own: Any, world_size: int) -> None:
    if isinstance(reply, list) and reply and all(isinstance(f, Failure) for f in reply):
        raise_failures(reply, own, world_size=world_size)


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
    _check(reply, local, group.size)
    return reply


def run_save(
    state_dict: Any, planner: SavePlanner, writer: StorageWriter, group: Group
) -> Metadata | None:
    """Plan, validate, write and commit; returns the metadata on the coordinator."""

    def local_step() -> SavePlan:
        planner.set_up_planner(
            state_dict=state_dict,
            storage_meta=writer.storage_meta(),
            is_coordinator=group.is_coordinator,
        )
        writer.set_up_storage_writer(group.is_coordinator, rank=group.rank)
        return writer.prepare_local_plan(planner.create_local_plan())

    local = attempt(group.rank, "plan", local_step)
    metadata: Metadata | None = None

    def global_step(plans: list[SavePlan]) -> list[Any]:
        nonlocal metadata
        plans, metadata = planner.create_global_plan(plans)
        plans = writer.prepare_global_plan(plans)
        return [(p.storage_data, p.planner_data) for p in plans]

    storage_data, planner_data = _coordinate(group, local, global_step, "plan")
    assert isinstance(local, SavePlan)
    plan = dataclasses.replace(local, storage_data=storage_data, planner_data=planner_data)

    def write_step() -> list[Any]:
        return writer.write_data(planner.finish_plan(plan), planner).wait()

    results = attempt(group.rank, "write", write_step)
    gathered = group.gather(results)
    outcome: list[Failure] | None = None
    if gathered is not None:
        outcome = [x for x in gathered if isinstance(x, Failure)]
        if not outcome:
            try:
                assert metadata is not None
                writer.finish(metadata=metadata, results=gathered)
            except Exception as e:
                outcome = [Failure.capture(group.rank, "commit", e)]
    outcome = group.broadcast(outcome)
    if outcome:
        raise_failures(outcome, results, world_size=group.size)
    return metadata


def run_load(state_dict: Any, planner: LoadPlanner, reader: StorageReader, group: Group) -> None:
    """Read metadata, plan reads (with the coordinator's global step), read, confirm on all."""

    def local_step() -> LoadPlan:
        metadata = reader.read_metadata()
        planner.set_up_planner(state_dict, metadata, group.is_coordinator)
        reader.set_up_storage_reader(metadata, group.is_coordinator)
        return reader.prepare_local_plan(planner.create_local_plan())

    local = attempt(group.rank, "plan", local_step)
    sent = dataclasses.replace(local, items=[]) if isinstance(local, LoadPlan) else local

    def global_step(plans: list[LoadPlan]) -> list[Any]:
        plans = reader.prepare_global_plan(planner.create_global_plan(plans))
        return [(p.storage_data, p.planner_data) for p in plans]

    storage_data, planner_data = _coordinate(group, sent, global_step, "plan")
    assert isinstance(local, LoadPlan)
    plan = dataclasses.replace(local, storage_data=storage_data, planner_data=planner_data)

    def read_step() -> None:
        reader.read_data(planner.finish_plan(plan), planner).wait()

    done = attempt(group.rank, "read", read_step)
    statuses = group.all_gather(done)
    raise_failures([s for s in statuses if isinstance(s, Failure)], done, world_size=group.size)
