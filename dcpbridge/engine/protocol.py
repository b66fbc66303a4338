"""What happens when a rank fails: every collective step carries each rank's exception to all.

Four step shapes (torch's ``_DistWrapper.reduce_scatter`` / ``all_reduce`` are the model):

- ``decide``: gather every rank's local result, decide on the coordinator, scatter each rank
  its reply (planning);
- ``commit``: gather every rank's local result, commit on the coordinator, broadcast the
  coordinator's result (publishing a checkpoint);
- ``agree``: all-gather, so every rank sees every rank's value (votes, shard exchanges);
- ``on_coordinator``: the coordinator works alone, the others learn whether it failed.

Local work runs inside the step, so a rank that fails still takes part in the collective and
no rank is left waiting. When any rank's work (or the coordinator's) raised, every rank raises
one exception naming each failed rank: the failures' own class when all failed alike (else
``DistributedCheckpointError``), with this rank's exception, or the first failed rank's, as
``__cause__``. A group of one raises its exception unchanged, and so does a rank whose work
was interrupted (``KeyboardInterrupt``, ``SystemExit``): its peers raise
``DistributedCheckpointError`` instead of waiting for it.
"""

from __future__ import annotations

import contextlib
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dcpbridge.engine.collectives import Group
from dcpbridge.errors import CheckpointError, DistributedCheckpointError

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Failure:
    """One rank's exception, in a form that survives pickling between processes."""

    rank: int
    step: str
    exc: BaseException | None  # None when the exception itself cannot be pickled
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


@dataclass(frozen=True)
class _Failed:
    """What the coordinator sends instead of replies when the step failed somewhere."""

    failures: list[Failure]


def _run(group: Group, step: str, work: Callable[[], T]) -> T | Failure:
    try:
        return work()
    except BaseException as e:  # an interrupt too: the peers must not wait for this rank
        return Failure.capture(group.rank, step, e)


def _failures(values: list[Any]) -> list[Failure]:
    return [v for v in values if isinstance(v, Failure)]


def raise_failures(failures: list[Failure], mine: Any, *, world_size: int) -> None:
    """Raise one exception describing every failed rank (``mine``: this rank's own result)."""
    if not failures:
        return
    own = mine.exc if isinstance(mine, Failure) else None
    if own is not None and not isinstance(own, Exception):
        raise own  # this rank was interrupted (KeyboardInterrupt...): its own, unchanged
    if world_size == 1 and len(failures) == 1 and failures[0].exc is not None:
        raise failures[0].exc  # a group of one: its rank failed (``failed_ranks``: None)
    by_message: dict[tuple[str, str], list[Failure]] = {}
    for f in failures:
        by_message.setdefault((f.type_name, f.message), []).append(f)
    lines = []
    for (type_name, message), alike in by_message.items():
        ranks = sorted({f.rank for f in alike})
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        prefix = "" if isinstance(alike[0].exc, CheckpointError) else f"{type_name}: "
        lines.append(f"{who}: {prefix}{message}")
    traces = [f"--- rank {f.rank} traceback ---\n{f.trace}" for f in failures if f.trace][:2]
    text = "\n".join(lines + traces)
    error: BaseException = DistributedCheckpointError(text)
    if len({type(f.exc) for f in failures}) == 1 and isinstance(failures[0].exc, Exception):
        with contextlib.suppress(Exception):
            error = type(failures[0].exc)(text)
    error.failed_ranks = frozenset(f.rank for f in failures)  # type: ignore[attr-defined]
    error.interrupted_ranks = frozenset(  # type: ignore[attr-defined]
        f.rank for f in failures if f.exc is not None and not isinstance(f.exc, Exception)
    )
    raise error from own or next((f.exc for f in failures if f.exc is not None), None)


def interrupted_ranks(error: BaseException) -> frozenset[int]:
    """The ranks of the step that raised ``error`` whose work was interrupted (a
    ``KeyboardInterrupt``, ``SystemExit``...): they raised it at once, unchanged."""
    return getattr(error, "interrupted_ranks", frozenset())


def failed_ranks(error: BaseException) -> frozenset[int] | None:
    """The ranks whose work failed in the step that raised ``error`` (None: not known, as in a
    group of one, where its only rank failed)."""
    return getattr(error, "failed_ranks", None)


def decide(
    group: Group,
    step: str,
    local: Callable[[], T],
    decide_all: Callable[[list[T]], list[R]],
) -> R:
    """Gather ``local()`` of every rank, run ``decide_all`` on the coordinator, scatter its
    replies (one per rank); raises on every rank if any of it failed."""
    mine = _run(group, step, local)
    gathered = group.gather(mine)
    replies: list[Any] | None = None
    if gathered is not None:
        failures = _failures(gathered)
        if not failures:
            decided = _run(group, step, lambda: decide_all(gathered))
            failures = [decided] if isinstance(decided, Failure) else []
            replies = None if failures else decided
            mine = decided if failures else mine  # the coordinator's own failure
        if failures:
            replies = [_Failed(failures)] * group.size
    reply = group.scatter(replies)
    if isinstance(reply, _Failed):
        raise_failures(reply.failures, mine, world_size=group.size)
    return reply


def commit(
    group: Group, step: str, local: Callable[[], T], commit_all: Callable[[list[T]], R]
) -> R:
    """Gather ``local()`` of every rank, run ``commit_all`` on the coordinator only if all
    succeeded, and broadcast its result; raises on every rank if any of it failed."""
    mine = _run(group, step, local)
    gathered = group.gather(mine)
    outcome: Any = None
    if gathered is not None:
        failures = _failures(gathered)
        if not failures:
            done = _run(group, "commit", lambda: commit_all(gathered))
            failures = [done] if isinstance(done, Failure) else []
            outcome = None if failures else done
            mine = done if failures else mine  # the coordinator's own failure
        if failures:
            outcome = _Failed(failures)
    outcome = group.broadcast(outcome)
    if isinstance(outcome, _Failed):
        raise_failures(outcome.failures, mine, world_size=group.size)
    return outcome


def agree(group: Group, step: str, local: Callable[[], T]) -> list[T]:
    """Every rank's ``local()``, on every rank (one all-gather); raises on every rank if any
    rank's failed."""
    mine = _run(group, step, local)
    everyone = group.all_gather(mine)
    raise_failures(_failures(everyone), mine, world_size=group.size)
    return everyone


def on_coordinator(group: Group, step: str, work: Callable[[], T]) -> T | None:
    """``work()`` on the coordinator alone (None elsewhere); raises on every rank if it failed."""
    mine = _run(group, step, work) if group.is_coordinator else None
    failure = group.broadcast(mine if isinstance(mine, Failure) else None)
    if failure is not None:
        raise_failures([failure], mine, world_size=group.size)
    return mine
