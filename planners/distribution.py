"""Who writes (or reads) a shard: the pure decisions behind ``dcpbridge.engine.ownership``.

A shard is written by its main replica, unless a parallelization group spreads the shards
several of its ranks hold over them (``distribute``); the common state by the coordinator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dcpbridge.planners.errors import ShardingValidationError, key_list
from dcpbridge.planners.protocol import ReplicaId

ShardId = Hashable


def is_main_replica(replica_id: ReplicaId) -> bool:
    """The main replica (0, or all zeros) is the one that writes a shard."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class WhoWrites(Protocol):
    """What the save planner asks before it plans a write on this rank."""

    def writes(self, shard: Any) -> bool:
        """Whether this rank writes ``shard`` (a tensor or object shard)."""
        ...

    def writes_common(self) -> bool:
        """Whether this rank writes the common (non-sharded) state."""
        ...


@dataclass(frozen=True, slots=True)
class MainReplicasWrite:
    """The default: main replicas write their shards, the coordinator the common state."""

    coordinator: bool

    def writes(self, shard: Any) -> bool:
        return is_main_replica(shard.replica_id)

    def writes_common(self) -> bool:
        return self.coordinator


@dataclass(frozen=True, slots=True)
class Holding:
    """A shard one rank holds: its identity, its size, and whether it is a main replica."""

    shard: ShardId
    nbytes: int
    main: bool = True


def holders(holdings: Sequence[Sequence[Holding]]) -> dict[ShardId, list[int]]:
    """The ranks holding each shard, ascending and without repeats."""
    out: dict[ShardId, list[int]] = {}
    for rank, held in enumerate(holdings):
        for h in held:
            ranks = out.setdefault(h.shard, [])
            if not ranks or ranks[-1] != rank:
                ranks.append(rank)
    return out


def keep_one_main(
    holdings: Sequence[Sequence[Holding]], copies: Mapping[ShardId, Sequence[int]]
) -> list[list[Holding]]:
    """``holdings`` where each shard of ``copies`` (its main holders, lowest rank first) stays
    a main replica on its first holder only (copies proven equal: any one may be written)."""
    return [
        [
            dataclasses.replace(h, main=False)
            if h.main and h.shard in copies and copies[h.shard][0] != rank
            else h
            for h in held
        ]
        for rank, held in enumerate(holdings)
    ]


def mains_held_twice(holdings: Sequence[Sequence[Holding]]) -> dict[ShardId, list[int]]:
    """Each shard that more than one rank holds as its main replica, with those ranks."""
    mains = holders([[h for h in held if h.main] for held in holdings])
    return {shard: ranks for shard, ranks in mains.items() if len(ranks) > 1}


def check_single_main(twice: Mapping[ShardId, list[int]]) -> None:
    """Raise ``ShardingValidationError`` naming every shard of ``twice`` (``mains_held_twice``)
    that more than one rank holds as its main replica: ``distribute`` would keep one of those
    copies and drop the others."""
    if not twice:
        return
    items = sorted(twice.items(), key=_by_order)
    listed = key_list(_describe(shard, ranks) for shard, ranks in items)
    raise ShardingValidationError(
        f"{len(items)} shard(s) with more than one main replica (replica_id 0) in the "
        f"parallelization group: {listed}; exactly one holder of a shard may be its main replica "
        "(a DTensor's replicas are its Replicate mesh dimensions only)"
    )


def _describe(shard: ShardId, ranks: list[int]) -> str:
    if isinstance(shard, tuple) and len(shard) in (2, 3):  # (key, global offset[, size])
        return f"{shard[0]!r} at offset {shard[1]} (ranks {ranks})"
    return f"{shard!r} (ranks {ranks})"


def _by_order(item: tuple[ShardId, list[int]]) -> tuple[str, str]:
    return _order(item[0])


def distribute(
    holdings: Sequence[Sequence[Holding]], *, only_main: bool = True
) -> dict[ShardId, int]:
    """Assign each shard to one of the ranks holding it, balancing bytes per rank.

    Deterministic greedy: shards held by the fewest ranks go first (they have the least
    choice), larger before smaller, ties by shard id; each goes to its least-loaded holder
    (lowest rank on ties). With ``only_main``, only shards some rank of the group holds as a
    main replica are assigned — the ones this group would save at all.
    """
    who = holders(holdings)
    size: dict[ShardId, int] = {}
    wanted: set[ShardId] = set()
    for held in holdings:
        for h in held:
            size[h.shard] = max(size.get(h.shard, 0), h.nbytes)
            if h.main or not only_main:
                wanted.add(h.shard)
    load = [0] * len(holdings)
    owner: dict[ShardId, int] = {}
    for shard in sorted(wanted, key=lambda s: (len(who[s]), -size[s], _order(s))):
        rank = min(who[shard], key=lambda r: (load[r], r))
        owner[shard] = rank
        load[rank] += size[shard]
    return owner


def _order(shard: ShardId) -> tuple[str, str]:
    """A total order on shard ids of mixed types (``repr`` is stable for tuples of str/int)."""
    return type(shard).__name__, repr(shard)
