"""Tied weights in a load template: tensor shards of different keys that share one memory.

Each key is read on its own, so the reads of two tied keys would land on the same bytes: the
last one silently winning, or one key's checksum verified over the other's bytes. Instead,
every shard but the first of a tied group is read into scratch memory of its own; once every
read is done, the scratch must hold the bytes the shared memory holds. Tied keys stored with
different values raise ``TiedTensorsError`` naming both, on every rank; equal ones (what a
model with tied embeddings saves) load as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from dcpbridge.errors import InvalidRequestError, TiedTensorsError
from dcpbridge.model.mapping import ShardedTensor


@dataclass(slots=True)
class Ties:
    """(shard that reads into the shared memory, its tied key's shard reading into scratch)."""

    pairs: list[tuple[ShardedTensor, ShardedTensor]] = field(default_factory=list)

    def settle(self, unfilled: Collection[str]) -> None:
        """After every read: the scratch of each pair matches the shared memory, or raise
        ``TiedTensorsError``. ``unfilled`` keys were not read into their shard (absent, or
        stored in another dtype or shape): a scratch whose shared memory was not read fills it."""
        filled: set[int] = set()
        for kept, scratch in self.pairs:
            if scratch.key in unfilled:
                continue
            if kept.key in unfilled and id(kept) not in filled:
                with torch.no_grad():  # a parameter's own memory
                    kept.data.copy_(scratch.data)  # type: ignore[union-attr]
                filled.add(id(kept))
            elif not same_bytes(kept.data, scratch.data):  # type: ignore[arg-type]
                raise tied_conflict(kept.key, scratch.key)


def tied_conflict(kept: str, scratch: str) -> TiedTensorsError:
    """The error of tied keys ``kept`` and ``scratch`` stored with different values."""
    return TiedTensorsError(
        f"{kept!r} and {scratch!r} share one tensor's memory in the load template (tied "
        "weights), but the checkpoint holds different values for them: give each its own "
        "tensor to load both"
    )


def untie(shards: list[Any]) -> tuple[list[Any], Ties]:
    """``shards`` with each tensor shard that is the very memory of an earlier one of another
    key (same address, dtype, shape and strides) replaced by a copy reading into scratch (the
    same list where nothing is tied), and the pairs ``Ties.settle`` checks after the reads."""
    return _untie(shards, _shared(shards))


def check_overlaps(shards: list[Any]) -> None:
    """Raise ``InvalidRequestError`` naming both keys where two tensor shards (other than
    one box asked twice) share memory in any other way than a whole tie (a slice of another
    key's tensor, the same memory in another dtype or shape): each would be read into the
    shared bytes, one silently taking the other's values. Views that interleave without
    sharing an element (a fused tensor's parts) are told apart element by element."""
    _check_shared(shards, _shared(shards))


def untie_checked(shards: list[Any]) -> tuple[list[Any], Ties]:
    """``check_overlaps`` and ``untie`` of ``shards`` with one pass over their addresses."""
    shared = _shared(shards)
    _check_shared(shards, shared)
    return _untie(shards, shared)


def _shared(shards: list[Any]) -> list[list[int]]:
    """Positions of the tensor shards in ``shards`` that share a storage with another, by
    storage, in order (ties and overlaps lie only among them; most shards are alone)."""
    by_address: dict[int, list[int]] = {}
    for i, shard in enumerate(shards):  # the fewest calls per tensor
        if type(shard) is not ShardedTensor and not isinstance(shard, ShardedTensor):
            continue
        data = shard.data
        if data is None:
            continue
        try:  # the storage's address (a subclass without storage of its own: skipped)
            offset = data.storage_offset()
            base = data.data_ptr() - offset * data.element_size() if offset else data.data_ptr()
        except (RuntimeError, NotImplementedError):
            continue
        alone = by_address.get(base)
        if alone is None:
            by_address[base] = [i]
        else:
            alone.append(i)
    return [at for at in by_address.values() if len(at) > 1]


def _untie(shards: list[Any], shared: list[list[int]]) -> tuple[list[Any], Ties]:
    """``untie`` over the groups of ``_shared``: a tie is one address, so one storage."""
    ties = Ties()
    out: list[Any] | None = None
    tied: list[tuple[int, ShardedTensor, ShardedTensor]] = []  # (position, first, shard)
    for group in shared:
        seen: dict[int, ShardedTensor] = {}
        for i in group:
            shard = shards[i]
            first = seen.setdefault(shard.data.data_ptr(), shard)
            if first is not shard and _tied(first, shard):
                tied.append((i, first, shard))
    for i, first, shard in sorted(tied, key=lambda t: t[0]):  # in the shards' order
        if out is None:
            out = list(shards)
        scratch = dataclasses.replace(shard, data=torch.empty_like(shard.data))
        out[i] = scratch
        ties.pairs.append((first, scratch))
    return (shards if out is None else out), ties


def _check_shared(shards: list[Any], shared: list[list[int]]) -> None:
    """``check_overlaps`` over the groups of ``_shared``."""
    for group in shared:
        by_device: dict[torch.device, list[ShardedTensor]] = {}
        for i in group:  # meta and empty tensors share no bytes
            shard = shards[i]
            data = shard.data
            if not data.is_meta and data.numel():
                by_device.setdefault(data.device, []).append(shard)
        for on_device in by_device.values():
            _check_group(on_device)


def _check_group(group: list[ShardedTensor]) -> None:
    """``check_overlaps`` for the shards of one storage on one device."""
    if len(group) < 2:
        return
    spans = sorted((*_byte_span(sh.data), i, sh) for i, sh in enumerate(group))  # type: ignore[arg-type]
    cluster: list[tuple[int, int, int, ShardedTensor]] = []
    end = -1
    for span in spans:
        if cluster and span[0] >= end:
            _check_cluster(cluster)
            cluster = []
        cluster.append(span)
        end = max(end, span[1])
    _check_cluster(cluster)


def _alike(a: ShardedTensor, b: ShardedTensor) -> bool:
    """Whether shards meeting in memory are one box asked twice or a whole tie (``untie``)."""
    x, y = a.data, b.data
    assert x is not None and y is not None
    same_view = (x.data_ptr(), x.dtype, x.shape, x.stride()) == (
        y.data_ptr(),
        y.dtype,
        y.shape,
        y.stride(),
    )
    same_box = a.key == b.key and tuple(a.global_offset) == tuple(b.global_offset)
    return same_view and (same_box or a.key != b.key)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of ``t``'s storage its elements lie in, as [start, end)."""
    k = t.element_size()
    start = t.storage_offset() * k
    if t.is_contiguous():
        return start, start + t.numel() * k
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * k


def _check_cluster(cluster: list[tuple[int, int, int, ShardedTensor]]) -> None:
    """``check_overlaps`` for shards whose byte spans chain into one run: each shard's bytes
    are marked with its position in a map of the run, to see whether it meets another's."""
    if len(cluster) < 2:
        return
    base = cluster[0][0]
    sizes = {span[3].data.element_size() for span in cluster}  # type: ignore[union-attr]
    unit = sizes.pop() if len(sizes) == 1 else 1  # one mark an element where all are alike
    kind = torch.int16 if len(cluster) < 2**15 else torch.int32
    marks = torch.zeros((max(span[1] for span in cluster) - base) // unit, dtype=kind)
    for i, (lo, _, at, shard) in enumerate(cluster, start=1):
        data = shard.data
        assert data is not None
        k = data.element_size() // unit
        view = marks.as_strided(
            (*data.shape, k), (*(s * k for s in data.stride()), 1), (lo - base) // unit
        )
        for j in view[view != 0].unique().tolist():
            _, _, other_at, other = cluster[j - 1]
            if not _alike(other, shard):
                first, second = (other, shard) if other_at < at else (shard, other)
                raise InvalidRequestError(
                    f"{first.key!r} and {second.key!r} share part of one tensor's memory in the "
                    "load template (a slice, or the same memory in another dtype or shape): "
                    "each would be read into the shared bytes, one silently taking the other's "
                    "values; give each its own tensor (clone()), or tie whole tensors only"
                )
        view.fill_(i)


def _tied(a: ShardedTensor, b: ShardedTensor) -> bool:
    """Whether ``b``'s data is ``a``'s very memory (both at one address) under another key."""
    x, y = a.data, b.data
    assert x is not None and y is not None
    return (
        a.key != b.key
        and x.numel() > 0
        and x.device == y.device
        and x.dtype == y.dtype
        and x.shape == y.shape
        and x.stride() == y.stride()
    )


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs of the same bits are equal; 0.0 and -0.0 are not)."""
    return torch.equal(_bytes(a), _bytes(b))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, flat: by its run of elements, as a contiguous tensor's size-1 dims may
    have any stride (``reshape(-1)`` of one element keeps it, and ``view`` then refuses)."""
    c = t.detach().contiguous()
    return c.as_strided((c.numel(),), (1,)).view(torch.uint8)
