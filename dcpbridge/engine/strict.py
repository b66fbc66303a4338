"""What a load does with keys requested but not stored, and stored but not requested.

Two vocabularies name these sets in opposite ways. Megatron-Core calls a key requested by the
load but absent from the checkpoint *unexpected*, and a key stored in the checkpoint that no
rank requested *missing* (the reverse of ``nn.Module.load_state_dict``). dcpbridge's own
``MissingKeysError`` is raised for requested-not-stored keys. To keep both readable, dcpbridge's
messages say "requested but not in the checkpoint" and "in the checkpoint but not requested",
and values returned for Megatron's ``return_*`` policies are exactly Megatron's:
``(state_dict, missing, unexpected)`` with ``missing`` = stored-not-requested (all ranks) and
``unexpected`` = requested-not-stored (this rank). Keys are tensor keys and ShardedObject keys
(never an object's storage name ``key/shard_0_4``); the common state is not a key.

Policies (any ``strict=`` value below, as a string in any case or as an enum member, including
Megatron's own ``StrictHandling``):

========================  =================================  ==================================
policy                    requested but not in checkpoint    in checkpoint but not requested
========================  =================================  ==================================
``raise_missing``         raise (dcpbridge's default)        ignored
``assume_ok_unexpected``  raise (Megatron's default)         ignored
``raise_unexpected``      raise                              ignored
``raise_all``             raise (one error with both sets)   raise
``log_unexpected``        WARNING log, skipped               ignored
``log_all``               WARNING log, skipped               WARNING log
``return_unexpected``     returned, skipped                  not computed (returned empty)
``return_all``            returned, skipped                  returned
``ignore_all``            skipped                            ignored
========================  =================================  ==================================

"Skipped" keys are left out of the load and absent from its result (dict entries dropped,
list positions None). Raising happens before any data is read, on every rank.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadPlan

from dcpbridge.errors import (
    CheckpointError,
    InvalidArgumentError,
    KeyMismatchError,
    MissingKeysError,
    ShapeMismatchError,
    UnexpectedKeysError,
)
from dcpbridge.model.mapping import COMMON_KEY, object_key
from dcpbridge.planners import ShardedLoadPlanner, StrictMode

log = logging.getLogger(__name__)

REQUESTED_NOT_STORED = "requested but not in the checkpoint"
STORED_NOT_REQUESTED = "in the checkpoint but not requested"


class StrictHandling(str, enum.Enum):
    """Megatron-Core's ``StrictHandling`` values (same names and strings), for code that
    switched its import to ``dcpbridge.dist_checkpointing``; see this module's table."""

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: Any) -> bool:
        """Whether the policy compares the request with the checkpoint's keys at all."""
        return parse_strict(val).name != "assume_ok_unexpected"

    @staticmethod
    def requires_global_app_metadata(val: Any) -> bool:
        """Whether the policy needs every rank's request (to find stored-not-requested keys)."""
        return parse_strict(val).name in ("ignore_all", "raise_all", "return_all", "log_all")

    @staticmethod
    def requires_returning_mismatch_keys(val: Any) -> bool:
        """Whether ``load`` returns ``(state_dict, missing, unexpected)`` under the policy."""
        return parse_strict(val).returns is not None


@dataclass(frozen=True)
class Policy:
    """One strict value, decoded: what happens to each kind of key mismatch."""

    name: str
    raise_requested: bool = False  # raise on requested-not-stored keys
    raise_stored: bool = False  # raise on stored-not-requested keys
    log_requested: bool = False
    log_stored: bool = False
    returns: str | None = None  # "unexpected" or "all": load returns the key sets

    @property
    def needs_stored(self) -> bool:
        """Whether stored-not-requested keys matter (computed from every rank's request)."""
        return self.raise_stored or self.log_stored or self.returns == "all"


_POLICIES = {
    p.name: p
    for p in (
        Policy("raise_missing", raise_requested=True),
        Policy("assume_ok_unexpected", raise_requested=True),
        Policy("raise_unexpected", raise_requested=True),
        Policy("raise_all", raise_requested=True, raise_stored=True),
        Policy("log_unexpected", log_requested=True),
        Policy("log_all", log_requested=True, log_stored=True),
        Policy("return_unexpected", returns="unexpected"),
        Policy("return_all", returns="all"),
        Policy("ignore_all"),
    )
}

STRICT_VALUES = tuple(_POLICIES)


def parse_strict(strict: Any) -> Policy:
    """The policy for a ``strict=`` value: a name (any case) or an enum member whose value is
    one (dcpbridge's ``StrictMode``/``StrictHandling`` or Megatron's ``StrictHandling``)."""
    if isinstance(strict, Policy):
        return strict
    value = strict.value if isinstance(strict, enum.Enum) else strict
    policy = _POLICIES.get(value.lower()) if isinstance(value, str) else None
    if policy is None:
        raise InvalidArgumentError(
            f"strict must be one of {', '.join(STRICT_VALUES)}; got {strict!r}"
        )
    return policy


@dataclass(frozen=True)
class Verdict:
    """What to do about one load's mismatches: raise, log, and/or return key sets."""

    error: CheckpointError | None = None
    warning: str | None = None
    returned: tuple[set[str], set[str]] | None = None  # Megatron's (missing, unexpected)


def _by_key(requested_not_stored: Mapping[int, Iterable[str]] | Iterable[str]) -> dict[str, list]:
    """Key -> the ranks that requested it (empty when ranks are not known)."""
    out: dict[str, list] = {}
    if isinstance(requested_not_stored, Mapping):
        for rank, keys in sorted(requested_not_stored.items()):
            for key in keys:
                out.setdefault(key, []).append(rank)
    else:
        for key in requested_not_stored:
            out.setdefault(key, [])
    return dict(sorted(out.items()))


def _listing(keys: Mapping[str, list], limit: int = 10) -> str:
    def one(key: str, ranks: list) -> str:
        if not ranks:
            return repr(key)
        return f"{key!r} (rank {ranks[0]})" if len(ranks) == 1 else f"{key!r} (ranks {ranks})"

    shown = [one(k, r) for k, r in list(keys.items())[:limit]]
    more = f", ... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(shown) + more


def requested_message(keys: Mapping[str, list]) -> str:
    return (
        f"{len(keys)} key(s) {REQUESTED_NOT_STORED} (Megatron calls them 'unexpected'): "
        f"{_listing(keys)}"
    )


def stored_message(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    return (
        f"{len(keys)} key(s) {STORED_NOT_REQUESTED} by any rank (Megatron calls them "
        f"'missing'): {_listing({key: [] for key in keys})}"
    )


def decide(
    policy: Policy,
    requested_not_stored: Mapping[int, Iterable[str]] | Iterable[str],
    stored_not_requested: Iterable[str],
) -> Verdict:
    """Raise / log / return for ``policy`` given the two key sets (pure: no I/O, no logging).

    ``requested_not_stored`` may map ranks to their keys, so that messages name the ranks;
    the returned ``unexpected`` set is the union of its keys.
    """
    requested = _by_key(requested_not_stored)
    stored = set(stored_not_requested)
    raised = []
    if policy.raise_requested and requested:
        raised.append(requested_message(requested))
    if policy.raise_stored and stored:
        raised.append(stored_message(stored))
    error: CheckpointError | None = None
    if raised:
        text = "; ".join(raised)
        if policy.raise_requested and requested and policy.raise_stored and stored:
            error = KeyMismatchError(text)
        elif policy.raise_requested and requested:
            error = MissingKeysError(text)
        else:
            error = UnexpectedKeysError(text)
    logged = []
    if policy.log_requested and requested:
        logged.append(requested_message(requested))
    if policy.log_stored and stored:
        logged.append(stored_message(stored))
    returned = None
    if policy.returns == "all":
        returned = (stored, set(requested))
    elif policy.returns == "unexpected":
        returned = (set(), set(requested))
    return Verdict(error, "; ".join(logged) or None, returned)


def requested_keys(
    fqns: Iterable[str], common: Iterable[str] = ()
) -> tuple[set[str], dict[str, str]]:
    """(keys a load request names, storage name -> key for its ShardedObject cells), from the
    storage names the planner requested; common-state entries are not keys."""
    keys: set[str] = set()
    names: dict[str, str] = {}
    skip = {COMMON_KEY, *common}
    for fqn in fqns:
        if fqn in skip:
            continue
        key = object_key(fqn)
        if key != fqn:
            names[fqn] = key
        keys.add(key)
    return keys, names


def stored_keys(metadata: Metadata, common: Iterable[str] = ()) -> set[str]:
    """The checkpoint's tensor and ShardedObject keys (objects by key, not storage name),
    without its common-state entries."""
    skip = {COMMON_KEY, *common}
    return {
        object_key(name) if isinstance(md, BytesStorageMetadata) else name
        for name, md in metadata.state_dict_metadata.items()
        if name not in skip
    }


class StrictLoadPlanner(ShardedLoadPlanner):
    """``ShardedLoadPlanner`` whose key mismatches follow a strict policy (see the module).

    The parent only collects what is absent; this planner names keys as Megatron does,
    raises inside planning (so every rank raises, before any read) and, for policies that
    need them, computes stored-not-requested keys on the coordinator from every rank's request.
    """

    def __init__(self, *, strict: Any = "raise_missing", **kwargs: Any) -> None:
        self.policy = parse_strict(strict)
        super().__init__(strict=StrictMode.RETURN_ALL, **kwargs)
        self.requested_not_stored: set[str] = set()  # this rank's
        self.stored_not_requested: set[str] = set()  # all ranks'; empty unless needs_stored
        self._stored: Metadata | None = None

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._stored = metadata

    def common_keys(self) -> set[str]:
        """Stored keys that are common state, not requests (none for a plain planner)."""
        return set()

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        assert self._stored is not None
        common = self.common_keys()
        requested, names = requested_keys(self._local.requested, common)
        stored = stored_keys(self._stored, common)
        absent = set()
        for name in self.missing_keys:
            key = names.get(name, name)
            if key != name and key in stored:
                cells = sorted(n for n in self._stored.state_dict_metadata if object_key(n) == key)
                raise ShapeMismatchError(
                    f"ShardedObject {key!r}: cell {name!r} is {REQUESTED_NOT_STORED}, which "
                    f"stores another grid of {key!r}: {', '.join(cells[:4])}"
                    + (", ..." if len(cells) > 4 else "")
                )
            if key != COMMON_KEY:
                absent.add(key)
        self.requested_not_stored = absent
        if not self.policy.needs_stored:  # the decision needs only this rank's request
            error = decide(self.policy, absent, ()).error
            if error is not None:
                raise error
        data = (requested if self.policy.needs_stored else None, sorted(absent))
        return dataclasses.replace(plan, planner_data=data)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        if not self.policy.needs_stored:
            return [dataclasses.replace(p, planner_data=None) for p in global_plan]
        assert self._stored is not None
        requested: set[str] = set().union(*(p.planner_data[0] for p in global_plan))
        stored = sorted(stored_keys(self._stored, self.common_keys()) - requested)
        absent = {rank: p.planner_data[1] for rank, p in enumerate(global_plan)}
        error = decide(self.policy, absent, stored).error
        if error is not None:
            raise error
        return [dataclasses.replace(p, planner_data=stored) for p in global_plan]

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        if self.policy.needs_stored:
            self.stored_not_requested = set(central_plan.planner_data or ())
        self.unexpected_keys = sorted(self.stored_not_requested)
        return central_plan


def load_result(planner: StrictLoadPlanner, state_dict: Any) -> Any:
    """``load``'s return value under the planner's policy (logging what it says to log)."""
    verdict = decide(planner.policy, planner.requested_not_stored, planner.stored_not_requested)
    if verdict.warning:
        log.warning("dcpbridge load: %s", verdict.warning)
    if verdict.returned is None:
        return state_dict
    return state_dict, *verdict.returned
