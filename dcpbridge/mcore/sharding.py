"""Rank 0 reads a full state dict; each tensor is broadcast once and every rank keeps its shard.

The template (``meta_sharded_state_dict``) says what each rank holds; its tensors only lend
shapes and placements, so they may live on the meta device. Leaves and what they become:

- a ``DTensor`` (``Shard``/``Replicate`` placements): a DTensor on the same mesh with the same
  placements whose local tensor is this rank's shard (on the mesh's device);
- a dcpbridge ``ShardedTensor``: a ShardedTensor with the same metadata whose ``data`` is its
  box of the global tensor (on the template data's device, CPU for meta), ready for
  ``dcpbridge.save``; it is matched to rank 0's entry by ``ShardedTensor.key`` (the global
  tensor, prepended axes included), every other leaf by its dotted path in the template;
- a plain tensor: the full tensor (replicated), on its device (CPU for meta);
- any other value: rank 0's value for that key, when it is not a tensor.

Values keep rank 0's dtype (casting is left to the consumer, as ``nn.Module.load_state_dict``
does). Keys rank 0 lacks are left out of the output and reported as missing. Peak memory per
rank is its shards plus one full tensor: tensors travel one at a time, in rank 0's order.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcpbridge.engine import protocol
from dcpbridge.engine.collectives import Group
from dcpbridge.errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidRequestError,
    KeyMismatchError,
    PickleRefusedError,
    ShapeMismatchError,
)
from dcpbridge.formats.checkpoint import load_torch_file
from dcpbridge.model.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from dcpbridge.model.state import HOLE, fill_holes, map_leaves
from dcpbridge.planners.errors import SerializationError, key_list
from dcpbridge.planners.leaves import not_dense
from dcpbridge.planners.walk import iter_leaves
from dcpbridge.storage.errors import storage_error
from dcpbridge.storage.read.delivery import as_shown

if TYPE_CHECKING:
    import torch.distributed as dist

DeviceLike = int | str | torch.device
DeviceMap = DeviceLike | dict[str, DeviceLike] | None


class DistributedKeys(NamedTuple):
    """Template keys rank 0 lacks (this rank's) and rank 0 keys no rank asked for."""

    missing_keys: list[str]
    unexpected_keys: list[str]


# ---------------------------------------------------------------------------------------------
# Planning (pure): what each rank needs, what rank 0 has, which tensors travel in which order.


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Plan:
    """The broadcast order and the outcome, computed identically on every rank."""

    order: list[str]
    missing: dict[int, list[str]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def plan_broadcasts(
    needs: list[dict[str, tuple[int, ...] | None]], header: dict[str, TensorInfo | Any]
) -> Plan:
    """Tensors to broadcast (rank 0's order) given each rank's needs (key -> global shape, or
    None for a non-tensor) and rank 0's entries; shape or kind mismatches become errors."""
    plan = Plan(order=[])
    wanted: set[str] = set()
    problems: dict[tuple[str, str], list[int]] = {}
    for rank, need in enumerate(needs):
        plan.missing[rank] = sorted(k for k in need if k not in header)
        for key, shape in need.items():
            if key not in header:
                continue
            wanted.add(key)
            problem = _mismatch(shape, header[key])
            if problem:
                problems.setdefault((key, problem), []).append(rank)
    for (key, problem), ranks in problems.items():
        who = f"rank {ranks[0]} expects" if len(ranks) == 1 else f"ranks {ranks} expect"
        plan.errors.append(f"{key!r}: {who} {problem}")
    plan.order = [k for k, v in header.items() if k in wanted and isinstance(v, TensorInfo)]
    plan.unexpected = [k for k in header if k not in wanted]
    return plan


def _mismatch(shape: tuple[int, ...] | None, have: TensorInfo | Any) -> str:
    """What is wrong with rank 0's entry ``have`` for a leaf needing ``shape`` ('' if nothing)."""
    if shape is None and isinstance(have, TensorInfo):
        return f"a non-tensor value, rank 0's state dict holds a tensor of shape {have.shape}"
    if shape is not None and not isinstance(have, TensorInfo):
        return f"a tensor of shape {shape}, rank 0's state dict holds a {type(have).__name__}"
    if shape is not None and have.shape != shape:
        return f"global shape {shape}, rank 0's tensor has shape {have.shape}"
    return ""


# ---------------------------------------------------------------------------------------------
# Template leaves.


def _source(path: str, leaf: Any) -> tuple[str, tuple[int, ...] | None]:
    """The key of ``leaf`` in rank 0's state dict, and the global shape it needs."""
    if isinstance(leaf, ShardedTensor):
        return leaf.key, leaf.global_shape
    if isinstance(leaf, (ShardedTensorFactory, ShardedObject)):
        raise InvalidRequestError(
            f"{path!r}: a {type(leaf).__name__} cannot be cut from a full tensor; apply "
            "factories (dcpbridge.model.state.apply_factories) or leave objects out of the template"
        )
    if isinstance(leaf, DTensor):
        bad = [p for p in leaf.placements if not isinstance(p, (Shard, Replicate))]
        if bad:
            raise InvalidRequestError(
                f"{path!r}: DTensor placements {bad} cannot be loaded from a full tensor "
                "(only Shard and Replicate)"
            )
        return path, tuple(leaf.shape)
    if isinstance(leaf, torch.Tensor):
        return path, tuple(leaf.shape)
    return path, None


def _target_device(t: torch.Tensor | None) -> torch.device:
    if t is None or t.device.type == "meta":
        return torch.device("cpu")
    return t.device


def _own_part(full: torch.Tensor, part: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``part`` of ``full`` on ``device`` without keeping the rest of ``full`` alive."""
    if part.numel() < full.numel():
        return part.to(device, memory_format=torch.contiguous_format, copy=True)
    return part.to(device)


def _shard(leaf: Any, full: torch.Tensor) -> Any:
    if isinstance(leaf, ShardedTensor):
        data = _own_part(full, full[leaf.global_slice()], _target_device(leaf.data))
        return replace(leaf, data=data, dtype=data.dtype)
    if isinstance(leaf, DTensor):
        return distribute_tensor(full, leaf.device_mesh, leaf.placements, src_data_rank=None)
    return full.to(_target_device(leaf))


# ---------------------------------------------------------------------------------------------
# Collective driver.


def _header(state_dict: Mapping[str, Any]) -> dict[str, TensorInfo | Any]:
    """Rank 0's entries: each tensor's shape and dtype (refused by key unless it has dense
    bytes to broadcast), other values as they are."""
    out: dict[str, TensorInfo | Any] = {}
    for k, v in state_dict.items():
        if isinstance(v, torch.Tensor):
            if (what := not_dense(v)) is not None:
                meta = "meta " if v.is_meta else ""
                raise SerializationError(
                    f"{str(k)!r}: rank 0's state dict holds a {what} {meta}tensor, which has "
                    "no dense data to broadcast"
                )
            v = TensorInfo(tuple(v.shape), v.dtype)
        out[str(k)] = v
    return out


def _distribute(
    group: Group,
    state_dict: Mapping[str, Any] | None,
    meta_sharded_state_dict: Mapping[str, Any],
    sharded_state_dict: dict[str, Any],
) -> DistributedKeys:
    template = dict(meta_sharded_state_dict)
    leaves = [(leaf.path, leaf.value) for leaf in iter_leaves(template)]  # map_leaves' order

    def local_step() -> tuple[list[tuple[str, tuple[int, ...] | None]], Any]:
        sources = [_source(path, leaf) for path, leaf in leaves]
        return sources, _header(state_dict) if state_dict is not None else None

    gathered = protocol.agree(group, "plan", local_step)
    sources = gathered[group.rank][0]
    header = gathered[0][1]
    plan = plan_broadcasts([dict(g[0]) for g in gathered], header)
    if plan.errors:
        more = f" (and {len(plan.errors) - 8} more)" if len(plan.errors) > 8 else ""
        raise ShapeMismatchError(
            "rank 0's state dict does not fit the template: " + "; ".join(plan.errors[:8]) + more
        )

    results: list[Any] = [HOLE] * len(leaves)
    by_key: dict[str, list[int]] = {}
    for i, (key, shape) in enumerate(sources):
        if key in header and shape is None:
            results[i] = header[key]
        by_key.setdefault(key, []).append(i)
    device = group.tensor_device
    for key in plan.order:
        info = header[key]
        if state_dict is not None:
            # a conjugate or negative view's memory holds other values than it shows
            full = as_shown(state_dict[key].detach()).to(device).contiguous()
        else:
            full = torch.empty(info.shape, dtype=info.dtype, device=device)
        group.broadcast_tensor(full)
        for i in by_key.get(key, []):
            results[i] = _shard(leaves[i][1], full)
        del full
    it = iter(results)
    rebuilt = fill_holes(map_leaves(template, lambda _: next(it)))
    sharded_state_dict.update(rebuilt)
    return DistributedKeys(plan.missing.get(group.rank, []), plan.unexpected)


def broadcast_and_shard_state_dict(
    state_dict: Mapping[str, Any],
    meta_sharded_state_dict: Mapping[str, Any],
    sharded_state_dict: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
) -> DistributedKeys:
    """Rank 0's half: broadcast each full tensor of ``state_dict`` once and keep rank 0's shards
    in ``sharded_state_dict`` (see the module docstring for what each leaf becomes)."""
    group = Group.resolve(process_group)
    if group.rank != 0:
        raise InvalidArgumentError(
            f"broadcast_and_shard_state_dict runs on rank 0 only (this is rank {group.rank}); "
            "other ranks call shard_broadcasted_state_dict"
        )
    return _distribute(group, state_dict, meta_sharded_state_dict, sharded_state_dict)


def shard_broadcasted_state_dict(
    meta_sharded_state_dict: Mapping[str, Any],
    sharded_state_dict: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
) -> DistributedKeys:
    """Every other rank's half: receive rank 0's tensors and keep this rank's shards."""
    group = Group.resolve(process_group)
    if group.rank == 0:
        raise InvalidArgumentError(
            "shard_broadcasted_state_dict runs on ranks other than 0; rank 0 calls "
            "broadcast_and_shard_state_dict with the full state dict"
        )
    return _distribute(group, None, meta_sharded_state_dict, sharded_state_dict)


# ---------------------------------------------------------------------------------------------
# Reading the full state dict on rank 0.


def _device_for(key: str, device_map: DeviceMap) -> torch.device:
    """The device of ``key`` under an accelerate-style ``device_map`` (longest module prefix)."""
    if device_map is None:
        return torch.device("cpu")
    if not isinstance(device_map, dict):
        return _as_device(device_map)
    best: str | None = None
    for prefix in device_map:
        if (prefix == "" or key == prefix or key.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best)
        ):
            best = prefix
    return torch.device("cpu") if best is None else _as_device(device_map[best])


def _as_device(d: DeviceLike) -> torch.device:
    if isinstance(d, int):
        return torch.device("cuda", d)
    if d in ("disk", "meta"):
        raise InvalidArgumentError(f"device_map value {d!r} is not supported; use a real device")
    try:
        return torch.device(d)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgumentError(f"device_map value {d!r} is not a device: {e}") from e


def _read_file(path: str, allow_pickle: bool = False) -> dict[str, Any]:
    """The state dict in ``path``; every failure is a ``CheckpointError`` naming the file."""
    try:
        return _read_state_file(path, allow_pickle)
    except CheckpointError:
        raise
    except OSError as e:
        raise storage_error(path, e) from e
    except pickle.UnpicklingError as e:
        raise PickleRefusedError(
            f"{path}: holds objects that safe (weights_only) loading refuses: {e}"
        ) from e
    except Exception as e:  # a damaged index, safetensors header or torch.save archive
        raise CorruptCheckpointError(
            f"{path}: not a readable state dict file: {type(e).__name__}: {e}"
        ) from e


def _read_state_file(path: str, allow_pickle: bool = False) -> dict[str, Any]:
    if os.path.isdir(path):  # a checkpoint directory of any format: every tensor, whole
        from dcpbridge.formats.sources import open_source

        source = open_source(path, allow_pickle=allow_pickle)
        try:
            return {
                k: source.read(k, (0,) * len(t.shape), t.shape)
                for k, t in sorted(source.tensors.items())
            }
        finally:
            source.close()
    if path.endswith(".index.json"):
        with open(path) as f:
            weight_map = _weight_map(json.load(f), path)
        out: dict[str, Any] = {}
        folder = os.path.dirname(path)
        for name in dict.fromkeys(weight_map.values()):
            part = _read_file(os.path.join(folder, name), allow_pickle)  # errors name it
            lacking = [k for k, n in weight_map.items() if n == name and k not in part]
            if lacking:
                raise CorruptCheckpointError(
                    f"{path} places {lacking[0]!r} in {name}, which lacks it"
                )
            out.update((k, v) for k, v in part.items() if weight_map.get(k, name) == name)
        return out
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    obj = load_torch_file(path, weights_only=not allow_pickle)
    if not isinstance(obj, Mapping):
        raise InvalidArgumentError(f"{path} holds a {type(obj).__name__}, not a state dict")
    return dict(obj)


def _weight_map(index: Any, path: str) -> dict[str, str]:
    """The index's ``weight_map`` (key -> file), checked: hostile input may only name plain
    files of its own folder (no paths, no other index)."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if weight_map is None:
        raise CorruptCheckpointError(f"{path}: not a shard index (it has no weight_map)")
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str)
        and isinstance(v, str)
        and v not in ("", ".", "..")
        and "/" not in v
        and os.sep not in v
        and not v.endswith(".index.json")
        for k, v in weight_map.items()
    ):
        raise CorruptCheckpointError(
            f"{path}: its weight_map must map keys to plain file names of its folder"
        )
    return weight_map


def load_state_dict(
    checkpoint_file: str | os.PathLike[str],
    device_map: DeviceMap = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    allow_pickle: bool = False,
) -> dict[str, Any]:
    """Every rank calls it; only rank 0 (global, or of ``process_group``) reads
    ``checkpoint_file`` (torch.save, ``.safetensors`` or a ``*.index.json`` of shards, or a
    checkpoint directory of any format: its tensors, whole) and gets its state dict, the
    others get ``{}``. ``allow_pickle`` is for trusted files whose objects (or DCP metadata)
    need classes that safe loading refuses.

    ``device_map`` places entries as accelerate does: one device for all, or a dict from
    module prefix to device (longest prefix wins). A read failure raises on every rank.
    """
    group = Group.resolve(process_group)
    path = os.fspath(checkpoint_file)

    def read() -> dict[str, Any]:
        sd = _read_file(path, allow_pickle)
        return {
            k: v.to(_device_for(k, device_map)) if isinstance(v, torch.Tensor) else v
            for k, v in sd.items()
        }

    return protocol.on_coordinator(group, "read", read) or {}


# ---------------------------------------------------------------------------------------------
# Module wrapper.


class ModuleKeysError(KeyMismatchError, RuntimeError):
    """A strict ``DistModule.load_state_dict`` found missing or unexpected keys (still the
    ``RuntimeError`` that ``nn.Module.load_state_dict`` raises)."""


class DistModule(nn.Module):
    """Wraps ``module`` so that ``load_state_dict`` takes rank 0's full state dict and gives
    every rank its shards (per the module's own, possibly DTensor, state dict)."""

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.module = module
        self._process_group = process_group

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("module", "_process_group") or name in self.__dict__:
            super().__setattr__(name, value)
        else:
            setattr(self._modules["module"], name, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict (no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> nn.modules.module._IncompatibleKeys:
        """Distribute rank 0's ``state_dict`` (other ranks' argument is ignored, e.g. ``{}``)
        tensor by tensor and load each rank's shards into the wrapped module."""
        group = Group.resolve(self._process_group)
        template = self.module.state_dict()
        shards: dict[str, Any] = {}
        keys = _distribute(group, state_dict if group.rank == 0 else None, template, shards)
        result = self.module.load_state_dict(shards, strict=False, assign=assign)
        missing = list(result.missing_keys)
        unexpected = keys.unexpected_keys + list(result.unexpected_keys)
        if strict and (missing or unexpected):
            parts = []
            if unexpected:
                parts.append("Unexpected key(s) in state_dict: " + key_list(map(repr, unexpected)))
            if missing:
                parts.append("Missing key(s) in state_dict: " + key_list(map(repr, missing)))
            raise ModuleKeysError(
                f"Error(s) in loading state_dict for {type(self.module).__name__}:\n\t"
                + "\n\t".join(parts)
            )
        return nn.modules.module._IncompatibleKeys(missing, unexpected)
