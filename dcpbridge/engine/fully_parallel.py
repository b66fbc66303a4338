"""Fully-parallel save and load: spread replicated shards' writes and reads over a group.

Save: of the ranks of the parallelization group that hold a shard (e.g. all data-parallel
replicas), exactly one writes it, chosen by ``dcpbridge.planners.distribution.distribute`` from one
exchange of shard metadata. Load: each box several ranks need is read by one of them and sent
point-to-point to the others that need it; a box only one rank needs is never exchanged.
Exchanges carry failures, so a rank that failed earlier makes the others fail, not wait.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from dcpbridge.engine.collectives import Group
from dcpbridge.engine.drive import Failure, raise_failures
from dcpbridge.model.mapping import ShardedTensor
from dcpbridge.planners.distribution import Holding, distribute, holders
from dcpbridge.planners.protocol import chunk_sizes, is_main_replica

ShardId = tuple[str, tuple[int, ...]]
BoxId = tuple[str, tuple[int, ...], tuple[int, ...]]


def exchange_holdings(group: Group, mine: list[Holding] | BaseException) -> list[list[Holding]]:
    """Everyone's holdings; raises (on every member) if any member brought a failure."""
    sent = (
        Failure.capture(group.rank, "fully-parallel exchange", mine)
        if isinstance(mine, BaseException)
        else mine
    )
    everyone = group.all_gather(sent)
    failures = [f for f in everyone if isinstance(f, Failure)]
    raise_failures(failures, sent, world_size=group.size)
    return everyone


# -- save --------------------------------------------------------------------------------------


def shard_id(sh: ShardedTensor) -> ShardId:
    return sh.key, tuple(sh.global_offset)


def save_holdings(shards: list[Any]) -> list[Holding]:
    return [
        Holding(shard_id(s), s.numel * s.dtype.itemsize, is_main_replica(s.replica_id))
        for s in shards
        if isinstance(s, ShardedTensor) and s.numel > 0
    ]


def writers(
    group: Group, shards: list[Any] | BaseException, *, only_main: bool = True
) -> dict[ShardId, int]:
    """Which group rank writes each shard some member holds as a main replica (collective).

    With ``only_main=False``, every shard some member holds gets a writer, so the group alone
    holds a full copy of its members' state (node-local checkpoints need that).
    """
    mine = shards if isinstance(shards, BaseException) else save_holdings(shards)
    return distribute(exchange_holdings(group, mine), only_main=only_main)


def assign_writers(shards: list[Any], owner: dict[ShardId, int], rank: int) -> list[Any]:
    """``shards`` with replica ids rewritten so that exactly the assigned rank writes each."""
    out = []
    for s in shards:
        writer = owner.get(shard_id(s)) if isinstance(s, ShardedTensor) else None
        if writer is not None:
            s = dataclasses.replace(s, replica_id=0 if writer == rank else 1)
        out.append(s)
    return out


# -- load --------------------------------------------------------------------------------------


def box_id(sh: ShardedTensor) -> BoxId:
    return sh.key, tuple(sh.global_offset), chunk_sizes(sh)


@dataclass
class LoadShare:
    """This rank's part of a fully-parallel load: what it reads, sends and receives."""

    read: list[Any] = field(default_factory=list)
    sends: list[tuple[ShardedTensor, list[int], int]] = field(default_factory=list)
    recvs: list[tuple[ShardedTensor, int, int]] = field(default_factory=list)
    copies: list[tuple[ShardedTensor, ShardedTensor]] = field(default_factory=list)


def share_load(group: Group, shards: list[Any] | BaseException) -> LoadShare:
    """Split this rank's load template between reading and receiving (collective)."""
    mine: list[Holding] | BaseException = shards
    if not isinstance(shards, BaseException):
        mine = [
            Holding(box_id(s), s.numel * s.dtype.itemsize)
            for s in shards
            if isinstance(s, ShardedTensor) and s.numel > 0
        ]
    everyone = exchange_holdings(group, mine)
    assert not isinstance(shards, BaseException)
    owner = distribute(everyone, only_main=False)
    wanted_by = holders(everyone)
    tags = {box: i for i, box in enumerate(sorted(owner, key=repr))}
    share = LoadShare()
    first: dict[BoxId, ShardedTensor] = {}
    for s in shards:
        if not (isinstance(s, ShardedTensor) and s.numel > 0):
            share.read.append(s)
            continue
        box = box_id(s)
        reader = owner[box]
        if reader == group.rank:
            share.read.append(s)
            if box not in first:
                first[box] = s
                others = [r for r in wanted_by[box] if r != group.rank]
                if others:
                    share.sends.append((s, others, tags[box]))
        elif box in first:  # the same box twice on this rank: receive once, copy
            share.copies.append((s, first[box]))
        else:
            first[box] = s
            share.recvs.append((s, reader, tags[box]))
    return share


def hand_off(group: Group, share: LoadShare) -> None:
    """Send every box this rank read to the others that need it; receive its own."""
    sends = []
    for s, dsts, tag in share.sends:
        data = s.data.contiguous()
        sends += [(data, dst, tag) for dst in dsts]
    recvs = []
    fixups = []
    for s, src, tag in share.recvs:
        buf = (
            s.data
            if s.data.is_contiguous()
            else torch.empty_like(s.data, memory_format=torch.contiguous_format)
        )
        if buf is not s.data:
            fixups.append((s.data, buf))
        recvs.append((buf, src, tag))
    group.exchange(sends, recvs)
    for dest, buf in fixups:
        dest.copy_(buf)
    for dup, src in share.copies:
        dup.data.copy_(src.data)
