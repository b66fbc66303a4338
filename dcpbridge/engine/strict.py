"""Strict loading for ``load``: the policies (``dcpbridge.planners.strict``, where the table of
what each ``strict=`` value does lives) and what ``load`` returns under them."""

from __future__ import annotations

import logging
from typing import Any

from dcpbridge.planners import ShardedLoadPlanner
from dcpbridge.planners.strict import (
    STRICT_VALUES,
    Policy,
    StrictHandling,
    decide,
    parse_strict,
)

log = logging.getLogger(__name__)

__all__ = [
    "STRICT_VALUES",
    "Policy",
    "StrictHandling",
    "decide",
    "load_result",
    "parse_strict",
]


def load_result(planner: ShardedLoadPlanner, state_dict: Any) -> Any:
    """``load``'s return value under the planner's policy (logging what it says to log)."""
    verdict = decide(planner.policy, planner.requested_not_stored, planner.stored_not_requested)
    if verdict.warning:
        log.warning("dcpbridge load: %s", verdict.warning)
    if verdict.returned is None:
        return state_dict
    return state_dict, *verdict.returned
