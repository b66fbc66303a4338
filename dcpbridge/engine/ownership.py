"""Who writes each item of a save, and who reads each box of a fully-parallel load.

For one save structure the answer is a ``WriteOwners`` map, computed once (with
``fully_parallel``: one exchange of shard sizes over the parallelization group) and cached
with that structure (``dcpbridge.engine.cache``). The save planner, staging and the
torch_dist path all ask it; ``replica_id``s are never rewritten. ``ReadOwners`` answers the
same for the boxes of a fully-parallel load, kept per process group while every rank's
template is unchanged. The decisions themselves are the pure functions of
``dcpbridge.planners.distribution``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dcpbridge.engine import protocol
from dcpbridge.engine.cache import PerGroup
from dcpbridge.engine.collectives import Group
from dcpbridge.model.mapping import ShardedTensor
from dcpbridge.planners.distribution import (
    Holding,
    check_single_main,
    distribute,
    holders,
    is_main_replica,
    keep_one_main,
    mains_held_twice,
)
from dcpbridge.planners.errors import ShardingValidationError, key_list
from dcpbridge.planners.protocol import chunk_sizes
from dcpbridge.storage.write.items import tensor_digest

ShardId = tuple[str, tuple[int, ...]]
WriteId = tuple[str, tuple[int, ...], tuple[int, ...]]
BoxId = tuple[str, tuple[int, ...], tuple[int, ...], str, tuple[int, ...]]


def shard_id(sh: ShardedTensor) -> ShardId:
    """A tensor shard's identity across ranks: its key and global offset."""
    return sh.key, tuple(sh.global_offset)


def write_id(sh: ShardedTensor) -> WriteId:
    """A tensor shard's identity for who writes it: key, global offset and box size. A
    replica sharded otherwise than its main replica, starting at the same offset, holds
    other bytes than the main's box: writing it in the main's place would lose the rest."""
    return sh.key, tuple(sh.global_offset), chunk_sizes(sh)


def box_id(sh: ShardedTensor) -> BoxId:
    """A requested box's identity across ranks: key, global offset, size, the template's
    dtype (ranks asking one box in two dtypes each read their own: one rank's bytes are not
    the other's values) and global shape (which, with the stored one, says whether the box
    is filled from storage: ``dcpbridge.engine.fully_parallel.exchanged``)."""
    return (
        sh.key,
        tuple(sh.global_offset),
        chunk_sizes(sh),
        str(sh.dtype),
        tuple(sh.global_shape),
    )


def _tensors(shards: list[Any]) -> list[ShardedTensor]:
    return [s for s in shards if isinstance(s, ShardedTensor) and s.numel > 0]


def _nbytes(sh: ShardedTensor) -> int:
    return sh.numel * sh.dtype.itemsize


@dataclass(frozen=True)
class WriteOwners:
    """Who writes each item of one save structure, as seen from one rank.

    A tensor shard the parallelization group spread (``assigned``) is written by the group
    rank it was assigned to; a plain tensor of the common state (``common_tensors``) and the
    common values by the coordinator; any other shard by its main replica.
    """

    coordinator: bool
    common_tensors: frozenset[str] = frozenset()
    assigned: Mapping[WriteId, int] | None = None
    parallel_rank: int = 0
    # shards several members hold as main replicas that are copies by placement (DTensors
    # whose data-parallel copies are off their mesh): each save checks they are still equal
    copies: frozenset[WriteId] = frozenset()

    def writes(self, shard: Any) -> bool:
        """Whether this rank writes ``shard``."""
        if self.assigned is not None and isinstance(shard, ShardedTensor):
            writer = self.assigned.get(write_id(shard))
            if writer is not None:
                return writer == self.parallel_rank
        return self.writes_alone(shard)

    def writes_alone(self, shard: Any) -> bool:
        """Whether this rank writes ``shard`` when no group spreads the writes."""
        if isinstance(shard, ShardedTensor) and shard.key in self.common_tensors:
            return self.coordinator
        return is_main_replica(shard.replica_id)

    def writes_common(self) -> bool:
        """Whether this rank writes the common state."""
        return self.coordinator


def write_owners(
    group: Group,
    parallel: Group | None,
    shards: list[Any],
    common_tensors: Any = (),
    placed: Any = (),
) -> WriteOwners:
    """The ``WriteOwners`` of a save on ``group`` (collective over ``parallel``, if given).

    ``placed``: keys whose replicas only their placement tells (DTensors, torch's sharded
    tensors). Several members holding one of their shards as main replica are copies the
    mesh does not show (tensor parallelism under DDP), if their bytes are equal: checked
    (``check_copies``), one is written. Any other shard with two main replicas is refused.
    """
    owners = WriteOwners(group.is_coordinator, frozenset(common_tensors))
    if parallel is None:
        return owners

    def held() -> list[Holding]:  # the common state's plain tensors: the coordinator's values
        spread = [s for s in _tensors(shards) if s.key not in owners.common_tensors]
        return [Holding(write_id(s), _nbytes(s), owners.writes_alone(s)) for s in spread]

    everyone = protocol.agree(parallel, "fully-parallel exchange", held)
    placed = set(placed)
    twice = mains_held_twice(everyone)
    copies = {s: ranks for s, ranks in twice.items() if s[0] in placed}
    check_single_main({s: ranks for s, ranks in twice.items() if s not in copies})
    if copies:  # the same verdicts on every member
        check_copies(parallel, shards, frozenset(copies), owners)
        everyone = keep_one_main(everyone, copies)
    assigned = distribute(everyone)
    return dataclasses.replace(
        owners, assigned=assigned, parallel_rank=parallel.rank, copies=frozenset(copies)
    )


def check_copies(
    parallel: Group, shards: list[Any], copies: frozenset[WriteId], owners: WriteOwners
) -> None:
    """Raise ``ShardingValidationError`` on every member of ``parallel`` unless each of
    ``copies`` holds the same bytes on every member holding it as main replica (collective:
    one exchange of digests). Different bytes are two tensors under one key (pipeline
    stages' layers named alike), not copies: writing one would lose the other."""
    mine = [s for s in _tensors(shards) if write_id(s) in copies and owners.writes_alone(s)]

    def digests() -> dict[WriteId, tuple[str, int]]:
        return {write_id(s): (str(s.dtype), tensor_digest(s.data)) for s in mine}

    by_digest: dict[WriteId, dict[tuple[str, int], list[int]]] = {}
    for rank, got in enumerate(protocol.agree(parallel, "replica digests", digests)):
        for shard, digest in got.items():
            by_digest.setdefault(shard, {}).setdefault(digest, []).append(rank)
    differ = sorted((s for s, seen in by_digest.items() if len(seen) > 1), key=repr)
    if differ:
        ranks = {s: sorted(r for rs in by_digest[s].values() for r in rs) for s in differ}
        listed = key_list(f"{s[0]!r} at offset {s[1]} (ranks {ranks[s]})" for s in differ)
        raise ShardingValidationError(
            f"invalid sharding, nothing was saved: {len(differ)} shard(s) held as the main "
            f"replica by several ranks with different values: {listed}; copies of a tensor "
            "(data parallelism off the mesh) must be equal, and two tensors need two keys"
        )


@dataclass(frozen=True)
class ReadOwners:
    """Which group rank reads each box several members of a fully-parallel load need."""

    reader: dict[BoxId, int]
    wanted_by: dict[BoxId, list[int]]

    def others(self, box: BoxId, rank: int) -> list[int]:
        """The members other than ``rank`` that need ``box``."""
        return [r for r in self.wanted_by[box] if r != rank]


@dataclass(frozen=True)
class _KnownReads:
    """The last ``ReadOwners`` of a group and the fingerprint of this rank's boxes then."""

    boxes: int
    owners: ReadOwners


_READS: PerGroup[list[_KnownReads]] = PerGroup()


def read_owners(group: Group, shards: Callable[[], list[Any]]) -> ReadOwners:
    """The ``ReadOwners`` of a load's template ``shards()`` on ``group`` (collective).

    A load whose boxes on every rank are those of the previous load on this group reuses its
    answer after one small vote; otherwise the boxes are exchanged and distributed again.
    """
    known = _READS.get(group, "read owners", list)
    wanted: list[Holding] = []
    boxes = 0

    def vote() -> bool:
        nonlocal boxes
        wanted[:] = [Holding(box_id(s), _nbytes(s)) for s in _tensors(shards())]
        boxes = hash(tuple(wanted))
        return bool(known) and known[0].boxes == boxes

    if all(protocol.agree(group, "fully-parallel reads", vote)):
        return known[0].owners
    everyone = protocol.agree(group, "fully-parallel exchange", lambda: wanted)
    owners = ReadOwners(distribute(everyone, only_main=False), holders(everyone))
    known[:] = [_KnownReads(boxes, owners)]
    return owners
