"""Key maps: a load template's tensor keys rewritten to the checkpoint's, stacked layers included.

A rule maps a template key pattern to a checkpoint key pattern; ``{name}`` stands for an
integer. A placeholder on both sides is carried over (a rename). One only in the template
pattern indexes a stacked checkpoint tensor: ``"layers.{i}.mlp.fc1.weight" ->
"decoder.layers.mlp.linear_fc1.weight"`` makes the template's layer ``i`` a box of the stacked
key with one prepended axis at offset ``i``, so only that slice is read. One only in the
checkpoint pattern does the reverse: a stacked template tensor reads layer ``i`` (a prepended
axis' offset, or each index of its first axis) from the ``i``-th per-layer key. A rule also
applies to the optimizer state stored for a matching key (``optimizer.state.<name>.<key>``).
``KeyMap.apply`` returns a rewritten template and leaves the given one untouched, so
``dcpbridge.load`` needs no option; loaded values land where the template had them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dcpbridge.errors import InvalidArgumentError, ShapeMismatchError
from dcpbridge.model.intake import own_tensor
from dcpbridge.model.mapping import ShardedTensor, ShardedTensorFactory
from dcpbridge.planners.leaves import tensor_boxes
from dcpbridge.planners.protocol import leaf_kind
from dcpbridge.planners.walk import STATE_WALKER, Leaf

_PLACEHOLDER = re.compile(r"\{([A-Za-z_]\w*)\}")
_OPTIMIZER_STATE = re.compile(r"(optimizer\.state\.[^.]+\.)(.+)")


def _fields(pattern: str) -> list[str]:
    names = _PLACEHOLDER.findall(pattern)
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"key pattern {pattern!r} repeats a placeholder")
    return names


def _regex(pattern: str) -> re.Pattern[str]:
    parts = _PLACEHOLDER.split(pattern)  # literal, name, literal, name, ...
    return re.compile(
        "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>\\d+)" for i, p in enumerate(parts))
    )


@dataclass(frozen=True)
class _Rule:
    """One template pattern -> checkpoint pattern, with its stacked-axis role if any."""

    template: str
    checkpoint: str
    index: str | None  # only in the template: indexes the stacked checkpoint key
    split: str | None  # only in the checkpoint: the template's stacked axis spans keys
    regex: re.Pattern[str]

    @classmethod
    def parse(cls, template: str, checkpoint: str) -> _Rule:
        t, c = _fields(template), _fields(checkpoint)
        only_t, only_c = [n for n in t if n not in c], [n for n in c if n not in t]
        if len(only_t) + len(only_c) > 1:
            raise InvalidArgumentError(
                f"key map rule {template!r} -> {checkpoint!r}: at most one placeholder may "
                f"appear on one side only (one stacked axis), got {only_t + only_c}"
            )
        index = only_t[0] if only_t else None
        split = only_c[0] if only_c else None
        return cls(template, checkpoint, index, split, _regex(template))


@dataclass(frozen=True)
class _Match:
    rule: _Rule
    values: dict[str, int]
    prefix: str  # the optimizer-state prefix the key carried, else ""

    def key(self, **extra: int) -> str:
        values = {k: v for k, v in self.values.items() if k != self.rule.index}
        return self.prefix + self.rule.checkpoint.format(**values, **extra)


class KeyMap:
    """Rules from template keys to checkpoint keys, applied to a load template (module doc)."""

    def __init__(self, rules: Mapping[str, str] | Iterable[tuple[str, str]]) -> None:
        pairs = rules.items() if isinstance(rules, Mapping) else rules
        self.rules = tuple(_Rule.parse(t, c) for t, c in pairs)

    def __repr__(self) -> str:
        return f"KeyMap({[(r.template, r.checkpoint) for r in self.rules]!r})"

    def inverse(self) -> KeyMap:
        """The map the other way: for loading into the layout the checkpoint keys describe."""
        return KeyMap([(r.checkpoint, r.template) for r in self.rules])

    def match(self, key: str) -> _Match | None:
        """The first rule matching ``key`` whole, else matching its optimizer state's model key."""
        found = _OPTIMIZER_STATE.fullmatch(key)
        candidates = [("", key)] + ([(found[1], found[2])] if found else [])
        for prefix, rest in candidates:
            for rule in self.rules:
                m = rule.regex.fullmatch(rest)
                if m is not None:
                    return _Match(rule, {k: int(v) for k, v in m.groupdict().items()}, prefix)
        return None

    def map_key(self, key: str) -> str | None:
        """The checkpoint key ``key`` reads (stacked key for an indexing rule), None if unmapped."""
        m = self.match(key)
        return None if m is None or m.rule.split else m.key()

    def apply(self, template: Any, *, stored: Mapping[str, Any] | None = None) -> Any:
        """``template`` with every mapped tensor leaf re-keyed (a new tree; tensors are shared).

        A stacked checkpoint key's layer count comes from ``stored`` (``dcpbridge.
        load_tensors_metadata(dir)``, or key -> global shape) if it names the key, else from
        the highest index the template asks for. Plain tensors, DTensors and torch
        ShardedTensors become factories that load into their own memory and return the
        original object; ShardedTensors stay ShardedTensors (several for a split).
        """
        lengths = self._lengths(template, stored or {})
        return STATE_WALKER.rebuild(template, lambda leaf: self._leaf(leaf, lengths))

    # -- internals ------------------------------------------------------------------------------

    def _lengths(self, template: Any, stored: Mapping[str, Any]) -> dict[str, int]:
        lengths: dict[str, int] = {}
        for leaf in STATE_WALKER.leaves(template):
            for key in _keys(leaf):
                m = self.match(key)
                if m is not None and m.rule.index is not None:
                    target = m.key()
                    index = m.values[m.rule.index]
                    lengths[target] = max(lengths.get(target, 0), index + 1)
        for target in lengths:
            if target in stored:
                shape = getattr(stored[target], "global_shape", stored[target])
                if not len(shape):  # no axis to stack layers along: IndexError otherwise
                    raise ShapeMismatchError(
                        f"key map: the checkpoint's {target!r} is a 0-dim tensor, not a stack of "
                        "layers"
                    )
                lengths[target] = int(shape[0])
        return lengths

    def _leaf(self, leaf: Leaf, lengths: dict[str, int]) -> Any:
        value, kind = leaf.value, leaf_kind(leaf.value)
        if kind == "tensor_shard":
            shard = own_tensor(value)
            mapped = self._shard(shard, lengths)
            if mapped is None:
                return value
            if len(mapped) == 1:
                return mapped[0]
            return _factory(shard.key, shard.data, mapped, lambda _: value.data)
        if kind in ("tensor", "dtensor", "torch_sharded"):
            if self.match(leaf.path) is None:
                return value
            boxes = [
                ShardedTensor.from_box(
                    b.key, b.data, b.global_shape, b.global_offset, replica_id=b.replica_id
                )
                for b in tensor_boxes(leaf.path, value, kind)
            ]
            mapped = [s for b in boxes for s in self._shard(b, lengths) or [b]]
            data = mapped[0].data if mapped else None
            return _factory(leaf.path, data, mapped, lambda _: value)
        if kind == "factory":
            return self._factory_leaf(value, lengths)
        return value

    def _factory_leaf(self, factory: Any, lengths: dict[str, int]) -> Any:
        built = factory.build()
        changed = False

        def remap(leaf: Leaf) -> Any:
            nonlocal changed
            if leaf_kind(leaf.value) != "tensor_shard":
                return leaf.value
            mapped = self._shard(own_tensor(leaf.value), lengths)
            if mapped is None:
                return leaf.value
            if len(mapped) != 1:
                raise InvalidArgumentError(
                    f"key map: factory {factory.key!r} builds {leaf.value.key!r}, which a rule "
                    "splits into several keys; factories can only be re-keyed one to one"
                )
            changed = True
            return mapped[0]

        rebuilt = STATE_WALKER.rebuild(built, remap)
        if not changed:
            return factory
        return ShardedTensorFactory(
            factory.key, factory.data, lambda *_: rebuilt, factory.merge_fn, factory.replica_id
        )

    def _shard(self, shard: ShardedTensor, lengths: dict[str, int]) -> list[ShardedTensor] | None:
        m = self.match(shard.key)
        if m is None:
            return None
        rule, p = m.rule, shard.prepend_axis_num
        frags = shard.axis_fragmentations
        if rule.index is not None:
            key, i = m.key(), m.values[rule.index]
            n = lengths[key]
            return [
                dataclasses.replace(
                    shard,
                    key=key,
                    global_shape=(n, *shard.global_shape),
                    global_offset=(i, *shard.global_offset),
                    prepend_axis_num=p + 1,
                    axis_fragmentations=None if frags is None else (n, *frags),
                )
            ]
        if rule.split is None:
            return [dataclasses.replace(shard, key=m.key())]
        if p > 0:  # Megatron's stacking: one prepended axis at the layer's index
            return [
                dataclasses.replace(
                    shard,
                    key=m.key(**{rule.split: shard.global_offset[0]}),
                    global_shape=shard.global_shape[1:],
                    global_offset=shard.global_offset[1:],
                    prepend_axis_num=p - 1,
                    axis_fragmentations=None if frags is None else frags[1:],
                )
            ]
        return [
            ShardedTensor(
                m.key(**{rule.split: shard.global_offset[0] + j}),
                None if shard.data is None else shard.data[j],
                shard.dtype,
                shard.local_shape[1:],
                shard.global_shape[1:],
                shard.global_offset[1:],
                None,
                shard.replica_id,
                0,
                shard.allow_shape_mismatch,
            )
            for j in range(shard.local_shape[0])
        ]


def _keys(leaf: Leaf) -> list[str]:
    kind = leaf_kind(leaf.value)
    if kind == "tensor_shard":
        return [leaf.value.key]
    if kind in ("tensor", "dtensor", "torch_sharded"):
        return [leaf.path]
    if kind == "factory":
        return [
            s.value.key for s in STATE_WALKER.leaves(leaf.value.build()) if hasattr(s.value, "key")
        ]
    return []


def _factory(key: str, data: Any, shards: list[ShardedTensor], merge: Any) -> ShardedTensorFactory:
    """A factory building ``shards`` whose merge returns the template's own object."""
    built = {str(n): s for n, s in enumerate(shards)}
    return ShardedTensorFactory(key, data, lambda *_: built, merge)
