"""``verify_staging``: prove that training left the saved tensors alone until they were staged.

At the call, each tensor this rank writes has its autograd version counter noted (every
in-place op bumps it, whenever it ran). Once staged, each staged copy's xxh3 digest is compared
with the live tensor's: that also catches writes the counter misses (through ``.data``, numpy or
another process) made after the copy. A difference raises ``StagingMutationError`` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcpbridge.errors import StagingMutationError
from dcpbridge.model.mapping import ShardedTensor
from dcpbridge.storage.write.items import tensor_digest


@dataclass(frozen=True, slots=True)
class LiveMark:
    """A written tensor as the save found it: the shard and its version counter then."""

    shard: ShardedTensor
    version: int | None  # None: the tensor keeps no counter (inference mode)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version
        return None


def mark_live(writes: list[ShardedTensor]) -> list[LiveMark]:
    """Note the version counter of each tensor in ``writes`` (at the save call)."""
    return [LiveMark(s, _version(s.data)) for s in writes]


def _changed(mark: LiveMark, copy: torch.Tensor) -> str | None:
    """How the live tensor of ``mark`` changed since the call, or None."""
    if _version(mark.shard.data) != mark.version:
        return "modified in place"
    live = mark.shard.data.resolve_conj().resolve_neg()  # as staging copied it (no view bits)
    if tensor_digest(copy) != tensor_digest(live):
        return "differs from its staged copy"
    return None


def verify_staged(marks: list[LiveMark], staged: dict[int, torch.Tensor]) -> None:
    """Raise ``StagingMutationError`` naming the marked tensors modified before their staged
    copies (``staged``: id of the live shard -> its copy) were verified."""
    changed = [
        f"{mark.shard.key!r} (offset {tuple(mark.shard.global_offset)}) {how}"
        for mark in marks
        if (how := _changed(mark, staged[id(mark.shard)])) is not None
    ]
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise StagingMutationError(
            f"{'; '.join(changed[:3])}{more}: changed while async_save was staging, so the "
            "save would not hold the state of the call (let CheckpointManager watch the "
            "optimizer, or call handle.wait_staged() before changing the state)"
        )
