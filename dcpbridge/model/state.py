"""Nested state-dict surgery: split sharded from common state, build factories, merge back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dcpbridge.model.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    merged,
)
from dcpbridge.planners.errors import SerializationError
from dcpbridge.planners.walk import like


class _Hole:
    """Marks a position with no value in a split-off part of a state dict."""

    def __repr__(self) -> str:
        return "HOLE"


HOLE: Any = _Hole()


def is_sharded(x: Any) -> bool:
    return isinstance(x, (ShardedTensor, ShardedObject))


def is_nonpersistent(x: Any) -> bool:
    return isinstance(x, LocalNonpersistentObject)


def extract(tree: Any, pred: Callable[[Any], bool]) -> tuple[Any, Any]:
    """Split ``tree`` into (leaves matching ``pred``, the rest), both keeping the structure.

    Dict entries without content are dropped; list positions without content become ``HOLE``
    so positions survive; an originally empty container counts as content of the rest.
    """
    if isinstance(tree, dict):
        if not tree:
            return HOLE, {}
        match, rest = {}, {}
        for k, v in tree.items():
            m, r = extract(v, pred)
            if m is not HOLE:
                match[k] = m
            if r is not HOLE:
                rest[k] = r
        return match or HOLE, rest or HOLE
    if isinstance(tree, (list, tuple)):
        if not tree:
            return HOLE, type(tree)()
        pairs = [extract(v, pred) for v in tree]
        match = [m for m, _ in pairs]
        rest = [r for _, r in pairs]
        return (
            like(tree, match) if any(m is not HOLE for m in match) else HOLE,
            like(tree, rest) if any(r is not HOLE for r in rest) else HOLE,
        )
    return (tree, HOLE) if pred(tree) else (HOLE, tree)


def map_leaves(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """A copy of ``tree``'s containers with ``fn`` applied to every leaf (holes stay holes)."""
    if isinstance(tree, dict):
        return {k: map_leaves(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return like(tree, [map_leaves(v, fn) for v in tree])
    return tree if tree is HOLE else fn(tree)


def leaves(tree: Any) -> list[Any]:
    """Every leaf of ``tree`` in traversal order, holes excluded."""
    out: list[Any] = []
    map_leaves(tree, out.append)
    return out


def merge(base: Any, overlay: Any) -> Any:
    """``overlay`` on top of ``base``: dicts merge by key, equal-length lists by position."""
    if overlay is HOLE:
        return base
    if base is HOLE:
        return overlay
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = dict(base)
        for k, v in overlay.items():
            out[k] = merge(out.get(k, HOLE), v)
        return out
    if (
        isinstance(base, (list, tuple))
        and isinstance(overlay, (list, tuple))
        and len(base) == len(overlay)
    ):
        merged = [merge(b, o) for b, o in zip(base, overlay)]
        return like(overlay, merged)
    return overlay


def fill_holes(tree: Any, value: Any = None) -> Any:
    """Drop dict entries that are holes; put ``value`` in list positions that are."""
    if isinstance(tree, dict):
        return {k: fill_holes(v, value) for k, v in tree.items() if v is not HOLE}
    if isinstance(tree, (list, tuple)):
        return like(tree, [fill_holes(v, value) for v in tree])
    return value if tree is HOLE else tree


def apply_factories(tree: Any) -> Any:
    """Replace every ``ShardedTensorFactory`` by the sharded state dict it builds."""

    def build(x: Any) -> Any:
        if not isinstance(x, ShardedTensorFactory):
            return x
        built = x.build()
        if any(isinstance(v, ShardedTensorFactory) for v in leaves(built)):
            raise SerializationError(
                f"factory {x.key!r} built another factory; nesting is not supported"
            )
        return built

    return map_leaves(tree, build)


def apply_factory_merges(loaded: Any, template: Any) -> Any:
    """Where ``template`` held a factory, replace the loaded sub-dict by ``merge_fn``'s tensor."""
    if isinstance(template, ShardedTensorFactory):
        if loaded is HOLE or _has_hole(loaded):
            return HOLE  # parts were missing from the checkpoint (strict="return_all")
        return merged(template, loaded)
    if isinstance(template, dict) and isinstance(loaded, dict):
        return {
            k: apply_factory_merges(v, template[k]) if k in template else v
            for k, v in loaded.items()
        }
    if isinstance(template, (list, tuple)) and isinstance(loaded, (list, tuple)):
        return like(loaded, [apply_factory_merges(x, t) for x, t in zip(loaded, template)])
    return loaded


def _has_hole(tree: Any) -> bool:
    if isinstance(tree, dict):
        return any(_has_hole(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_has_hole(v) for v in tree)
    return tree is HOLE


def assemble(common: Any, loaded: Any, template: Any, nonpersistent: Any) -> Any:
    """The result of a load: ``loaded`` (factories merged back) over ``common``, plus the
    template's non-persistent objects, in new containers; missing entries dropped."""
    loaded = apply_factory_merges(loaded, template)
    result = merge(common, loaded)
    if nonpersistent is not HOLE:
        result = merge(result, map_leaves(nonpersistent, lambda x: x.unwrap()))
    return fill_holes(result, None)
