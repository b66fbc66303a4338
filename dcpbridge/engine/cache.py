"""What a process keeps per process group between saves, and when a save may reuse it.

State is held weakly by process group: destroying a group drops what was kept for it, and a
new group that happens to reuse a freed group's ``id`` never sees it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from dcpbridge.engine import protocol
from dcpbridge.engine.collectives import Group
from dcpbridge.model.mapping import ShardedTensor
from dcpbridge.storage.write.writer import new_save_id

V = TypeVar("V")


class PerGroup(Generic[V]):
    """Values kept per (process group, key), dropped with the group; single processes
    (no group) share one small table."""

    def __init__(self) -> None:
        self._by_group: weakref.WeakKeyDictionary[Any, dict[Hashable, V]] = (
            weakref.WeakKeyDictionary()
        )
        self._alone: dict[Hashable, V] = {}
        self._lock = threading.Lock()

    def get(self, group: Group, key: Hashable, make: Callable[[], V]) -> V:
        """The value for ``group`` and ``key``, made by ``make()`` on first use."""
        full = (group.rank, group.size, group.coordinator, key)
        with self._lock:
            table = self._alone if group.pg is None else self._by_group.setdefault(group.pg, {})
            value = table.get(full)
            if value is None:
                value = table[full] = make()
            return value

    def discard(self, value: V) -> None:
        """Forget ``value`` wherever it is kept (compared by identity)."""
        with self._lock:
            for table in [self._alone, *self._by_group.values()]:
                for key in [k for k, v in table.items() if v is value]:
                    del table[key]

    def values(self) -> list[V]:
        with self._lock:
            return [
                *self._alone.values(),
                *(v for t in self._by_group.values() for v in t.values()),
            ]

    def clear(self) -> None:
        with self._lock:
            self._alone.clear()
            self._by_group.clear()


@dataclass(frozen=True)
class CacheEntry:
    """What a full save of one sharded structure decided (replaced whole, never mutated).

    ``structure`` fingerprints the shards, ``planner_data`` is the coordinator's planner reply
    to this rank, ``metadata`` the validated global metadata (coordinator only), ``owners``
    who writes each item of that structure (``dcpbridge.engine.ownership.WriteOwners``),
    ``tensor_writes`` this rank's tensor write items (``dcpbridge.engine.bridge.TensorWrites``).
    """

    structure: int
    planner_data: Any
    metadata: Metadata | None
    owners: Any = None
    tensor_writes: Any = None


@dataclass
class SaveCache:
    """The last full save's decisions, reused while every rank's structure is unchanged."""

    entry: CacheEntry | None = None


SAVE_CACHES: PerGroup[SaveCache] = PerGroup()


def save_cache(group: Group, validate: bool, format: str) -> SaveCache:
    """The cache of saves on ``group`` with this validation flag and format."""
    return SAVE_CACHES.get(group, (validate, format), SaveCache)


def members(group: Group | None) -> tuple[int, ...] | None:
    """The global ranks of ``group`` (None for no group): what identifies it across ids."""
    if group is None:
        return None
    if group.pg is None:
        return (group.coordinator,)
    return tuple(dist.get_process_group_ranks(group.pg))


def structure_of(shards: list[Any], parallel: Group | None, common: Any = ()) -> int:
    """Fingerprint of what the shards declare (keys, boxes, dtypes, replicas), of the common
    state's keys and of the parallelization group (members and place), not of the data."""
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
    where = None if parallel is None else (members(parallel), parallel.rank)
    return hash((tuple(parts), tuple(common), where))


@dataclass(frozen=True)
class Reuse:
    """Agreement of all ranks to reuse ``entry`` for a new save named ``save_id``."""

    save_id: str
    entry: CacheEntry


def agree_to_reuse(
    group: Group,
    cache: SaveCache,
    structure: Callable[[], int],
    report: Callable[[], Any] | None = None,
) -> tuple[Reuse | None, list[Any]]:
    """Whether every rank's ``structure()`` still matches its cached entry (one tiny vote),
    and every rank's ``report()`` (run after ``structure()``), carried by the same vote.

    Every rank votes on every save, even with an empty cache, so the decision is collective
    even when background saves fill the caches of different ranks at different times. A rank
    whose ``structure()`` or ``report()`` raises makes every rank raise here. The vote
    replaces the plan exchange, its validation and the ownership exchange, whose results the
    entry holds. The entry reused is the one this rank voted on: a background save that lands
    after the vote replaces ``cache.entry`` with its own structure's.
    """
    voted: list[CacheEntry | None] = [None]

    def vote() -> tuple[bool, str, Any]:
        mine, entry = structure(), cache.entry
        voted[0] = entry
        extra = report() if report is not None else None
        return entry is not None and mine == entry.structure, new_save_id(), extra

    votes = protocol.agree(group, "plan", vote)
    reports = [extra for _, _, extra in votes]
    if not all(same for same, _, _ in votes):
        return None, reports
    entry = voted[0]
    assert entry is not None
    return Reuse(votes[0][1], entry), reports
