"""Optimizer state as sharded state: each state tensor inherits its parameter's sharding.

``optim_state_to_sharding_state`` turns ``optimizer.state_dict()`` into a sharded state dict
that reshards exactly like the model:

- ``state[id][k]`` with the parameter's shape -> a ShardedTensor keyed
  ``optimizer.state.<k>.<model key>`` with the parameter's global shape, offset, axis
  fragmentations, prepended axes and replica id (or a factory with the same build/merge
  functions when the parameter is a ``ShardedTensorFactory``);
- any other per-parameter entry (``step``) must be a number or a 0-dim tensor, equal for
  every parameter; it is stored once, as common state, under ``"shared_state"`` (a tensor of
  one or more dims not shaped like its parameter, e.g. Adafactor's ``row_var``, is refused:
  stored once, every rank would load rank 0's);
- each param group's hyper-parameters are common state under ``"param_groups"``, keyed by the
  group's identity (its ``"group_key"`` entry, else its position ``"#i"``); its ``params`` and
  ``param_names`` lists stay local (``LocalNonpersistentObject`` under ``"local"``), as they
  name this rank's parameters.

After ``dcpbridge.load``, ``restore_optim_state`` turns the result back into what
``torch.optim.Optimizer.load_state_dict`` accepts, matching saved groups by identity.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any

import torch
from torch import nn

from dcpbridge.errors import OptimizerStateError
from dcpbridge.model.mapping import (
    LocalNonpersistentObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)
from dcpbridge.model.state import leaves
from dcpbridge.model.stateful import LOCAL_GROUP_FIELDS, check_hyper
from dcpbridge.planners.protocol import leaf_kind

KEEP_VARS_HINT = (
    " Make sure the model sharded state dict holds the original torch.nn.Parameters (not "
    "detached tensors): build it from module.state_dict(keep_vars=True) or the parameters."
)
GROUP_KEY = "group_key"  # a param group's stable identity (set by dcpbridge.get_param_groups)
SHARED_KEYS = frozenset({"step"})  # per-parameter entries always stored once

ShardedParam = ShardedTensor | ShardedTensorFactory


def get_optim_param_to_id_map(optim_params_iter: Iterable[nn.Parameter]) -> dict[int, int]:
    """``id(param)`` -> the param's id in ``optimizer.state_dict()`` (its position)."""
    out: dict[int, int] = {}
    for state_id, param in enumerate(optim_params_iter):
        out.setdefault(id(param), state_id)
    return out


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[nn.Parameter]
) -> dict[int, ShardedParam]:
    """Optimizer state id -> the model's ShardedTensor/factory holding that very parameter.

    ``optim_params_iter`` lists the optimizer's parameters in its own order (all groups).
    Matching is by object identity, so the sharded state dict must hold the Parameters; the
    first leaf holding a parameter wins (tied weights appear twice).
    """
    by_param: dict[int, ShardedParam] = {}
    holds_parameters = False
    for leaf in leaves(model_sharded_state_dict):
        if _is_sharded_param(leaf) and leaf.data is not None:
            holds_parameters |= isinstance(leaf.data, nn.Parameter)
            by_param.setdefault(id(leaf.data), leaf)
    out: dict[int, ShardedParam] = {}
    unmatched: list[str] = []
    for state_id, param in enumerate(optim_params_iter):
        sharded = by_param.get(id(param))
        if sharded is None:
            unmatched.append(f"#{state_id} {tuple(param.shape)}")
        else:
            out[state_id] = sharded
    if unmatched:
        shown = ", ".join(unmatched[:8]) + (" ..." if len(unmatched) > 8 else "")
        hint = "" if holds_parameters else KEEP_VARS_HINT
        raise OptimizerStateError(
            f"{len(unmatched)} optimizer parameter(s) match no ShardedTensor or "
            f"ShardedTensorFactory of the model sharded state dict (state id and shape: "
            f"{shown}).{hint}"
        )
    return out


def _is_sharded_param(leaf: Any) -> bool:
    """A ShardedTensor or factory, dcpbridge's or Megatron-Core's (recognised by its fields)."""
    return leaf_kind(leaf) in ("tensor_shard", "factory")


def _is_factory(model_param: Any) -> bool:
    return isinstance(model_param, ShardedTensorFactory) or leaf_kind(model_param) == "factory"


def _local_shape(model_param: ShardedParam) -> tuple[int, ...]:
    if _is_factory(model_param):
        return tuple(model_param.data.shape)
    return tuple(model_param.local_shape)


def make_sharded_optimizer_tensor(
    model_param: ShardedParam, optim_param: torch.Tensor, prefix: str
) -> ShardedParam:
    """``optim_param`` (shaped like the parameter) sharded exactly as ``model_param``, keyed
    ``f"{prefix}.{model_param.key}"``; it keeps its own dtype."""
    shape = _local_shape(model_param)
    if tuple(optim_param.shape) != shape:
        raise OptimizerStateError(
            f"{prefix}.{model_param.key}: optimizer state of shape {tuple(optim_param.shape)} "
            f"does not match its parameter's local shape {shape}"
        )
    key = f"{prefix}.{model_param.key}"
    if _is_factory(model_param):
        return replace(model_param, key=key, data=optim_param)
    return replace(model_param, key=key, data=optim_param, dtype=optim_param.dtype)


# ---------------------------------------------------------------------------------------------
# Entries stored once (``step``): equal for every parameter, restored in the optimizer's type.


@dataclass(frozen=True)
class _ValueType:
    """How the optimizer keeps a shared entry: a tensor of this dtype/device/shape, or a number."""

    kind: str  # "tensor" | "int" | "float" | "other"
    dtype: torch.dtype | None = None
    device: str | None = None
    shape: tuple[int, ...] = ()

    @staticmethod
    def of(value: Any) -> _ValueType:
        if isinstance(value, torch.Tensor):
            return _ValueType("tensor", value.dtype, str(value.device), tuple(value.shape))
        if isinstance(value, (bool, int)):
            return _ValueType("int")
        return _ValueType("float" if isinstance(value, float) else "other")

    def make(self, key: str, value: Any) -> Any:
        """A fresh ``value`` of this type (steps are incremented in place: never share one);
        ``OptimizerStateError`` naming ``key`` where a stored value has none (another shape
        or kind, or a fraction where this optimizer keeps a whole number)."""
        try:
            made = self._make(value)
            whole = self.kind == "int" or (
                self.kind == "tensor"
                and self.dtype is not None
                and not self.dtype.is_floating_point
            )
            if whole and _number(made) != _number(value):
                raise ValueError("not a whole number")
            number = _number(made)
            if key in SHARED_KEYS and isinstance(number, (int, float)) and not _is_count(number):
                raise ValueError("a step count is a finite whole number >= 0")
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise OptimizerStateError(
                f"optimizer state {key!r}: the checkpoint's value {value!r} does not fit this "
                f"optimizer's {self.describe()} ({e})"
            ) from e
        return made

    def _make(self, value: Any) -> Any:
        if self.kind == "tensor":
            t = torch.as_tensor(value).detach()
            return t.to(dtype=self.dtype, device=self.device, copy=True).reshape(self.shape)
        if isinstance(value, torch.Tensor):
            value = value.item()
        if self.kind == "int":
            return int(value)
        if self.kind == "float":
            return float(value)
        return value

    def describe(self) -> str:
        """How error messages name this type."""
        if self.kind == "tensor":
            return f"{self.dtype} tensor of shape {self.shape}"
        return {"int": "integer", "float": "float"}.get(self.kind, "value")


def _number(value: Any) -> Any:
    """A one-element tensor's number, or ``value`` itself."""
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _is_count(number: float) -> bool:
    """Whether ``number`` counts steps (an optimizer's ``step``): finite, whole, not negative."""
    return math.isfinite(number) and number >= 0 and float(number).is_integer()


def _comparable(value: Any) -> Any:
    """A hashable stand-in for ``value`` that is equal exactly when the values are."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else tuple(value.flatten().tolist())
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _shared_value(key: str, values: dict[int, Any]) -> Any:
    """The one value of entry ``key`` over all parameters, or an error naming the differences."""
    groups: dict[Any, list[int]] = {}
    for param_id, value in values.items():
        groups.setdefault(_comparable(value), []).append(param_id)
    if len(groups) > 1:
        shown = "; ".join(f"{v!r} for params {ids[:6]}" for v, ids in groups.items())
        raise OptimizerStateError(
            f"optimizer state {key!r} differs between parameters ({shown}); dcpbridge stores "
            f"it once, so all parameters must agree (or pass exclude_keys=({key!r},))"
        )
    value = next(iter(values.values()))
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def split_param_groups(
    param_groups: list[Mapping[str, Any]],
) -> tuple[dict[str, dict[str, Any]], list[tuple[str, dict[str, Any]]]]:
    """Saved hyper-parameters by group identity, and each group's rank-local fields."""
    groups: dict[str, dict[str, Any]] = {}
    local_groups: list[tuple[str, dict[str, Any]]] = []
    for index, group in enumerate(param_groups):
        identity = _group_identity(group, index)
        if identity in groups:
            raise OptimizerStateError(f"two param groups share the identity {identity!r}")
        groups[identity] = {k: v for k, v in group.items() if k not in LOCAL_GROUP_FIELDS}
        local_groups.append((identity, {k: group[k] for k in LOCAL_GROUP_FIELDS if k in group}))
    return groups, local_groups


def _group_identity(group: Mapping[str, Any], index: int) -> str:
    return str(group.get(GROUP_KEY, f"#{index}"))


def optim_state_to_sharding_state(
    optim_state_dict: StateDict,
    id_to_sharded_param_map: Mapping[int, ShardedParam],
    exclude_keys: tuple[str, ...] = (),
) -> None:
    """Turn ``optimizer.state_dict()`` into a sharded state dict in place (module docstring).

    ``exclude_keys`` entries are not saved; ``restore_optim_state`` puts this optimizer's
    own values back for them.
    """
    sharded: dict[int, dict[str, Any]] = {}
    shared: dict[str, dict[int, Any]] = {}
    types: dict[int, dict[str, _ValueType]] = {}
    excluded: dict[int, dict[str, Any]] = {}
    for param_id, param_state in optim_state_dict["state"].items():
        model_param = id_to_sharded_param_map.get(param_id)
        if model_param is None:
            raise OptimizerStateError(
                f"optimizer state of param {param_id} matches no model sharded parameter."
                + KEEP_VARS_HINT
            )
        shape = _local_shape(model_param)
        sharded[param_id] = {}
        for key, value in param_state.items():
            if key in exclude_keys:
                excluded.setdefault(param_id, {})[key] = value
            elif (
                key not in SHARED_KEYS
                and isinstance(value, torch.Tensor)
                and tuple(value.shape) == shape
            ):
                sharded[param_id][key] = make_sharded_optimizer_tensor(
                    model_param, value, prefix=f"optimizer.state.{key}"
                )
            elif key not in SHARED_KEYS and isinstance(value, torch.Tensor) and value.ndim > 0:
                raise OptimizerStateError(
                    f"optimizer state {key!r} of {model_param.key!r} has shape "
                    f"{tuple(value.shape)}, not shaped like its parameter ({shape}): it can "
                    "neither be sharded like it nor stored once for all ranks (pass "
                    f"exclude_keys=({key!r},) to leave it out)"
                )
            else:
                shared.setdefault(key, {})[param_id] = value
                types.setdefault(param_id, {})[key] = _ValueType.of(value)
    groups, local_groups = split_param_groups(optim_state_dict["param_groups"])
    optim_state_dict.clear()
    optim_state_dict["state"] = sharded
    optim_state_dict["param_groups"] = groups
    if shared:
        optim_state_dict["shared_state"] = {k: _shared_value(k, v) for k, v in shared.items()}
    optim_state_dict["local"] = LocalNonpersistentObject(
        {"groups": local_groups, "types": types, "excluded": excluded, "hyper": live_hyper(groups)}
    )


def restore_optim_state(loaded: StateDict) -> StateDict:
    """What ``Optimizer.load_state_dict`` accepts, from the loaded sharded optimizer state.

    Shared entries are given to every parameter with state, each its own copy in the type
    this optimizer keeps them in; saved param groups are matched to this optimizer's groups
    by identity, with the saved hyper-parameters and this rank's ``params``.
    """
    local = loaded["local"]
    if isinstance(local, LocalNonpersistentObject):
        local = local.unwrap()
    shared = loaded.get("shared_state", {})
    if not isinstance(shared, Mapping):
        raise OptimizerStateError(
            f"the checkpoint's optimizer shared_state is a {type(shared).__name__}, not a "
            "mapping of entries stored once (step)"
        )
    types: dict[int, dict[str, _ValueType]] = local["types"]
    state: dict[int, dict[str, Any]] = {}
    for param_id, tensors in loaded.get("state", {}).items():
        entry = dict(tensors)
        for key, value in shared.items():
            if key in entry:  # would replace the loaded per-parameter state, silently
                raise OptimizerStateError(
                    f"optimizer state {key!r}: the checkpoint holds it per parameter and "
                    "stored once (shared_state) too; it is not a checkpoint of this optimizer's "
                    "state (damaged, or another program's)"
                )
            entry[key] = types.get(param_id, {}).get(key, _ValueType.of(value)).make(key, value)
        entry.update(local["excluded"].get(param_id, {}))
        state[param_id] = entry
    if shared and not state and any(g.get("params") for _, g in local["groups"]):
        raise OptimizerStateError(
            "the checkpoint holds optimizer state but the load template had none: the "
            "optimizer's state was not initialized when the template was built "
            "(call dcpbridge.init_optimizer_state(optimizer) first)"
        )
    return {"state": state, "param_groups": _match_groups(loaded["param_groups"], local)}


def live_hyper(groups: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """This optimizer's hyper-parameters by group identity, kept apart from the load
    template (a load replaces those): what a checkpoint's values are checked against."""
    return {identity: dict(group) for identity, group in groups.items()}


def _check_hyper(identity: str, live: Mapping[str, Any], stored: Any) -> dict[str, Any]:
    """A saved group's hyper-parameters, each checked against this optimizer's (a damaged or
    foreign checkpoint's would fail the next step, or train on silently), without the
    group's rank-local fields."""
    if not isinstance(stored, Mapping):
        raise OptimizerStateError(
            f"param group {identity!r}: the checkpoint holds {type(stored).__name__}, not a "
            "mapping of hyper-parameters"
        )
    check_hyper(f"param group {identity!r}", live, stored)
    # params and param_names are this rank's own (never saved): a checkpoint's never count
    return {k: v for k, v in stored.items() if k not in LOCAL_GROUP_FIELDS}


def _match_groups(saved: Any, local: Mapping[str, Any]) -> list[dict[str, Any]]:
    if not isinstance(saved, Mapping):
        raise OptimizerStateError(
            f"the checkpoint's param_groups is a {type(saved).__name__}, not a mapping of "
            "group identities to hyper-parameters"
        )
    current = [identity for identity, _ in local["groups"]]
    only_current = [g for g in current if g not in saved]
    only_saved = [g for g in saved if g not in current]
    if only_current or only_saved:
        raise OptimizerStateError(
            "the optimizer's param groups do not match the checkpoint's: "
            f"groups with no saved counterpart: {only_current}; saved groups with no current "
            f"counterpart: {only_saved}"
        )
    hyper = local.get("hyper", {})
    return [
        {**_check_hyper(identity, hyper.get(identity, {}), saved[identity]), **fields}
        for identity, fields in local["groups"]
    ]


# ---------------------------------------------------------------------------------------------
# Whole-optimizer conveniences.


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return list(chain.from_iterable(g["params"] for g in optimizer.param_groups))


def optimizer_sharded_state_dict(
    optimizer: torch.optim.Optimizer,
    model_sharded_state_dict: ShardedStateDict,
    *,
    exclude_keys: tuple[str, ...] = (),
) -> ShardedStateDict:
    """``optimizer.state_dict()`` sharded like ``model_sharded_state_dict`` (save or load
    template: its tensors are the optimizer's own, so a load fills them in place)."""
    id_map = get_param_id_to_sharded_param_map(
        model_sharded_state_dict, _optimizer_params(optimizer)
    )
    state_dict = optimizer.state_dict()
    optim_state_to_sharding_state(state_dict, id_map, exclude_keys)
    return state_dict


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the lazily built state (e.g. Adam's moments) of parameters that have none, so a
    load template covers them: one step on zero gradients, parameters restored bit-exactly."""
    everyone = _optimizer_params(optimizer)
    fresh = [p for p in everyone if not optimizer.state.get(p)]
    if not fresh:
        return
    grads = [p.grad for p in everyone]
    backup = [p.detach().clone() for p in fresh]
    with torch.no_grad():
        for p in everyone:
            p.grad = None
        for p in fresh:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for p, b in zip(fresh, backup):
            p.copy_(b)
    for p, g in zip(everyone, grads):
        p.grad = g


def load_optimizer_state(optimizer: torch.optim.Optimizer, loaded: StateDict) -> None:
    """``optimizer.load_state_dict(restore_optim_state(loaded))``."""
    optimizer.load_state_dict(restore_optim_state(loaded))
