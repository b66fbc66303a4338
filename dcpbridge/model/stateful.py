"""Top-level ``Stateful`` values (models, optimizers, apps) go through their state dicts, as in
DCP: ``state_dict()`` before a save or load, ``load_state_dict`` with what a load returned."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from dcpbridge.errors import DataStateError, OptimizerStateError
from dcpbridge.model.mapping import ShardedTensor
from dcpbridge.storage.format.table import shown_value

_NEVER = frozenset(
    {ShardedTensor, torch.Tensor, torch.nn.Parameter, int, float, str, bool, type(None)}
)


def is_stateful(value: Any) -> bool:
    """DCP's ``isinstance(value, Stateful)``, answered by the value's type or two ``hasattr``
    first: a Protocol check costs about 5 us, a state dict has a value per tensor at its top
    level (a ShardedTensor's ``hasattr`` misses cost ~0.2 us: its type is looked up first)."""
    return (
        type(value) not in _NEVER
        and hasattr(value, "state_dict")
        and hasattr(value, "load_state_dict")
        and isinstance(value, Stateful)
    )


def state_dicts(tree: Any) -> Any:
    """``tree`` with each top-level Stateful value replaced by its ``state_dict()``; an
    object that stands for a sharded state dict (``sharded_state_dict_for_save()``, as a
    ``TensorAwareStateDict`` does) is replaced by it."""
    to_save = getattr(tree, "sharded_state_dict_for_save", None)
    if not isinstance(tree, Mapping) and callable(to_save):
        tree = to_save()
    if not isinstance(tree, Mapping) or not any(map(is_stateful, tree.values())):
        return tree
    return {k: v.state_dict() if is_stateful(v) else v for k, v in tree.items()}


def load_into(template: Any, result: Any) -> Any:
    """Hand each top-level Stateful of ``template`` its loaded state; ``result`` keeps the
    Stateful object itself at that key, as ``dcp.load`` leaves it in the state dict. A data
    position or stream that refuses its state is named by its key; dcpbridge's own (samplers,
    per-rank states, RNG states, optimizers) are all checked before any of them changes."""
    if not isinstance(template, Mapping) or not isinstance(result, dict):
        return result
    loading = [(k, v) for k, v in template.items() if k in result and is_stateful(v)]
    for key, value in loading:  # every state checked before any changes (no half-loaded job)
        if isinstance(value, torch.optim.Optimizer):
            _check_optimizer_state(key, value, result[key])
        check = getattr(value, "_check_state_dict", None)
        if callable(check):
            _named(key, check, result[key])
    for key, value in loading:
        _named(key, value.load_state_dict, result[key])
        result[key] = value
    return result


def _named(key: str, call: Any, state: Any) -> None:
    """``call(state)``, a data position or stream that refuses it named by its key."""
    try:
        call(state)
    except DataStateError as e:
        raise type(e)(f"state {key!r}: {e}") from e


LOCAL_GROUP_FIELDS = ("params", "param_names")  # a param group's own entries, not hyper-parameters


def _param_ids(state: Any) -> list[Any] | None:
    """Each param group's ``params`` of an optimizer state dict (None: not one)."""
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
        return None
    return [g.get("params") for g in groups]


def _check_optimizer_state(key: str, optimizer: torch.optim.Optimizer, loaded: Any) -> None:
    """A top-level optimizer's loaded ``params`` ids must be its own (its ``load_state_dict``
    maps them to its parameters by position, so a checkpoint's duplicated, reordered or
    out-of-range ids would hand parameters each other's state, silently), and each stored
    hyper-parameter it keeps must be of a kind it can use (``fits_hyper``)."""
    mine, stored = _param_ids(optimizer.state_dict()), _param_ids(loaded)
    if stored != mine:
        raise OptimizerStateError(
            f"state {key!r}: the checkpoint's optimizer param groups list parameter ids "
            f"{stored if stored is not None else type(loaded).__name__}, this optimizer's are "
            f"{mine}; it is not this optimizer's state (damaged, or another program's)"
        )
    for i, (live, saved) in enumerate(zip(optimizer.param_groups, loaded["param_groups"])):
        check_hyper(f"state {key!r}: param group {i}", live, saved)


def check_hyper(where: str, live: Mapping[str, Any], stored: Mapping[str, Any]) -> None:
    """``OptimizerStateError`` naming ``where`` and the entry where one of a group's stored
    hyper-parameters does not fit this optimizer's (``fits_hyper``); its own fields pass."""
    for name, value in live.items():
        if name in LOCAL_GROUP_FIELDS or name not in stored or fits_hyper(value, stored[name]):
            continue
        raise OptimizerStateError(
            f"{where}: hyper-parameter {name!r} of the checkpoint "
            f"({shown_value(stored[name])}) does not fit this optimizer's ({shown_value(value)})"
        )


def fits_hyper(live: Any, stored: Any) -> bool:
    """Whether a stored hyper-parameter can stand where this optimizer keeps ``live``: a
    flag for a flag, a number no float overflows on and no NaN for a number or one-element
    tensor (an int or a float: ``lr=1`` and ``lr=1e-3`` are both a learning rate), a sequence
    of as many fitting values for a sequence, text for text, None, a flag or a number for
    None; anything for other kinds (not checked)."""
    if isinstance(live, bool):
        return isinstance(stored, bool)
    if isinstance(live, (int, float)) or (isinstance(live, torch.Tensor) and live.numel() == 1):
        if isinstance(stored, torch.Tensor):
            stored = stored.item() if stored.numel() == 1 else None
        if isinstance(stored, bool) or not isinstance(stored, (int, float)):
            return False
        try:
            return not math.isnan(float(stored))
        except OverflowError:
            return False
    if isinstance(live, (tuple, list)):
        return (
            isinstance(stored, (tuple, list))
            and len(stored) == len(live)
            and all(fits_hyper(a, b) for a, b in zip(live, stored))
        )
    if isinstance(live, str):
        return isinstance(stored, str)
    if live is None:
        return stored is None or isinstance(stored, bool) or fits_hyper(0.0, stored)
    return True
