"""Walk nested state dicts exactly as DCP's ``flatten_state_dict`` does, keyed by dotted paths.

DCP's rule (``torch/distributed/checkpoint/_traverse.py``): mappings always recurse; a list
recurses by index only if it holds a tensor, a mapping, or such a list; tuples and every other
value are one leaf. dcpbridge extends "holds a tensor" to any tensor-like or sharded leaf and
also recurses into tuples that hold sharded metadata (which DCP would pickle whole), so that
checkpoints match DCP's keys wherever DCP can store the state at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any

from dcpbridge.planners.errors import SerializationError
from dcpbridge.planners.protocol import is_sharded_meta, keeps_list_recursing

PathItem = str | int
ObjPath = tuple[PathItem, ...]


@dataclass(slots=True, eq=False)
class Leaf:
    """A leaf value, its DCP key and path, and how to replace it in its parent container.

    Treated as read-only but not frozen: a frozen dataclass's ``__init__`` sets each field
    through ``object.__setattr__`` (~5x the cost), and a load builds three per tensor.
    """

    path: str
    value: Any
    parent: Any
    slot: Any
    obj_path: ObjPath = ()

    def replace(self, value: Any) -> None:
        """Store ``value`` where the leaf was (a leaf inside a tuple cannot be replaced)."""
        if isinstance(self.parent, (MutableMapping, MutableSequence)):
            self.parent[self.slot] = value


def like(seq: list | tuple, items: Any) -> Any:
    """``items`` in a sequence of ``seq``'s type; a namedtuple takes them as its fields."""
    if isinstance(seq, tuple) and hasattr(seq, "_fields"):
        return type(seq)(*items)
    return type(seq)(items)


def dotted(obj_path: ObjPath) -> str:
    """DCP's flattened key of a path: its items joined by ``.``."""
    return ".".join(map(str, obj_path))


def _always_false(_: Any) -> bool:
    return False


_PLAIN: dict[type, bool] = {}  # per type: neither a mapping, a list nor a tuple


def _plain(node: Any) -> bool:
    """Whether ``node`` is a leaf by its type alone (cached: ABC checks cost ~0.3 us each)."""
    cls = type(node)
    plain = _PLAIN.get(cls)
    if plain is None:
        plain = _PLAIN[cls] = not isinstance(node, (Mapping, list, tuple))
    return plain


class Walker:
    """DCP's traversal rules with two predicates: what makes a list recurse (``keep``), and
    what makes a tuple recurse (``sharded``: metadata DCP cannot pickle meaningfully)."""

    def __init__(
        self, keep: Callable[[Any], bool], sharded: Callable[[Any], bool] = _always_false
    ) -> None:
        self.keep = keep
        self.sharded = sharded

    def is_terminal(self, value: Any) -> bool:
        if _plain(value):
            return True
        if isinstance(value, Mapping):
            return False
        if isinstance(value, tuple):
            return not any(
                self.sharded(v)
                or (isinstance(v, (Mapping, list, tuple)) and self._holds_sharded(v))
                for v in value
            )
        if not isinstance(value, list):
            return True
        for entry in value:
            if isinstance(entry, (Mapping, list, tuple)) and not self.is_terminal(entry):
                return False
            if self.keep(entry):
                return False
        return True

    def is_leaf(self, node: Any, path: ObjPath) -> bool:
        """Whether ``node`` at ``path`` is a leaf (the root is one unless it is a container)."""
        if _plain(node):
            return True
        if isinstance(node, Mapping):
            return False
        return self.is_terminal(node) if path else not isinstance(node, (list, tuple))

    def _holds_sharded(self, value: Any) -> bool:
        items = value.values() if isinstance(value, Mapping) else value
        return any(
            self.sharded(v) or (isinstance(v, (Mapping, list, tuple)) and self._holds_sharded(v))
            for v in items
        )

    def leaves(self, tree: Any, prefix: ObjPath = (), bare: type | None = None) -> Iterator[Any]:
        """Every leaf of ``tree`` in DCP's order, with its dotted key; duplicate keys raise.
        A leaf of exactly type ``bare`` comes as itself, not as a ``Leaf`` (for a caller that
        needs only its value: no path tuple and object per leaf)."""
        seen: set[str] = set()
        # each entry carries its dotted key, built once from its parent's (not re-joined)
        stack: list[tuple[ObjPath, str, Any, Any, Any]] = [
            (prefix, dotted(prefix), tree, None, None)
        ]
        while stack:
            path, key, node, parent, slot = stack.pop()
            if self.is_leaf(node, path):
                if key in seen:
                    raise SerializationError(
                        f"two entries of the state dict flatten to the same key {key!r}"
                    )
                seen.add(key)
                yield node if type(node) is bare else Leaf(key, node, parent, slot, path)
                continue
            dot = f"{key}." if path else ""
            # (slot, path item, key part, value) per child, a mapping's by its keys' strings;
            # over a snapshot of the children, as the tree may change between two leaves
            entries: Iterator[tuple[Any, Any, str, Any]] = (
                ((k, s, s, v) for k, v in list(node.items()) for s in (str(k),))
                if isinstance(node, Mapping)
                else ((i, i, str(i), v) for i, v in enumerate(list(node)))
            )
            known = _PLAIN.get
            for slot, item, s, v in entries:
                if not (known(type(v)) or _plain(v)):  # a container: it and the rest walked
                    rest = [((*path, item), dot + s, v, node, slot)]  # in order from the stack
                    rest += [((*path, i), dot + p, w, node, k) for k, i, p, w in entries]
                    stack.extend(reversed(rest))
                    break
                child = dot + s  # a leaf by its type: yielded here, no stack round trip
                if child in seen:
                    raise SerializationError(
                        f"two entries of the state dict flatten to the same key {child!r}"
                    )
                seen.add(child)
                yield v if type(v) is bare else Leaf(child, v, node, slot, (*path, item))

    def rebuild(
        self,
        tree: Any,
        fn: Callable[[Leaf], Any],
        prefix: ObjPath = (),
        quick: Callable[[Any], Any] | None = None,
        known: Mapping[int, Any] | None = None,
    ) -> Any:
        """New containers shaped like ``tree``, with ``fn(leaf)`` in place of every leaf;
        ``quick(value)``, where given, answers first for the leaves of mappings by their value
        alone (``SLOW``: ask ``fn``), so the commonest leaves need no ``Leaf`` each; before it,
        ``known`` answers for the leaves of mappings it holds by their ``id`` (no call each)."""
        look = (known or {}).get

        def go(path: ObjPath, key: str, node: Any, parent: Any, slot: Any) -> Any:
            if self.is_leaf(node, path):
                return fn(Leaf(key, node, parent, slot, path))
            dot = f"{key}." if path else ""
            if isinstance(node, Mapping):
                return {
                    k: got
                    if (got := look(id(v), SLOW)) is not SLOW
                    else entry(path, dot, node, k, v)
                    for k, v in node.items()
                }
            return like(node, [go((*path, i), f"{dot}{i}", v, node, i) for i, v in enumerate(node)])

        def entry(path: ObjPath, dot: str, node: Any, k: Any, v: Any) -> Any:
            """A mapping's value ``v`` at ``k``: leaves by their type, no call of ``go`` each."""
            s = str(k)
            if not _plain(v):
                return go((*path, s), dot + s, v, node, k)
            if quick is not None and (got := quick(v)) is not SLOW:
                return got
            return fn(Leaf(dot + s, v, node, k, (*path, s)))

        return go(prefix, dotted(prefix), tree, None, None)


SLOW: Any = object()  # ``rebuild``'s ``quick`` cannot answer for this value


def set_path(
    tree: dict[str, Any], obj_path: ObjPath, value: Any, keys: Sequence[Any] | None = None
) -> None:
    """Put ``value`` at ``obj_path`` in ``tree``, creating dicts and lists on the way (DCP's
    ``set_element``): integer path items index lists, string items key dicts (by ``keys``,
    where given: the dict keys the path's strings were made of, ints or tuples included)."""
    node: Any = tree
    for at, (item, nxt) in enumerate(itertools.pairwise(obj_path)):
        empty: Any = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            assert isinstance(item, int)
            node.extend([None] * (item + 1 - len(node)))
            if node[item] is None:
                node[item] = empty
            node = node[item]
        else:
            node = node.setdefault(item if keys is None else keys[at], empty)
    last = obj_path[-1]
    if isinstance(node, list):
        assert isinstance(last, int)
        node.extend([None] * (last + 1 - len(node)))
        node[last] = value
    else:
        node[last if keys is None else keys[-1]] = value


STATE_WALKER = Walker(keep=keeps_list_recursing, sharded=is_sharded_meta)


def iter_leaves(tree: Any, prefix: str = "") -> Iterator[Leaf]:
    """Leaves of ``tree`` under DCP's rules (any tensor or sharded value keeps a list recursing)."""
    yield from STATE_WALKER.leaves(tree, (prefix,) if prefix else ())
