"""Sharded state types with Megatron-Core ``dist_checkpointing.mapping`` semantics."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dcpbridge.errors import CheckpointError, InvalidShardError
from dcpbridge.planners.distribution import is_main_replica
from dcpbridge.planners.protocol import ReplicaId, parse_object_name

StateDict = dict[str, Any]
ShardedStateDict = dict[str, Any]

__all__ = [
    "COMMON_KEY",
    "LocalNonpersistentObject",
    "ReplicaId",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StateDict",
    "apply_factories",
    "apply_factory_merges",
    "check_not_flattened",
    "is_main_replica",
    "parse_object_name",
]

COMMON_KEY = "__common__"
_ZEROS = tuple((0,) * n for n in range(9))


def _int_tuple(values: Any) -> tuple[int, ...]:
    """``values`` as a tuple of Python ints (tuples of ints pass unchanged)."""
    if type(values) is tuple:
        for v in values:  # a plain loop: ~3x cheaper than all() over a generator here
            if type(v) is not int:
                break
        else:
            return values
    return tuple(map(int, values))


_RESERVED = frozenset({COMMON_KEY})


def _check_key(kind: str, key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise InvalidShardError(f"{kind} key must be a non-empty string, got {key!r}")
    if key in _RESERVED:
        raise InvalidShardError(f"{kind} key {key!r} is reserved by dcpbridge")


def _check_replica_id(what: str, replica_id: Any) -> None:
    if type(replica_id) is int and replica_id >= 0:  # the common case, checked first
        return
    ok = (isinstance(replica_id, int) and replica_id >= 0) or (
        isinstance(replica_id, tuple) and all(isinstance(r, int) and r >= 0 for r in replica_id)
    )
    if not ok or isinstance(replica_id, bool):
        raise InvalidShardError(
            f"{what}: replica_id must be a non-negative int or a tuple of them, got {replica_id!r}"
        )


@dataclass(repr=False, slots=True)
class ShardedTensor:
    """This rank's box of a global tensor.

    ``global_shape`` and ``global_offset`` include ``prepend_axis_num`` leading axes that the
    local ``data`` lacks (e.g. a layer axis for pipeline stages); along them the box has size 1.
    Only the main replica (``replica_id`` 0 or all zeros) writes the box. ``flattened_range``
    exists so Megatron code that passes it constructs; anything but None is refused, as in
    Megatron-Core 0.16. Slotted: no per-instance dict, so one GC-tracked object per shard
    instead of two (templates hold 10^4-10^5 of them).
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
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        self.local_shape = _int_tuple(self.local_shape)
        self.global_shape = _int_tuple(self.global_shape)
        self.global_offset = _int_tuple(self.global_offset)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = _int_tuple(self.axis_fragmentations)
        self.validate()

    def validate(self) -> None:
        """Raise ``InvalidShardError`` naming the key unless the metadata is self-consistent."""
        _check_key("ShardedTensor", self.key)
        if self.flattened_range is not None:
            check_not_flattened(self)
        replica_id = self.replica_id
        if type(replica_id) is not int or replica_id < 0:
            _check_replica_id(self._what(), replica_id)
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidShardError(
                f"{self._what()}: dtype must be a torch.dtype, got {self.dtype!r}"
            )
        data = self.data
        if data is not None:
            if not isinstance(data, torch.Tensor):
                raise InvalidShardError(f"{self._what()}: data must be a tensor, got {type(data)}")
            if data.dtype != self.dtype:
                raise InvalidShardError(
                    f"{self._what()}: data dtype {data.dtype} != dtype {self.dtype}"
                )
            if data.shape != self.local_shape:
                raise InvalidShardError(
                    f"{self._what()}: data shape {tuple(data.shape)} != local_shape "
                    f"{self.local_shape}"
                )
        p = self.prepend_axis_num
        if not isinstance(p, int) or p < 0:
            raise InvalidShardError(f"{self._what()}: prepend_axis_num must be >= 0, got {p!r}")
        ndim = p + len(self.local_shape)
        if len(self.global_shape) != ndim or len(self.global_offset) != ndim:
            raise InvalidShardError(
                f"{self._what()}: global_shape {self.global_shape} and global_offset "
                f"{self.global_offset} must have {ndim} dims ({p} prepended + local shape "
                f"{self.local_shape})"
            )
        sizes = (1,) * p + self.local_shape if p else self.local_shape
        if (
            self.global_offset == self._zeros(ndim)
            and sizes == self.global_shape
            and min(sizes, default=0) >= 0
        ):
            pass  # the whole tensor (the common case): nothing to check per axis
        else:
            self._check_fits(self._what(), sizes)
        frags = self.axis_fragmentations
        if frags is None:
            return
        self._check_fragments(self._what(), frags, sizes, ndim)

    def _what(self) -> str:
        """How errors name this shard (built only when one is raised)."""
        return f"ShardedTensor {self.key!r}"

    @staticmethod
    def _zeros(ndim: int) -> tuple[int, ...]:
        return _ZEROS[ndim] if ndim < len(_ZEROS) else (0,) * ndim

    def _check_fits(self, what: str, sizes: tuple[int, ...]) -> None:
        for d, (o, s, n) in enumerate(zip(self.global_offset, sizes, self.global_shape)):
            if min(o, s, n) < 0 or o + s > n:
                raise InvalidShardError(
                    f"{what}: along axis {d} the shard [{o}:{o + s}] does not fit the global "
                    f"size {n} (global_shape {self.global_shape}, global_offset "
                    f"{self.global_offset}, local_shape {self.local_shape})"
                )

    def _check_fragments(
        self, what: str, frags: tuple[int, ...], sizes: tuple[int, ...], ndim: int
    ) -> None:
        p = self.prepend_axis_num
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
        """Allocate ``data`` for a template that has none or only meta-device data (e.g.
        ``load_tensors_metadata``'s), so a load has real memory to fill."""
        if self.data is None or self.data.is_meta:
            self.data = init_fn(self.local_shape, dtype=self.dtype, device=device)

    def without_data(self) -> ShardedTensor:
        """The same box with ``data`` None (Megatron's metadata-only form)."""
        return dataclasses.replace(self, data=None)

    def narrow(self, dim: int, start: int, length: int) -> list[ShardedTensor]:
        """``torch.narrow`` of the local data along local axis ``dim``, with the global tensor
        shrunk alike on every rank (Megatron's meaning: each rank narrows its own piece).

        Needs a regular grid along ``dim`` (global size and offset multiples of the local
        size); returns a one-element list, as Megatron does for non-flat tensors.
        """
        if self.data is None:
            raise InvalidShardError(f"ShardedTensor {self.key!r}: narrow needs data")
        axis = dim + self.prepend_axis_num
        local = self.local_shape[dim]
        size, offset = self.global_shape[axis], self.global_offset[axis]
        if local == 0 or size % local or offset % local:
            raise InvalidShardError(
                f"ShardedTensor {self.key!r}: narrow along axis {dim} needs a regular grid "
                f"(global size {size} and offset {offset} multiples of the local size {local})"
            )
        data = self.data.narrow(dim, start, length)
        shape, offsets = list(self.global_shape), list(self.global_offset)
        shape[axis], offsets[axis] = size // local * length, offset // local * length
        return [
            dataclasses.replace(
                self,
                data=data,
                local_shape=tuple(data.shape),
                global_shape=tuple(shape),
                global_offset=tuple(offsets),
            )
        ]

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

    def without_data(self) -> ShardedObject:
        """The same grid cell with ``data`` None."""
        return dataclasses.replace(self, data=None)

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """The data-less cell a storage name ``<key>/shard_<offset>_<shape>`` stands for."""
        parsed = parse_object_name(unique_key)
        if parsed is None:
            raise InvalidShardError(
                f"{unique_key!r} is not a ShardedObject storage name (<key>/shard_<offset>_<shape>)"
            )
        return cls(parsed[0], None, parsed[2], parsed[1], replica_id)

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
    dict filled with loaded tensors and returns the local tensor. A Megatron-style
    ``build_fn(key, data, replica_id, flattened_range)`` also works (it receives None);
    ``flattened_range`` itself must stay None.
    """

    key: str
    data: torch.Tensor
    build_fn: Callable[..., ShardedStateDict]
    merge_fn: Callable[[Any], torch.Tensor]
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> ShardedStateDict:
        """``build_fn``'s sharded state dict; its failure is an ``InvalidShardError`` naming
        the factory's key (the user's exception as the cause)."""
        check_not_flattened(self)
        try:
            if _takes_four_args(self.build_fn):
                return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)
            return self.build_fn(self.key, self.data, self.replica_id)
        except CheckpointError:
            raise
        except Exception as e:
            raise InvalidShardError(f"factory {self.key!r}: build_fn failed: {e!r}") from e

    def without_data(self) -> ShardedTensorFactory:
        """The same factory with ``data`` None (Megatron's metadata-only form)."""
        return dataclasses.replace(self, data=None)


def merged(factory: Any, loaded: Any) -> Any:
    """``factory.merge_fn(loaded)`` without autograd history (its inputs are views filled in
    place), its failure an ``InvalidShardError`` naming the factory's key (a Megatron-Core
    factory too), the user's exception as the cause."""
    try:
        with torch.no_grad():
            return factory.merge_fn(loaded)
    except CheckpointError:
        raise
    except Exception as e:
        key = getattr(factory, "key", "?")
        raise InvalidShardError(f"factory {key!r}: merge_fn failed: {e!r}") from e


def _takes_four_args(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` accepts a fourth positional argument (Megatron's build_fn signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 4 or any(p.kind == p.VAR_POSITIONAL for p in params)


def check_not_flattened(x: Any) -> None:
    """Refuse a shard or factory with a ``flattened_range`` (flat, DistributedOptimizer-style
    shards): Megatron-Core 0.16 dropped them and dcpbridge never supported them."""
    flat = getattr(x, "flattened_range", None)
    if flat is not None:
        raise InvalidShardError(
            f"{type(x).__name__} {getattr(x, 'key', '?')!r}: flattened_range={flat!r} is not "
            "supported (Megatron-Core 0.16 rejects it too); describe the shard as a box "
            "(global_shape, global_offset) of an unflattened tensor instead"
        )


@dataclass
class LocalNonpersistentObject:
    """A value kept in the state dict across save/load but never written."""

    obj: Any

    def unwrap(self) -> Any:
        """The wrapped value, as a load hands it back."""
        return self.obj


def apply_factories(sharded_state_dict: Any) -> Any:
    """Replace every ``ShardedTensorFactory`` in dicts and lists by what it builds, in place
    (Megatron's ``apply_factories``); returns the state dict for convenience."""

    def visit(x: Any) -> Any:
        if isinstance(x, ShardedTensorFactory):
            return x.build()
        if isinstance(x, dict):
            for k, v in x.items():
                x[k] = visit(v)
        elif isinstance(x, list):
            for i, v in enumerate(x):
                x[i] = visit(v)
        return x

    return visit(sharded_state_dict)


def apply_factory_merges(loaded: Any, factories: Any, key: tuple[Any, ...] = ()) -> Any:
    """Where ``factories`` (a sub-tree of the load template) holds a factory, replace the
    matching part of ``loaded`` by its ``merge_fn`` result, in place (Megatron's
    ``apply_factory_merges``); returns ``loaded``."""
    if isinstance(factories, ShardedTensorFactory):
        return merged(factories, loaded)
    where = ".".join(map(str, key)) or "<root>"
    if isinstance(loaded, dict) and isinstance(factories, dict):
        for k, sub in factories.items():
            if k not in loaded:
                raise InvalidShardError(
                    f"apply_factory_merges: {where}: factory entry {k!r} has no loaded value "
                    f"(loaded keys: {sorted(map(str, loaded))})"
                )
            loaded[k] = apply_factory_merges(loaded[k], sub, (*key, k))
        return loaded
    if isinstance(loaded, list) and isinstance(factories, list):
        if len(loaded) != len(factories):
            raise InvalidShardError(
                f"apply_factory_merges: {where}: loaded list has {len(loaded)} items, the "
                f"factories' list {len(factories)}"
            )
        for i, sub in enumerate(factories):
            loaded[i] = apply_factory_merges(loaded[i], sub, (*key, i))
        return loaded
    raise InvalidShardError(
        f"apply_factory_merges: {where}: cannot merge {type(factories).__name__} factories "
        f"into a loaded {type(loaded).__name__}"
    )
