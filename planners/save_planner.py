"""Save planning: local shards -> DCP WriteItems, and whole-checkpoint validation on the coordinator."""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from planners.boxes import Placed, Shape, coverage_problems
from planners.errors import SerializationError, ShardingValidationError
from planners.protocol import (
    ObjectShard,
    TensorShard,
    chunk_sizes,
    chunk_view,
    is_main_replica,
    leaf_kind,
)
from planners.walk import Leaf, iter_leaves
from storage.format import dtype_name, parse_dtype

_MAX_REPORTED = 20


@dataclass(slots=True)
class LocalSummary:
    """What one rank holds (main replica or not), sent with its plan for global validation."""

    tensors: dict[str, tuple[Shape, str]] = field(default_factory=dict)
    objects: dict[str, tuple[str, Shape, Shape]] = field(default_factory=dict)


@dataclass(slots=True)
class LocalWrites:
    """A rank's write items, the values they resolve to, and its summary."""

    items: list[WriteItem]
    sources: dict[MetadataIndex, Any]
    summary: LocalSummary


def _tensor_item(
    key: str, offsets: Shape, sizes: Shape, shape: Shape, dtype: torch.dtype
) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(key, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape),
        ),
    )


def plan_local_writes(leaves: Iterable[Leaf], is_coordinator: bool) -> LocalWrites:
    """Write items for this rank's main replicas; plain tensors and objects go to the coordinator."""
    out = LocalWrites([], {}, LocalSummary())

    def declare(key: str, shape: Shape, dtype: torch.dtype) -> None:
        decl = (shape, dtype_name(dtype))
        prev = out.summary.tensors.setdefault(key, decl)
        if prev != decl:
            raise ShardingValidationError(
                f"{key!r}: shards on this rank disagree: global shape/dtype {prev} vs {decl}"
            )

    for leaf in leaves:
        value = leaf.value
        kind = leaf_kind(value)
        if kind == "tensor_shard":
            sh: TensorShard = value
            shape = tuple(sh.global_shape)
            declare(sh.key, shape, sh.dtype)
            sizes = chunk_sizes(sh)
            if is_main_replica(sh.replica_id) and math.prod(sizes) > 0:
                if sh.data is None:
                    raise ValueError(f"ShardedTensor {sh.key!r} has no data to save")
                item = _tensor_item(sh.key, tuple(sh.global_offset), sizes, shape, sh.dtype)
                out.items.append(item)
                out.sources[item.index] = sh
        elif kind == "tensor":
            shape = tuple(value.shape)
            declare(leaf.path, shape, value.dtype)
            if is_coordinator and value.numel() > 0:
                item = _tensor_item(leaf.path, (0,) * len(shape), shape, shape, value.dtype)
                out.items.append(item)
                out.sources[item.index] = value
        elif kind == "object_shard":
            obj: ObjectShard = value
            uk = obj.unique_key
            out.summary.objects[uk] = (obj.key, tuple(obj.global_shape), tuple(obj.global_offset))
            if is_main_replica(obj.replica_id):
                item = WriteItem(index=MetadataIndex(uk), type=WriteItemType.BYTE_IO)
                out.items.append(item)
                out.sources[item.index] = obj
        elif is_coordinator:
            item = WriteItem(index=MetadataIndex(leaf.path), type=WriteItemType.BYTE_IO)
            out.items.append(item)
            out.sources[item.index] = leaf.value
    return out


def build_metadata(plans: list[SavePlan], *, validate: bool = True) -> Metadata:
    """Global checkpoint metadata from every rank's plan; raises if the shards do not tile.

    Checks that ranks agree on each tensor's global shape and dtype, and (with ``validate``)
    that main replicas cover every tensor exactly once and every object grid exactly once.
    All problems are collected into one ``ShardingValidationError``.
    """
    problems: list[str] = []
    decls: dict[str, dict[tuple[Shape, str], list[int]]] = {}
    objects: dict[str, dict[str, tuple[Shape, Shape]]] = {}
    object_shapes: dict[str, dict[Shape, list[int]]] = {}
    for rank, plan in enumerate(plans):
        summary = plan.planner_data
        if not isinstance(summary, LocalSummary):
            raise TypeError(f"rank {rank}'s plan was not made by ShardedSavePlanner")
        for key, decl in summary.tensors.items():
            decls.setdefault(key, {}).setdefault(decl, []).append(rank)
        for uk, (key, shape, offset) in summary.objects.items():
            objects.setdefault(key, {})[uk] = (shape, offset)
            object_shapes.setdefault(key, {}).setdefault(shape, []).append(rank)

    chunks: dict[str, list[Placed]] = {}
    stored_chunks: dict[str, list[ChunkStorageMetadata]] = {}
    byte_writers: dict[str, list[int]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if item.tensor_data is not None:
                c = item.tensor_data.chunk
                chunks.setdefault(item.index.fqn, []).append(
                    Placed(tuple(c.offsets), tuple(c.sizes), rank)
                )
                stored_chunks.setdefault(item.index.fqn, []).append(c)
            else:
                byte_writers.setdefault(item.index.fqn, []).append(rank)

    for key, variants in decls.items():
        if len(variants) > 1:
            described = "; ".join(
                f"ranks {ranks} say shape {shape} {dtype}"
                for (shape, dtype), ranks in variants.items()
            )
            problems.append(f"{key!r}: ranks disagree on the global shape or dtype: {described}")
    for key, variants in object_shapes.items():
        if len(variants) > 1:
            described = "; ".join(f"ranks {r} say {s}" for s, r in variants.items())
            problems.append(
                f"ShardedObject {key!r}: ranks disagree on the global shape: {described}"
            )
    for fqn in sorted(set(decls) & set(byte_writers)):
        problems.append(f"{fqn!r} is saved both as a tensor and as an object")
    for fqn, ranks in byte_writers.items():
        if len(ranks) > 1:
            problems.append(
                f"object {fqn!r} is written by ranks {ranks}: exactly one main replica "
                "(replica_id 0) may save it"
            )

    if validate and not problems:
        for key, variants in decls.items():
            ((shape, _),) = variants
            problems.extend(coverage_problems(key, shape, chunks.get(key, [])))
        for key, shards in objects.items():
            problems.extend(_object_grid_problems(key, shards, byte_writers))

    if problems:
        shown = problems[:_MAX_REPORTED]
        more = len(problems) - len(shown)
        raise ShardingValidationError(
            "invalid sharding, nothing was saved:\n  - "
            + "\n  - ".join(shown)
            + (f"\n  ... and {more} more" if more else "")
        )

    state: dict[str, STORAGE_TYPES] = {}
    for key, variants in decls.items():
        shape, dtype = next(iter(variants))
        state[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=parse_dtype(dtype)),
            size=torch.Size(shape),
            chunks=sorted(stored_chunks.get(key, []), key=lambda c: tuple(c.offsets)),
        )
    for fqn in byte_writers:
        state[fqn] = BytesStorageMetadata()
    object_table = {
        uk: {"key": key, "global_shape": list(shape), "global_offset": list(offset)}
        for key, shards in objects.items()
        for uk, (shape, offset) in shards.items()
        if uk in byte_writers
    }
    return Metadata(state_dict_metadata=state, planner_data={"objects": object_table})


def _object_grid_problems(
    key: str, shards: dict[str, tuple[Shape, Shape]], byte_writers: dict[str, list[int]]
) -> list[str]:
    shape = next(iter(shards.values()))[0]
    written = {offset for uk, (_, offset) in shards.items() if uk in byte_writers}
    problems = [
        f"ShardedObject {key!r}: offset {offset} lies outside the global shape {shape}"
        for offset in sorted(written)
        if len(offset) != len(shape) or any(not 0 <= o < n for o, n in zip(offset, shape))
    ]
    expected = math.prod(shape)
    if not problems and len(written) != expected:
        if expected <= 100_000:
            missing = [
                o for o in itertools.product(*(range(n) for n in shape)) if o not in written
            ][:5]
            detail = f"; no main replica saves offsets {missing}"
        else:
            detail = ""
        problems.append(
            f"ShardedObject {key!r} (global shape {shape}): {len(written)} of {expected} "
            f"shards are saved{detail}"
        )
    return problems


def serialize_object(value: Any, what: str) -> io.BytesIO:
    """``torch.save`` of ``value`` into a buffer at position 0; ``what`` names it in errors."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as e:
        raise SerializationError(f"cannot serialize {what} ({type(value).__name__}): {e}") from e
    buf.seek(0)
    return buf


class ShardedSavePlanner(SavePlanner):
    """DCP ``SavePlanner`` for Megatron-style sharded state; works with ``dcp.save`` too.

    Leaves of the (nested) state dict may be tensor shards, object shards, plain tensors
    or plain objects. Only main replicas are written; the coordinator validates that the
    shards of every rank tile each global tensor before anything is written.
    """

    def __init__(self, *, validate: bool = True) -> None:
        self.validate = validate
        self._state_dict: Any = None
        self._is_coordinator = False
        self._sources: dict[MetadataIndex, Any] = {}

    def set_up_planner(
        self,
        state_dict: Any,
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self._state_dict = state_dict
        self._is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        local = plan_local_writes(iter_leaves(self._state_dict), self._is_coordinator)
        self._sources = local.sources
        return SavePlan(local.items, planner_data=local.summary)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        metadata = build_metadata(all_plans, validate=self.validate)
        return [dataclasses.replace(p, planner_data=None) for p in all_plans], metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        source = self._sources[write_item.index]
        kind = leaf_kind(source)
        if kind == "tensor_shard":
            return chunk_view(source)
        if kind == "tensor":
            return source
        value = source.data if kind == "object_shard" else source
        return serialize_object(value, f"object {write_item.index.fqn!r}")
