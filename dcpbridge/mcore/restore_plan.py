"""Restoring a tensor-aware state dict: which rank sends each requested shard to which ranks.

Pure planning over every group member's manifest (the shards it kept, the shards it needs),
so that every member derives the same transfers and the same errors from one exchange.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from dcpbridge.engine.ownership import ShardId, WriteId
from dcpbridge.model.mapping import ShardedTensor
from dcpbridge.planners import DTypeMismatchError, ShapeMismatchError, ShardingValidationError
from dcpbridge.planners.errors import key_list
from dcpbridge.planners.protocol import object_key


@dataclass(frozen=True, slots=True)
class ShardMeta:
    """A tensor shard's identity and layout, without its data."""

    key: str
    offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(sh: ShardedTensor) -> ShardMeta:
        return ShardMeta(sh.key, sh.global_offset, sh.local_shape, sh.global_shape, sh.dtype)

    @property
    def shard(self) -> WriteId:
        """Its identity: key, global offset and box size (``ownership.write_id``'s): a replica
        sharded otherwise than its main replica, at the same offset, is another shard."""
        ndim = len(self.local_shape)
        return self.key, self.offset, (1,) * (len(self.offset) - ndim) + self.local_shape

    @property
    def place(self) -> ShardId:
        """Its key and global offset (where a shard of another size is a shape mismatch)."""
        return self.key, self.offset

    @property
    def nbytes(self) -> int:
        return math.prod(self.local_shape) * self.dtype.itemsize

    def layout(self) -> str:
        return f"local shape {self.local_shape} of {self.global_shape}, {self.dtype}"


@dataclass(frozen=True, slots=True)
class Manifest:
    """One rank's side of a restore: what it kept and what its template asks for."""

    kept: tuple[ShardMeta, ...] = ()
    wanted: tuple[ShardMeta, ...] = ()
    kept_objects: tuple[str, ...] = ()  # ShardedObject unique keys
    wanted_objects: tuple[str, ...] = ()
    tied: bool = False  # its template asks keys tied (one memory): checked after the fill


@dataclass(frozen=True, slots=True)
class Transfer:
    """One shard sent by the rank that kept it to the ranks that need it."""

    meta: ShardMeta
    src: int
    dsts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Gap:
    """A shard or object a restore cannot place as asked, and the ranks concerned."""

    key: str  # tensor key, or object key
    where: str
    ranks: tuple[int, ...]

    def describe(self) -> str:
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {list(self.ranks)}"
        return f"{self.key!r}{self.where} ({who})"


@dataclass
class RestorePlan:
    """Every member's transfers and everything wrong with the group's kept and wanted shards."""

    transfers: list[Transfer] = field(default_factory=list)
    missing: list[Gap] = field(default_factory=list)  # wanted, kept by no usable rank
    duplicates: list[Gap] = field(default_factory=list)  # kept by several ranks
    shape_mismatches: list[str] = field(default_factory=list)
    dtype_mismatches: list[str] = field(default_factory=list)
    kept_keys: set[str] = field(default_factory=set)  # tensor and object keys, all members
    wanted_keys: set[str] = field(default_factory=set)

    def requested_not_kept(self) -> dict[int, set[str]]:
        """Rank -> the keys it requests some shard of that no usable rank kept (Megatron's
        *unexpected*, per rank)."""
        out: dict[int, set[str]] = {}
        for gap in self.missing:
            for rank in gap.ranks:
                out.setdefault(rank, set()).add(gap.key)
        return out

    def kept_not_requested(self) -> set[str]:
        """Keys kept by some member that no member requests (Megatron's *missing*)."""
        return self.kept_keys - self.wanted_keys

    def check(self, *, validate: bool) -> None:
        """Raise the group's layout problems (identically on every member); key mismatches
        are the strict policy's to judge."""
        if self.shape_mismatches:
            raise ShapeMismatchError(
                "requested shards differ from the kept ones: " + _preview(self.shape_mismatches)
            )
        if self.dtype_mismatches:
            raise DTypeMismatchError(
                "requested shards differ from the kept ones: " + _preview(self.dtype_mismatches)
            )
        if validate and self.duplicates:
            raise ShardingValidationError(
                f"{len(self.duplicates)} shard(s) are kept by more than one rank of the group "
                "(states from different saves, or an atomic state restored fully parallel?): "
                + _preview([g.describe() for g in self.duplicates])
            )


def plan_restore(manifests: Mapping[int, Manifest], *, local_only: bool) -> RestorePlan:
    """Transfers and problems for the members' manifests (keyed by group rank).

    A rank that kept a shard it needs uses its own copy; otherwise (unless ``local_only``)
    the lowest rank that kept it sends it. Objects are never sent: each rank restores the
    ShardedObjects it kept itself.
    """
    plan = RestorePlan()
    keepers: dict[WriteId, dict[int, ShardMeta]] = {}
    places: dict[ShardId, dict[int, ShardMeta]] = {}  # of another size: a shape mismatch
    for rank, m in manifests.items():
        for meta in m.kept:
            keepers.setdefault(meta.shard, {}).setdefault(rank, meta)
            places.setdefault(meta.place, {}).setdefault(rank, meta)
        plan.kept_keys.update(meta.key for meta in m.kept)
        plan.wanted_keys.update(meta.key for meta in m.wanted)
        plan.kept_keys.update(map(object_key, m.kept_objects))
        plan.wanted_keys.update(map(object_key, m.wanted_objects))
    receivers: dict[WriteId, list[int]] = {}
    missing: dict[WriteId, list[int]] = {}
    for rank, m in manifests.items():
        for need in dict.fromkeys(m.wanted):
            held = keepers.get(need.shard, {})
            if rank in held:
                src = rank
            elif local_only or not held:
                at = places.get(need.place, {})
                if rank in at or (at and not local_only):  # kept there in another size
                    src = rank if rank in at else _sender(at)
                    _compare(plan, need, rank, at[src], src)
                else:
                    _add(missing, need.shard, rank)
                continue
            else:
                src = _sender(held)
                _add(receivers, need.shard, rank)
            _compare(plan, need, rank, held[src], src)
    for shard in sorted(receivers):
        src = _sender(keepers[shard])
        plan.transfers.append(Transfer(keepers[shard][src], src, tuple(receivers[shard])))
    plan.missing = [Gap(k, f" at offset {o}", tuple(r)) for (k, o, _), r in sorted(missing.items())]
    for shard, held in sorted(keepers.items()):
        key, offset, _ = shard
        if len(held) > 1:
            plan.duplicates.append(Gap(key, f" at offset {offset}", tuple(sorted(held))))
    _plan_objects(plan, manifests)
    return plan


def _sender(held: dict[int, ShardMeta]) -> int:
    """Of the ranks that kept a shard, the one that sends it (deterministic on every member)."""
    return min(held)


def _add(index: dict[WriteId, list[int]], shard: WriteId, rank: int) -> None:
    ranks = index.setdefault(shard, [])
    if rank not in ranks:
        ranks.append(rank)


def _compare(plan: RestorePlan, need: ShardMeta, rank: int, kept: ShardMeta, src: int) -> None:
    if (need.local_shape, need.global_shape, need.dtype) == (
        kept.local_shape,
        kept.global_shape,
        kept.dtype,
    ):
        return
    text = (
        f"{need.key!r} at offset {need.offset}: rank {rank} requests {need.layout()}, "
        f"rank {src} kept {kept.layout()}"
    )
    if (need.local_shape, need.global_shape) != (kept.local_shape, kept.global_shape):
        plan.shape_mismatches.append(text)
    else:
        plan.dtype_mismatches.append(text)


def _plan_objects(plan: RestorePlan, manifests: Mapping[int, Manifest]) -> None:
    """Each rank restores the objects it kept itself: one it requests but did not keep is
    missing (named by its key, as Megatron names objects)."""
    missing: dict[str, list[int]] = {}
    for rank, m in manifests.items():
        for name in sorted(set(m.wanted_objects) - set(m.kept_objects)):
            missing.setdefault(name, []).append(rank)
    plan.missing += [
        Gap(object_key(name), f" (object {name})", tuple(r)) for name, r in sorted(missing.items())
    ]


def _preview(items: list[str]) -> str:
    return key_list(items, sep="; ")
