"""The common-state table of a checkpoint's ``planner_data``, checked before a load trusts it.

A save records every common key with its path in the state dict (``SaveParts.common_table``)
and the empty dicts; a load rebuilds the nesting from those paths, so a hostile table could
otherwise crash it, make it allocate a list as long as any index it names, or silently place
values elsewhere.
"""

from __future__ import annotations

from typing import Any

from dcpbridge.errors import CorruptCheckpointError
from dcpbridge.planners.walk import dotted
from dcpbridge.storage.format.table import shown_value

WHERE = "dcpbridge.json: planner_data.common"


def check_common_table(table: dict[str, Any]) -> dict[str, Any]:
    """``table`` if its keys and empty-dict paths are what a save records, else
    ``CorruptCheckpointError``.

    Each key maps to its own path (``dotted(path) == key``): strings key dicts, integers index
    lists. A list index is below the number of recorded paths (every list position holds at
    least one), and the paths form one tree: no path twice, none inside another's value, and
    no node indexed by both strings and integers.
    """
    keys, empty = table.get("keys"), table.get("empty", [])
    if type(keys) is not dict or type(empty) is not list:
        raise CorruptCheckpointError(f"{WHERE}: 'keys' must be a JSON object, 'empty' a list")
    entries = [*keys.items(), *((None, path) for path in empty)]
    bound = len(entries)
    kinds: dict[tuple[Any, ...], type] = {(): str}  # a node's child type; the root is a dict
    ends: set[tuple[Any, ...]] = set()
    for key, raw in entries:
        what = f"{WHERE}: path {shown_value(raw)}" + (f" of key {key!r}" if key is not None else "")
        if type(raw) is not list or not raw:
            raise CorruptCheckpointError(f"{what} is not a non-empty list")
        for i, item in enumerate(raw):
            kind = type(item)
            if kind is not str and not (kind is int and 0 <= item < bound):
                raise CorruptCheckpointError(
                    f"{what}: item {shown_value(item)} is neither a string nor a list index in "
                    f"[0, {bound})"
                )
            if kinds.setdefault(tuple(raw[:i]), kind) is not kind:
                raise CorruptCheckpointError(f"{what} indexes a dict or a list the wrong way")
        if key is not None and dotted(raw) != key:
            raise CorruptCheckpointError(f"{what} is not the key's path")
        end = tuple(raw)
        if end in ends:
            raise CorruptCheckpointError(f"{what} is recorded twice")
        ends.add(end)
    if clash := next((end for end in ends if end in kinds), None):
        raise CorruptCheckpointError(f"{WHERE}: path {list(clash)} holds a value and entries")
    return table
