"""Load planning: for each requested shard, the exact overlaps with the stored chunks."""

from __future__ import annotations

import bisect
import dataclasses
import enum
import functools
import io
import math
import pickle
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from dcpbridge.planners.boxes import Shape, fmt_box, intersect, sweep_dim
from dcpbridge.planners.errors import (
    DTypeMismatchError,
    InvalidRequestError,
    PickleRefusedError,
    ShapeMismatchError,
    key_list,
)
from dcpbridge.planners.leaves import TENSOR_KINDS, refuse, tensor_boxes
from dcpbridge.planners.protocol import (
    TensorShard,
    chunk_sizes,
    chunk_view,
    leaf_kind,
    object_key,
)
from dcpbridge.planners.strict import decide, parse_strict, requested_keys, stored_keys
from dcpbridge.planners.walk import Leaf, iter_leaves
from dcpbridge.storage.backends.regions import narrow_box
from dcpbridge.storage.errors import CorruptCheckpointError
from dcpbridge.storage.format.fields import QUANTIZED_DTYPES
from dcpbridge.storage.format.table import ChunkList, ItemTable
from dcpbridge.storage.format.tiling import distinct
from dcpbridge.storage.read.whole_reads import WholeReads

# Keys with more stored chunks than this get a sorted index instead of a linear scan.
_INDEX_THRESHOLD = 32


class StrictMode(str, enum.Enum):
    """dcpbridge's first three strict policies by name; ``strict=`` takes every Megatron
    ``StrictHandling`` value too (``dcpbridge.planners.strict``)."""

    RAISE_MISSING = "raise_missing"  # default: requested-not-stored keys raise
    RAISE_ALL = "raise_all"  # both kinds of mismatch raise, in one error
    RETURN_ALL = "return_all"  # neither raises; Megatron's (missing, unexpected) are returned


def _read_item(
    fqn: str,
    dest_offset: Shape,
    chunk_offsets: Shape,
    overlap: tuple[Shape, Shape],
) -> ReadItem:
    lo, lengths = overlap
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn, dest_offset),
        dest_offsets=torch.Size(s - d for s, d in zip(lo, dest_offset)),
        storage_index=MetadataIndex(fqn, chunk_offsets),
        storage_offsets=torch.Size(s - c for s, c in zip(lo, chunk_offsets)),
        lengths=torch.Size(lengths),
    )


Box = tuple[Shape, Shape]
_ZERO_SIZES: dict[int, torch.Size] = {}


def _zeros(ndim: int) -> torch.Size:
    z = _ZERO_SIZES.get(ndim)
    if z is None:
        z = _ZERO_SIZES[ndim] = torch.Size((0,) * ndim)
    return z


class ChunkIndex:
    """Stored chunks of one tensor as (offsets, sizes) boxes, sorted along one dimension for
    fast overlap queries. Chunks decoded as arrays (``ChunkList``) are searched as arrays
    and only the candidates become tuples."""

    def __init__(self, chunks: Sequence[ChunkStorageMetadata]) -> None:
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None
        self.boxes: list[Box] = []
        self.starts: list[int] | np.ndarray = []
        if isinstance(chunks, ChunkList):
            if len(chunks) == 1:
                self.boxes = [chunks.box(0)]
                return
            offsets, sizes = chunks.arrays()
            if len(offsets) <= _INDEX_THRESHOLD:
                self.boxes = list(zip(map(tuple, offsets.tolist()), map(tuple, sizes.tolist())))
                return
            ndim = offsets.shape[1]
            counts = [distinct(offsets[:, d]) for d in range(ndim)]
            self.dim = int(np.argmax(counts)) if ndim else -1
            if self.dim < 0:
                self.boxes = [((), ())] * len(offsets)
                return
            order = np.argsort(offsets[:, self.dim], kind="stable")
            self._arrays = (offsets[order], sizes[order])
            self.starts = self._arrays[0][:, self.dim]
            self.max_len = int(sizes[:, self.dim].max())
            return
        self.boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks]
        ndim = len(self.boxes[0][0]) if self.boxes else 0
        self.dim = sweep_dim(chunks) if ndim else -1
        if self.dim >= 0 and len(self.boxes) > _INDEX_THRESHOLD:
            self.boxes.sort(key=lambda b: b[0][self.dim])
            self.starts = [b[0][self.dim] for b in self.boxes]
            self.max_len = max(b[1][self.dim] for b in self.boxes)

    def candidates(self, offsets: Shape, sizes: Shape) -> Iterable[Box]:
        if not len(self.starts):
            return self.boxes
        d = self.dim
        if self._arrays is not None:
            lo = int(np.searchsorted(self.starts, offsets[d] - self.max_len, side="right"))
            hi = int(np.searchsorted(self.starts, offsets[d] + sizes[d], side="left"))
            o, s = (a[lo:hi].tolist() for a in self._arrays)
            return list(zip(map(tuple, o), map(tuple, s)))
        lo = bisect.bisect_right(self.starts, offsets[d] - self.max_len)
        hi = bisect.bisect_left(self.starts, offsets[d] + sizes[d])
        return self.boxes[lo:hi]


def plan_tensor_reads(
    fqn: str, offsets: Shape, sizes: Shape, index: ChunkIndex
) -> tuple[list[ReadItem], int]:
    """Read items for the box ``offsets``+``sizes`` and the number of elements they cover."""
    items = []
    covered = 0
    for chunk_offsets, stored_sizes in index.candidates(offsets, sizes):
        if chunk_offsets == offsets and stored_sizes == sizes:  # same layout: the whole chunk
            items.append(_read_item(fqn, offsets, chunk_offsets, (offsets, sizes)))
            covered += math.prod(sizes)
            continue
        overlap = intersect(offsets, sizes, chunk_offsets, stored_sizes)
        if overlap is not None:
            items.append(_read_item(fqn, offsets, chunk_offsets, overlap))
            covered += math.prod(overlap[1])
    return items, covered


_SAFE_LOAD = threading.Lock()  # see load_object


def load_object(value: io.BytesIO, *, allow_pickle: bool, what: str) -> Any:
    """``torch.load`` with ``weights_only`` unless pickles are explicitly allowed.

    ``io.BytesIO`` (DCP's way to store opaque bytes) is the one class added to the safe set.
    """
    try:
        if allow_pickle:
            return torch.load(value, weights_only=False, map_location="cpu")
        # torch's safe_globals adds to and removes from one process-wide set: reader threads
        # entering and leaving it at once removed BytesIO while another thread loaded
        with _SAFE_LOAD, torch.serialization.safe_globals([io.BytesIO]):
            return torch.load(value, weights_only=True, map_location="cpu")
    except Exception as e:  # a refused pickle, or damaged bytes no checksum caught
        if isinstance(e, pickle.UnpicklingError) and not allow_pickle and _looks_saved(value):
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            reason = next((ln for ln in lines if "error:" in ln), "unsupported object")
            detail = next((ln for ln in lines if "Unsupported global" in ln), reason)
            raise PickleRefusedError(
                f"{what} holds Python objects that safe (weights_only) loading refuses "
                f"({detail}). If you trust this checkpoint, load it with allow_pickle=True."
            ) from e
        raise CorruptCheckpointError(f"{what} is not readable torch.save data: {e}") from e


def _looks_saved(value: io.BytesIO) -> bool:
    """Whether ``value`` starts as ``torch.save`` output does (a zip archive, or a legacy
    pickle): only then can a refusal mean objects rather than damaged bytes."""
    head = value.getbuffer()[:4].tobytes()
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


@dataclass(slots=True)
class _Dest:
    """Where a requested box lands: one or more local tensors (duplicates share the read)."""

    views: list[torch.Tensor]
    stored_dtype: torch.dtype


@dataclass(slots=True)
class LocalReads:
    """A rank's read items, where they land, and which requested keys are absent."""

    items: list[ReadItem] = field(default_factory=list)
    dests: dict[MetadataIndex, _Dest] = field(default_factory=dict)
    objects: dict[str, list[Leaf]] = field(default_factory=dict)
    legacy: dict[str, _Legacy] = field(default_factory=dict)
    requested: set[str] = field(default_factory=set)
    missing: list[str] = field(default_factory=list)
    whole: WholeReads | None = None  # whole-chunk requests as columns, instead of items
    whole_at: dict[tuple[str, Shape], int] = field(default_factory=dict)  # entry by box


def plan_local_reads(
    leaves: Iterable[Leaf],
    metadata: Metadata,
    *,
    allow_dtype_cast: bool = False,
    whole_columns: bool = False,
    shards: Sequence[Any] = (),
) -> LocalReads:
    """Read items that fill every requested tensor-like leaf and object from ``metadata``.

    ``shards`` are tensor shards (``TensorShard``) each stored under its own key, planned
    before ``leaves`` as the leaves ``Leaf("", shard)`` would be, the commonest ones in bulk.
    With ``whole_columns``, requests that are exactly one stored chunk, into a plain CPU
    tensor of the stored dtype, go to ``LocalReads.whole`` instead of becoming read items
    (for a reader that takes them: ``FsspecCheckpointReader.read_whole``).
    """
    out = LocalReads(whole=WholeReads() if whole_columns else None)
    stored = metadata.state_dict_metadata
    indexes: dict[str, ChunkIndex] = {}
    rest = _take_plain_wholes(out, shards, stored) if out.whole is not None else shards
    for shard in rest:
        _plan_leaf(out, Leaf("", shard, None, None), stored, indexes, allow_dtype_cast)
    for leaf in leaves:
        _plan_leaf(out, leaf, stored, indexes, allow_dtype_cast)
    return out


def _plan_leaf(
    out: LocalReads,
    leaf: Leaf,
    stored: dict[str, Any],
    indexes: dict[str, ChunkIndex],
    allow_dtype_cast: bool,
) -> None:
    """Plan one leaf: an object's bytes item, a tensor's whole-chunk entry or read items."""
    value = leaf.value
    kind = leaf_kind(value)
    if kind in ("object_shard", "object"):
        fqn = value.unique_key if kind == "object_shard" else leaf.path
        _plan_object(out, fqn, leaf, stored)
    elif kind in TENSOR_KINDS:
        if (
            out.whole is not None
            and kind == "tensor_shard"
            and not _take_plain_wholes(out, (value,), stored)
        ):
            return
        for sh in tensor_boxes(leaf.path, value, kind):
            _plan_box(out, sh, stored, indexes, allow_dtype_cast)
    elif kind != "nonpersistent":
        raise refuse(leaf.path, value, kind)


def _plan_object(out: LocalReads, fqn: str, leaf: Leaf, stored: dict[str, Any]) -> None:
    out.requested.add(fqn)
    if fqn not in stored or isinstance(stored[fqn], TensorStorageMetadata):
        parts = _legacy_parts(fqn, stored) if isinstance(leaf.value, (list, tuple)) else None
        if parts is None:
            out.missing.append(fqn)
            return
        pending = _Legacy(leaf, parts, fqn)  # stored item by item by dcpbridge < 0.2
        for part in pending.keys:
            out.requested.add(part)
            out.legacy[part] = pending
            out.items.append(_bytes_item(part))
        return
    if fqn not in out.objects:
        out.items.append(_bytes_item(fqn))
    out.objects.setdefault(fqn, []).append(leaf)


def _bytes_item(fqn: str) -> ReadItem:
    z = torch.Size([0])
    mi = MetadataIndex(fqn)
    return ReadItem(LoadItemType.BYTE_IO, mi, z, mi, z, z)


def _legacy_parts(fqn: str, stored: dict[str, Any]) -> list[Any] | None:
    """Keys ``fqn.0``, ``fqn.1``... (nested for nested sequences) under which an older
    dcpbridge stored a list or tuple item by item; None if there are none."""
    prefixes = {k[:i] for k in stored if k.startswith(fqn + ".") for i in _dots(k)}
    return _parts_under(fqn, stored, prefixes)


def _dots(key: str) -> list[int]:
    return [i for i, c in enumerate(key) if c == "."]


def _parts_under(fqn: str, stored: dict[str, Any], prefixes: set[str]) -> list[Any] | None:
    parts: list[Any] = []
    while True:
        sub = f"{fqn}.{len(parts)}"
        if sub in stored and not isinstance(stored[sub], TensorStorageMetadata):
            parts.append(sub)
        elif sub in prefixes:
            nested = _parts_under(sub, stored, prefixes)
            if nested is None:
                return parts or None
            parts.append(nested)
        else:
            return parts or None


class _Legacy:
    """A list or tuple leaf read back from its per-item keys, replaced once all arrive."""

    def __init__(self, leaf: Leaf, parts: list[Any], fqn: str) -> None:
        self.leaf, self.parts, self.fqn = leaf, parts, fqn
        self.keys: list[str] = []
        self._collect(parts)
        self.values: dict[str, Any] = {}

    def _collect(self, parts: list[Any]) -> None:
        for p in parts:
            if isinstance(p, str):
                self.keys.append(p)
            else:
                self._collect(p)

    def arrive(self, key: str, value: Any) -> Any | None:
        """Record one item; the rebuilt value once every item has arrived, else None."""
        self.values[key] = value
        if len(self.values) < len(self.keys):
            return None

        def build(parts: list[Any], like: Any) -> Any:
            items = [
                self.values[p]
                if isinstance(p, str)
                else build(p, like[i] if isinstance(like, (list, tuple)) and i < len(like) else [])
                for i, p in enumerate(parts)
            ]
            return tuple(items) if isinstance(like, tuple) else items

        return build(self.parts, self.leaf.value)


def _plan_box(
    out: LocalReads,
    sh: TensorShard,
    stored: dict[str, Any],
    indexes: dict[str, ChunkIndex],
    allow_dtype_cast: bool,
) -> None:
    fqn = sh.key
    if sh.data is None or sh.data.is_meta:
        raise InvalidRequestError(
            f"{fqn!r}: the load template has no data to fill ({'meta' if sh.data is not None else 'None'})"
        )
    view = chunk_view(sh)
    if _shares_elements(view):
        raise InvalidRequestError(
            f"{fqn!r}: the load template's tensor has elements sharing memory (an expanded "
            "or overlapping view) and cannot be filled; pass a tensor with memory of its own "
            "(clone())"
        )
    offsets, sizes, shape = tuple(sh.global_offset), chunk_sizes(sh), tuple(sh.global_shape)
    out.requested.add(fqn)
    md = stored.get(fqn)
    if not isinstance(md, TensorStorageMetadata):
        if md is not None:  # nothing to fill the tensor from (and a common key is not missing)
            raise ShapeMismatchError(
                f"{fqn!r}: stored as a value, not a tensor; requested as a tensor of shape {shape}"
            )
        out.missing.append(fqn)
        return
    stored_dtype = md.properties.dtype
    if stored_dtype in QUANTIZED_DTYPES:
        raise DTypeMismatchError(
            f"{fqn!r}: stored as a quantized {stored_dtype} tensor, whose scale and zero "
            "point a load cannot restore (dequantize it before saving)"
        )
    if stored_dtype != view.dtype:
        if not allow_dtype_cast:
            raise DTypeMismatchError(
                f"{fqn!r}: stored as {stored_dtype}, requested as {view.dtype} "
                "(pass allow_dtype_cast=True to convert)"
            )
        why = _cast_refusal(stored_dtype, view.dtype)
        if why is not None:
            raise DTypeMismatchError(
                f"{fqn!r}: stored as {stored_dtype}, which cannot be cast to {view.dtype} ({why})"
            )
    stored_shape = tuple(md.size)
    if stored_shape != shape:
        allow_mismatch = sh.allow_shape_mismatch
        if not allow_mismatch or len(stored_shape) != len(shape):
            raise ShapeMismatchError(
                f"{fqn!r}: global shape in checkpoint is {stored_shape}, requested {shape}"
                + ("" if allow_mismatch else " (set allow_shape_mismatch=True to load the overlap)")
            )
        view.zero_()
    if math.prod(sizes) == 0:
        return
    if out.whole is not None and _take_whole(out, fqn, offsets, sizes, view, md):
        return
    dest_key = MetadataIndex(fqn, offsets)
    dest = out.dests.get(dest_key)
    if dest is not None:  # the same box requested twice on this rank: read once, copy
        if tuple(dest.views[0].shape) != tuple(view.shape):
            raise ShapeMismatchError(f"{fqn!r}: two shards at offset {offsets} differ in size")
        dest.views.append(view)
        return
    out.dests[dest_key] = _Dest([view], stored_dtype)
    chunks = md.chunks
    if isinstance(chunks, ChunkList) and chunks.holds(offsets, sizes):
        # The request is a stored chunk (the same layout as at save): read it whole; stored
        # chunks are disjoint and inside the stored shape, so it covers the request.
        zeros = _zeros(len(sizes))
        out.items.append(
            ReadItem(LoadItemType.TENSOR, dest_key, zeros, dest_key, zeros, torch.Size(sizes))
        )
        return
    index = indexes.get(fqn)
    if index is None:
        index = indexes[fqn] = ChunkIndex(md.chunks)
    items, covered = plan_tensor_reads(fqn, offsets, sizes, index)
    if stored_shape == shape:  # the box lies inside the shape (shards are validated)
        expected = math.prod(sizes)
    else:
        inside = intersect(offsets, sizes, (0,) * len(shape), stored_shape)
        expected = math.prod(inside[1]) if inside else 0
    if covered != expected:
        raise CorruptCheckpointError(
            f"{fqn!r}: stored chunks cover {covered} of the {expected} elements requested "
            f"at {fmt_box(offsets, sizes)}; the checkpoint is missing part of this tensor"
        )
    out.items.extend(items)


@functools.cache
def _cast_refusal(stored: torch.dtype, requested: torch.dtype) -> str | None:
    """Why ``allow_dtype_cast`` cannot convert ``stored`` values to ``requested`` (None: it
    can): torch has no conversion (bits, float4), or it would drop imaginary parts."""
    if stored.is_complex and not requested.is_complex:
        return "its imaginary parts would be dropped"
    try:
        torch.empty(1, dtype=requested).copy_(torch.empty(1, dtype=stored))
    except RuntimeError:  # NotImplementedError included: no copy kernel for the pair
        return "torch has no conversion between them"
    return None


def _shares_elements(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` are one memory location (an expanded view, or an
    ``as_strided`` one whose elements meet): reads into it would keep one stored value of
    each such pair, silently, or raise from ``copy_``. Contiguous tensors never are."""
    if t.is_contiguous() or not t.numel():
        return False
    verdict = torch._debug_has_internal_overlap(t)  # 0: no, 1: a zero stride, 2: too hard
    if verdict != 2:
        return verdict == 1
    reach = 0  # the farthest offset of the dimensions taken so far, smallest stride first
    for stride, n in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:  # may meet an earlier dimension's elements: count exactly
            offsets = torch.zeros((), dtype=torch.int64)
            for size, step in zip(t.shape, t.stride()):
                offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * step
            return torch.unique(offsets).numel() != t.numel()
        reach += (n - 1) * stride
    return False


def _take_plain_wholes(
    out: LocalReads, shards: Sequence[Any], stored: dict[str, Any]
) -> Sequence[Any]:
    """``_plan_box`` + ``_take_whole`` for the commonest requests, with nothing to convert:
    shards whose data is a plain CPU tensor (no grad, no prepended axes) of the stored dtype
    and global shape, which is one whole stored chunk of the checkpoint's item table, asked
    for once. Planned as columns: one pass picks them, ``WholeReads.add_many`` checks their
    data against the chunks in one more. Returns the others (nothing recorded for them): the
    general path plans them, and raises where it must."""
    whole = out.whole
    assert whole is not None
    table = whole.table  # every entry comes from one item table
    rest: list[Any] = []
    picked: list[Any] = []
    ts: list[int] = []
    keys: list[tuple[str, Shape]] = []
    tensor, meta, get = torch.Tensor, TensorStorageMetadata, stored.get
    for sh in shards:
        data = sh.data
        if (
            type(data) is not tensor  # a plain tensor (``add_many`` checks the rest)
            or data.requires_grad  # filled through a detached view by the general path
            or sh.prepend_axis_num
            or getattr(sh, "flattened_range", None) is not None
        ):
            rest.append(sh)
            continue
        md = get(sh.key)
        chunks = md.chunks if type(md) is meta else None
        if type(chunks) is not ChunkList or md.size != sh.global_shape:
            rest.append(sh)
            continue
        if chunks.table is not table:
            if table is not None or not isinstance(chunks.table, ItemTable):
                rest.append(sh)
                continue
            table = chunks.table
        picked.append(sh)
        ts.append(chunks.t)
        keys.append((sh.key, o if type(o := sh.global_offset) is tuple else tuple(o)))
    if not picked:
        return rest
    if out.whole_at or out.dests:  # asked for before: the general path reads once and copies
        before = [i for i, k in enumerate(keys) if _planned(out, k)]
        if before:
            rest.extend(picked[i] for i in before)
            picked, ts, keys = _without(before, picked, ts, keys)
    at = len(whole.keys)
    refused = whole.add_many(table, ts, keys, [sh.data for sh in picked])
    if refused:  # not the plain chunk of the stored dtype, or a box asked for twice
        rest.extend(picked[i] for i in refused)
        (keys,) = _without(refused, keys)
    out.whole_at.update(zip(keys, range(at, at + len(keys))))
    out.requested.update([k[0] for k in keys])
    return rest


def _planned(out: LocalReads, box: tuple[str, Shape]) -> bool:
    """Whether ``box`` was planned already, as a whole-chunk entry or as read items."""
    return box in out.whole_at or MetadataIndex(*box) in out.dests


def _without(drop: list[int], *columns: list[Any]) -> tuple[list[Any], ...]:
    """``columns`` without the entries at positions ``drop``."""
    skip = set(drop)
    return tuple([x for i, x in enumerate(col) if i not in skip] for col in columns)


def _take_whole(
    out: LocalReads,
    fqn: str,
    offsets: Shape,
    sizes: Shape,
    view: torch.Tensor,
    md: TensorStorageMetadata,
) -> bool:
    """Record the request as a whole-chunk column entry if it is one; False if it must be
    planned as read items."""
    whole = out.whole
    assert whole is not None
    box = (fqn, offsets)
    at = out.whole_at.get(box)
    if at is not None:  # the same box requested twice on this rank: read once, copy
        if whole.targets[at].shape != view.shape:
            raise ShapeMismatchError(f"{fqn!r}: two shards at offset {offsets} differ in size")
        whole.copies.setdefault(at, []).append(view)
        return True
    if not isinstance(md.chunks, ChunkList) or view.shape != sizes:
        return False
    if out.dests and MetadataIndex(fqn, offsets) in out.dests:
        return False  # already planned as items (an earlier request of another kind)
    at = len(whole.keys)
    if not whole.add(box, view, md.chunks):  # not the plain chunk of the stored dtype
        return False
    out.whole_at[box] = at
    return True


class ShardedLoadPlanner(LoadPlanner):
    """DCP ``LoadPlanner`` that reshards: any box split of the stored tensors to any other.

    Works with ``dcp.load`` too. Tensor shards are filled in place; objects are unpickled
    with ``weights_only`` unless ``allow_pickle``. ``strict`` takes dcpbridge's and every
    Megatron-Core policy (``dcpbridge.planners.strict``): key mismatches are named as Megatron
    names them, raised inside planning (so every rank raises, before any read) and, for
    policies that need them, stored-not-requested keys are found on the coordinator from every
    rank's request. After planning, ``requested_not_stored`` (this rank's; Megatron's
    *unexpected*) and ``stored_not_requested`` (all ranks'; Megatron's *missing*, empty unless
    the policy needs it) hold the keys; ``missing_keys`` (the storage names of the former)
    and ``unexpected_keys`` (the latter, sorted) keep ``nn.Module``'s naming.
    """

    collect_whole_reads = False
    """Set by dcpbridge's driver when the reader takes ``whole_reads`` (``read_whole``):
    whole-chunk requests are then planned as columns, not as read items."""

    def __init__(
        self,
        *,
        strict: Any = StrictMode.RAISE_MISSING,
        allow_pickle: bool = False,
        allow_dtype_cast: bool = False,
    ) -> None:
        self.policy = parse_strict(strict)
        self.allow_pickle = allow_pickle
        self.allow_dtype_cast = allow_dtype_cast
        self.requested_not_stored: set[str] = set()
        self.stored_not_requested: set[str] = set()
        self.missing_keys: list[str] = []
        self.unexpected_keys: list[str] = []
        self.loaded_objects: dict[str, Any] = {}
        self._state_dict: Any = None
        self._metadata: Metadata | None = None
        self._local = LocalReads()
        self._lock = threading.Lock()

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        if metadata is None:
            raise InvalidRequestError("ShardedLoadPlanner needs the checkpoint metadata")
        self._state_dict = state_dict
        self._metadata = metadata

    def leaves(self) -> Iterable[Leaf]:
        """The leaves to fill: the state dict's, keyed as DCP keys them."""
        return iter_leaves(self._state_dict)

    def common_keys(self) -> set[str]:
        """Stored names that are common state, not keys (none for a plain planner)."""
        return set()

    def requests(self) -> tuple[Sequence[Any], Iterable[Leaf]]:
        """What to fill: tensor shards each stored under its own key (planned in bulk), and
        the other leaves (by default every leaf of the state dict, keyed as DCP keys them)."""
        return (), self.leaves()

    def create_local_plan(self) -> LoadPlan:
        assert self._metadata is not None
        shards, leaves = self.requests()
        self._local = plan_local_reads(
            leaves,
            self._metadata,
            allow_dtype_cast=self.allow_dtype_cast,
            whole_columns=self.collect_whole_reads,
            shards=shards,
        )
        self.missing_keys = sorted(self._local.missing)
        common = self.common_keys()
        requested: set[str] | None = None
        names: dict[str, str] = {}
        if self.missing_keys or self.policy.needs_stored:  # else neither is asked (a full load)
            requested, names = requested_keys(self._local.requested, common)
        stored = stored_keys(self._metadata, common) if self.missing_keys else set()
        absent = set()
        for name in self.missing_keys:
            key = names.get(name, name)
            if key != name and key in stored:
                raise _other_grid(key, name, self._metadata)
            if name not in common:
                absent.add(key)
        self.requested_not_stored = absent
        if not self.policy.needs_stored:  # the decision needs only this rank's request
            error = decide(self.policy, absent, ()).error
            if error is not None:
                raise error
        data = (requested if self.policy.needs_stored else None, sorted(absent))
        return LoadPlan(self._local.items, planner_data=data)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        if not self.policy.needs_stored:
            return [dataclasses.replace(p, planner_data=None) for p in global_plan]
        assert self._metadata is not None
        common = self.common_keys()
        requested: set[str] = set().union(*(p.planner_data[0] for p in global_plan))
        stored = sorted(stored_keys(self._metadata, common) - requested)
        absent = {rank: p.planner_data[1] for rank, p in enumerate(global_plan)}
        error = decide(self.policy, absent, stored).error
        if error is not None:
            raise error
        return [dataclasses.replace(p, planner_data=stored) for p in global_plan]

    @property
    def whole_reads(self) -> WholeReads | None:
        """The whole-chunk requests planned as columns (None unless ``collect_whole_reads``)."""
        return self._local.whole

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        if self.policy.needs_stored:
            self.stored_not_requested = set(central_plan.planner_data or ())
        self.unexpected_keys = sorted(self.stored_not_requested)
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_object(value, allow_pickle=self.allow_pickle, what=f"object {fqn!r}")
        legacy = self._local.legacy.get(fqn)
        if legacy is not None:
            with self._lock:
                obj = legacy.arrive(fqn, obj)
            if obj is None:
                return
            fqn = legacy.fqn
            legacy.leaf.replace(obj)
        self.loaded_objects[fqn] = obj
        for leaf in self._local.objects.get(fqn, ()):
            if leaf_kind(leaf.value) == "object":
                leaf.replace(obj)
            else:
                leaf.value.data = obj

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self._local.dests[read_item.dest_index]
        target = _narrow(dest.views[0], read_item.dest_offsets, read_item.lengths)
        if target.dtype != dest.stored_dtype:
            return torch.empty(read_item.lengths, dtype=dest.stored_dtype)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        dest = self._local.dests[read_item.dest_index]
        if tensor is dest.views[0] and len(dest.views) == 1:
            return  # read in place (resolve_tensor's whole view)
        first = _narrow(dest.views[0], read_item.dest_offsets, read_item.lengths)
        if tensor.data_ptr() != first.data_ptr() or tensor.dtype != first.dtype:
            first.copy_(tensor)
        for view in dest.views[1:]:  # from the stored bytes: ``first`` may be a cast of them
            _narrow(view, read_item.dest_offsets, read_item.lengths).copy_(tensor)


def _narrow(t: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    """The view of box ``offsets``+``lengths`` of ``t``."""
    return narrow_box(t, offsets, lengths)


def _other_grid(key: str, name: str, metadata: Metadata) -> ShapeMismatchError:
    """ShardedObject ``key`` is stored, but not cell ``name``: another grid of it is."""
    cells = sorted(n for n in metadata.state_dict_metadata if object_key(n) == key)
    return ShapeMismatchError(
        f"ShardedObject {key!r}: cell {name!r} is requested but not in the checkpoint, which "
        f"stores another grid of {key!r}: {key_list(cells, limit=4)}"
    )
