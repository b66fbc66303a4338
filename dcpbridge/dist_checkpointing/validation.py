"""Megatron-Core's ``dist_checkpointing.validation`` strict names (semantics: ``dcpbridge.planners.strict``)."""

from __future__ import annotations

from typing import Any

from dcpbridge.engine.strict import StrictHandling, parse_strict


def parse_strict_flag(strict: Any) -> StrictHandling:
    """``strict`` as a ``StrictHandling`` member (dcpbridge's ``raise_missing`` has none: it
    behaves as ``ASSUME_OK_UNEXPECTED``, which is returned for it)."""
    name = parse_strict(strict).name
    return StrictHandling.ASSUME_OK_UNEXPECTED if name == "raise_missing" else StrictHandling(name)


__all__ = ["StrictHandling", "parse_strict_flag"]
