"""What a load does with keys requested but not stored, and stored but not requested.

Two vocabularies name these sets in opposite ways. Megatron-Core calls a key requested by the
load but absent from the checkpoint *unexpected*, and a key stored in the checkpoint that no
rank requested *missing* (the reverse of ``nn.Module.load_state_dict``). dcpbridge's own
``MissingKeysError`` is raised for requested-not-stored keys. To keep both readable, dcpbridge's
messages say "requested but not in the checkpoint" and "in the checkpoint but not requested",
and values returned for Megatron's ``return_*`` policies are exactly Megatron's:
``(state_dict, missing, unexpected)`` with ``missing`` = stored-not-requested (all ranks) and
``unexpected`` = requested-not-stored (this rank). Keys are tensor keys and ShardedObject keys
(never an object's storage name ``key/shard_0_4``); common state is not a key. Every error
names every key, up to ``KEY_LIST_LIMIT``, then how many more.

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

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from dcpbridge.planners.errors import (
    KeyMismatchError,
    MissingKeysError,
    UnexpectedKeysError,
    key_list,
)
from dcpbridge.planners.protocol import object_key
from dcpbridge.storage.errors import CheckpointError, InvalidArgumentError

CHECKPOINT = "the checkpoint"  # where stored keys are, in messages (the default)


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

    def reported(
        self, requested_not_stored: Iterable[str], stored_not_requested: Iterable[str]
    ) -> tuple[set[str], set[str]]:
        """Megatron's ``(missing, unexpected)`` under this policy: what its validation hands
        back (empty for ``ignore_all``; ``missing`` empty unless the policy computes it)."""
        if self.name == "ignore_all":
            return set(), set()
        missing = set(stored_not_requested) if self.needs_stored else set()
        return missing, set(requested_not_stored)


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


def _listing(keys: Mapping[str, list]) -> str:
    def one(key: str, ranks: list) -> str:
        if not ranks:
            return repr(key)
        return f"{key!r} (rank {ranks[0]})" if len(ranks) == 1 else f"{key!r} (ranks {ranks})"

    return key_list(one(k, r) for k, r in keys.items())


def requested_message(keys: Mapping[str, list], where: str = CHECKPOINT) -> str:
    return (
        f"{len(keys)} key(s) requested but not in {where} (Megatron calls them 'unexpected'): "
        f"{_listing(keys)}"
    )


def stored_message(keys: Iterable[str], where: str = CHECKPOINT) -> str:
    keys = sorted(keys)
    return (
        f"{len(keys)} key(s) in {where} but not requested by any rank (Megatron calls them "
        f"'missing'): {_listing({key: [] for key in keys})}"
    )


def decide(
    policy: Policy,
    requested_not_stored: Mapping[int, Iterable[str]] | Iterable[str],
    stored_not_requested: Iterable[str],
    where: str = CHECKPOINT,
) -> Verdict:
    """Raise / log / return for ``policy`` given the two key sets (pure: no I/O, no logging).

    ``requested_not_stored`` may map ranks to their keys, so that messages name the ranks;
    the returned ``unexpected`` set is the union of its keys. ``where`` names the stored
    state in messages.
    """
    requested = _by_key(requested_not_stored)
    stored = set(stored_not_requested)
    raised = []
    if policy.raise_requested and requested:
        raised.append(requested_message(requested, where))
    if policy.raise_stored and stored:
        raised.append(stored_message(stored, where))
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
        logged.append(requested_message(requested, where))
    if policy.log_stored and stored:
        logged.append(stored_message(stored, where))
    returned = policy.reported(requested, stored) if policy.returns else None
    return Verdict(error, "; ".join(logged) or None, returned)


def requested_keys(
    fqns: Iterable[str], skip: Iterable[str] = ()
) -> tuple[set[str], dict[str, str]]:
    """(keys a load request names, storage name -> key for its ShardedObject cells), from the
    storage names the planner requested; names in ``skip`` (common state) are not keys."""
    keys: set[str] = set()
    names: dict[str, str] = {}
    skip = set(skip)
    for fqn in fqns:
        if fqn in skip:
            continue
        key = object_key(fqn)
        if key != fqn:
            names[fqn] = key
        keys.add(key)
    return keys, names


def stored_keys(metadata: Metadata, skip: Iterable[str] = ()) -> set[str]:
    """The checkpoint's tensor and ShardedObject keys (objects by key, not storage name),
    without the names in ``skip`` (common state)."""
    skip = set(skip)
    return {
        object_key(name) if isinstance(md, BytesStorageMetadata) else name
        for name, md in metadata.state_dict_metadata.items()
        if name not in skip
    }
