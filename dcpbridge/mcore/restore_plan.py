"""Restoring a tensor-aware state dict: which rank sends each requested shard to which ranks.

Pure planning over every group member's manifest (the shards it kept, the shards it needs),
so that every member derives the same transfers and the same errors from one exchange.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from dcpbridge.engine.ownership import ShardId
from dcpbridge.model.mapping import ShardedTensor
from dcpbridge.planners import (
    DTypeMismatchError,
    MissingKeysError,
    ShapeMismatchError,
    ShardingValidationError,
    StrictMode,
    UnexpectedKeysError,
)


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
    def shard(self) -> ShardId:
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


@dataclass(frozen=True, slots=True)
class Transfer:
    """One shard sent by the rank that kept it to the ranks that need it."""

    meta: ShardMeta
    src: int
    dsts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Gap:
    """A shard or object a restore cannot place as asked, and the ranks concerned."""

    key: str  # tensor key, or object unique key
    where: str
    ranks: tuple[int, ...]

    def describe(self) -> str:
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {list(self.ranks)}"
        return f"{self.key!r}{self.where} ({who})"


@dataclass
class RestorePlan:
    """Every member's transfers and everything wrong with the group's kept and wanted shards."""

    local_only: bool
    transfers: list[Transfer] = field(default_factory=list)
    missing: list[Gap] = field(default_factory=list)  # wanted, kept by no usable rank
    unexpected: list[Gap] = field(default_factory=list)  # kept, wanted by no rank
    duplicates: list[Gap] = field(default_factory=list)  # kept by several ranks
    shape_mismatches: list[str] = field(default_factory=list)
    dtype_mismatches: list[str] = field(default_factory=list)

    def missing_keys(self, rank: int) -> list[str]:
        return sorted({g.key for g in self.missing if rank in g.ranks})

    def unexpected_keys(self, rank: int) -> list[str]:
        return sorted({g.key for g in self.unexpected if not self.local_only or rank in g.ranks})

    def check(self, *, validate: bool, strict: StrictMode) -> None:
        """Raise the group's first kind of problem (identically on every member)."""
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
        if self.missing and strict != StrictMode.RETURN_ALL:
            where = (
                "not kept by the rank that requests them (algo='atomic' restores only what "
                "each rank kept itself)"
                if self.local_only
                else "kept by no rank of the group"
            )
            raise MissingKeysError(
                f"{len(self.missing)} requested shard(s) are {where}: "
                + _preview([g.describe() for g in self.missing])
            )
        if self.unexpected and strict == StrictMode.RAISE_ALL:
            raise UnexpectedKeysError(
                f"{len(self.unexpected)} kept shard(s) were requested by no rank: "
                + _preview([g.describe() for g in self.unexpected])
            )


def plan_restore(manifests: Mapping[int, Manifest], *, local_only: bool) -> RestorePlan:
    """Transfers and problems for the members' manifests (keyed by group rank).

    A rank that kept a shard it needs uses its own copy; otherwise (unless ``local_only``)
    the lowest rank that kept it sends it. Objects are never sent: each rank restores the
    ShardedObjects it kept itself.
    """
    plan = RestorePlan(local_only)
    keepers: dict[ShardId, dict[int, ShardMeta]] = {}
    for rank, m in manifests.items():
        for meta in m.kept:
            keepers.setdefault(meta.shard, {}).setdefault(rank, meta)
    receivers: dict[ShardId, list[int]] = {}
    missing: dict[ShardId, list[int]] = {}
    wanted_by: dict[ShardId, set[int]] = {}
    for rank, m in manifests.items():
        for need in dict.fromkeys(m.wanted):
            wanted_by.setdefault(need.shard, set()).add(rank)
            held = keepers.get(need.shard, {})
            if rank in held:
                src = rank
            elif local_only or not held:
                _add(missing, need.shard, rank)
                continue
            else:
                src = _sender(held)
                _add(receivers, need.shard, rank)
            _compare(plan, need, rank, held[src], src)
    for shard in sorted(receivers):
        src = _sender(keepers[shard])
        plan.transfers.append(Transfer(keepers[shard][src], src, tuple(receivers[shard])))
    plan.missing = [Gap(k, f" at offset {o}", tuple(r)) for (k, o), r in sorted(missing.items())]
    for shard, held in sorted(keepers.items()):
        key, offset = shard
        wanted = wanted_by.get(shard, set())
        idle = [r for r in held if r not in wanted] if local_only else ([] if wanted else held)
        if idle:
            plan.unexpected.append(Gap(key, f" at offset {offset}", tuple(sorted(idle))))
        if len(held) > 1:
            plan.duplicates.append(Gap(key, f" at offset {offset}", tuple(sorted(held))))
    _plan_objects(plan, manifests)
    return plan


def _sender(held: dict[int, ShardMeta]) -> int:
    """Of the ranks that kept a shard, the one that sends it (deterministic on every member)."""
    return min(held)


def _add(index: dict[ShardId, list[int]], shard: ShardId, rank: int) -> None:
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
    missing: dict[str, list[int]] = {}
    unexpected: dict[str, list[int]] = {}
    for rank, m in manifests.items():
        kept, wanted = set(m.kept_objects), set(m.wanted_objects)
        for key in wanted - kept:
            missing.setdefault(key, []).append(rank)
        for key in kept - wanted:
            unexpected.setdefault(key, []).append(rank)
    plan.missing += [Gap(k, " (object)", tuple(r)) for k, r in sorted(missing.items())]
    plan.unexpected += [Gap(k, " (object)", tuple(r)) for k, r in sorted(unexpected.items())]


def _preview(items: list[str], limit: int = 10) -> str:
    shown = "; ".join(items[:limit])
    return shown + (f"; ... ({len(items) - limit} more)" if len(items) > limit else "")
