"""The planners ``save`` and ``load`` run: the generic planners fed with sorted state.

Save: shards plus the common state one entry per key, and a table in the metadata naming
the common keys and paths, so a load returns the common state whole (Megatron's meaning)
while plain DCP reads every entry by its key. Load: the template's shards and plain values,
every common entry the checkpoint recorded, and the common blob of older checkpoints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from dcpbridge.engine.common_table import WHERE, check_common_table
from dcpbridge.errors import CorruptCheckpointError, InvalidRequestError
from dcpbridge.model.intake import MISSING, LoadParts, Shard
from dcpbridge.model.mapping import COMMON_KEY, ShardedObject, ShardedTensor
from dcpbridge.model.state import merge
from dcpbridge.model.ties import check_overlaps, same_bytes, tied_conflict, untie, untie_checked
from dcpbridge.planners import ShardedLoadPlanner, ShardedSavePlanner
from dcpbridge.planners.columns import PlanColumns
from dcpbridge.planners.distribution import WhoWrites
from dcpbridge.planners.errors import key_list
from dcpbridge.planners.save_planner import LocalSummary, check_data, plan_local_writes
from dcpbridge.planners.walk import Leaf, ObjPath, like, set_path

COMMON_TABLE = "common"  # key of the common-state table in the metadata's planner_data
OBJECT_TABLE = "objects"  # the ShardedObjects' table (ShardedSavePlanner's)


@dataclass(frozen=True, slots=True)
class TensorWrites:
    """A local plan's tensor items and, for each, the position of its shard in the planner's
    shard list: what a save of the same structure writes again, with new data (``at``: the
    items' places in that plan of ``size`` items, whose ``columns`` a re-plan keeps)."""

    positions: list[int]
    items: list[WriteItem]
    at: list[int]
    size: int
    columns: PlanColumns | None


def _in_places(previous: TensorWrites, objects: list[WriteItem]) -> list[WriteItem] | None:
    """The previous plan's item list again: its tensor items at their places, ``objects``
    in the other places in order; None if they are not as many as the places left."""
    if len(previous.items) + len(objects) != previous.size:
        return None
    items: list[WriteItem | None] = [None] * previous.size
    for place, item in zip(previous.at, previous.items):
        items[place] = item
    left = iter(objects)
    return [next(left) if item is None else item for item in items]


class BridgeSavePlanner(ShardedSavePlanner):
    """Plans ``save``'s shards and common entries, and records the common table."""

    # the commit document records every declared tensor, and ``drive`` writes the local
    # plan's items: no empty chunk is added to a plan
    plans_empty_chunks = False

    def __init__(
        self,
        shards: list[Shard],
        objects: dict[str, Any],
        table: dict[str, Any],
        *,
        validate: bool = True,
        owners: WhoWrites | None = None,
        paths: Mapping[str, ObjPath] | None = None,
    ) -> None:
        super().__init__(validate=validate, owners=owners)
        self._shards, self._objects, self._table = shards, objects, table
        self._paths = paths or {}  # state-dict paths of DCP keys (others: the key itself)
        self._previous: TensorWrites | None = None
        self.tensor_writes: TensorWrites | None = None  # of the last local plan

    def leaves(self) -> Iterator[Leaf]:
        for shard in self._shards:
            yield Leaf("", shard, None, None)
        for key, value in self._objects.items():
            yield Leaf(key, value, None, None)

    def reuse_tensor_writes(self, previous: TensorWrites | None) -> None:
        """Plan the tensors as ``previous`` did: the caller vouches that the shards have the
        structure they had then (``dcpbridge.engine.cache``), so only their data is checked."""
        self._previous = previous

    def create_local_plan(self) -> SavePlan:
        previous = self._previous
        if previous is not None and self._matches(previous):
            return self._replan(previous)
        plan = super().create_local_plan()
        at = {id(s): i for i, s in enumerate(self._shards)}
        positions, items, places = [], [], []
        for place, item in enumerate(plan.items):
            if item.tensor_data is not None:
                pos = at.get(id(self._sources[item.index]))
                if pos is None:  # not one of the shards as given: nothing to reuse
                    return plan
                positions.append(pos)
                items.append(item)
                places.append(place)
        self.tensor_writes = TensorWrites(positions, items, places, len(plan.items), self._columns)
        return plan

    def _matches(self, previous: TensorWrites) -> bool:
        """Whether each reused item still names its shard's key and offsets (a cheap guard
        against a shard list ordered otherwise than the structure vote saw)."""
        shards = self._shards
        n = len(shards)
        for pos, item in zip(previous.positions, previous.items):
            if pos >= n:
                return False
            sh, index = shards[pos], item.index
            if not isinstance(sh, ShardedTensor) or sh.key != index.fqn:
                return False
            if sh.global_offset != index.offset:
                return False
        return True

    def _replan(self, previous: TensorWrites) -> SavePlan:
        """The previous tensor items over the new shards' data; objects planned afresh."""
        shards = self._shards
        sources: dict[Any, Any] = {}
        for pos, item in zip(previous.positions, previous.items):
            sh = shards[pos]
            check_data(sh)
            sources[item.index] = sh
        objects = plan_local_writes(self._object_leaves(), self._is_coordinator, owners=self.owners)
        sources.update(objects.sources)
        self._sources = sources
        self.tensor_writes = previous
        items = _in_places(previous, objects.items)
        if items is None or previous.columns is None:
            items, self._columns = [*previous.items, *objects.items], None
        else:  # the tensor items where the columns place them: the writer reports by them
            self._columns = dataclasses.replace(previous.columns, items=items)
        self._planned = tuple(items)
        return SavePlan(items, planner_data=LocalSummary())

    def _object_leaves(self) -> Iterator[Leaf]:
        for shard in self._shards:
            if isinstance(shard, ShardedObject):
                yield Leaf("", shard, None, None)
        for key, value in self._objects.items():
            yield Leaf(key, value, None, None)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        data = metadata.planner_data
        for key in metadata.state_dict_metadata:  # DCP's mapping: torch's template-free
            if key not in (COMMON_TABLE, OBJECT_TABLE):  # loaders rebuild the nesting
                data.setdefault(key, list(self._paths.get(key, (key,))))
        data[COMMON_TABLE] = self._table
        return plans, metadata


def common_table(metadata: Metadata) -> dict[str, Any] | None:
    """The common-state table a dcpbridge save recorded (checked), or None (plain DCP, whose
    planner data maps keys to paths, and older saves)."""
    data = metadata.planner_data
    table = data.get(COMMON_TABLE) if isinstance(data, dict) else None
    return check_common_table(table) if isinstance(table, dict) and "keys" in table else None


def _check_common_entries(table: dict[str, Any], stored: Mapping[str, Any]) -> None:
    """Every key the common-state table lists is a stored entry (a save records one for each):
    a damaged document's listed key would otherwise hide a request for it, never missing."""
    lost = [key for key in table["keys"] if key not in stored]
    if lost:
        raise CorruptCheckpointError(
            f"{WHERE}: lists common keys the checkpoint stores no entry for: {key_list(map(repr, lost))}"
        )


def _path(raw: Any) -> ObjPath:
    return tuple(p if isinstance(p, int) else str(p) for p in raw)


def lookup(tree: Any, path: ObjPath) -> Any:
    """The value at ``path`` in a nested common state, or MISSING."""
    node = tree
    for item in path:
        if isinstance(node, Mapping):
            if item in node:
                node = node[item]
                continue
            match = [k for k in node if str(k) == item]
            if not match:
                return MISSING
            node = node[match[0]]
        elif isinstance(node, (list, tuple)) and isinstance(item, int) and item < len(node):
            node = node[item]
        else:
            return MISSING
    return node


class BridgeLoadPlanner(ShardedLoadPlanner):
    """Plans ``load``: the template's shards and values plus the checkpoint's common state."""

    def __init__(
        self,
        parts: LoadParts,
        shards: list[Shard],
        *,
        legacy_common: bool,
        common: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.parts = parts
        # tied keys' shards read into scratch; other memory shared by two requests: refused
        if shards is parts.shards:  # (not a fully-parallel share): one pass finds both
            self.shards, self.ties = untie_checked(shards)
        else:
            self.shards, self.ties = untie(shards)
            check_overlaps(parts.shards)
        self.legacy_common = legacy_common  # the common state is one blob (torch_dist)
        # that blob, where it was read before planning (torch_dist's common.pt): a value it
        # holds is the one loaded, as Megatron-Core loads it, even where a shard has its key
        self.common = common
        self.values: dict[str, Any] = {}  # plain values and common entries, by key
        self.from_blob: set[str] = set()  # plain tensors to copy out of the blob
        self.replaced: dict[str, torch.Tensor] = {}  # plain tensors stored in another form
        self.as_values: set[str] = set()  # plain tensors stored as values (read into values)
        self.table: dict[str, Any] | None = None
        self.others: list[Shard] | None = None  # shards not planned in bulk (``requests``)

    def leaves(self) -> Iterator[Leaf]:
        shards, rest = self.requests()
        for shard in shards:
            yield Leaf("", shard, None, None)
        yield from rest

    def requests(self) -> tuple[list[ShardedTensor], Iterator[Leaf]]:
        """The template's ShardedTensors, as they are (planned in bulk), and the other
        leaves: its objects, plain tensors and values, and the checkpoint's common state."""
        plain = self.parts.plain_tensors
        direct: list[ShardedTensor] = []
        others: list[Shard] = []
        self.others = others
        for s in self.shards:
            (direct if isinstance(s, ShardedTensor) and s.key not in plain else others).append(s)
        return direct, self._other_leaves(others)

    def _other_leaves(self, others: list[Shard]) -> Iterator[Leaf]:
        """``requests``' leaves: of ``others`` (ShardedObjects, plain tensors' shards), plain
        values and the common state."""
        assert self._metadata is not None
        taken: set[str] = set()  # keys planned: the template's tensors join them where a table asks
        stored = self._metadata.state_dict_metadata
        self.table = common_table(self._metadata)
        blob = self.legacy_common or COMMON_KEY in stored
        if self.table is not None and not blob:
            _check_common_entries(self.table, stored)
        plain = self.parts.plain_tensors
        for shard in others:
            key = shard.key if isinstance(shard, ShardedTensor) else shard.unique_key
            if key in plain:
                md = stored.get(key)
                if blob and (md is None or self._in_common(self.parts.tensor_paths[key])):
                    if md is not None:
                        self._check_unambiguous(key)
                    self.from_blob.add(key)
                    continue
                if isinstance(md, BytesStorageMetadata) and isinstance(shard, ShardedTensor):
                    # the plain tensor is stored as a value: it comes back as stored
                    self.as_values.add(key)
                    taken.add(key)
                    yield Leaf(key, None, self.values, key)
                    continue
                if isinstance(md, TensorStorageMetadata) and (
                    md.properties.dtype != shard.dtype or tuple(md.size) != shard.global_shape
                ):
                    shard = self._stored_tensor(key, md)
                    self.replaced[key] = shard.data
            taken.add(key)
            yield Leaf("", shard, None, None)
        for key, path in self.parts.values.items():  # plain values: the checkpoint's
            md = stored.get(key)
            if md is None or self._in_common(path):
                continue
            taken.add(key)
            yield self._as_stored(key, md)  # a stored tensor where the template has a value: whole
        if self.table:  # every tensor the template asks for, also one a fully-parallel
            # load reads on another rank (not this rank's common state to return whole)
            taken.update([s.key for s in self.parts.shards if isinstance(s, ShardedTensor)])
        for key in self.table["keys"] if self.table else ():
            if key in taken:
                continue
            yield self._as_stored(key, stored.get(key))
        if COMMON_KEY in stored:
            yield Leaf(COMMON_KEY, None, self.values, COMMON_KEY)

    def _check_unambiguous(self, key: str) -> None:
        """Refuse a template asking for ``key`` both as a plain tensor (the common state's
        value) and as a ShardedTensor, where the checkpoint holds both under that key."""
        if sum(isinstance(s, ShardedTensor) and s.key == key for s in self.shards) > 1:
            raise InvalidRequestError(
                f"{key!r}: the load template asks for it both as a plain tensor and as a "
                "ShardedTensor, and the checkpoint holds both a common-state value (common.pt) "
                "and a stored tensor under that key; rename one of them in the template"
            )

    def _plain_in_common(self) -> set[str]:
        """The template's plain tensors the common state read before planning holds."""
        return self._plain_in(self.common)

    def _plain_in(self, blob: Any) -> set[str]:
        """The template's plain tensors a common blob holds, this rank's own or not: a
        fully-parallel load hands boxes over before they are filled from it, so every rank
        (each reads the blob) fills them itself."""
        if blob is None:
            return set()
        paths = self.parts.tensor_paths
        return {k for k in self.parts.plain_tensors if lookup(blob, paths[k]) is not MISSING}

    def _in_common(self, path: ObjPath) -> bool:
        """Whether the common state read before planning holds a value at ``path``."""
        return self.common is not None and lookup(self.common, path) is not MISSING

    def common_keys(self) -> set[str]:
        return {COMMON_KEY, *(self.table["keys"] if self.table else ())}

    def _as_stored(self, key: str, md: Any) -> Leaf:
        """The leaf that reads stored ``key`` into ``values`` as it is stored: a stored tensor
        whole, anything else as a value."""
        if isinstance(md, TensorStorageMetadata):
            box = self._stored_tensor(key, md)
            self.values[key] = box.data
            return Leaf("", box, None, None)
        return Leaf(key, None, self.values, key)

    @staticmethod
    def _stored_tensor(key: str, md: TensorStorageMetadata) -> ShardedTensor:
        """A new whole tensor to read stored tensor ``key`` into, as it is stored."""
        t = torch.empty(md.size, dtype=md.properties.dtype)
        return ShardedTensor.from_box(key, t, tuple(md.size), (0,) * t.ndim)

    def after_reads(self) -> None:
        """Once every read is done (inside the read step, so a failure raises on every rank):
        tied keys must have been stored with the same values."""
        if self.ties.pairs:
            self._check_common_ties()
            self.ties.settle({*self.missing_keys, *self.replaced, *self.from_blob, *self.as_values})

    def _check_common_ties(self) -> None:
        """Tied keys of which one or both come from the common state read before planning
        (filled only after the reads): their values must be alike too."""
        common = self._plain_in_common()
        if not common:
            return
        for kept, scratch in self.ties.pairs:
            if kept.key in common or scratch.key in common:
                a, b = self._tied_value(kept, common), self._tied_value(scratch, common)
                if a is not None and b is not None and not same_bytes(a, b):
                    raise tied_conflict(kept.key, scratch.key)

    def _tied_value(self, shard: ShardedTensor, common: set[str]) -> torch.Tensor | None:
        """What a tied shard loads into the shared memory (None: it loads nothing there)."""
        data = shard.data
        assert data is not None
        if shard.key not in common:
            unfilled = self.missing_keys, self.replaced, self.as_values
            return None if any(shard.key in keys for keys in unfilled) else data
        found = lookup(self.common, self.parts.tensor_paths[shard.key])
        fits = isinstance(found, torch.Tensor) and found.dtype == data.dtype
        return found if fits and found.shape == data.shape else None

    def shard_objects(self) -> dict[str, Any]:
        """Loaded ShardedObjects by storage key."""
        shards = self.shards if self.others is None else self.others
        keys = {s.unique_key for s in shards if isinstance(s, ShardedObject)}
        return {k: v for k, v in self.loaded_objects.items() if k in keys}

    def result(self, objects: dict[str, Any], blob: Any) -> tuple[Any, set[str]]:
        """The loaded state in the template's structure, with the checkpoint's common state;
        and the requested keys found absent only now (plain tensors an older blob lacks).

        Tensors and sharded objects are requests; plain values are common state, as in
        Megatron-Core: the checkpoint's value where it has one, else left out.
        """
        missing = set(self.missing_keys)
        holes = False  # a MISSING handed out: only then has the result anything to prune
        from_blob = self.from_blob | self._plain_in(blob)  # also what other ranks read
        filled_all = not (from_blob or missing or self.replaced or self.as_values)

        def loaded(shard: Shard) -> Any:
            nonlocal holes
            if filled_all and type(shard) is ShardedTensor:
                return shard.data
            if isinstance(shard, ShardedObject):
                got = objects.get(shard.unique_key, MISSING)
            elif shard.key in from_blob:
                got = self._copy_from_blob(shard, blob, missing)
            elif shard.key in self.as_values:
                got = self.values.get(shard.key, MISSING)
            elif shard.key in missing:
                got = MISSING
            else:
                return self.replaced.get(shard.key, shard.data)
            holes = holes or got is MISSING
            return got

        def value(key: str) -> Any:
            nonlocal holes
            if key in self.values:
                return self.values[key]
            got = MISSING if blob is None else lookup(blob, self.parts.values[key])
            holes = holes or got is MISSING
            return got

        result = self.parts.result(loaded, value, in_place=filled_all)
        if holes:
            result = _prune(result)
        result = {} if result is MISSING else result
        if self.table is not None:
            for key, raw in self.table["keys"].items():
                if key in self.values and key not in self.parts.values:
                    set_path(result, _path(raw), self.values[key])
            for raw in self.table.get("empty", ()):
                if lookup(result, _path(raw)) is MISSING:
                    set_path(result, _path(raw), {})
        if blob is not None:
            result = merge(blob, result)
        return result, missing - set(self.missing_keys)

    def _copy_from_blob(self, shard: ShardedTensor, blob: Any, missing: set[str]) -> Any:
        """The blob's value of a plain tensor: copied in place, or as stored where it is not
        a tensor of the template's dtype and shape (never cast, as from stored entries)."""
        found = lookup(blob, self.parts.tensor_paths[shard.key])
        if found is MISSING:
            missing.add(shard.key)
            return MISSING
        data = shard.data
        if (
            not isinstance(found, torch.Tensor)
            or found.dtype != data.dtype
            or found.shape != data.shape
        ):
            return found
        data.copy_(found)
        return data


def _prune(tree: Any) -> Any:
    """Drop MISSING values, and dicts left empty by that (as if never requested); list
    positions keep their place as None."""
    if isinstance(tree, dict):
        kept = {k: v for k, v in ((k, _prune(v)) for k, v in tree.items()) if v is not MISSING}
        return MISSING if tree and not kept else kept
    if isinstance(tree, (list, tuple)):
        return like(tree, [None if v is MISSING else v for v in map(_prune, tree)])
    return tree
