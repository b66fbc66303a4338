"""Optimizer param groups from a base config and per-ParamKey overrides, same on every rank.

There is one group per override plus the default group, always all of them and always in the
order of ``config_overrides`` (default first), even where a rank holds no parameter of a group.
So every rank of every layout has the same groups in the same order, and each group carries a
stable identity (``"group_key"``) by which a checkpoint's groups are matched on load. A
parameter belongs to the first override whose key matches it, else to the default group.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from dcpbridge.engine.collectives import Group
from dcpbridge.errors import InvalidArgumentError
from dcpbridge.mcore.optimizer import GROUP_KEY
from dcpbridge.storage.errors import storage_faults

DEFAULT_GROUP = "default"
OPTIMIZERS = ("adam", "adamw", "sgd")


def _as_tuple(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamKey:
    """Selects parameters: any name glob, any truthy attribute, or the predicate matches."""

    name: str | tuple[str, ...] = ()
    """Glob patterns (``fnmatch``, case-sensitive) on the parameter's name in its module."""
    attr: str | tuple[str, ...] = ()
    """Attribute names; a parameter with any of them set truthy matches."""
    predicate: Callable[[str, nn.Parameter], bool] | None = None
    """``predicate(name, param)``; needs a ``label`` since a function has no stable name."""
    label: str | None = None
    """The group's identity in checkpoints; derived from ``name``/``attr`` when omitted."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", _as_tuple(self.name))
        object.__setattr__(self, "attr", _as_tuple(self.attr))
        if not (self.name or self.attr or self.predicate):
            raise InvalidArgumentError("ParamKey needs a name pattern, an attr or a predicate")
        if self.predicate is not None and not self.label:
            raise InvalidArgumentError(
                "a ParamKey with a predicate needs a label (its stable identity)"
            )
        if self.identity == DEFAULT_GROUP:
            raise InvalidArgumentError(f"{DEFAULT_GROUP!r} is the default group's identity")

    def matches(self, name: str, param: nn.Parameter) -> bool:
        """Whether parameter ``name`` is selected (a name glob, an attribute or the predicate)."""
        return (
            any(fnmatchcase(name, pattern) for pattern in self.name)
            or any(getattr(param, a, False) for a in self.attr)
            or (self.predicate is not None and bool(self.predicate(name, param)))
        )

    @property
    def identity(self) -> str:
        if self.label:
            return self.label
        parts = [f"name={'|'.join(self.name)}"] if self.name else []
        parts += [f"attr={'|'.join(self.attr)}"] if self.attr else []
        return ";".join(parts)


@dataclass(kw_only=True, frozen=True, slots=True)
class OptimizerConfig:
    """What ``get_optimizer`` builds; every field but ``optimizer`` may be overridden per key."""

    optimizer: str = "adam"
    """One of 'adam', 'adamw', 'sgd'."""
    lr: float = 1e-3
    """Learning rate."""
    min_lr: float | None = None
    """Floor for LR schedules; kept in each group as ``"min_lr"`` (not used by torch.optim)."""
    weight_decay: float = 0.0
    """L2 penalty (adam, sgd) or decoupled decay (adamw)."""
    adam_beta1: float = 0.9
    """First-moment decay."""
    adam_beta2: float = 0.999
    """Second-moment decay."""
    adam_eps: float = 1e-8
    """Denominator term."""
    sgd_momentum: float = 0.0
    """SGD momentum (0 keeps no state)."""
    sgd_nesterov: bool = False
    """Nesterov momentum (needs sgd_momentum > 0)."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise InvalidArgumentError(
                f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}"
            )
        for name in ("lr", "weight_decay", "adam_eps", "sgd_momentum"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise InvalidArgumentError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.adam_eps <= 0:
            raise InvalidArgumentError(f"adam_eps must be > 0, got {self.adam_eps!r}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise InvalidArgumentError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr!r}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.sgd_nesterov and self.sgd_momentum <= 0:
            raise InvalidArgumentError("sgd_nesterov needs sgd_momentum > 0")

    def group_options(self) -> dict[str, Any]:
        """The torch.optim param-group entries this config sets."""
        out: dict[str, Any] = {"lr": self.lr, "weight_decay": self.weight_decay}
        if self.optimizer == "sgd":
            out.update(momentum=self.sgd_momentum, nesterov=self.sgd_nesterov)
        else:
            out.update(betas=(self.adam_beta1, self.adam_beta2), eps=self.adam_eps)
        if self.min_lr is not None:
            out["min_lr"] = self.min_lr
        return out


Override = Mapping[str, Any] | OptimizerConfig


def _override(config: OptimizerConfig, key: ParamKey, value: Override) -> OptimizerConfig:
    if isinstance(value, OptimizerConfig):
        new = value
    else:
        fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise InvalidArgumentError(f"override for {key.identity!r}: unknown fields {unknown}")
        new = dataclasses.replace(config, **value)
    if new.optimizer != config.optimizer:
        raise InvalidArgumentError(
            f"override for {key.identity!r} asks for optimizer {new.optimizer!r}; one "
            f"optimizer ({config.optimizer!r}) serves every group"
        )
    return new


def _named_parameters(model_chunks: Sequence[nn.Module]) -> list[tuple[str, str, nn.Parameter]]:
    """(name in its chunk, unique display name, param) of trainable params, first use wins."""
    seen: set[int] = set()
    out = []
    for index, chunk in enumerate(model_chunks):
        for name, param in chunk.named_parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                shown = name if len(model_chunks) == 1 else f"chunk{index}.{name}"
                out.append((name, shown, param))
    return out


def get_param_groups(
    model_chunks: nn.Module | Sequence[nn.Module],
    config: OptimizerConfig,
    config_overrides: Mapping[ParamKey, Override] | None = None,
) -> list[dict[str, Any]]:
    """One group per override (in order) after the default group, each with ``params``,
    ``param_names``, the torch.optim options of its config and its ``group_key``."""
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    keys = list((config_overrides or {}).items())
    configs = [config] + [_override(config, key, value) for key, value in keys]
    identities = [DEFAULT_GROUP] + [key.identity for key, _ in keys]
    if len(set(identities)) != len(identities):
        raise InvalidArgumentError(f"ParamKey identities must be distinct, got {identities}")
    groups = [
        {"params": [], "param_names": [], **cfg.group_options(), GROUP_KEY: identity}
        for cfg, identity in zip(configs, identities)
    ]
    for name, shown, param in _named_parameters(chunks):
        slot = next((i + 1 for i, (key, _) in enumerate(keys) if key.matches(name, param)), 0)
        groups[slot]["params"].append(param)
        groups[slot]["param_names"].append(shown)
    return groups


_OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}


def get_optimizer(
    model_chunks: nn.Module | Sequence[nn.Module],
    config: OptimizerConfig,
    config_overrides: Mapping[ParamKey, Override] | None = None,
    dump_param_groups_to: str | os.PathLike[str] | None = None,
) -> torch.optim.Optimizer:
    """A torch.optim optimizer over ``get_param_groups``; optionally writes
    ``{param name: group identity}`` as JSON (``{rank}`` in the path is the global rank;
    without it only global rank 0 writes)."""
    groups = get_param_groups(model_chunks, config, config_overrides)
    defaults = {k: v for k, v in config.group_options().items() if k != "min_lr"}
    optimizer = _OPTIMIZER_CLASSES[config.optimizer](groups, **defaults)
    if dump_param_groups_to is not None:
        _dump(groups, os.fspath(dump_param_groups_to))
    return optimizer


def _dump(groups: list[dict[str, Any]], path: str) -> None:
    rank = Group.resolve().rank
    if "{rank}" not in path and rank != 0:
        return
    path = path.replace("{rank}", str(rank))
    mapping = {n: g[GROUP_KEY] for g in groups for n in g["param_names"]}
    tmp = f"{path}.tmp{os.getpid()}"
    with storage_faults(f"dump of param groups to {path}"):
        try:
            with open(tmp, "w") as f:
                json.dump(mapping, f, indent=1)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
