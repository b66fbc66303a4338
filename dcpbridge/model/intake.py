"""Every kind of training state into dcpbridge's own sharded types, keyed as DCP keys it.

One walk over the user's state dict (DCP's flattening rules) sorts each leaf:
- dcpbridge's or Megatron-Core's ShardedTensor / ShardedObject (recognised by their fields)
  become dcpbridge shards; factories are built; non-persistent objects are skipped;
- DTensors and torch ShardedTensors become ShardedTensors under their dotted path;
- plain tensors become whole-tensor ShardedTensors under their path, held by every rank
  (who writes them is ``dcpbridge.engine.ownership``'s answer, as for every shard);
- any other value is common state, stored one entry per key (plain DCP's layout);
- anything else carrying sharding is refused by name.
On load, the same walk remembers how to put each loaded value back where the template had it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dcpbridge.model.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    check_not_flattened,
    merged,
)
from dcpbridge.model.state import HOLE
from dcpbridge.planners.errors import SerializationError
from dcpbridge.planners.leaves import (
    check_key,
    freed_storage,
    refuse,
    storage_holds,
    tensor_boxes,
)
from dcpbridge.planners.protocol import LeafKind, leaf_kind
from dcpbridge.planners.walk import SLOW, STATE_WALKER, Leaf, ObjPath, set_path

Shard = ShardedTensor | ShardedObject
_LEAF_TYPES = frozenset({ShardedTensor, ShardedObject, torch.Tensor, torch.nn.Parameter})
_SHARDS = (ShardedTensor, ShardedObject)
_SHARD_TYPES = frozenset(_SHARDS)  # checked before isinstance: the commonest slots


def own_tensor(value: Any) -> ShardedTensor:
    """dcpbridge's ShardedTensor for ours or a Megatron-Core one (sharing its data)."""
    check_not_flattened(value)
    if isinstance(value, ShardedTensor):
        return value
    return ShardedTensor(
        value.key,
        value.data,
        value.dtype,
        tuple(value.local_shape),
        tuple(value.global_shape),
        tuple(value.global_offset),
        getattr(value, "axis_fragmentations", None),
        value.replica_id,
        value.prepend_axis_num,
        value.allow_shape_mismatch,
    )


def _held(shard: Any) -> Any:
    """``shard`` for a save, unless its data's storage was freed (``storage_holds``): writing
    or staging it read a dangling address (a crash, or a bare RuntimeError)."""
    data = getattr(shard, "data", None)
    if isinstance(data, torch.Tensor) and not data.is_meta and not storage_holds(data):
        raise freed_storage(f"ShardedTensor {shard.key!r}", data, save=True)
    return shard


def own_object(value: Any) -> ShardedObject:
    if isinstance(value, ShardedObject):
        return value
    return ShardedObject(
        value.key,
        value.data,
        tuple(value.global_shape),
        tuple(value.global_offset),
        value.replica_id,
    )


def _boxes(path: str, value: Any, kind: LeafKind, save: bool = False) -> list[ShardedTensor]:
    """ShardedTensors of a DTensor / torch ShardedTensor / plain tensor leaf (``save``: see
    ``tensor_boxes``)."""
    return [
        ShardedTensor.from_box(
            b.key,
            b.data,
            b.global_shape,
            b.global_offset,
            replica_id=b.replica_id,
        )
        for b in tensor_boxes(path, value, kind, save)
    ]


def _built(factory: Any) -> Any:
    check_not_flattened(factory)
    built = factory.build()
    for leaf in STATE_WALKER.leaves(built):
        kind = leaf_kind(leaf.value)
        if kind not in ("tensor_shard", "object_shard"):
            raise SerializationError(
                f"factory {getattr(factory, 'key', '?')!r} built a {type(leaf.value).__name__} "
                f"at {leaf.path!r}; factories must build ShardedTensors and ShardedObjects"
            )
    return built


def _factory_shards(built: Any) -> list[Shard]:
    return [
        own_tensor(leaf.value)
        if leaf_kind(leaf.value) == "tensor_shard"
        else own_object(leaf.value)
        for leaf in STATE_WALKER.leaves(built)
    ]


@dataclass
class SaveParts:
    """A state dict sorted for saving: shards, and the common state by DCP key."""

    shards: list[Shard] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)  # common values by key
    paths: dict[str, ObjPath] = field(default_factory=dict)  # every common key's path
    empty: list[ObjPath] = field(default_factory=list)  # empty dicts (DCP keys drop them)
    plain: dict[str, torch.Tensor] = field(default_factory=dict)  # common tensors by key
    tensor_paths: dict[str, ObjPath] = field(default_factory=dict)  # DTensors', torch's

    def staged(self, shards: list[Shard]) -> SaveParts:
        """These parts after staging (``async_save``): staged shards, copied common values."""
        return dataclasses.replace(self, shards=shards, objects=copy.deepcopy(self.objects))

    def common_layout(self) -> tuple[Any, ...]:
        """The common state's keys, paths and empty dicts, and the DTensors' paths (part of
        a save's structure), each its own part: a path moved from one to another (a plain
        tensor turned DTensor) changes the layout."""
        return (tuple(self.paths.items()), tuple(self.empty), tuple(self.tensor_paths.items()))

    def common_table(self) -> dict[str, Any]:
        """What the metadata records so a load returns the common state whole."""
        return {
            "keys": {k: list(p) for k, p in self.paths.items()},
            "empty": [list(p) for p in self.empty],
        }

    def nested_common(self, tree: Any = None) -> dict[str, Any]:
        """The common state (values and plain tensors) as the nested dict it came from; with
        ``tree``, the state dict these parts were sorted from, under its own dict keys (an
        optimizer's int keys stay ints, as Megatron-Core's common state keeps them)."""
        names: dict[int, dict[str, Any]] = {}
        out: dict[str, Any] = {}
        for key, path in self.paths.items():
            value = self.objects[key] if key in self.objects else self.plain[key]
            set_path(out, path, value, None if tree is None else _keys(tree, path, names))
        for path in self.empty:
            set_path(out, path, {}, None if tree is None else _keys(tree, path, names))
        return out


def _keys(tree: Any, path: ObjPath, names: dict[int, dict[str, Any]]) -> list[Any]:
    """The keys and indices of ``tree`` that ``path`` (dict keys as strings) was made of;
    ``names`` caches each dict's keys by their string."""
    keys: list[Any] = []
    node = tree
    for item in path:
        key = item
        if isinstance(node, Mapping) and not (type(item) is str and item in node):
            by_name = names.get(id(node))
            if by_name is None:
                by_name = names[id(node)] = {str(k): k for k in node}
            key = by_name[item]
        keys.append(key)
        node = node[key]
    return keys


def for_save(tree: Any) -> SaveParts:
    """Sort ``tree``'s leaves for a save."""
    if not isinstance(tree, Mapping):
        raise SerializationError(f"a state dict must be a mapping, got {type(tree).__name__}")
    parts = SaveParts()
    shards = parts.shards
    for leaf in STATE_WALKER.leaves(tree, bare=ShardedTensor):
        if type(leaf) is ShardedTensor:  # the commonest leaf: own_tensor's check, no call
            if leaf.flattened_range is not None:
                check_not_flattened(leaf)
            shards.append(_held(leaf))
            continue
        value, kind = leaf.value, leaf_kind(leaf.value)
        if kind == "nonpersistent":
            continue
        if kind == "factory":
            parts.shards.extend(_held(s) for s in _factory_shards(_built(value)))
        elif kind == "tensor_shard":
            parts.shards.append(_held(own_tensor(value)))
        elif kind == "object_shard":
            parts.shards.append(own_object(value))
        elif kind in ("dtensor", "torch_sharded", "tensor"):
            key = check_key(leaf.path)
            parts.shards.extend(_boxes(key, value, kind, save=True))
            if kind == "tensor":  # common state: its path is in ``paths``
                parts.plain[key] = value
                parts.paths[key] = leaf.obj_path
            else:
                parts.tensor_paths[key] = leaf.obj_path
        elif kind == "object":
            key = check_key(leaf.path)
            parts.objects[key] = value
            parts.paths[key] = leaf.obj_path
        else:
            raise refuse(leaf.path, value, kind)
    _find_empty(tree, (), parts.empty)
    return parts


def _find_empty(node: Any, path: ObjPath, out: list[ObjPath]) -> None:
    if type(node) in _LEAF_TYPES:  # shards and tensors hold no dicts: skip the ABC checks
        return
    if isinstance(node, Mapping):
        if not node and path:
            out.append(path)
        for k, v in node.items():
            if type(v) not in _LEAF_TYPES:  # (no path built for the commonest leaves)
                _find_empty(v, (*path, str(k)), out)
    elif isinstance(node, list) and not STATE_WALKER.is_terminal(node):
        for i, v in enumerate(node):
            if type(v) not in _LEAF_TYPES:
                _find_empty(v, (*path, i), out)


def normalize(tree: Any) -> Any:
    """``tree`` with Megatron-Core's sharded types replaced by dcpbridge's (same data)."""

    def own(leaf: Leaf) -> Any:
        value, kind = leaf.value, leaf_kind(leaf.value)
        if kind == "tensor_shard":
            return own_tensor(value)
        if kind == "object_shard":
            return own_object(value)
        if kind == "factory" and not isinstance(value, ShardedTensorFactory):
            return ShardedTensorFactory(
                value.key,
                value.data,
                lambda *_: normalize(_built(value)),
                value.merge_fn,
                value.replica_id,
            )
        if kind == "nonpersistent" and not isinstance(value, LocalNonpersistentObject):
            return LocalNonpersistentObject(value.unwrap())
        return value

    return STATE_WALKER.rebuild(tree, own)


# -- load --------------------------------------------------------------------------------------


MISSING: Any = HOLE  # a requested value the checkpoint does not hold (dropped from results)


@dataclass
class LoadParts:
    """A load template sorted: the shards to fill, the plain values and tensors it names."""

    template: Any
    shards: list[Shard] = field(default_factory=list)
    plain_tensors: dict[str, ShardedTensor] = field(default_factory=dict)  # by key
    tensor_paths: dict[str, ObjPath] = field(default_factory=dict)  # plain tensors' paths
    values: dict[str, ObjPath] = field(default_factory=dict)  # plain values wanted, by key
    _slots: dict[int, Shard | Callable[[Callable[[Shard], Any]], Any]] = field(
        default_factory=dict
    )  # by the template leaf's id: its one shard (the value is what loaded it), or a slot

    def result(
        self, loaded: Callable[[Shard], Any], value: Callable[[str], Any], in_place: bool = False
    ) -> Any:
        """The template's structure with every leaf replaced by what was loaded for it:
        ``loaded(shard)`` for shards (MISSING if absent), ``value(key)`` for plain values.
        ``in_place``: every ShardedTensor was filled in place, so ``loaded`` would answer its
        data (taken here for all of them at once, without a call each)."""

        slots = self._slots
        known = (
            {i: s.data for i, s in slots.items() if type(s) is ShardedTensor} if in_place else None
        )

        def filled(leaf_value: Any) -> Any:
            slot = slots.get(id(leaf_value))
            if slot is None:
                return SLOW
            shard = type(slot) in _SHARD_TYPES or isinstance(slot, _SHARDS)
            return loaded(slot) if shard else slot(loaded)

        def fill(leaf: Leaf) -> Any:
            got = filled(leaf.value)
            if got is not SLOW:
                return got
            kind = leaf_kind(leaf.value)
            if kind == "nonpersistent":
                return leaf.value.unwrap()
            if kind == "object":
                return value(leaf.path)
            return leaf.value

        return STATE_WALKER.rebuild(self.template, fill, quick=filled, known=known)


def for_load(tree: Any) -> LoadParts:
    """Sort a load template; tensor-like leaves are filled in place by the load."""
    if not isinstance(tree, Mapping):
        raise SerializationError(f"a load template must be a mapping, got {type(tree).__name__}")
    parts = LoadParts(tree)
    all_shards, slots = parts.shards, parts._slots
    for leaf in STATE_WALKER.leaves(tree, bare=ShardedTensor):
        if type(leaf) is ShardedTensor:  # the commonest leaf: own_tensor's and init_data's
            value = leaf
            if value.flattened_range is not None:  # checks, without their calls
                check_not_flattened(value)
            data = value.data
            if data is None or data.is_meta:
                value.init_data()
            elif not storage_holds(data):  # filling it wrote to a dangling address
                raise freed_storage(f"ShardedTensor {value.key!r}", data, save=False)
            all_shards.append(value)
            slots[id(value)] = value
            continue
        value = leaf.value
        kind = leaf_kind(value)
        if kind == "nonpersistent":
            continue
        if kind == "factory":
            built = _built(value)
            shards = _factory_shards(built)
            parts.shards.extend(shards)
            parts._slots[id(value)] = _merge_slot(value, built, shards)
        elif kind in ("tensor_shard", "object_shard"):
            shard = own_tensor(value) if kind == "tensor_shard" else own_object(value)
            if isinstance(shard, ShardedTensor):
                shard.init_data()
                data = shard.data
                if data is not None and not storage_holds(data):
                    raise freed_storage(f"ShardedTensor {shard.key!r}", data, save=False)
            parts.shards.append(shard)
            parts._slots[id(value)] = shard  # not a closure per tensor: ``result`` asks it
        elif kind in ("dtensor", "torch_sharded", "tensor"):
            key = check_key(leaf.path)
            shards = _boxes(key, value, kind)
            parts.shards.extend(shards)
            if kind == "tensor":
                parts.plain_tensors[key] = shards[0]
                parts.tensor_paths[key] = leaf.obj_path
                parts._slots[id(value)] = _plain_slot(value, shards[0])
            else:
                parts._slots[id(value)] = _whole_slot(value, shards)
        elif kind == "object":
            parts.values[check_key(leaf.path)] = leaf.obj_path
        else:
            raise refuse(leaf.path, value, kind)
    return parts


def _plain_slot(value: torch.Tensor, shard: Shard) -> Callable[[Callable[[Shard], Any]], Any]:
    """A plain tensor comes back filled in place, or as the stored tensor if the checkpoint
    holds it in another dtype or shape (common state: the checkpoint's value wins)."""

    def slot(loaded: Callable[[Shard], Any]) -> Any:
        got = loaded(shard)
        return value if got is shard.data else got

    return slot


def _whole_slot(value: Any, shards: list[Shard]) -> Callable[[Callable[[Shard], Any]], Any]:
    def slot(loaded: Callable[[Shard], Any]) -> Any:
        return MISSING if any(loaded(s) is MISSING for s in shards) else value

    return slot


def _merge_slot(
    factory: Any, built: Any, shards: list[Shard]
) -> Callable[[Callable[[Shard], Any]], Any]:
    by_leaf = dict(zip((id(leaf.value) for leaf in STATE_WALKER.leaves(built)), shards))

    def slot(loaded: Callable[[Shard], Any]) -> Any:
        values = STATE_WALKER.rebuild(built, lambda leaf: loaded(by_leaf[id(leaf.value)]))
        if any(v is MISSING for v in (loaded(s) for s in shards)):
            return MISSING
        return merged(factory, values)

    return slot
