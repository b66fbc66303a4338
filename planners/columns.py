"""A rank's save plan as arrays, sent alongside its write items: the coordinator validates
and indexes a million chunks with array operations instead of walking a million objects.

The items stay the DCP protocol's (any writer can write them); the columns describe exactly
those items (``PlanColumns.items`` is the very list, checked by identity after the plan
crossed processes), and their fingerprint ties each rank's write results to the plan the
coordinator validated (``dcpbridge.storage.write.written``).
"""

from __future__ import annotations

import hashlib
import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from dcpbridge.planners.boxes import chunk_arrays

_TENSOR_DATA = operator.attrgetter("tensor_data")
_INDEX, _FQN = operator.attrgetter("index"), operator.attrgetter("fqn")
_CHUNK = operator.attrgetter("chunk")
_OFFSETS, _SIZES = operator.attrgetter("offsets"), operator.attrgetter("sizes")
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


@dataclass(slots=True, eq=False)
class PlanColumns:
    """A rank's write items as arrays: the tensor items in plan order, and where the object
    items are."""

    items: list[WriteItem]  # the plan's own list these describe (identity is checked)
    key: np.ndarray  # per tensor item: its key's position in the rank's declarations
    offsets: np.ndarray  # (n, width) int64, padded with 0
    sizes: np.ndarray  # (n, width) int64, padded with 1
    dims: np.ndarray  # per tensor item: its number of dimensions
    objects: np.ndarray  # positions of the object (BYTE_IO) items in ``items``
    declared: int  # how many keys the rank declared (``key`` indexes them)
    digest: bytes  # fingerprint of the declarations and of all the above

    def describes(self, plan: SavePlan) -> bool:
        """Whether these columns are those of ``plan``'s items (its list, same length)."""
        return self.items is plan.items and len(self.key) + len(self.objects) == len(plan.items)


def declarations_digest(tensors: Mapping[str, tuple[Sequence[int], str]]) -> bytes:
    """A fingerprint of a rank's tensor declarations (key -> (shape, dtype), in order): ranks
    declaring the same are merged by it instead of comparing every entry."""
    names = list(tensors)
    shapes = list(map(_FIRST, tensors.values()))
    h = hashlib.blake2b(digest_size=16)
    for text in (names, list(map(_SECOND, tensors.values()))):
        h.update(np.fromiter(map(len, text), np.int64, len(text)).tobytes())
        h.update("".join(text).encode("utf-8", "surrogatepass"))
    total = sum(map(len, shapes))
    h.update(np.fromiter(map(len, shapes), np.int64, len(shapes)).tobytes())
    try:
        h.update(np.fromiter(itertools.chain.from_iterable(shapes), np.int64, total).tobytes())
    except (OverflowError, TypeError, ValueError):  # not int64: ranks are compared in full
        return b""
    return h.digest()


def plan_columns(
    items: list[WriteItem], tensors: Mapping[str, Any], declared: bytes
) -> PlanColumns | None:
    """The columns of ``items``, whose tensor keys ``tensors`` declares (in order, with
    fingerprint ``declared``); None if one does not fit (an undeclared key, ragged or beyond-int64 boxes): the coordinator
    then reads that plan's items one by one and words what is wrong."""
    names = {k: i for i, k in enumerate(tensors)}
    data = list(map(_TENSOR_DATA, items))
    is_object = np.fromiter(map(operator.is_, data, itertools.repeat(None)), bool, len(data))
    objects = np.flatnonzero(is_object)
    chunk_items = items
    if objects.size:
        chunk_items = list(itertools.compress(items, ~is_object))
        data = list(itertools.compress(data, ~is_object))
    n = len(chunk_items)
    key = np.fromiter(
        map(names.get, map(_FQN, map(_INDEX, chunk_items)), itertools.repeat(-1)), np.int64, n
    )
    if key.size and key.min() < 0:
        return None
    chunks = list(map(_CHUNK, data))
    offsets: Sequence[Sequence[int]] = list(map(_OFFSETS, chunks))
    width = max(map(len, offsets), default=0)
    try:
        box_o, box_s, dims = chunk_arrays(offsets, list(map(_SIZES, chunks)), width)
    except (OverflowError, ValueError, TypeError):
        return None
    h = hashlib.blake2b(digest_size=16)
    h.update(declared)
    for part in (np.array([len(items), width]), key, box_o, box_s, dims, objects):
        h.update(np.ascontiguousarray(part, dtype=np.int64).tobytes())
    objects = objects.astype(np.int64)
    return PlanColumns(items, key, box_o, box_s, dims, objects, len(tensors), h.digest())


@dataclass(slots=True, eq=False)
class GatheredColumns:
    """Every rank's columns joined, rank by rank (the coordinator's view of all chunks)."""

    kid: np.ndarray  # per chunk: global key id
    offsets: np.ndarray  # (n, width)
    sizes: np.ndarray
    dims: np.ndarray
    counts: list[int]  # chunks per rank
    item_counts: np.ndarray  # items per rank (chunks and objects)
    flat: np.ndarray  # per chunk: its position among all ranks' items, rank by rank
    object_items: list[tuple[int, WriteItem]]  # (rank, item) of every object item
    digests: tuple[bytes, ...]  # per rank: its columns' fingerprint


def gather_columns(
    plans: Sequence[SavePlan], columns: Sequence[PlanColumns], key_maps: Sequence[np.ndarray]
) -> GatheredColumns:
    """Join the columns of every rank's plan; ``key_maps[r]`` maps rank ``r``'s key
    positions to global key ids."""
    width = max((c.offsets.shape[1] for c in columns), default=0)

    def padded(a: np.ndarray, fill: int) -> np.ndarray:
        if a.shape[1] == width:
            return a
        out = np.full((a.shape[0], width), fill, dtype=np.int64)
        out[:, : a.shape[1]] = a
        return out

    item_counts = np.fromiter((len(p.items) for p in plans), np.int64, len(plans))
    item_starts = np.cumsum(item_counts) - item_counts
    is_object = np.zeros(int(item_counts.sum()), dtype=bool)
    object_items = []
    for rank, (plan, c) in enumerate(zip(plans, columns)):
        if c.objects.size:
            is_object[item_starts[rank] + c.objects] = True
            object_items.extend((rank, plan.items[p]) for p in c.objects.tolist())
    return GatheredColumns(
        kid=np.concatenate(
            [m[c.key] for m, c in zip(key_maps, columns)] or [np.zeros(0, np.int64)]
        ),
        offsets=np.concatenate(
            [padded(c.offsets, 0) for c in columns] or [np.zeros((0, width), np.int64)]
        ),
        sizes=np.concatenate(
            [padded(c.sizes, 1) for c in columns] or [np.zeros((0, width), np.int64)]
        ),
        dims=np.concatenate([c.dims for c in columns] or [np.zeros(0, np.int64)]),
        counts=[len(c.key) for c in columns],
        item_counts=item_counts,
        flat=np.flatnonzero(~is_object),
        object_items=object_items,
        digests=tuple(c.digest for c in columns),
    )
