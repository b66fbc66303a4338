"""``GlobalBatchSampler``: a training position in samples that any data-parallel size resumes.

Each epoch is one permutation of the dataset drawn from ``(seed, epoch)`` alone, cut into
global batches of ``global_batch_size`` (the last partial one dropped); global batch ``b`` of
an epoch is always the same slice, and DP rank ``r`` takes its contiguous ``1/dp_size`` of it.
The position is ``consumed_samples`` as Megatron counts it: what training marked consumed
(``mark_consumed`` after each optimizer step), never what a DataLoader prefetched. The state
is rank-independent common state, so a job with any ``dp_size`` dividing the global batch
continues with the same global batches, jumping there without replaying the skipped ones.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from dcpbridge.errors import DataStateError, InvalidArgumentError

STATE_VERSION = 1
CHANGEABLE = frozenset({"dataset", "seed", "global_batch_size"})
_LIMIT = 1 << 62  # bound on every stored count (hostile metadata)
_MASK64 = (1 << 64) - 1
_FIELDS = frozenset(
    {
        "version",
        "seed",
        "epoch",
        "sample_in_epoch",
        "consumed_samples",
        "global_batch_size",
        "num_samples",
        "dataset_id",
    }
)


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of ``epoch``'s permutation: mixed, so that ``(seed, epoch + 1)`` and
    ``(seed + 1, epoch)`` never share a permutation as ``seed + epoch`` would."""
    return _splitmix64(_splitmix64(seed) ^ epoch) >> 1


def _count(name: str, value: Any, low: int = 0, high: int = _LIMIT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidArgumentError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Position:
    """A validated saved position (what ``GlobalBatchSampler.state_dict`` records)."""

    seed: int
    epoch: int
    sample_in_epoch: int
    consumed_samples: int
    global_batch_size: int
    num_samples: int
    dataset_id: str | None

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, **{f: getattr(self, f) for f in self.__slots__}}


def parse_position(state: Any) -> Position:
    """A stored position checked field by field (it comes from storage: hostile until here)."""
    where = "GlobalBatchSampler state"
    if not isinstance(state, Mapping):
        raise DataStateError(f"{where} must be a mapping, got {type(state).__name__}")
    keys = set(state)
    if keys != _FIELDS:
        raise DataStateError(
            f"{where} has fields {sorted(map(str, keys))}; expected {sorted(_FIELDS)}"
        )
    try:
        if _count("version", state["version"]) != STATE_VERSION:
            raise InvalidArgumentError(
                f"version {state['version']} is not {STATE_VERSION} (a newer dcpbridge wrote it?)"
            )
        pos = Position(
            seed=_count("seed", state["seed"], high=(1 << 63) - 1),
            epoch=_count("epoch", state["epoch"]),
            sample_in_epoch=_count("sample_in_epoch", state["sample_in_epoch"]),
            consumed_samples=_count("consumed_samples", state["consumed_samples"]),
            global_batch_size=_count("global_batch_size", state["global_batch_size"], 1),
            num_samples=_count("num_samples", state["num_samples"], 1),
            dataset_id=state["dataset_id"],
        )
        if pos.dataset_id is not None and not isinstance(pos.dataset_id, str):
            raise InvalidArgumentError(
                f"dataset_id must be a str or None, got {type(pos.dataset_id).__name__}"
            )
    except InvalidArgumentError as e:
        raise DataStateError(f"{where}: {e}") from e
    gbs = pos.global_batch_size
    per_epoch = pos.num_samples // gbs * gbs
    problems = []
    if gbs > pos.num_samples:
        problems.append(f"global_batch_size {gbs} > num_samples {pos.num_samples}")
    if pos.consumed_samples % gbs or pos.sample_in_epoch % gbs:
        problems.append(
            f"consumed_samples {pos.consumed_samples} and sample_in_epoch "
            f"{pos.sample_in_epoch} must be multiples of global_batch_size {gbs}"
        )
    if pos.sample_in_epoch >= max(per_epoch, 1):
        problems.append(f"sample_in_epoch {pos.sample_in_epoch} is past the epoch ({per_epoch})")
    if pos.consumed_samples < pos.epoch * gbs + pos.sample_in_epoch:
        problems.append(
            f"consumed_samples {pos.consumed_samples} is less than epoch {pos.epoch} and "
            f"sample_in_epoch {pos.sample_in_epoch} imply"
        )
    if problems:
        raise DataStateError(f"{where} is not a valid position: {'; '.join(problems)}")
    return pos


class GlobalBatchSampler(Sampler[list[int]]):
    """A batch sampler (``DataLoader(batch_sampler=...)``) and DCP ``Stateful`` whose position
    survives any change of data-parallel size dividing ``global_batch_size``.

    Each iteration yields this rank's ``global_batch_size // dp_size`` sample indices of the
    next global batch, from the consumed position to the end of the epoch. Call
    ``mark_consumed()`` once per optimizer step: the checkpointed ``consumed_samples`` is what
    training consumed, so batches a DataLoader prefetched but training never saw come again
    after a resume. ``allow_changed`` names what a checkpoint may differ in (``"dataset"``:
    ``dataset_id`` / ``num_samples``, ``"seed"``, ``"global_batch_size"``); the position then
    continues at the same sample of the epoch.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int = 0,
        dataset_id: str | None = None,
        *,
        allow_changed: Collection[str] = (),
    ) -> None:
        super().__init__()
        self.num_samples = _count("num_samples", num_samples, 1)
        self.global_batch_size = _count("global_batch_size", global_batch_size, 1, num_samples)
        self.dp_size = _count("dp_size", dp_size, 1)
        self.dp_rank = _count("dp_rank", dp_rank, 0, dp_size - 1)
        if global_batch_size % dp_size:
            raise InvalidArgumentError(
                f"global_batch_size {global_batch_size} is not divisible by dp_size {dp_size}"
            )
        self.seed = _count("seed", seed, high=(1 << 63) - 1)
        if dataset_id is not None and not isinstance(dataset_id, str):
            raise InvalidArgumentError(f"dataset_id must be a str or None, got {dataset_id!r}")
        self.dataset_id = dataset_id
        unknown = set(allow_changed) - CHANGEABLE
        if isinstance(allow_changed, str) or unknown:
            raise InvalidArgumentError(
                f"allow_changed takes a collection of {sorted(CHANGEABLE)}, got {allow_changed!r}"
            )
        self.allow_changed = frozenset(allow_changed)
        self._epoch = 0
        self._offset = 0  # first sample of the next global batch, within the epoch
        self._consumed = 0
        self._drawn = 0  # consumed_samples plus what the newest iterator yielded beyond it
        self._generation = 0  # bumped by iter() and load_state_dict: older iterators go stale
        self._perm: tuple[int, torch.Tensor] | None = None

    # -- position -----------------------------------------------------------------------------

    @property
    def local_batch_size(self) -> int:
        """Indices per yielded batch: this rank's share of a global batch."""
        return self.global_batch_size // self.dp_size

    @property
    def samples_per_epoch(self) -> int:
        """Samples consumed per epoch: whole global batches only."""
        return self.num_samples // self.global_batch_size * self.global_batch_size

    @property
    def consumed_samples(self) -> int:
        """Samples training consumed, over all ranks and epochs (Megatron's count)."""
        return self._consumed

    @property
    def epoch(self) -> int:
        return self._epoch

    def permutation(self, epoch: int) -> torch.Tensor:
        """The epoch's order of sample indices (depends on seed and epoch only)."""
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            self._perm = (epoch, torch.randperm(self.num_samples, generator=g))
        return self._perm[1]

    def global_batch(self, epoch: int, index: int) -> list[int]:
        """All ranks' indices of global batch ``index`` of ``epoch``, in rank order."""
        start = index * self.global_batch_size
        return self.permutation(epoch)[start : start + self.global_batch_size].tolist()

    def __len__(self) -> int:
        """Batches the next iteration yields: the rest of the current epoch."""
        return (self.samples_per_epoch - self._offset) // self.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        self._generation += 1
        generation, epoch, start = self._generation, self._epoch, self._offset
        self._drawn = self._consumed
        perm = self.permutation(epoch)
        lo = self.dp_rank * self.local_batch_size
        for first in range(start, self.samples_per_epoch, self.global_batch_size):
            if generation == self._generation:
                self._drawn += self.global_batch_size
            yield perm[first + lo : first + lo + self.local_batch_size].tolist()

    def mark_consumed(self, global_batches: int = 1) -> None:
        """Training consumed the next ``global_batches`` global batches (one per step)."""
        n = _count("global_batches", global_batches, 1)
        if self._consumed + n * self.global_batch_size > self._drawn:
            raise InvalidArgumentError(
                f"mark_consumed({n}) goes past what this sampler yielded: "
                f"{(self._drawn - self._consumed) // self.global_batch_size} global batch(es) "
                "drawn and not yet marked (call it once per step, after the step)"
            )
        self._consumed += n * self.global_batch_size
        self._offset += n * self.global_batch_size
        while self._offset >= self.samples_per_epoch:
            self._offset -= self.samples_per_epoch
            self._epoch += 1

    # -- Stateful -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position (plain values, identical on every rank: common state)."""
        return Position(
            seed=self.seed,
            epoch=self._epoch,
            sample_in_epoch=self._offset,
            consumed_samples=self._consumed,
            global_batch_size=self.global_batch_size,
            num_samples=self.num_samples,
            dataset_id=self.dataset_id,
        ).state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        """Continue at a saved position, refusing one of another dataset, seed or global batch
        size unless ``allow_changed`` names it; iterate anew afterwards."""
        pos = parse_position(state_dict)
        self._check_same(pos)
        epoch, offset = pos.epoch, pos.sample_in_epoch
        if offset >= self.samples_per_epoch:  # a smaller dataset (allowed): its next epoch
            epoch, offset = epoch + 1, 0
        self._epoch, self._offset, self._consumed = epoch, offset, pos.consumed_samples
        self._drawn = self._consumed
        self._generation += 1

    def _check_state_dict(self, state_dict: Any) -> None:
        """Raise ``DataStateError`` where ``load_state_dict`` would refuse ``state_dict``,
        changing nothing (a load checks every state before it changes any)."""
        self._check_same(parse_position(state_dict))

    def _check_same(self, pos: Position) -> None:
        def refuse(stored: str, mine: str, name: str) -> DataStateError:
            return DataStateError(
                f"the checkpoint's data position has {stored}, this sampler {mine}; pass "
                f"allow_changed=({name!r},) to continue at sample {pos.sample_in_epoch} of "
                f"epoch {pos.epoch} anyway"
            )

        changed = self.allow_changed
        stored_data = f"dataset_id={pos.dataset_id!r}, num_samples={pos.num_samples}"
        my_data = f"dataset_id={self.dataset_id!r}, num_samples={self.num_samples}"
        if stored_data != my_data and "dataset" not in changed:
            raise refuse(stored_data, my_data, "dataset")
        if pos.seed != self.seed and "seed" not in changed:
            raise refuse(f"seed={pos.seed}", f"seed={self.seed}", "seed")
        gbs = self.global_batch_size
        if pos.global_batch_size != gbs:
            if "global_batch_size" not in changed:
                raise refuse(
                    f"global_batch_size={pos.global_batch_size}",
                    f"global_batch_size={gbs}",
                    "global_batch_size",
                )
            if pos.consumed_samples % gbs or pos.sample_in_epoch % gbs:
                raise DataStateError(
                    f"the checkpoint's data position (consumed_samples={pos.consumed_samples}, "
                    f"sample_in_epoch={pos.sample_in_epoch}) is not a multiple of the new "
                    f"global_batch_size {gbs}: change the global batch where it is"
                )
