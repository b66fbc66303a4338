"""Copy the shards a save writes into reusable host buffers, so training may mutate its tensors.

One flat buffer per in-flight save, reused across saves (host memory stays flat), pinned when
CUDA is available. CPU sources are copied at once; CUDA sources are copied with non-blocking
copies on a side stream, and the training stream waits for them on the GPU, not on the host.
Staging may run on a background thread: ``copy_objects`` and ``mark_streams`` then run in the
call (objects are copied as they are then; GPU copies start after the work queued before it).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dcpbridge.engine.ownership import WriteOwners
from dcpbridge.errors import StagingError
from dcpbridge.model.mapping import ShardedObject, ShardedTensor
from dcpbridge.planners.leaves import not_dense, storage_holds
from dcpbridge.storage.backends.device_copy import host_target

_ALIGN = 64


def allocated(make: Callable[[], torch.Tensor], where: str, what: str) -> torch.Tensor:
    """``make()``, a new buffer; where it cannot be allocated (out of memory: torch's
    ``OutOfMemoryError`` is a ``RuntimeError``), ``StagingError`` "``where``: cannot allocate
    ``what``", the allocator's error as its cause."""
    try:
        return make()
    except (RuntimeError, MemoryError) as e:
        raise StagingError(f"{where}: cannot allocate {what}: {e}") from e


@dataclass(eq=False)
class BufferSet:
    """One save's staging memory; ``ready`` is set once its CUDA copies have landed. Sets
    are equal only to themselves (the free list finds one by identity, never by comparing
    the tensors)."""

    flat: torch.Tensor
    events: list[Any] = field(default_factory=list)
    shared: Any = None  # the shared-memory segment ``flat`` lives in, if any (writer process)
    copies: list[DeviceCopies] = field(default_factory=list)  # this save's, for hold_streams

    def wait_ready(self) -> None:
        """Block until the staged bytes are in host memory (CUDA copies finished)."""
        for event in self.events:
            event.synchronize()


DeviceCopies = tuple[torch.device, Any]
"""A CUDA device and an event recorded after the staging copies from its tensors."""


def hold_streams(copies: list[DeviceCopies]) -> None:
    """Make the current stream of each device wait, on the GPU, for the staging copies from
    it (no host wait): kernels queued after this may modify the staged tensors."""
    for device, event in copies:
        torch.cuda.current_stream(device).wait_event(event)


class StagingArea:
    """At most ``max_sets`` buffer sets; a set is reused by the next save once released."""

    def __init__(self, max_sets: int) -> None:
        self.max_sets = max_sets
        self._free: list[BufferSet] = []
        self._count = 0
        self._cond = threading.Condition()
        self._streams: dict[torch.device, Any] = {}
        self._shared: Callable[[int], BufferSet] | None = None

    def use(self, shared: Callable[[int], BufferSet] | None) -> None:
        """Allocate sets with ``shared`` from now on (None: private host memory); free sets of
        the other kind are dropped, busy ones once released."""
        with self._cond:
            if shared is not self._shared:
                self._shared = shared
                self._count -= len(self._free)
                self._free.clear()
                self._cond.notify_all()

    def acquire(self, nbytes: int) -> BufferSet:
        """A free set of at least ``nbytes`` (allocating or growing one if needed)."""
        with self._cond:
            while not self._free and self._count >= self.max_sets:
                self._cond.wait()
            fit = [s for s in self._free if s.flat.numel() >= nbytes]
            if fit:
                chosen = min(fit, key=lambda s: s.flat.numel())
                self._free.remove(chosen)
                chosen.events, chosen.copies = [], []
                return chosen
            if self._free:  # grow: drop a free set that is too small instead of adding one
                self._free.pop()
            else:
                self._count += 1
        try:
            if self._shared is not None:
                return self._shared(max(nbytes, 1))
            return BufferSet(host_target((max(nbytes, 1),), torch.uint8, for_device=True))
        except BaseException:  # no set came to be: its place is free again (else saves hang)
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def release(self, buffers: BufferSet) -> None:
        with self._cond:
            if (buffers.shared is None) == (self._shared is None):
                self._free.append(buffers)
            else:  # allocated before ``use`` changed the kind: dropped
                self._count -= 1
            self._cond.notify()

    def clear(self) -> None:
        """Drop the free sets (their memory goes once no save holds them)."""
        with self._cond:
            self._count -= len(self._free)
            self._free.clear()
            self._cond.notify_all()

    def settle(self) -> None:
        """Wait for every copy queued on the side streams (before a failed stage's buffers
        are reused)."""
        for stream in self._streams.values():
            stream.synchronize()

    def side_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream


def _layout(tensors: list[torch.Tensor]) -> tuple[list[tuple[int, int]], int]:
    """Each tensor's aligned (start, end) byte span in one flat buffer, and the buffer's size."""
    spans, pos = [], 0
    for t in tensors:
        start = pos + -pos % _ALIGN
        pos = start + t.numel() * t.element_size()
        spans.append((start, pos))
    return spans, pos


StreamMarks = dict[torch.device, tuple[Any, Any]]
"""Per CUDA device: the caller's stream, and an event recorded on it when the save was called."""


def tensor_writes(shards: list[Any], owners: WriteOwners) -> list[ShardedTensor]:
    """The non-empty ShardedTensors of ``shards`` that this rank writes."""
    return [s for s in shards if isinstance(s, ShardedTensor) and owners.writes(s) and s.numel > 0]


def mark_streams(writes: list[ShardedTensor]) -> StreamMarks:
    """The caller's current stream of each CUDA device in ``writes``, marked by an event now."""
    marks: StreamMarks = {}
    for s in writes:
        device = s.data.device
        if s.data.is_cuda and device not in marks:
            stream = torch.cuda.current_stream(device)
            marks[device] = (stream, stream.record_event())
    return marks


def copy_objects(shards: list[Any], owners: WriteOwners) -> list[Any]:
    """``shards`` with the ShardedObjects this rank writes deep-copied (the others' data
    dropped); tensors untouched."""
    return [
        dataclasses.replace(s, data=copy.deepcopy(s.data) if owners.writes(s) else None)
        if isinstance(s, ShardedObject)
        else s
        for s in shards
    ]


def stage(
    shards: list[Any],
    area: StagingArea,
    owners: WriteOwners,
    *,
    marks: StreamMarks | None = None,
    objects_copied: bool = False,
    hold_caller: bool = True,
) -> tuple[list[Any], BufferSet]:
    """Staged copies of ``shards``: the tensors this rank writes (per ``owners``) in host
    buffers, its objects deep-copied (unless ``objects_copied``); shards it does not write
    keep their metadata only. GPU copies follow ``marks`` (default: the current streams now);
    the marked streams' later work waits for them unless ``hold_caller`` is False (then
    ``hold_streams(buffers.copies)`` must run before the tensors are modified)."""
    writes = tensor_writes(shards, owners)
    spans, total = _layout([s.data for s in writes])
    buffers = area.acquire(total)
    try:
        if marks is None:
            marks = mark_streams(writes)
        staged = _fill(shards, writes, spans, buffers, area, marks, hold_caller)
        return (staged if objects_copied else copy_objects(staged, owners)), buffers
    except BaseException:  # the set goes back: a later save must not wait for it forever
        area.settle()  # copies already queued into it land first
        area.release(buffers)
        raise


def _check_backed(shard: ShardedTensor) -> None:
    """Raise ``StagingError`` unless ``shard``'s data is dense with values (meta, sparse or
    quantized data fails in torch's copy, naming no key) and its storage holds all its
    elements: torch copies from a freed or shrunk storage without a check (a segfault, or
    other memory's bytes)."""
    data = shard.data
    if (what := not_dense(data)) is not None:
        what = "meta" if data.is_meta else what
        raise StagingError(
            f"{shard.key!r} (offset {tuple(shard.global_offset)}): {what} data cannot be "
            "saved (a save stores a dense tensor's values)"
        )
    if not storage_holds(data):
        raise StagingError(
            f"{shard.key!r} (offset {tuple(shard.global_offset)}): its storage holds "
            f"{data.untyped_storage().nbytes()} bytes, fewer than its shape "
            f"{tuple(data.shape)} needs (freed or shrunk, as FSDP frees a parameter's "
            "storage), so it cannot be copied"
        )


def _fill(
    shards: list[Any],
    writes: list[ShardedTensor],
    spans: list[tuple[int, int]],
    buffers: BufferSet,
    area: StagingArea,
    marks: StreamMarks,
    hold_caller: bool,
) -> list[Any]:
    """Copy ``writes`` into their ``spans`` of ``buffers`` (GPU data by side-stream copies that
    start after ``marks`` and that the marked streams' later work waits for); the tensor
    shards with their staged data."""
    views: dict[int, torch.Tensor] = {}
    cuda: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for s, (start, end) in zip(writes, spans):
        src = s.data
        _check_backed(s)
        view = buffers.flat[start:end].view(src.dtype).view(src.shape)
        if src.is_cuda:
            cuda.setdefault(src.device, []).append((view, src))
        else:
            view.copy_(src)
        views[id(s)] = view
    for device, pairs in cuda.items():
        origin, called = marks[device]
        stream = area.side_stream(device)
        stream.wait_event(called)  # the copies see the state as it was at the call
        with torch.cuda.stream(stream):
            for view, src in pairs:
                view.copy_(src, non_blocking=True)
                src.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
        if hold_caller:
            origin.wait_event(event)  # the caller's later kernels wait for the copies
        buffers.events.append(event)
        buffers.copies.append((device, event))
    return [
        dataclasses.replace(s, data=views.get(id(s))) if isinstance(s, ShardedTensor) else s
        for s in shards
    ]
