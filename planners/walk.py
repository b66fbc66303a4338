"""Walk nested state dicts (dicts, lists, tuples) to their leaves with DCP-style dotted paths."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, MutableSequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Leaf:
    """A leaf value, its dotted path, and how to replace it in its parent container."""

    path: str
    value: Any
    parent: Any
    slot: Any

    def replace(self, value: Any) -> None:
        """Store ``value`` where the leaf was (tuples are immutable: their leaves are not replaced)."""
        if isinstance(self.parent, (MutableMapping, MutableSequence)):
            self.parent[self.slot] = value


def iter_leaves(tree: Any, prefix: str = "") -> Iterator[Leaf]:
    """Yield every non-container value under ``tree`` in a deterministic order."""
    stack: list[tuple[str, Any, Any, Any]] = [(prefix, tree, None, None)]
    while stack:
        path, node, parent, slot = stack.pop()
        if isinstance(node, dict):
            children = [(f"{path}.{k}" if path else str(k), v, node, k) for k, v in node.items()]
        elif isinstance(node, (list, tuple)):
            children = [(f"{path}.{i}" if path else str(i), v, node, i) for i, v in enumerate(node)]
        else:
            yield Leaf(path, node, parent, slot)
            continue
        stack.extend(reversed(children))
