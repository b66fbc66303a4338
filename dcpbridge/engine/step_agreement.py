"""Which step a manager's ranks resume from: the same on every rank, and one every rank sees
committed (a stale listing on one rank, such as NFS's, must not make ranks load different
steps)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from dcpbridge.engine import protocol
from dcpbridge.engine.collectives import Group
from dcpbridge.errors import DistributedCheckpointError, InvalidArgumentError, NotACheckpointError

log = logging.getLogger("dcpbridge")


def choose_step(
    group: Group,
    step: int | None,
    root: str,
    complete: Callable[[], list[int]],
    committed: Callable[[int], bool],
    step_url: Callable[[int], str],
) -> int:
    """The step a load takes on every rank: ``step`` (the same on every rank), else the newest
    complete one (rank 0's ``complete()``) that every rank sees ``committed`` (``root``: the
    manager's, named in errors)."""

    def choose(asked: list[int | None]) -> list[list[int]]:
        if any(a != step for a in asked):
            raise InvalidArgumentError(
                "CheckpointManager.load() was asked for different steps: "
                + ", ".join(f"rank {r}: {a}" for r, a in enumerate(asked))
            )
        steps = complete()
        if step is None and not steps:
            raise NotACheckpointError(f"{root}: no complete checkpoint (step_*) to load")
        if step is not None and step not in steps:
            raise NotACheckpointError(
                f"{step_url(step)}: no complete checkpoint of step {step} "
                f"(complete steps: {steps[-5:]})"
            )
        return [steps if step is None else [step]] * len(asked)

    chosen = protocol.decide(group, "choose step", lambda: step, choose)
    if step is not None:
        return step
    newest = agreed_newest(group, chosen, complete, committed, root)
    assert newest is not None  # rank 0 saw a complete step: agreed on one, or raised
    return newest


def agreed_newest(
    group: Group,
    steps: list[int],
    complete: Callable[[], list[int]],
    committed: Callable[[int], bool],
    root: str,
) -> int | None:
    """The newest of rank 0's complete ``steps`` that every rank sees ``committed``, alike on
    every rank (each rank looks for commit files newest first: one lookup and one all-gather
    where all see rank 0's newest); raises where some rank sees none of them (``complete``:
    this rank's own listing, named in that error)."""
    if group.size == 1 or not steps:
        return steps[-1] if steps else None
    candidates, first = steps, None
    while True:
        look = functools.partial(_newest_seen, group, candidates, complete, committed)
        seen = protocol.agree(group, "newest step", look)
        found = [s for s, _ in seen]
        first = first or found
        if None in found:
            r = found.index(None)
            own = "none" if seen[r][1] is None else f"step {seen[r][1]}"
            raise DistributedCheckpointError(
                f"{root}: no complete checkpoint that every rank sees: rank 0 sees "
                f"step {steps[-1]} as the newest, rank {r} none of steps "
                f"{candidates[-5:]} (its newest: {own}); a stale listing (NFS), or ranks "
                "that see different storage?"
            )
        low = min(s for s in found if s is not None)
        if all(s == low for s in found):
            if low != steps[-1]:
                log.warning(
                    "dcpbridge: ranks %s do not see step %d of %s committed (a stale "
                    "listing?): the ranks take step %d, the newest all of them see",
                    [r for r, s in enumerate(first) if s != steps[-1]],
                    steps[-1],
                    root,
                    low,
                )
            return low
        candidates = [s for s in candidates if s <= low]


def _newest_seen(
    group: Group,
    candidates: list[int],
    complete: Callable[[], list[int]],
    committed: Callable[[int], bool],
) -> tuple[int | None, int | None]:
    """The newest of rank 0's ``candidates`` whose commit file this rank sees (rank 0: the
    newest, which it listed), and, where none, this rank's own newest complete step."""
    if group.is_coordinator:
        return candidates[-1], None
    for step in reversed(candidates):
        if committed(step):
            return step, None
    own = complete()
    return None, own[-1] if own else None
