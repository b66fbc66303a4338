"""What a state-dict leaf stores: the tensor boxes of every tensor-like kind, or a refusal.

Plain tensors, DTensors (any placements, meshes, uneven and empty shards) and torch's
``ShardedTensor`` become ``LocalBox``es in global coordinates; Megatron-style tensor shards
(dcpbridge's or Megatron-Core's own, recognised by their fields) are used as they are.
Anything else that carries sharding is refused by name rather than pickled.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dcpbridge.planners.errors import SerializationError
from dcpbridge.planners.protocol import LeafKind, LocalBox, TensorShard
from dcpbridge.storage.read.delivery import as_shown

_CONTROL = re.compile("[\x00-\x1f\x7f]")
TENSOR_KINDS = frozenset({"tensor", "dtensor", "torch_sharded", "tensor_shard"})


def check_key(key: Any, what: str = "key") -> str:
    """A storage key must be a non-empty string without NUL or control characters."""
    if not isinstance(key, str) or not key:
        raise SerializationError(f"{what} must be a non-empty string, got {key!r}")
    if _CONTROL.search(key):
        raise SerializationError(f"{what} {key!r} contains NUL or control characters")
    return key


def refuse(key: str, value: Any, kind: LeafKind) -> SerializationError:
    """The error for a leaf that holds sharded data dcpbridge cannot store as tensors."""
    kind_text = {
        "factory": "a ShardedTensorFactory (save and load it with dcpbridge.save/load, which "
        "apply factories)",
        "unknown_sharded": "a tensor subclass or sharding metadata dcpbridge does not know",
        "dtensor": "a DTensor, which Megatron's split (common state + ShardedTensors and "
        "ShardedObjects) has no place for: save DTensors with dcpbridge.save or "
        "CheckpointManager, or give a ShardedTensor of its local shard",
    }.get(kind, kind)
    return SerializationError(
        f"{key!r} is {type(value).__module__}.{type(value).__qualname__}, {kind_text}; "
        "it would be pickled and lose its other shards, so nothing was saved"
    )


def not_dense(t: torch.Tensor) -> Any:
    """None if ``t``'s elements are dense bytes to store or fill, else what it is instead:
    "nested", "quantized" (its bytes would lose their scale) or its layout (sparse; a meta
    tensor's is ``torch.strided``: it has no data at all)."""
    if t.layout == torch.strided and not (t.is_meta or t.is_quantized or t.is_nested):
        return None
    return "nested" if t.is_nested else "quantized" if t.is_quantized else t.layout


def _plain_data(key: str, t: torch.Tensor, save: bool = False) -> torch.Tensor:
    """``t`` detached, refused unless it is dense; for a save, a conjugate or negative view
    becomes a copy of the values it shows (its memory holds them unconjugated, unnegated)."""
    if (what := not_dense(t)) is not None:
        raise SerializationError(
            f"{key!r}: a {what} {'meta ' if t.is_meta else ''}tensor has no dense data to store"
        )
    if not storage_holds(t):
        raise freed_storage(repr(key), t, save)
    return as_shown(t.detach()) if save else t.detach()


def freed_storage(what: str, t: torch.Tensor, save: bool) -> SerializationError:
    """The error for ``what`` (a key, quoted), whose tensor ``t`` fails ``storage_holds``."""
    return SerializationError(
        f"{what}: the tensor's storage holds {t.untyped_storage().nbytes()} bytes, fewer than "
        f"its shape {tuple(t.shape)} needs (memory freed by resizing its storage, as FSDP "
        f"does to unsharded parameters): nothing to {'store' if save else 'fill'}"
    )


def storage_holds(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage reaches its last element; a storage resized to fewer bytes
    (FSDP frees parameter memory so, the tensor keeping its shape) leaves its address
    dangling: reading or filling it crashed the process."""
    try:
        held = t.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):  # sparse and other storage-less layouts:
        return True  # not this check's to refuse (the layout checks name them)
    if t.is_contiguous():  # the commonest: its bytes follow its offset (~0.6 us here)
        offset = t.storage_offset()
        if held >= t.nbytes + (offset * t.element_size() if offset else 0):
            return True
    if not t.numel():  # nothing to read or fill, wherever it points
        return True
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return held >= (last + 1) * t.element_size()


def _scattered(mesh: Any, placements: tuple[Any, ...], shape: tuple[int, ...]) -> str | None:
    """Where a ``_StridedShard`` layout gives this rank indices of a dimension that are not
    one block (torch's box starts at the first of them: its bytes would be other indices'),
    or None."""
    ndim = len(shape)
    for d in sorted({p.dim % ndim for p in placements if _strided(p)}):
        index = torch.arange(shape[d]).reshape([-1 if i == d else 1 for i in range(ndim)])
        kept = [p if getattr(p, "dim", None) in (d, d - ndim) else Replicate() for p in placements]
        rows = distribute_tensor(index, mesh, kept, src_data_rank=None).to_local()
        rows = rows.reshape(-1).cpu()  # on a GPU mesh, the index was moved to its device
        if len(rows) and not torch.equal(
            rows, torch.arange(int(rows[0]), int(rows[0]) + len(rows))
        ):
            return f"indices {rows.tolist()[:8]} of dimension {d}"
    return None


@functools.lru_cache(maxsize=4096)
def _layout(
    mesh: Any, placements: tuple[Any, ...], shape: tuple[int, ...], coordinate: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...], str | None]:
    """DTensor's own box of this rank (local shape, offset) and, for a strided layout, where
    its indices are not one block (``_scattered``); cached: the same for every tensor of a
    mesh, placements and shape, and torch computes a strided box in milliseconds (1.7 ms
    here, 0.05-0.09 ms for Shard and Replicate), on every save and load of every tensor.
    Keyed by this rank's ``coordinate`` on the mesh too: torch compares meshes by their ranks
    only, so the mesh of a process group made again with this process under another rank
    (an in-process restart) equals the old one, whose box is another coordinate's."""
    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    strided = any(_strided(p) for p in placements)
    return tuple(local), tuple(offset), _scattered(mesh, placements, shape) if strided else None


def _strided(p: Any) -> bool:
    """A sharding placement other than ``Shard`` (FSDP2's ``_StridedShard``)."""
    return type(p) is not Shard and isinstance(getattr(p, "dim", None), int)


def _check_placements(
    key: str, mesh_ndim: int, placements: tuple[Any, ...], shape: tuple[int, ...]
) -> None:
    """One placement per mesh dimension, each sharding one of the tensor's dimensions
    (``DTensor.from_local(..., run_check=False)`` takes any): else ``SerializationError``
    naming the key, where torch's box maths raised a bare IndexError."""
    if len(placements) != mesh_ndim:
        raise SerializationError(
            f"{key!r}: DTensor has {len(placements)} placements {placements} on a "
            f"{mesh_ndim}-D mesh; it needs one per mesh dimension"
        )
    ndim = len(shape)
    for p in placements:
        dim = getattr(p, "dim", None)
        if isinstance(dim, int) and not -ndim <= dim < ndim:
            raise SerializationError(
                f"{key!r}: DTensor placements {placements} shard dimension {dim} of a tensor "
                f"of shape {shape}"
            )


def dtensor_box(key: str, dt: DTensor, save: bool = False) -> LocalBox | None:
    """This rank's box of ``dt`` (None if it is not on the mesh); replicas along Replicate
    mesh dimensions other than coordinate 0 are not the main replica."""
    if any(isinstance(p, Partial) for p in dt.placements):
        raise SerializationError(
            f"{key!r}: DTensor with a Partial placement {dt.placements} holds unreduced "
            "values; call .redistribute() to Replicate or Shard before checkpointing"
        )
    coordinate = dt.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    placements, global_shape = tuple(dt.placements), tuple(dt.shape)
    _check_placements(key, dt.device_mesh.ndim, placements, global_shape)
    try:
        shape, offset, scattered = _layout(
            dt.device_mesh, placements, global_shape, tuple(coordinate)
        )
    except Exception as e:  # torch's box maths refused them (a split factor below 1, ...)
        raise SerializationError(
            f"{key!r}: DTensor placements {placements} cannot place a tensor of shape "
            f"{global_shape} on its mesh: {e}"
        ) from e
    local = _plain_data(key, dt.to_local(), save)
    if tuple(local.shape) != tuple(shape):
        if local.numel() or math.prod(shape):
            raise SerializationError(
                f"{key!r}: DTensor local tensor has shape {tuple(local.shape)}, its placements "
                f"{dt.placements} give {tuple(shape)}"
            )
        local = local.reshape(shape)  # FSDP2 gives some empty shards another empty shape
    if scattered:
        raise SerializationError(
            f"{key!r}: DTensor placements {dt.placements} give this rank {scattered}, not one "
            "block; redistribute it to Shard or Replicate placements"
        )
    replica = tuple(c for c, p in zip(coordinate, dt.placements) if isinstance(p, Replicate))
    return LocalBox(
        key,
        local,
        dt.dtype,
        tuple(shape),
        tuple(dt.shape),
        tuple(offset),
        replica_id=replica or 0,
    )


def torch_sharded_boxes(key: str, st: Any, save: bool = False) -> list[LocalBox]:
    """One box per local shard of a ``torch.distributed._shard`` ShardedTensor."""
    shape = tuple(st.size())
    out = []
    for shard in st.local_shards():
        data = _plain_data(key, shard.tensor, save)
        md = shard.metadata
        out.append(
            LocalBox(
                key,
                data,
                data.dtype,
                tuple(md.shard_sizes),
                shape,
                tuple(md.shard_offsets),
            )
        )
    return out


def tensor_boxes(key: str, value: Any, kind: LeafKind, save: bool = False) -> list[TensorShard]:
    """The boxes a tensor-like leaf stores under ``key`` (a plain tensor: one whole box);
    ``save``: the data to write (conjugate and negative views resolved), else a template's."""
    if kind == "tensor_shard":
        if getattr(value, "flattened_range", None) is not None:
            raise SerializationError(
                f"ShardedTensor {value.key!r} has a flattened_range, which dcpbridge (like "
                "Megatron-Core 0.16) does not support: store optimizer state in model space"
            )
        return [value]
    if kind == "tensor":
        data = _plain_data(key, value, save)
        shape = tuple(data.shape)
        return [LocalBox(key, data, data.dtype, shape, shape, (0,) * len(shape))]
    if kind == "dtensor":
        box = dtensor_box(key, value, save)
        return [] if box is None else [box]
    if kind == "torch_sharded":
        return torch_sharded_boxes(key, value, save)
    raise refuse(key, value, kind)
