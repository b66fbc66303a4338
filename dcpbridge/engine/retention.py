"""Which of a manager's complete steps survive (``Retention``), and the per-step sidecar
(``manager.json``) holding the metrics ``keep_best`` ranks them by: written before a save
commits, read back as untrusted input."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dcpbridge.errors import InvalidArgumentError
from dcpbridge.storage import METADATA_FILE, Location
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.backends.store import Storage
from dcpbridge.storage.write.commit import committed_save_id, json_object

SIDECAR = "manager.json"
"""Per-step file of the manager (the step's metrics), written before the save commits."""
MAX_SIDECAR_BYTES = 1 << 20
"""A larger sidecar is not read (it counts as no metric): a few metrics take bytes."""


@dataclass(frozen=True, slots=True)
class Retention:
    """Which complete checkpoints survive: the newest ``keep_last`` (None: all), multiples of
    ``keep_every``, the ``keep_best`` best by ``best_metric``, and always the newest one."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_mode: str = "min"

    def keep(self, steps: Iterable[int], metric: Mapping[int, float | None]) -> set[int]:
        """The steps to keep among the complete ``steps`` (``metric``: step -> value)."""
        ordered = sorted(set(steps))
        if not ordered:
            return set()
        if self.keep_last is None and self.keep_best is None:
            return set(ordered)
        kept = {ordered[-1]}
        if self.keep_last is not None:
            kept.update(ordered[-self.keep_last :] if self.keep_last else [])
        if self.keep_every is not None:
            kept.update(s for s in ordered if s % self.keep_every == 0)
        if self.keep_best is not None:
            sign = 1.0 if self.best_mode == "min" else -1.0
            ranked = [
                (sign * v, -s)
                for s in ordered
                if (v := metric.get(s)) is not None and not math.isnan(v)
            ]
            kept.update(-s for _, s in sorted(ranked)[: self.keep_best])
        return kept


def replaced(store: Storage, kept: bytes | None) -> dict[str, Any]:
    """The sidecar member recording the commit a re-save replaces (its save id and, from
    ``kept``, its sidecar's metrics): while that commit stays (a killed save), they hold."""
    over = json_object(kept)
    return {
        "save_id": committed_save_id(store),
        "metrics": over.get("metrics") if over is not None else None,
    }


def stored_metric(location: Location, name: str | None) -> float | None:
    """Metric ``name`` of the step at ``location`` from its sidecar (untrusted: anything odd
    is None); the metrics of the commit a re-save was written over while that commit is
    still there. A storage fault raises."""
    store = storage_for(location)
    try:
        doc = json_object(read_sidecar(store, location))
    except IsADirectoryError:
        doc = None
    over = doc.get("over") if isinstance(doc, dict) else None
    if isinstance(over, dict) and over.get("save_id") == committed_save_id(store):
        doc = over  # the re-save that wrote this sidecar never committed
    return metric_in(doc, name)


def committed_anyway(store: Storage, location: Location, kept: bytes | None) -> bool:
    """Whether a save that raised committed all the same (its commit landed, the exchange
    after it failed): ``kept``, the sidecar before it (None: a new step), tells whether the
    step's commit is the one this save wrote, not the one it was replacing."""
    if kept is None:
        return store.exists(METADATA_FILE)
    doc = json_object(read_sidecar(store, location))
    over = doc.get("over") if doc is not None else None
    replaced = over.get("save_id") if isinstance(over, dict) else None
    return replaced is not None and committed_save_id(store) not in (None, replaced)


def read_sidecar(store: Storage, location: Location) -> bytes | None:
    """The sidecar's bytes at ``location`` (None: absent, or larger than one can be, unread);
    a storage fault raises."""
    path = location.path(SIDECAR)
    try:
        if store.file_size(path) > MAX_SIDECAR_BYTES:  # checked before it is read whole
            return None
        return store.read_file(path)
    except FileNotFoundError:
        return None


def metric_in(doc: Any, name: str | None) -> float | None:
    """Metric ``name`` of a parsed sidecar (untrusted: anything but a number is None)."""
    try:
        raw = doc["metrics"][name]
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
    except (KeyError, TypeError, IndexError, OverflowError):
        pass
    return None


def plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """``save``'s metrics as floats (a sidecar holds numbers only); anything else raises."""
    out = {}
    for name, value in (metrics or {}).items():
        try:
            out[str(name)] = float(value)
        except (TypeError, ValueError, OverflowError, RuntimeError) as e:
            raise InvalidArgumentError(
                f"metric {name!r} must be a number (or a one-element tensor), got "
                f"{type(value).__name__}"
            ) from e
    return out
