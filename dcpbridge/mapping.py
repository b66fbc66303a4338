"""Sharded state types with Megatron-Core ``dist_checkpointing.mapping`` semantics."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dcpbridge.errors import InvalidShardError
from planners.protocol import ReplicaId

StateDict = dict[str, Any]
ShardedStateDict = dict[str, Any]

COMMON_KEY = "__common__"
_RESERVED = frozenset({COMMON_KEY})


def _check_key(kind: str, key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise InvalidShardError(f"{kind} key must be a non-empty string, got {key!r}")
    if key in _RESERVED:
        raise InvalidShardError(f"{kind} key {key!r} is reserved by dcpbridge")


def _check_replica_id(what: str, replica_id: Any) -> None:
    ok = (isinstance(replica_id, int) and replica_id >= 0) or (
        isinstance(replica_id, tuple) and all(isinstance(r, int) and r >= 0 for r in replica_id)
    )
    if not ok or isinstance(replica_id, bool):
        raise InvalidShardError(
            f"{what}: replica_id must be a non-negative int or a tuple of them, got {replica_id!r}"
        )


@dataclass(repr=False)
class ShardedTensor:
    """This rank's box of a global tensor.

    ``global_shape`` and ``global_offset`` include ``prepend_axis_num`` leading axes that the
    local ``data`` lacks (e.g. a layer axis for pipeline stages); along them the box has size 1.
    Only the main replica (``replica_id`` 0 or all zeros) writes the box.
    """

    key: str
    data: torch.Tensor | None
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False

    def __post_init__(self) -> None:
        self.local_shape = tuple(int(s) for s in self.local_shape)
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = tuple(int(f) for f in self.axis_fragmentations)
        self.validate()

    def validate(self) -> None:
        """Raise ``InvalidShardError`` naming the key unless the metadata is self-consistent."""
        _check_key("ShardedTensor", self.key)
        what = f"ShardedTensor {self.key!r}"
        _check_replica_id(what, self.replica_id)
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidShardError(f"{what}: dtype must be a torch.dtype, got {self.dtype!r}")
        if self.data is not None:
            if not isinstance(self.data, torch.Tensor):
                raise InvalidShardError(f"{what}: data must be a tensor, got {type(self.data)}")
            if self.data.dtype != self.dtype:
                raise InvalidShardError(
                    f"{what}: data dtype {self.data.dtype} != dtype {self.dtype}"
                )
            if tuple(self.data.shape) != self.local_shape:
                raise InvalidShardError(
                    f"{what}: data shape {tuple(self.data.shape)} != local_shape {self.local_shape}"
                )
        p = self.prepend_axis_num
        if not isinstance(p, int) or p < 0:
            raise InvalidShardError(f"{what}: prepend_axis_num must be >= 0, got {p!r}")
        ndim = p + len(self.local_shape)
        if len(self.global_shape) != ndim or len(self.global_offset) != ndim:
            raise InvalidShardError(
                f"{what}: global_shape {self.global_shape} and global_offset {self.global_offset} "
                f"must have {ndim} dims ({p} prepended + local shape {self.local_shape})"
            )
        sizes = (1,) * p + self.local_shape
        for d, (o, s, n) in enumerate(zip(self.global_offset, sizes, self.global_shape)):
            if min(o, s, n) < 0 or o + s > n:
                raise InvalidShardError(
                    f"{what}: along axis {d} the shard [{o}:{o + s}] does not fit the global "
                    f"size {n} (global_shape {self.global_shape}, global_offset "
                    f"{self.global_offset}, local_shape {self.local_shape})"
                )
        frags = self.axis_fragmentations
        if frags is None:
            return
        if len(frags) != ndim or any(f < 1 for f in frags):
            raise InvalidShardError(
                f"{what}: axis_fragmentations {frags} must have {ndim} entries >= 1"
            )
        for d, (f, s, n, o) in enumerate(zip(frags, sizes, self.global_shape, self.global_offset)):
            if d < p:
                bad = n != f
            else:
                bad = n != s * f or (s > 0 and o % s != 0)
            if bad:
                raise InvalidShardError(
                    f"{what}: axis {d} split into {f} fragments of size {s} is inconsistent "
                    f"with global size {n} at offset {o}"
                )

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """Even split: each ``(axis, axis_rank_offset, axis_fragments)`` puts ``data`` at
        fragment ``axis_rank_offset`` of ``axis_fragments`` along ``axis`` (a global axis,
        prepended axes first)."""
        if not isinstance(data, torch.Tensor):
            raise InvalidShardError(f"ShardedTensor {key!r}: data must be a tensor")
        ndim = prepend_axis_num + data.ndim
        shape = [1] * prepend_axis_num + list(data.shape)
        offset = [0] * ndim
        frags = [1] * ndim
        seen: set[int] = set()
        for entry in rank_offsets:
            if len(entry) != 3:
                raise InvalidShardError(
                    f"ShardedTensor {key!r}: rank offsets are (axis, rank_offset, fragments), "
                    f"got {entry!r}"
                )
            axis, rank_offset, fragments = entry
            if not 0 <= axis < ndim or axis in seen:
                raise InvalidShardError(
                    f"ShardedTensor {key!r}: axis {axis} is out of range for {ndim} dims "
                    "or given twice"
                )
            if fragments < 1 or not 0 <= rank_offset < fragments:
                raise InvalidShardError(
                    f"ShardedTensor {key!r}: axis {axis}: rank offset {rank_offset} is not in "
                    f"[0, {fragments})"
                )
            seen.add(axis)
            frags[axis] = fragments
            offset[axis] = rank_offset * shape[axis]
            shape[axis] *= fragments
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(shape),
            tuple(offset),
            tuple(frags),
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_box(
        cls,
        key: str,
        data: torch.Tensor,
        global_shape: tuple[int, ...],
        global_offset: tuple[int, ...],
        *,
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        allow_shape_mismatch: bool = False,
    ) -> ShardedTensor:
        """Any (uneven, possibly empty) box given by its global shape and offset."""
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            None,
            replica_id,
            prepend_axis_num,
            allow_shape_mismatch,
        )

    def global_slice(self) -> tuple[int | slice, ...]:
        """Index of this box in the global tensor (prepended axes as integers)."""
        p = self.prepend_axis_num
        return tuple(self.global_offset[:p]) + tuple(
            slice(o, o + s) for o, s in zip(self.global_offset[p:], self.local_shape)
        )

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    def init_data(
        self, device: torch.device | str = "cpu", init_fn: Callable = torch.empty
    ) -> None:
        """Allocate ``data`` for a template that has none (e.g. before a load)."""
        if self.data is None:
            self.data = init_fn(self.local_shape, dtype=self.dtype, device=device)

    def __repr__(self) -> str:
        return (
            f"ShardedTensor(key={self.key!r}, dtype={self.dtype}, local_shape={self.local_shape}, "
            f"global_shape={self.global_shape}, global_offset={self.global_offset}, "
            f"replica_id={self.replica_id}, prepend_axis_num={self.prepend_axis_num})"
        )


@dataclass(repr=False)
class ShardedObject:
    """One picklable object of a ``global_shape`` grid of objects (e.g. per-rank RNG state)."""

    key: str
    data: Any
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        _check_key("ShardedObject", self.key)
        what = f"ShardedObject {self.key!r}"
        _check_replica_id(what, self.replica_id)
        if len(self.global_shape) != len(self.global_offset) or any(
            not 0 <= o < n for o, n in zip(self.global_offset, self.global_shape)
        ):
            raise InvalidShardError(
                f"{what}: global_offset {self.global_offset} is not inside global_shape "
                f"{self.global_shape}"
            )

    @property
    def unique_key(self) -> str:
        """The storage key of this grid cell (Megatron's naming)."""
        offsets = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offsets}_{shape}"

    def __repr__(self) -> str:
        return (
            f"ShardedObject(key={self.key!r}, global_shape={self.global_shape}, "
            f"global_offset={self.global_offset}, replica_id={self.replica_id})"
        )


@dataclass
class ShardedTensorFactory:
    """Saves ``data`` as whatever ``build_fn`` returns and rebuilds it with ``merge_fn``.

    ``build_fn(key, data, replica_id)`` returns a sharded state dict (e.g. the two halves of
    a fused SwiGLU weight as separate ShardedTensors); after a load, ``merge_fn`` receives that
    dict filled with loaded tensors and returns the local tensor.
    """

    key: str
    data: torch.Tensor
    build_fn: Callable[[str, torch.Tensor, ReplicaId], ShardedStateDict]
    merge_fn: Callable[[Any], torch.Tensor]
    replica_id: ReplicaId = 0

    def build(self) -> ShardedStateDict:
        return self.build_fn(self.key, self.data, self.replica_id)


@dataclass
class LocalNonpersistentObject:
    """A value kept in the state dict across save/load but never written."""

    obj: Any

    def unwrap(self) -> Any:
        return self.obj
