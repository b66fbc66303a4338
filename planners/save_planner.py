"""Save planning: local shards -> DCP WriteItems, and whole-checkpoint validation on the coordinator."""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
import operator
import pickletools
import sys
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
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

from dcpbridge.planners.boxes import (
    Placed,
    Shape,
    chunk_arrays,
    coverage_problems,
    untiled_keys,
)
from dcpbridge.planners.columns import (
    GatheredColumns,
    PlanColumns,
    declarations_digest,
    gather_columns,
    plan_columns,
)
from dcpbridge.planners.distribution import MainReplicasWrite, WhoWrites, is_main_replica
from dcpbridge.planners.errors import SerializationError, ShardingValidationError
from dcpbridge.planners.leaves import (
    TENSOR_KINDS,
    check_key,
    freed_storage,
    not_dense,
    refuse,
    storage_holds,
    tensor_boxes,
)
from dcpbridge.planners.protocol import (
    LocalBox,
    ObjectShard,
    TensorShard,
    chunk_sizes,
    chunk_view,
    leaf_kind,
)
from dcpbridge.planners.walk import Leaf, ObjPath, iter_leaves
from dcpbridge.planners.wire import ReceivedItems, WireItems
from dcpbridge.storage.format.fields import dtype_name, parse_dtype
from dcpbridge.storage.format.table import ChunkList, PlannedBoxes, Sources
from dcpbridge.storage.read.delivery import holds_its_values

_MAX_REPORTED = 20


@dataclass(slots=True)
class LocalSummary:
    """What one rank holds (main replica or not), sent with its plan for global validation."""

    tensors: dict[str, tuple[Shape, str]] = field(default_factory=dict)
    objects: dict[str, tuple[str, Shape, Shape]] = field(default_factory=dict)
    paths: dict[str, ObjPath] = field(default_factory=dict)  # DCP key -> path in the state dict
    digest: bytes = b""  # fingerprint of ``tensors`` (``describe_plan``; empty: not made)
    columns: PlanColumns | None = None  # the plan's items as arrays (``describe_plan``)
    # keys of 0-element tensors held as shards, which no local rule plans a chunk of: the
    # coordinator has one holder plan the whole empty chunk (``plan_empty_chunks``)
    empty: list[str] = field(default_factory=list)


def describe_plan(items: list[WriteItem], summary: LocalSummary) -> None:
    """Fingerprint ``summary``'s declarations and attach ``items`` (the plan's, final) as
    columns, which the coordinator validates instead of the items one by one."""
    summary.digest = declarations_digest(summary.tensors)
    summary.columns = plan_columns(items, summary.tensors, summary.digest)


@dataclass(slots=True)
class LocalWrites:
    """A rank's write items, the values they resolve to, and its summary."""

    items: list[WriteItem]
    sources: dict[MetadataIndex, Any]
    summary: LocalSummary


_PROPERTIES: dict[torch.dtype, TensorProperties] = {}  # one per dtype, shared and never changed
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _properties(dtype: torch.dtype) -> TensorProperties:
    props = _PROPERTIES.get(dtype)
    if props is None:
        props = _PROPERTIES[dtype] = TensorProperties(dtype=dtype)
    return props


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return name


def _tensor_item(
    key: str, offsets: Shape, sizes: Shape, shape: Shape, dtype: torch.dtype
) -> WriteItem:
    size = torch.Size(shape)
    return WriteItem(
        index=MetadataIndex(key, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(
                torch.Size(offsets), size if sizes == shape else torch.Size(sizes)
            ),
            properties=_properties(dtype),
            size=size,
        ),
    )


def plan_local_writes(
    leaves: Iterable[Leaf],
    is_coordinator: bool,
    *,
    list_wrapped_objects: bool = False,
    owners: WhoWrites | None = None,
) -> LocalWrites:
    """Write items for what ``owners`` says this rank writes (default: its main replicas,
    and the plain values if it is the coordinator).

    Tensor-like leaves (plain tensors, DTensors, torch ShardedTensors, Megatron-style
    shards) become tensor chunks; non-persistent objects are skipped; sharded values of
    unknown kinds are refused by name before anything is written. Objects are serialized
    here, so an object that cannot be stored fails the plan, not the write
    (``list_wrapped_objects``: ShardedObjects stored as ``[data]``, as torch_dist does).
    """
    out = LocalWrites([], {}, LocalSummary())
    owners = owners or MainReplicasWrite(is_coordinator)

    def declare(key: str, shape: Shape, dtype: torch.dtype) -> None:
        decl = (shape, _dtype_name(dtype))
        prev = out.summary.tensors.setdefault(key, decl)
        if prev != decl:
            raise ShardingValidationError(
                f"{key!r}: shards on this rank disagree: global shape/dtype {prev} vs {decl}"
            )

    for leaf in leaves:
        value = leaf.value
        kind = leaf_kind(value)
        if leaf.obj_path and kind in ("tensor", "dtensor", "torch_sharded", "object"):
            out.summary.paths[leaf.path] = leaf.obj_path  # stored under its DCP key
        if kind in TENSOR_KINDS:
            for sh in tensor_boxes(leaf.path, value, kind, save=True):
                key = check_key(sh.key)
                shape = tuple(sh.global_shape)
                declare(key, shape, sh.dtype)
                sizes = chunk_sizes(sh)
                writes = owners.writes_common() if kind == "tensor" else owners.writes(sh)
                # an empty plain tensor or DTensor is one empty chunk, as in DCP's own plans:
                # a storage writer that writes only its items (HF's) must not drop the key
                empty = not math.prod(shape) and kind in ("tensor", "dtensor")
                if writes and empty and kind == "dtensor":
                    # one whole empty chunk, from the mesh's first coordinate only
                    writes = not any(value.device_mesh.get_coordinate())
                    whole = value.to_local().new_empty(shape)
                    sh = LocalBox(key, whole, sh.dtype, shape, shape, (0,) * len(shape))
                    sizes = shape
                if not empty and not math.prod(shape):  # a shard of a 0-element tensor
                    out.summary.empty.append(key)
                elif writes and (math.prod(sizes) > 0 or empty):
                    check_data(sh)
                    item = _tensor_item(key, tuple(sh.global_offset), sizes, shape, sh.dtype)
                    kept = out.sources.get(item.index)
                    if kept is not None:
                        if not _one_copy_of(kept, sh, sizes):
                            raise ShardingValidationError(
                                f"{key!r}: this rank saves the chunk at "
                                f"{list(item.index.offset)} twice"
                            )
                        if is_main_replica(sh.replica_id):  # the main replica's data
                            out.sources[item.index] = sh
                        continue
                    out.items.append(item)
                    out.sources[item.index] = sh
        elif kind == "object_shard":
            obj: ObjectShard = value
            uk = check_key(obj.unique_key)
            out.summary.objects[uk] = (obj.key, tuple(obj.global_shape), tuple(obj.global_offset))
            if owners.writes(obj):
                item = WriteItem(index=MetadataIndex(uk), type=WriteItemType.BYTE_IO)
                out.items.append(item)
                data = [obj.data] if list_wrapped_objects else obj.data
                out.sources[item.index] = serialize_object(data, f"ShardedObject {uk!r}")
        elif kind == "nonpersistent":
            continue
        elif kind != "object":
            raise refuse(leaf.path, value, kind)
        elif owners.writes_common():
            key = check_key(leaf.path)
            item = WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
            out.items.append(item)
            out.sources[item.index] = serialize_object(leaf.value, f"object {key!r}")
    return out


def plan_empty_chunks(plans: list[SavePlan]) -> list[SavePlan]:
    """``plans`` with one whole empty chunk for each 0-element tensor held only as shards
    (Megatron-style ShardedTensors, torch ShardedTensors), planned by the lowest rank that
    holds it: no rank plans a chunk of it otherwise, and a storage writer that writes only
    the planned items (DCP's HF writer) would drop the key. Its columns are made again."""
    lowest: dict[str, int] = {}
    for rank, plan in enumerate(plans):
        summary = plan.planner_data
        if isinstance(summary, LocalSummary):
            for key in summary.empty:
                lowest.setdefault(key, rank)
    if not lowest:
        return plans
    out = list(plans)
    for key, rank in lowest.items():
        plan = out[rank]
        summary = plan.planner_data
        shape, dtype = summary.tensors[key]
        item = _tensor_item(key, (0,) * len(shape), shape, shape, parse_dtype(dtype))
        out[rank] = dataclasses.replace(plan, items=[*plan.items, item])
    for rank, plan in enumerate(out):
        if plan is not plans[rank] and plan.planner_data.columns is not None:
            summary = dataclasses.replace(plan.planner_data, columns=None)
            describe_plan(plan.items, summary)
            out[rank] = dataclasses.replace(plan, planner_data=summary)
    return out


def _one_copy_of(kept: TensorShard, again: TensorShard, sizes: Shape) -> bool:
    """Whether ``again``, a chunk this rank already writes as ``kept``, is another copy of it
    that only one of them writes: at most one is the main replica (the other a replica a
    fully-parallel group assigned this rank), of the same box. Two main replicas of one chunk
    are two values under one key."""
    mains = is_main_replica(kept.replica_id) + is_main_replica(again.replica_id)
    return mains < 2 and chunk_sizes(kept) == sizes


def check_data(sh: TensorShard) -> None:
    """A main replica's data must be a tensor of exactly the declared local shape and dtype."""
    data = sh.data
    if not isinstance(data, torch.Tensor):
        raise ShardingValidationError(f"ShardedTensor {sh.key!r} has no data to save")
    dtype = data.dtype
    if data.shape != tuple(sh.local_shape) or dtype != sh.dtype:
        raise ShardingValidationError(
            f"ShardedTensor {sh.key!r}: data is {data.dtype} of shape {tuple(data.shape)}, "
            f"declared {sh.dtype} of local shape {tuple(sh.local_shape)}"
        )
    if not_dense(data) is not None:
        what = "quantized " if data.is_quantized else ""  # its scale would be lost
        raise ShardingValidationError(
            f"ShardedTensor {sh.key!r}: {what}{data.layout} {data.device} data cannot be saved"
        )
    if not storage_holds(data):  # read unchecked: a segfault, or bytes past its end
        raise freed_storage(f"ShardedTensor {sh.key!r}", data, save=True)
    if not holds_its_values(data, dtype):  # the tensor and its dtype already in hand
        raise _view_refused(sh.key, data)


def check_shows_its_values(sh: TensorShard) -> None:
    """Refuse a shard whose data is a conjugate or negative view (its memory holds other
    values than it shows): every save path (sync, staged, fully parallel) refuses it alike."""
    data = sh.data
    if isinstance(data, torch.Tensor) and not holds_its_values(data, data.dtype):
        raise _view_refused(sh.key, data)


def _view_refused(key: str, data: torch.Tensor) -> SerializationError:
    return SerializationError(
        f"ShardedTensor {key!r}: data is a {'conjugate' if data.is_conj() else 'negative'}"
        " view; pass data.resolve_conj().resolve_neg()"
    )


def build_metadata(plans: list[SavePlan], *, validate: bool = True) -> Metadata:
    """Global checkpoint metadata from every rank's plan; raises if the shards do not tile.

    Its ``planner_data`` holds, like DCP's, the state-dict path of every key stored under its
    DCP key (so DCP's ``_EmptyStateDictLoadPlanner`` rebuilds the nesting), and the
    ``"objects"`` table of ShardedObjects.

    Checks that ranks agree on each tensor's global shape and dtype, and (with ``validate``)
    that main replicas cover every tensor exactly once and every object grid exactly once.
    All problems are collected into one ``ShardingValidationError``. The chunks of all ranks
    are checked as arrays; only keys that fail get the per-chunk, worded check.
    """
    problems: list[str] = []
    decls, objects, object_shapes, paths, groups = _merge_summaries(plans)
    keys = list(decls)
    key_ids = {k: i for i, k in enumerate(keys)}
    written = _column_writes(plans, key_ids, groups) or _collect_writes(plans, key_ids)
    byte_writers = written.byte_writers

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
    problems.extend(f"{k!r} is written but no rank declares it" for k in written.undeclared)

    kid = order = None
    shapes: list[Shape] = []
    if not problems:
        kid = written.kid
        shapes = [next(iter(decls[k]))[0] for k in keys]
        order = _check_chunks(problems, keys, shapes, kid, written, validate)
        if validate:
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

    assert kid is not None and order is not None
    counts = np.bincount(kid, minlength=len(keys)).astype(np.int64)
    chunk_lists = _chunk_lists(keys, shapes, counts, order, written, checked=validate)
    state: dict[str, STORAGE_TYPES] = {}
    for k, key in enumerate(keys):
        shape, dtype = next(iter(decls[key]))
        state[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=parse_dtype(dtype)),
            size=torch.Size(shape),
            chunks=chunk_lists[k],
        )
    for fqn in byte_writers:
        state[fqn] = BytesStorageMetadata()
    object_table = {
        uk: {"key": key, "global_shape": list(shape), "global_offset": list(offset)}
        for key, shards in objects.items()
        for uk, (shape, offset) in shards.items()
        if uk in byte_writers
    }
    mappings: dict[str, Any] = {k: list(p) for k, p in paths.items() if k in state}
    return Metadata(state_dict_metadata=state, planner_data={**mappings, "objects": object_table})


def _merge_summaries(plans: list[SavePlan]) -> tuple[Any, Any, Any, Any, Any]:
    """Every rank's declarations merged: (tensor decls -> ranks, object grids, object shapes
    -> ranks, DCP key paths, the distinct declarations with their ranks). Ranks declaring
    exactly what an earlier rank did are merged by their fingerprint, or with one dict
    comparison, instead of one step per key."""
    decls: dict[str, dict[tuple[Shape, str], list[int]]] = {}
    objects: dict[str, dict[str, tuple[Shape, Shape]]] = {}
    object_shapes: dict[str, dict[Shape, list[int]]] = {}
    paths: dict[str, ObjPath] = {}
    seen: list[tuple[dict[str, tuple[Shape, str]], list[int]]] = []  # distinct decls, ranks
    by_digest: dict[bytes, list[int]] = {}
    for rank, plan in enumerate(plans):
        summary = plan.planner_data
        if not isinstance(summary, LocalSummary):
            raise ShardingValidationError(f"rank {rank}'s plan was not made by ShardedSavePlanner")
        if summary.paths:
            paths.update(summary.paths)
        tensors = summary.tensors
        same = by_digest.get(summary.digest) if summary.digest else None
        if same is not None:
            same.append(rank)
        else:
            for known, ranks in reversed(seen[-8:]):
                if known == tensors:
                    ranks.append(rank)
                    break
            else:
                seen.append((tensors, [rank]))
                if summary.digest:
                    by_digest[summary.digest] = seen[-1][1]
        for uk, (key, shape, offset) in summary.objects.items():
            objects.setdefault(key, {})[uk] = (shape, offset)
            object_shapes.setdefault(key, {}).setdefault(shape, []).append(rank)
    for tensors, ranks in seen:
        for key, decl in tensors.items():
            decls.setdefault(key, {}).setdefault(decl, []).extend(ranks)
    for variants in decls.values():
        for ranks in variants.values():
            ranks.sort()
    return decls, objects, object_shapes, paths, seen


@dataclass(slots=True)
class _Writes:
    """Every rank's write items as flat lists: tensor chunks, and the writers of objects.

    ``boxes`` holds the chunks' (offsets, sizes, dims) as arrays once ``_check_chunks`` made
    them (None if a value lies beyond int64)."""

    kid: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # key ids
    undeclared: list[str] = field(default_factory=list)  # written keys no rank declares
    offsets: list[Sequence[int]] = field(default_factory=list)
    sizes: list[Sequence[int]] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # chunks per rank
    byte_writers: dict[str, list[int]] = field(default_factory=dict)
    boxes: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    gathered: GatheredColumns | None = None  # when every plan came with its columns

    def box(self, i: int) -> tuple[Shape, Shape]:
        """(offsets, sizes) of chunk ``i`` as tuples."""
        if self.gathered is None:
            return tuple(self.offsets[i]), tuple(self.sizes[i])
        assert self.boxes is not None
        offsets, sizes, dims = self.boxes
        n = int(dims[i])
        return tuple(offsets[i, :n].tolist()), tuple(sizes[i, :n].tolist())


_TENSOR_DATA = operator.attrgetter("tensor_data")
_INDEX, _FQN = operator.attrgetter("index"), operator.attrgetter("fqn")
_CHUNK = operator.attrgetter("chunk")
_OFFSETS, _SIZES = operator.attrgetter("offsets"), operator.attrgetter("sizes")


def _column_writes(
    plans: list[SavePlan], key_ids: dict[str, int], groups: list[tuple[dict[str, Any], list[int]]]
) -> _Writes | None:
    """Every rank's writes from the columns its plan carries (``groups``: the distinct
    declarations and their ranks); None unless every plan carries columns of its own items."""
    columns = []
    for plan in plans:
        summary = plan.planner_data
        c = summary.columns
        if c is None or not c.describes(plan) or c.declared != len(summary.tensors):
            return None
        columns.append(c)
    key_maps: list[np.ndarray] = [np.zeros(0, np.int64)] * len(plans)
    for tensors, ranks in groups:
        ids = np.fromiter(map(key_ids.__getitem__, tensors), np.int64, len(tensors))
        for rank in ranks:
            key_maps[rank] = ids
    gathered = gather_columns(plans, columns, key_maps)
    out = _Writes(
        kid=gathered.kid,
        counts=gathered.counts,
        boxes=(gathered.offsets, gathered.sizes, gathered.dims),
        gathered=gathered,
    )
    for rank, item in gathered.object_items:
        out.byte_writers.setdefault(item.index.fqn, []).append(rank)
    return out


def _collect_writes(plans: list[SavePlan], key_ids: dict[str, int]) -> _Writes:
    """One C-level pass per field over every rank's items (a million chunks stay cheap);
    ``key_ids`` numbers the declared keys."""
    out = _Writes()
    kids = []
    for rank, plan in enumerate(plans):
        items = plan.items
        data = list(map(_TENSOR_DATA, items))
        if any(map(operator.is_, data, itertools.repeat(None))):
            for item in items:
                if item.tensor_data is None:
                    out.byte_writers.setdefault(item.index.fqn, []).append(rank)
            items = [item for item in items if item.tensor_data is not None]
            data = list(map(_TENSOR_DATA, items))
        ids = np.fromiter(
            map(key_ids.get, map(_FQN, map(_INDEX, items)), itertools.repeat(-1)),
            np.int64,
            len(items),
        )
        if ids.size and ids.min() < 0:
            out.undeclared.extend(items[i].index.fqn for i in np.flatnonzero(ids < 0).tolist())
        kids.append(ids)
        chunks = list(map(_CHUNK, data))
        out.offsets.extend(map(_OFFSETS, chunks))
        out.sizes.extend(map(_SIZES, chunks))
        out.counts.append(len(items))
    out.kid = np.concatenate(kids) if kids else out.kid
    out.undeclared = sorted(set(out.undeclared))
    return out


def _check_chunks(
    problems: list[str],
    keys: list[str],
    shapes: list[Shape],
    kid: np.ndarray,
    written: _Writes,
    validate: bool,
) -> np.ndarray:
    """Append the coverage problems of every key; returns the chunks' order by key, offsets."""
    width = max(map(len, shapes), default=0)
    if written.gathered is None:
        try:
            written.boxes = chunk_arrays(written.offsets, written.sizes, width)
        except (OverflowError, ValueError):  # values beyond int64: every key the worded way
            written.boxes = None
    rank = np.repeat(np.arange(len(written.counts), dtype=np.int64), written.counts)
    if validate:
        if written.boxes is None:
            suspects = list(range(len(keys)))
        else:
            suspects = untiled_keys(shapes, kid, *written.boxes)
        for k in suspects:
            rows = np.flatnonzero(kid == k).tolist()
            placed = [Placed(*written.box(i), int(rank[i])) for i in rows]
            problems.extend(coverage_problems(keys[k], shapes[k], placed))
    if written.boxes is None:
        return np.array(
            sorted(range(len(kid)), key=lambda i: (kid[i], tuple(written.offsets[i]))),
            dtype=np.int64,
        )
    return np.lexsort((*written.boxes[0].T[::-1], kid))


def _chunk_lists(
    keys: list[str],
    shapes: list[Shape],
    counts: np.ndarray,
    order: np.ndarray,
    written: _Writes,
    *,
    checked: bool,
) -> list[Sequence[ChunkStorageMetadata]]:
    """Each key's chunks sorted by offsets: views of one ``PlannedBoxes`` (``checked``: they
    tile every key, so the commit document's encoder does not check them again), or lists
    when a value lies beyond int64."""
    if written.boxes is not None:
        offsets, sizes, _ = written.boxes
        boxes = PlannedBoxes(list(shapes), counts, offsets[order], sizes[order], checked)
        if written.gathered is not None:
            boxes.sources = _sources(written.gathered, order)
        return [ChunkList(boxes, k) for k in range(len(keys))]
    made = [
        ChunkStorageMetadata(torch.Size(written.offsets[i]), torch.Size(written.sizes[i]))
        for i in order.tolist()
    ]
    bounds = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    edges = bounds.tolist()
    return [made[edges[k] : edges[k + 1]] for k in range(len(keys))]


def _sources(gathered: GatheredColumns, order: np.ndarray) -> Sources:
    """Which rank's item, at which position of its plan, each planned chunk row is."""
    starts = np.zeros(len(gathered.item_counts) + 1, dtype=np.int64)
    np.cumsum(gathered.item_counts, out=starts[1:])
    row = np.full(int(starts[-1]), -1, dtype=np.int64)
    row[gathered.flat[order]] = np.arange(len(order), dtype=np.int64)
    return Sources(gathered.digests, starts, row)


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
    """``torch.save`` of ``value`` into a buffer at position 0; ``what`` names it in errors.

    Refuses values that would pickle sharding metadata or tensor subclasses (a DTensor's
    pickle holds only this rank's shard): those must be stored as tensors, or not at all.
    """
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as e:
        raise SerializationError(f"cannot serialize {what} ({type(value).__name__}): {e}") from e
    bad = _sharded_globals(buf.getbuffer())
    if bad:
        raise SerializationError(
            f"{what} ({type(value).__name__}) holds {', '.join(sorted(bad))}, which would be "
            "pickled and lose the other ranks' shards; put it in the state dict as its own "
            "entry (a dict or list, not a tuple or object) so it is stored as a tensor"
        )
    buf.seek(0)
    return buf


_SHARDED_MODULES = ("torch.distributed", "dcpbridge", "planners", "megatron")
_SUBCLASS_REBUILDS = {"_rebuild_from_type_v2", "_rebuild_wrapper_subclass", "_rebuild_dtensor"}


def _sharded_globals(raw: memoryview) -> set[str]:
    """Classes in a ``torch.save`` pickle that mean sharded data or tensor subclasses."""
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        name = next(n for n in z.namelist() if n.endswith("data.pkl"))
        pickled = z.read(name)
    found = set()
    for op, arg, _ in pickletools.genops(pickled):
        if op.name != "GLOBAL" or not isinstance(arg, str):
            continue
        module, _, attr = arg.partition(" ")
        if (
            module.startswith(_SHARDED_MODULES)
            or attr in _SUBCLASS_REBUILDS
            or "Shard" in attr
            or "DTensor" in attr
        ):
            found.add(f"{module}.{attr}")
    return found


def _caller_writes_tensors_only(frame: Any) -> bool:
    """Whether the ``storage_writer`` of the nearest of the frames calling ``set_up_planner``
    that has one (DCP's save step, above a subclass's override: DCP hands the planner no
    reference to its writer) is DCP's ``HuggingFaceStorageWriter``, which writes tensors only."""
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
    except ImportError:  # a torch without it
        return False
    for _ in range(4):
        if frame is None:
            return False
        if "storage_writer" in frame.f_code.co_varnames + frame.f_code.co_freevars:
            return isinstance(frame.f_locals.get("storage_writer"), HuggingFaceStorageWriter)
        frame = frame.f_back
    return False


def refuse_non_tensors(leaves: Iterable[Leaf]) -> None:
    """Raise ``SerializationError`` naming the first non-tensor value (objects, ShardedObjects):
    DCP's HF writer would write its bytes where no safetensors header names them."""
    for leaf in leaves:
        if leaf_kind(leaf.value) in ("object", "object_shard"):
            raise SerializationError(
                f"{leaf.path!r}: DCP's HuggingFaceStorageWriter stores tensors only, not "
                f"{type(leaf.value).__name__}; save it elsewhere (db.save stores any value)"
            )


class ShardedSavePlanner(SavePlanner):
    """DCP ``SavePlanner`` for Megatron-style sharded state; works with ``dcp.save`` too.

    Leaves of the (nested) state dict may be tensor shards, object shards, plain tensors
    or plain objects. Only main replicas are written; the coordinator validates that the
    shards of every rank tile each global tensor before anything is written.
    """

    list_wrapped_objects = False  # ShardedObjects stored as ``[data]`` (torch_dist's way)
    # Send the plan's chunks as columns too: they save the coordinator a walk over every
    # rank's items, and the writers report by their positions (the commit's item table is
    # then joined from arrays).
    columns = True
    # The coordinator adds a whole empty chunk of each 0-element tensor held only as shards
    # to the plan of its lowest holder (``plan_empty_chunks``): DCP's writers write only the
    # planned items. Off where the writer records every declared tensor and writes only the
    # local plan's items (dcpbridge's own saves).
    plans_empty_chunks = True

    def __init__(self, *, validate: bool = True, owners: WhoWrites | None = None) -> None:
        self.validate = validate
        self.owners = owners  # who writes what (default: main replicas, common on coordinator)
        self._state_dict: Any = None
        self._is_coordinator = False
        self._sources: dict[MetadataIndex, Any] = {}
        self._columns: PlanColumns | None = None
        self._planned: tuple[WriteItem, ...] = ()
        self._tensors_only = False  # the storage writer is DCP's HF writer (tensors only)

    def __getstate__(self) -> dict[str, Any]:
        """Picklable for DCP's checkpoint process: the settings travel, not the state dict,
        sources or plan of a previous save (a reused planner would send them all)."""
        state = self.__dict__.copy()
        state.update(
            _state_dict=None, _is_coordinator=False, _sources={}, _columns=None, _planned=()
        )
        return state

    def set_up_planner(
        self,
        state_dict: Any,
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self._state_dict = state_dict
        self._is_coordinator = is_coordinator
        self._tensors_only = _caller_writes_tensors_only(sys._getframe(1))

    def leaves(self) -> Iterable[Leaf]:
        """The leaves to save: the state dict's, keyed as DCP keys them."""
        return iter_leaves(self._state_dict)

    def create_local_plan(self) -> SavePlan:
        if self._tensors_only:
            refuse_non_tensors(self.leaves())
        local = plan_local_writes(
            self.leaves(),
            self._is_coordinator,
            list_wrapped_objects=self.list_wrapped_objects,
            owners=self.owners,
        )
        self._sources = local.sources
        items = WireItems(local.items)  # pickled compactly on its way to the coordinator
        if self.columns:
            describe_plan(items, local.summary)
        self._columns = local.summary.columns
        self._planned = tuple(items)
        return SavePlan(items, planner_data=local.summary)

    def plan_digest(self, plan: SavePlan) -> bytes | None:
        """The fingerprint of ``plan``'s columns if its items are still exactly the ones this
        planner planned and described (a writer then reports its results by position in
        them), else None."""
        columns = self._columns
        if columns is None or not columns.describes(plan) or tuple(plan.items) != self._planned:
            return None
        return columns.digest

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if self.plans_empty_chunks:
            all_plans = plan_empty_chunks(all_plans)
        metadata = build_metadata(all_plans, validate=self.validate)
        return [dataclasses.replace(p, planner_data=None) for p in all_plans], metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if len(new_plan.items) == len(self._planned):  # this rank's own items came back
            if isinstance(new_plan.items, ReceivedItems):  # through DCP's scatter: its list
                own = self._columns.items if self._columns is not None else list(self._planned)
                new_plan = dataclasses.replace(new_plan, items=own)
            return new_plan
        # the coordinator added empty chunks
        sources = self._sources
        for item in new_plan.items:
            data = item.tensor_data
            if item.index not in sources and data is not None and not data.size.numel():
                empty = torch.empty(data.size, dtype=data.properties.dtype)
                shape = tuple(data.size)
                sources[item.index] = LocalBox(
                    item.index.fqn, empty, empty.dtype, shape, shape, (0,) * len(shape)
                )
        return dataclasses.replace(new_plan, items=list(new_plan.items))

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        source = self._sources[write_item.index]
        if isinstance(source, io.BytesIO):
            return source
        data = source.data
        if type(data) is torch.Tensor and not source.prepend_axis_num and not data.requires_grad:
            return data  # only read by the writer: no detached view needed (~1 us a tensor)
        return chunk_view(source)
