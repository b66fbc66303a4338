"""torch's optimizer state-dict layout <-> dcpbridge's model-space layout, for cross-framework resume.

torch keys optimizer state by parameter (``state.<fqn>.<name>`` from
``torch.distributed.checkpoint.state_dict.get_state_dict``, or integer ids with
``param_names`` from ``optimizer.state_dict()``); dcpbridge's Megatron-style helpers
(``dcpbridge.mcore.optimizer``) key it by state name and model key (``optimizer.state.<name>.<model
key>``), store ``step`` once (``optimizer.shared_state.step``) and the param groups'
hyper-parameters by group identity (``optimizer.param_groups.<identity>.<hyper-parameter>``).
``to_model_space`` rearranges the first into the second without copying any tensor (DTensors
stay DTensors, so they reshard like their parameters), and ``from_model_space`` turns what
``dcpbridge.load`` returns back into what ``Optimizer.load_state_dict`` or
``torch.distributed.checkpoint.state_dict.set_state_dict`` accept. Placed under the top-level
key ``"optimizer"``, the result has exactly the keys a Megatron-style job saves, so either job
resumes the other's checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dcpbridge.errors import OptimizerStateError
from dcpbridge.mcore.optimizer import (
    SHARED_KEYS,
    _shared_value,
    _ValueType,
    live_hyper,
    restore_optim_state,
    split_param_groups,
)
from dcpbridge.model.mapping import LocalNonpersistentObject, StateDict


def _names_by_id(optim_state_dict: StateDict) -> dict[Any, str]:
    """Each state id's parameter name: FQN keys as they are, integer ids via ``param_names``."""
    names: dict[Any, str] = {}
    for index, group in enumerate(optim_state_dict["param_groups"]):
        params = list(group.get("params", ()))
        if all(isinstance(p, str) for p in params):
            names.update((p, p) for p in params)
            continue
        param_names = group.get("param_names")
        if param_names is None or len(param_names) != len(params):
            raise OptimizerStateError(
                f"param group {index} lists parameters by id without their names; pass the "
                "state dict of torch.distributed.checkpoint.state_dict.get_state_dict, or "
                "build the optimizer from model.named_parameters() so it records param_names"
            )
        names.update(zip(params, param_names))
    unnamed = [pid for pid in optim_state_dict["state"] if pid not in names]
    if unnamed:
        raise OptimizerStateError(f"optimizer state of {unnamed[:6]} belongs to no param group")
    ids_by_name: dict[str, list[Any]] = {}
    for pid, name in names.items():
        ids_by_name.setdefault(name, []).append(pid)
    shared = [f"{name!r} (state ids {ids})" for name, ids in ids_by_name.items() if len(ids) > 1]
    if shared:  # one model-space key would hold both parameters' state: one would be lost
        raise OptimizerStateError(
            f"parameters share a name in the optimizer's param groups: {', '.join(shared[:6])}; "
            "each parameter's state is stored under its name, so names must be unique "
            "(prefix each model's names, e.g. with its model chunk)"
        )
    return names


def _per_parameter_names(
    state: Mapping[Any, Mapping[str, Any]], exclude_keys: tuple[str, ...]
) -> set[str]:
    """State names stored per parameter: those with a tensor of one or more dims anywhere.

    A 0-dim parameter's entry of such a name (its ``exp_avg``) is per-parameter too: stored
    once as shared state, it would replace every other parameter's on restore.
    """
    return {
        name
        for entry in state.values()
        for name, value in entry.items()
        if name not in SHARED_KEYS
        and name not in exclude_keys
        and isinstance(value, torch.Tensor)
        and value.ndim > 0
    }


def to_model_space(
    optim_state_dict: StateDict, *, model_prefix: str = "", exclude_keys: tuple[str, ...] = ()
) -> StateDict:
    """torch's optimizer state dict in dcpbridge's model-space layout; save it as ``"optimizer"``.

    A parameter's tensor entries (``exp_avg``...) go to ``state[<name>][model_prefix + <fqn>]``,
    so they are stored as ``optimizer.state.<name>.<model key>``, sharded like the parameter;
    ``model_prefix`` is the path of the model state dict in the saved state (``""`` when its
    keys are the parameters' FQNs, ``"model."`` for ``{"model": model_sd, ...}``). ``step``
    and any other scalar entry (of a name no parameter holds a 1+ dim tensor of) must agree
    across parameters and are stored once; param groups are keyed by ``group_key`` else
    position (``"#0"``...). Works as a save state and as a load template (tensors are the optimizer's own, filled in place); ``exclude_keys`` are neither
    saved nor loaded.
    """
    names = _names_by_id(optim_state_dict)
    state: dict[str, dict[str, Any]] = {}
    shared: dict[str, dict[Any, Any]] = {}
    types: dict[Any, dict[str, _ValueType]] = {}
    excluded: dict[Any, dict[str, Any]] = {}
    keys: dict[Any, str] = {}
    per_param = _per_parameter_names(optim_state_dict["state"], exclude_keys)
    for pid, entry in optim_state_dict["state"].items():
        key = keys[pid] = model_prefix + names[pid]
        for name, value in entry.items():
            if name in exclude_keys:
                excluded.setdefault(pid, {})[name] = value
            elif name in per_param and isinstance(value, torch.Tensor):
                state.setdefault(name, {})[key] = value
            else:
                shared.setdefault(name, {})[pid] = value
                types.setdefault(pid, {})[name] = _ValueType.of(value)
    groups, local_groups = split_param_groups(optim_state_dict["param_groups"])
    out: StateDict = {"state": state, "param_groups": groups}
    if shared:
        out["shared_state"] = {k: _shared_value(k, v) for k, v in shared.items()}
    local = {
        "groups": local_groups,
        "types": types,
        "excluded": excluded,
        "keys": keys,
        "hyper": live_hyper(groups),
    }
    out["local"] = LocalNonpersistentObject(local)
    return out


def from_model_space(loaded: Mapping[str, Any]) -> StateDict:
    """What ``to_model_space``'s template became after ``dcpbridge.load``, in torch's layout.

    Keys are those of the state dict given to ``to_model_space`` (FQNs or ids); ``step`` is
    restored per parameter in the type the optimizer keeps it in, and saved param groups are
    matched by identity (their hyper-parameters, this optimizer's ``params``).
    """
    local = loaded["local"]
    if isinstance(local, LocalNonpersistentObject):
        local = local.unwrap()
    tensors: Mapping[str, Mapping[str, Any]] = loaded.get("state", {})
    state: dict[Any, dict[str, Any]] = {}
    for pid, key in local["keys"].items():
        state[pid] = {name: by_key[key] for name, by_key in tensors.items() if key in by_key}
    return restore_optim_state(
        {
            "state": state,
            "shared_state": loaded.get("shared_state", {}),
            "param_groups": loaded["param_groups"],
            "local": local,
        }
    )
