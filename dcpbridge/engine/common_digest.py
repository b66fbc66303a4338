"""Common state that differs across ranks: found by a digest carried in the save's plan vote.

The common state (the plain values of a state dict, not its tensors) is written from the
group's rank 0 only, as in Megatron-Core: another rank's different values are dropped. Each
rank therefore adds one 8-byte digest of its common values to the vote every save already
takes; only where the digests differ does a second exchange gather the differing ranks'
per-key digests, and rank 0 warns (``CommonStateMismatchWarning``) naming keys and ranks.
Digests are of a canonical form: dict and set order (which differs across processes with
their own hash seeds) does not count, and tensors inside values count by dtype and shape only
(the common state's tensors are sharded data, compared where they are written).
"""

from __future__ import annotations

import hashlib
import pickle
import warnings
from typing import Any

import torch

from dcpbridge.engine.collectives import Group

_UNHASHABLE = b"\x00unhashable"
"""The digest of a value that does not pickle (never reported as differing)."""

_SHOWN = 8
"""How many differing keys and ranks a warning names (then a count of the rest)."""


class CommonStateMismatchWarning(UserWarning):
    """Ranks hold different common state (plain values) in one save: only rank 0's is
    written, the others' differing values are dropped."""


def _canonical(value: Any, depth: int = 0) -> Any:
    """``value`` with dicts and sets in a fixed order and tensors as (dtype, shape)."""
    if depth > 64:  # deeper than any real state: compared as pickled
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape))
    if isinstance(value, dict):
        items = [(_canonical(k, depth + 1), _canonical(v, depth + 1)) for k, v in value.items()]
        if all(type(k) is str for k in value):  # the usual case: no key to pickle for order
            return ("dict", type(value).__name__, sorted(items, key=lambda kv: kv[0]))
        return ("dict", type(value).__name__, sorted(items, key=lambda kv: _bytes(kv[0])))
    if isinstance(value, (set, frozenset)):
        return ("set", sorted((_canonical(v, depth + 1) for v in value), key=_bytes))
    if type(value) in (list, tuple):
        return (type(value).__name__, [_canonical(v, depth + 1) for v in value])
    if isinstance(getattr(value, "__dict__", None), dict) and not isinstance(value, type):
        kind = f"{type(value).__module__}.{type(value).__qualname__}"  # an argparse.Namespace
        return ("object", kind, _canonical(vars(value), depth + 1))
    return value


def _bytes(value: Any) -> bytes:
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return _UNHASHABLE


def key_digests(objects: dict[str, Any]) -> dict[str, bytes]:
    """Each common key's digest (8 bytes)."""
    out = {}
    for key, value in objects.items():
        try:
            raw = _bytes(_canonical(value))
        except Exception:  # an odd object's attributes: the digest never fails a save
            raw = _UNHASHABLE
        out[key] = raw if raw == _UNHASHABLE else hashlib.blake2b(raw, digest_size=8).digest()
    return out


def digest(per_key: dict[str, bytes]) -> bytes:
    """One digest of all of ``per_key`` (what the vote carries)."""
    h = hashlib.blake2b(digest_size=8)
    for key in sorted(per_key):
        h.update(key.encode() + b"\x00" + per_key[key])
    return h.digest()


def differing(mine: dict[str, bytes], theirs: dict[str, bytes]) -> list[str]:
    """The keys whose values differ between rank 0 (``mine``) and another rank, or that
    only one of them holds; a value that does not pickle on either side is not compared."""
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if a != b and _UNHASHABLE not in (a, b):
            out.append(key)
    return out


def check(group: Group, digests: list[bytes], per_key: dict[str, bytes], what: str) -> None:
    """Warn on rank 0 where ranks' common state differs from its own: ``digests`` are every
    rank's (from the vote, alike on every rank); only then does each rank send its per-key
    digests to rank 0 (one more exchange, taken by every rank or none)."""
    if len(set(digests)) <= 1:
        return
    sent = per_key if digests[group.rank] != digests[0] else None
    gathered = group.gather(sent)
    if gathered is None:
        return
    by_key: dict[str, list[int]] = {}
    for rank, theirs in enumerate(gathered):
        if theirs is None or rank == 0:
            continue
        for key in differing(per_key, theirs):
            by_key.setdefault(key, []).append(rank)
    if not by_key:  # differing only in values that do not pickle
        return
    shown = [f"{k!r} (ranks {_ranks(r)})" for k, r in list(by_key.items())[:_SHOWN]]
    more = f" and {len(by_key) - _SHOWN} more" if len(by_key) > _SHOWN else ""
    warnings.warn(
        f"{what}: the common state differs across ranks; only rank 0's is saved, the other "
        f"ranks' values are dropped: {', '.join(shown)}{more}",
        CommonStateMismatchWarning,
        stacklevel=2,
    )


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:_SHOWN]))
    return shown + (f", ... ({len(ranks)} ranks)" if len(ranks) > _SHOWN else "")
