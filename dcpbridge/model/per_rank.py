"""``PerRankState``: one rank's data-stream state, which no other layout can continue.

A StatefulDataLoader's state, a packing buffer or a process's RNG streams belong to the rank
that produced them. Each is saved as cell ``rank`` of a ``size``-cell ShardedObject grid
(beside it, one cell of ``<key>.samples``: how many samples the stream holds, for the
warning below). A load in the same layout hands every rank its own cell back. A load by
another number of ranks cannot: it raises ``DataLayoutError`` naming the state, unless the
caller passes ``reshard_data_state="drop"``, which starts those streams fresh and warns with
the number of samples they held. A checkpoint missing any rank's cell is refused in both
modes. The decisions here are pure functions of the checkpoint's stored keys.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dcpbridge.errors import DataLayoutError, InvalidArgumentError
from dcpbridge.model.mapping import ReplicaId, ShardedObject, parse_object_name
from dcpbridge.model.stateful import is_stateful

SAMPLES_SUFFIX = ".samples"
RESHARD_MODES = ("raise", "drop")


class DataStateDroppedWarning(UserWarning):
    """Per-rank data state was dropped on a layout change (``reshard_data_state="drop"``)."""


def _index(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgumentError(f"{name} must be an int >= {low}, got {value!r}")
    if high is not None and value > high:
        raise InvalidArgumentError(f"{name} must be <= {high}, got {value!r}")
    return value


class PerRankState:
    """``value`` (a ``Stateful`` or a plain picklable value) saved as this rank's own cell.

    ``rank`` / ``size`` say whose stream it is: the DP rank and size for a data stream (ranks
    that share one, e.g. tensor-parallel peers, pass a non-zero ``replica_id`` so that one of
    them writes it), the global rank and world size for a process's RNG. ``samples()``, if
    given, counts the samples the stream holds that a fresh start would replay or skip
    (reported when the state is dropped). Put it at the top level of the saved state.
    """

    def __init__(
        self,
        key: str,
        value: Any,
        rank: int,
        size: int,
        *,
        replica_id: ReplicaId = 0,
        samples: Callable[[], int] | None = None,
    ) -> None:
        self.size = _index("size", size, 1)
        self.rank = _index("rank", rank, 0, size - 1)
        ShardedObject(key, None, (size,), (rank,), replica_id)  # checks the key and replica id
        self.key = key
        self.value = value
        self.replica_id = replica_id
        self.samples = samples

    def _cell(self, key: str, data: Any) -> ShardedObject:
        return ShardedObject(key, data, (self.size,), (self.rank,), self.replica_id)

    def state_dict(self) -> dict[str, ShardedObject]:
        """This rank's cells: the stream's state and its sample count."""
        inner = self.value.state_dict() if is_stateful(self.value) else self.value
        count = None if self.samples is None else _index("samples()", self.samples(), 0)
        return {
            "state": self._cell(self.key, inner),
            "samples": self._cell(self.key + SAMPLES_SUFFIX, count),
        }

    def request(self) -> dict[str, ShardedObject]:
        """This rank's cells as a load asks for them (no ``state_dict()`` of the value: a
        StatefulDataLoader would start its workers for it)."""
        return {
            "state": self._cell(self.key, None),
            "samples": self._cell(self.key + SAMPLES_SUFFIX, None),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore this rank's stream from its loaded cell."""
        inner = state_dict["state"]
        if is_stateful(self.value):
            self.value.load_state_dict(inner)
        else:
            self.value = inner

    def _check_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Raise where the value's own check refuses its loaded cell, changing nothing."""
        check = getattr(self.value, "_check_state_dict", None)
        if callable(check):
            check(state_dict["state"])

    def __repr__(self) -> str:
        return (
            f"PerRankState(key={self.key!r}, rank={self.rank}, size={self.size}, "
            f"value={type(self.value).__name__})"
        )


Grids = dict[str, dict[tuple[int, ...], set[tuple[int, ...]]]]


def saved_grids(stored_keys: Iterable[str]) -> Grids:
    """ShardedObject key -> grid shape -> the cells (offsets) a checkpoint holds."""
    grids: Grids = {}
    for name in stored_keys:
        parsed = parse_object_name(name)
        if parsed is not None:
            key, offset, shape = parsed
            grids.setdefault(key, {}).setdefault(shape, set()).add(offset)
    return grids


@dataclass(frozen=True, slots=True)
class Dropped:
    """A per-rank state a load starts fresh: where it is and how many ranks saved it."""

    path: str  # its key in the state dict
    state: PerRankState
    saved_size: int  # 0: the checkpoint does not hold it
    counted: tuple[int, ...]  # saved cells of ``<key>.samples`` to read (all, or none)


def _saved_size(path: str, state: PerRankState, grid: dict[tuple[int, ...], set]) -> int:
    """The number of ranks that saved ``state``; raises unless every one of them is there."""
    what = f"per-rank state {path!r} (ShardedObject {state.key!r})"
    if len(grid) != 1 or len(shape := next(iter(grid))) != 1:
        raise DataLayoutError(
            f"{what}: the checkpoint holds it as grids {sorted(grid)}, not one grid of ranks"
        )
    size = shape[0]  # from the stored names (hostile): never a range of it built whole
    present = {o[0] for o in grid[shape] if o[0] < size}
    if len(present) < size:
        first = list(itertools.islice((r for r in range(size) if r not in present), 10))
        count = size - len(present)
        shown = ", ".join(map(str, first)) + (
            f" ... ({count} of {size} ranks)" if count > 10 else ""
        )
        raise DataLayoutError(
            f"{what}: the checkpoint was saved by {size} ranks but holds no state of rank(s) "
            f"{shown}; their streams cannot be restored and would silently restart. Load a "
            "complete checkpoint, or leave this state out of the load to start all streams fresh"
        )
    return size


def check_per_rank(
    states: Mapping[str, PerRankState], stored_keys: Iterable[str], mode: str
) -> list[Dropped]:
    """Which of ``states`` (by state-dict key) a load starts fresh; raises ``DataLayoutError``
    for a missing rank, or for a layout change unless ``mode`` is ``"drop"``."""
    if mode not in RESHARD_MODES:
        raise InvalidArgumentError(f"reshard_data_state must be 'raise' or 'drop', got {mode!r}")
    grids = saved_grids(stored_keys)
    dropped, refused = [], []
    for path, state in states.items():
        what = f"per-rank state {path!r} (ShardedObject {state.key!r})"
        grid = grids.get(state.key)
        if not grid:
            refused.append(f"{what} is not in the checkpoint")
            dropped.append(Dropped(path, state, 0, ()))
            continue
        size = _saved_size(path, state, grid)
        if size == state.size:
            continue
        refused.append(
            f"{what} was saved by {size} ranks and cannot follow this job's {state.size}"
        )
        counts = grids.get(state.key + SAMPLES_SUFFIX, {}).get((size,), set())
        full = {o[0] for o in counts} == set(range(size))
        dropped.append(Dropped(path, state, size, tuple(range(size)) if full else ()))
    if refused and mode != "drop":
        raise DataLayoutError(
            "; ".join(refused) + ". Each cell is one rank's own stream (loader position, RNG, "
            "buffers), which no other layout continues: resume with the saving layout, or "
            "load with reshard_data_state='drop' to start these streams fresh (a "
            "GlobalBatchSampler's global position follows any layout)"
        )
    return dropped


def count_requests(dropped: Dropped) -> dict[str, ShardedObject]:
    """A load template reading every saved cell of ``dropped``'s sample counts."""
    key, size = dropped.state.key + SAMPLES_SUFFIX, dropped.saved_size
    return {str(r): ShardedObject(key, None, (size,), (r,)) for r in dropped.counted}


def drop_message(dropped: Dropped, counts: Mapping[str, Any] | None) -> str:
    """The warning for a dropped state, with the samples its streams held (if counted)."""
    what = f"per-rank state {dropped.path!r} (ShardedObject {dropped.state.key!r})"
    if dropped.saved_size == 0:
        return f"{what} is not in the checkpoint: it starts fresh (reshard_data_state='drop')"
    values = list((counts or {}).values())
    if values and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 for v in values
    ):
        held = f"the {sum(values)} samples they held (as samples= counted them)"
    else:
        held = "an unknown number of samples they held (pass samples= to PerRankState to count)"
    return (
        f"{what} was saved by {dropped.saved_size} ranks and this job has "
        f"{dropped.state.size}: dropped as asked (reshard_data_state='drop'); its streams "
        f"start fresh, and {held} will be replayed or skipped"
    )
