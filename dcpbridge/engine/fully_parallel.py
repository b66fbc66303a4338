"""Fully-parallel load: each box several ranks need is read by one of them and sent to the others.

Which rank reads which box is ``dcpbridge.engine.ownership.ReadOwners``'s answer; a box only
one rank needs is never exchanged. (Fully-parallel *save* needs no code of its own: the
ownership map tells the planner which rank writes each shard.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dcpbridge.engine.collectives import Group
from dcpbridge.engine.ownership import BoxId, ReadOwners, box_id
from dcpbridge.engine.staging import allocated
from dcpbridge.model.mapping import ShardedTensor
from dcpbridge.model.ties import untie
from dcpbridge.storage.read.delivery import holds_its_values


@dataclass
class LoadShare:
    """This rank's part of a fully-parallel load: what it reads, sends and receives."""

    read: list[Any] = field(default_factory=list)
    sends: list[tuple[ShardedTensor, list[int], int]] = field(default_factory=list)
    recvs: list[tuple[ShardedTensor, int, int]] = field(default_factory=list)
    copies: list[tuple[ShardedTensor, ShardedTensor]] = field(default_factory=list)
    # where each send and receive travels (None: the box's own tensor), made by ``allocate``
    send_bufs: list[torch.Tensor | None] | None = None
    recv_bufs: list[torch.Tensor | None] | None = None


def exchangeable(shards: list[Any]) -> list[Any]:
    """The tensor shards of ``shards`` a fully-parallel load may read on one rank for others.

    Not those tied to another key's shard (one tensor under two keys, ``untie``): a received
    box lands after the read step, whose check that tied keys are stored alike
    (``TiedTensorsError``) would not see it; so each rank reads its tied shards itself.
    """
    candidates = [s for s in shards if isinstance(s, ShardedTensor) and s.numel > 0]
    untied, ties = untie(candidates)
    if not ties.pairs:
        return candidates
    tied = {id(kept) for kept, _ in ties.pairs}
    tied |= {id(s) for s, u in zip(candidates, untied) if u is not s}
    return [s for s in candidates if id(s) not in tied]


def share_load(rank: int, owners: ReadOwners, shards: list[Any], exchanged: list[Any]) -> LoadShare:
    """Split this rank's load template ``shards`` between reading and receiving, as
    ``owners`` (of every rank's ``exchangeable`` shards; this rank's: ``exchanged``) say: any
    shard not exchanged is read by this rank."""
    tags = {box: i for i, box in enumerate(sorted(owners.reader, key=repr))}
    share = LoadShare()
    first: dict[BoxId, ShardedTensor] = {}
    exchanged_here = {id(s) for s in exchanged}
    for s in shards:
        if id(s) not in exchanged_here:
            share.read.append(s)
            continue
        box = box_id(s)
        reader = owners.reader[box]
        if reader == rank:
            share.read.append(s)
            if box not in first:
                first[box] = s
                others = owners.others(box, rank)
                if others:
                    share.sends.append((s, others, tags[box]))
        elif box in first:  # the same box twice on this rank: receive once, copy
            share.copies.append((s, first[box]))
        else:
            first[box] = s
            share.recvs.append((s, reader, tags[box]))
    return share


def exchanged(share: LoadShare, stored: Mapping[str, Any]) -> None:
    """Keep in ``share``'s exchange only boxes the checkpoint fills as asked: a tensor of the
    box's dtype and global shape. Any other box (absent, stored as a value or in another
    dtype or shape) is planned by each rank asking for it, which then reports, raises or
    returns what is stored as without ``fully_parallel``: its reader would otherwise send
    its template's untouched values, returned by the others as loaded. Every rank decides
    from the same metadata and ``box_id`` (key, dtype, global shape), so both ends agree."""

    def filled(s: ShardedTensor) -> bool:
        md = stored.get(s.key)
        return (
            isinstance(md, TensorStorageMetadata)
            and md.properties.dtype == s.dtype
            and tuple(md.size) == tuple(s.global_shape)
        )

    share.sends = [x for x in share.sends if filled(x[0])]
    own = [s for s, _, _ in share.recvs if not filled(s)]
    share.recvs = [x for x in share.recvs if filled(x[0])]
    own += [dup for dup, first in share.copies if not filled(first)]
    share.copies = [x for x in share.copies if filled(x[1])]
    share.read.extend(own)


def allocate(group: Group, share: LoadShare) -> None:
    """Make the buffers ``share``'s exchange needs, before the reads: called inside the load's
    first collective step, a failure (out of memory) fails the load on every rank, where in
    ``hand_off`` it left the others waiting in the exchange.

    Boxes travel on the group's device (CUDA for NCCL, host for gloo): data elsewhere, not
    contiguous, or a conjugate or negative view (its memory holds other values than it shows)
    goes through a buffer there.
    """
    device = group.tensor_device
    share.send_bufs = [_buffer(s, device) for s, _, _ in share.sends]
    share.recv_bufs = [_buffer(s, device) for s, _, _ in share.recvs]


def _buffer(shard: ShardedTensor, device: torch.device) -> torch.Tensor | None:
    """None where ``shard``'s data itself can travel, else a new tensor of its shape on
    ``device``; ``StagingError`` naming the box where it cannot be allocated."""
    t = shard.data
    assert t is not None
    if t.device == device and t.is_contiguous() and holds_its_values(t):
        return None
    return allocated(
        lambda: torch.empty(tuple(t.shape), dtype=t.dtype, device=device),
        "fully-parallel load",
        f"the exchange buffer of {shard.key!r} (offset {tuple(shard.global_offset)}, "
        f"{tuple(t.shape)} {t.dtype}, {t.nelement() * t.element_size()} bytes) on {device}",
    )


def hand_off(group: Group, share: LoadShare) -> None:
    """Send every box this rank read to the others that need it; receive its own.

    Through the buffers ``allocate`` made (made here if it was not called); a received box
    goes from its buffer into place after the exchange. Boxes are filled detached, as the
    reader fills its own: a box may be a view of an ``nn.Parameter``.
    """
    if share.send_bufs is None or share.recv_bufs is None:
        allocate(group, share)
    assert share.send_bufs is not None and share.recv_bufs is not None
    sends = []
    for (s, dsts, tag), buf in zip(share.sends, share.send_bufs, strict=True):
        data = s.data.detach()
        if buf is not None:
            data = buf.copy_(data)  # the values it shows (a conjugate view's resolved)
        sends += [(data, dst, tag) for dst in dsts]
    recvs = []
    fixups = []
    for (s, src, tag), buf in zip(share.recvs, share.recv_bufs, strict=True):
        dest = s.data.detach()
        if buf is None:
            buf = dest
        else:
            fixups.append((dest, buf))
        recvs.append((buf, src, tag))
    group.exchange(sends, recvs)
    for dest, buf in fixups:
        dest.copy_(buf)
    for dup, src in share.copies:
        dup.data.detach().copy_(src.data)
