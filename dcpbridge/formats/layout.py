"""Target parallel layouts for offline resharding: which box of each tensor every rank owns.

A layout (YAML or a dict) names a target world size, optionally a named rank mesh, and rules
that match tensor keys with glob patterns (first match wins). A rule either splits tensor axes
evenly into parts (rank ``r`` owns part ``r``) or over mesh dimensions (the part follows the
rank's coordinates; ranks that differ only in unused mesh dimensions hold replicas, and the one
with coordinate 0 there owns the box), or replicates the tensor (one owner, rank 0 by default).

    world_size: 8
    mesh: {pp: 2, tp: 4}              # optional; product = world_size, last name varies fastest
    default: replicate                 # keys no rule matches: replicate (default) | error
    rules:
      - match: "*.linear_qkv.weight"   # a glob or a list of globs
        split: {axis: 0, over: tp}     # over: a mesh dim or a list (first varies slowest)
      - match: "decoder.layers.*"
        split: [{axis: 0, over: pp}, {axis: 1, over: tp}]
      - match: "embedding.*"
        split: {axis: 0, parts: 4}     # without a mesh: parts 0..3 -> ranks 0..3
      - match: "*"
        replicate: true                # optional owner: {replicate: true, rank: 7}
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dcpbridge.errors import CheckpointError
from dcpbridge.formats.schema import Doc, read_yaml

Shape = tuple[int, ...]


class LayoutError(CheckpointError, ValueError):
    """A layout file or mapping is malformed, or does not fit a tensor it must split."""


@dataclass(frozen=True, slots=True)
class AxisSplit:
    """Tensor ``axis`` cut into ``parts`` even pieces, indexed by the ranks' ``over`` coordinates."""

    axis: int
    parts: int
    over: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Rule:
    """Keys matching ``patterns`` are split by ``splits`` (none: replicated, owned by ``owner``)."""

    patterns: tuple[str, ...]
    splits: tuple[AxisSplit, ...] = ()
    owner: int = 0

    def matches(self, key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, p) for p in self.patterns)


@dataclass(frozen=True, slots=True)
class TargetBox:
    """The box of a global tensor that target ``rank`` owns and stores as one chunk."""

    rank: int
    offsets: Shape
    sizes: Shape

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def even_pieces(n: int, parts: int) -> list[tuple[int, int]]:
    """(start, length) of ``parts`` near-equal pieces of ``range(n)``; the first ones are longer."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((start, size))
        start += size
    return out


@dataclass(frozen=True, slots=True)
class Layout:
    """A target world size, its rank mesh (name -> size, last fastest) and the split rules."""

    world_size: int
    rules: tuple[Rule, ...]
    mesh: tuple[tuple[str, int], ...] = ()
    default: str = "replicate"
    source: str = "<layout>"

    def rule_for(self, key: str) -> Rule | None:
        """The first rule whose patterns match ``key`` (None: the layout's default applies)."""
        return next((r for r in self.rules if r.matches(key)), None)

    def boxes(self, key: str, shape: Shape) -> list[TargetBox]:
        """Every non-empty target box of tensor ``key`` with its owner, in offset order."""
        rule = self.rule_for(key)
        if rule is None:
            if self.default == "error":
                raise LayoutError(f"{self.source}: no rule matches tensor {key!r}")
            rule = Rule(("*",))
        if not rule.splits:
            return [TargetBox(rule.owner, (0,) * len(shape), tuple(shape))]
        axes = []
        for s in rule.splits:
            axis = s.axis + len(shape) if s.axis < 0 else s.axis
            if not 0 <= axis < len(shape):
                raise LayoutError(
                    f"{self.source}: the rule for {key!r} splits axis {s.axis}, but the tensor "
                    f"has shape {tuple(shape)}"
                )
            axes.append(axis)
        if len(set(axes)) != len(axes):
            raise LayoutError(f"{self.source}: the rule for {key!r} splits an axis twice")
        pieces = [even_pieces(shape[axis], s.parts) for axis, s in zip(axes, rule.splits)]
        out = []
        for part in itertools.product(*(range(s.parts) for s in rule.splits)):
            offsets, sizes = [0] * len(shape), list(shape)
            for axis, axis_pieces, i in zip(axes, pieces, part):
                offsets[axis], sizes[axis] = axis_pieces[i]
            box = TargetBox(self._owner(rule, part), tuple(offsets), tuple(sizes))
            if box.numel:
                out.append(box)
        return sorted(out, key=lambda b: b.offsets)

    def _owner(self, rule: Rule, part: tuple[int, ...]) -> int:
        """The rank owning grid cell ``part``: its mesh coordinates, 0 on unused dimensions."""
        if not rule.splits[0].over:  # plain parts: row-major cell index
            rank = 0
            for s, i in zip(rule.splits, part):
                rank = rank * s.parts + i
            return rank
        coords = dict.fromkeys((name for name, _ in self.mesh), 0)
        sizes = dict(self.mesh)
        for s, i in zip(rule.splits, part):
            for name in reversed(s.over):
                i, coords[name] = divmod(i, sizes[name])
        rank = 0
        for name, size in self.mesh:
            rank = rank * size + coords[name]
        return rank


# -- parsing ---------------------------------------------------------------------------------


def _names(doc: Doc, value: Any, path: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
        raise doc.fail("expected a string or a non-empty list of strings", path)
    return tuple(items)


def _parse_split(d: Doc, spec: Any, path: str, world_size: int, mesh: dict[str, int]) -> AxisSplit:
    s = d.item(spec, path).only({"axis", "parts", "over"})
    if "axis" not in s.doc:
        raise s.fail("missing 'axis'")
    axis = s.integer("axis")
    if "over" not in s.doc:
        return AxisSplit(axis, s.integer("parts", world_size, minimum=1))
    if not mesh:
        raise s.error("over", "'over' needs a 'mesh' in the layout")
    over = _names(s, s.doc["over"], s.key("over"))
    bad = [n for n in over if n not in mesh]
    if bad:
        raise s.error("over", f"unknown mesh dimension(s) {bad}")
    parts = math.prod(mesh[n] for n in over)
    if "parts" in s.doc and s.integer("parts") != parts:
        raise s.error("parts", f"must equal the size of {list(over)} ({parts})")
    return AxisSplit(axis, parts, over)


def _parse_rule(d: Doc, world_size: int, mesh: dict[str, int]) -> Rule:
    d.only({"match", "split", "replicate", "rank"})
    if "match" not in d.doc:
        raise d.fail("missing 'match' (a glob or a list of globs)")
    patterns = _names(d, d.doc["match"], d.key("match"))
    has_split, replicate = "split" in d.doc, d.doc.get("replicate", False)
    if not isinstance(replicate, bool):
        raise d.error("replicate", "expected true or false")
    if has_split == replicate:
        raise d.fail("give exactly one of 'split' or 'replicate: true'")
    if replicate:
        owner = d.integer("rank", 0, minimum=0)
        if owner >= world_size:
            raise d.error("rank", f"{owner} is not a rank of world_size {world_size}")
        return Rule(patterns, (), owner)
    if "rank" in d.doc:
        raise d.error("rank", "only replicated rules name an owner rank")
    specs = d.doc["split"] if isinstance(d.doc["split"], list) else [d.doc["split"]]
    splits = [
        _parse_split(d, spec, f"{d.key('split')}[{i}]", world_size, mesh)
        for i, spec in enumerate(specs)
    ]
    if len({bool(s.over) for s in splits}) > 1:
        raise d.error("split", "use either 'over' or 'parts' on every axis, not both")
    used = [n for s in splits for n in s.over]
    if len(set(used)) != len(used):
        raise d.error("split", "a mesh dimension is used twice")
    cells = math.prod(s.parts for s in splits)
    if not splits[0].over and cells > world_size:
        raise d.error("split", f"{cells} parts need more than world_size {world_size} ranks")
    return Rule(patterns, tuple(splits))


def parse_layout(doc: Any, where: str = "<layout>") -> Layout:
    """Validate a layout mapping; errors name ``where`` and the offending key."""
    if not isinstance(doc, Mapping):
        raise LayoutError(f"{where}: layout: expected a mapping, got {type(doc).__name__}")
    d = Doc(doc, where, "", LayoutError, label="layout")
    d.only({"world_size", "mesh", "rules", "default"})
    mesh: dict[str, int] = {}
    if "mesh" in d.doc:
        m = d.sub("mesh")
        for name in m.doc:
            if not isinstance(name, str):
                raise m.fail("dimension names must be strings")
            mesh[name] = m.integer(name, minimum=1)
        if not mesh:
            raise m.fail("must name at least one dimension")
    if "world_size" in d.doc:
        world_size = d.integer("world_size", minimum=1)
        if mesh and math.prod(mesh.values()) != world_size:
            raise d.error("mesh", f"sizes multiply to {math.prod(mesh.values())}, not {world_size}")
    elif mesh:
        world_size = math.prod(mesh.values())
    else:
        raise d.fail("missing 'world_size' (or a 'mesh')")
    default = d.doc.get("default", "replicate")
    if default not in ("replicate", "error"):
        raise d.error("default", "expected 'replicate' or 'error'")
    rules_doc = d.doc.get("rules", [])
    if not isinstance(rules_doc, list):
        raise d.error("rules", f"expected a list, got {type(rules_doc).__name__}")
    rules = tuple(
        _parse_rule(d.item(r, f"rules[{i}]"), world_size, mesh) for i, r in enumerate(rules_doc)
    )
    return Layout(world_size, rules, tuple(mesh.items()), default, where)


def load_layout(path: str | os.PathLike[str]) -> Layout:
    """Read and validate a layout YAML file."""
    where = os.fspath(path)
    return parse_layout(read_yaml(where, "layout file", LayoutError), where)


def whole_tensors(world_size: int = 1) -> Layout:
    """Every tensor as one chunk owned by rank 0 (plain conversion)."""
    return Layout(world_size, (), (), "replicate", "<whole tensors>")
