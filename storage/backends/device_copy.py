"""Device tensors' bytes carried to the writer through a few reused pinned host slabs.

The writer takes its items' bytes in order from ``carry``. A device (CUDA) tensor is copied
into host slabs of ``slab_bytes`` with non-blocking copies on a side stream, packed back to
back (many small tensors share a slab; a large one spans several, in slices), up to ``slabs``
slabs ahead of the one being written, so the copies of the next slabs overlap the write of
the current one. Host memory held is at most ``slabs * slab_bytes`` per call (pinned when
CUDA is available; torch's caching host allocator keeps it for the next save). Items that
are not carried (CPU tensors, objects) pass through untouched, in order.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from dcpbridge.storage.errors import InvalidArgumentError

log = logging.getLogger(__name__)

SLAB_BYTES = 32 << 20
SLABS = 4
_PLAIN = (torch.Tensor, torch.nn.Parameter)

T = TypeVar("T")


@dataclass(slots=True)
class Piece(Generic[T]):
    """An item's resolved ``data``, and for a carried tensor one slice of its bytes (``view``,
    valid until the next piece is asked for); ``first``/``last`` mark the item's ends."""

    tag: T
    data: Any
    view: memoryview | None = None
    first: bool = True
    last: bool = True


@dataclass(slots=True)
class _Slab:
    buf: torch.Tensor
    fill: int = 0
    pieces: list[Piece[Any]] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)


def on_device(data: Any) -> bool:
    """True for a plain tensor whose memory is not host memory (what ``carry`` stages)."""
    return type(data) in _PLAIN and not data.is_cpu and not data.is_meta


def carry(
    items: Iterable[tuple[T, Any]],
    *,
    stage: Callable[[Any], bool] = on_device,
    slab_bytes: int | None = None,
    slabs: int | None = None,
) -> Iterator[Piece[T]]:
    """Every item of ``items`` (tag, data) as pieces, in order: data ``stage`` picks as host
    byte slices copied ahead through at most ``slabs`` slabs, the rest as it is."""
    slab_bytes = SLAB_BYTES if slab_bytes is None else slab_bytes
    slabs = SLABS if slabs is None else slabs
    if slab_bytes < 1 or slabs < 1:
        raise InvalidArgumentError(f"slab_bytes and slabs must be >= 1, got {slab_bytes}, {slabs}")
    free: list[torch.Tensor] = []
    made = 0
    sealed: deque[_Slab] = deque()
    current: _Slab | None = None
    streams: dict[torch.device, Any] = {}

    def seal() -> None:
        nonlocal current
        if current is not None:
            for stream in streams.values():  # the host waits for the side streams' copies
                event = torch.cuda.Event()
                event.record(stream)
                current.events.append(event)
            sealed.append(current)
            current = None

    def hand_over(slab: _Slab) -> Iterator[Piece[T]]:
        for event in slab.events:
            event.synchronize()
        yield from slab.pieces
        slab.pieces = []
        free.append(slab.buf)

    for tag, data in items:
        if not stage(data):
            if current is not None or sealed:
                seal()
                while sealed:
                    yield from hand_over(sealed.popleft())
            yield Piece(tag, data)
            continue
        src = data.detach()
        stream = _side_stream(streams, src) if src.is_cuda else None
        dense = src.contiguous()  # a one-element strided view is contiguous with stride != 1:
        flat = dense.as_strided((dense.numel(),), (1,)).view(torch.uint8)  # reshape keeps it
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(src.device))
            flat.record_stream(stream)  # a temporary contiguous copy outlives its use
        n, start = flat.numel(), 0
        while True:
            if current is None or current.fill == slab_bytes:
                seal()
                while not free and made >= slabs:
                    yield from hand_over(sealed.popleft())
                if free:
                    current = _Slab(free.pop())
                else:
                    made += 1
                    current = _Slab(host_target((slab_bytes,), torch.uint8, True))
            take = min(n - start, slab_bytes - current.fill)
            dst = current.buf[current.fill : current.fill + take]
            if stream is not None:
                with torch.cuda.stream(stream):
                    dst.copy_(flat[start : start + take], non_blocking=True)
            else:
                dst.copy_(flat[start : start + take])
            view = memoryview(dst.numpy()).cast("B") if take else memoryview(b"")
            current.pieces.append(Piece(tag, data, view, start == 0, start + take == n))
            current.fill += take
            start += take
            if start >= n:
                break
    seal()
    while sealed:
        yield from hand_over(sealed.popleft())


def _side_stream(streams: dict[torch.device, Any], t: torch.Tensor) -> Any:
    stream = streams.get(t.device)
    if stream is None:
        stream = streams[t.device] = torch.cuda.Stream(device=t.device)
    return stream


def host_target(shape: tuple[int, ...], dtype: torch.dtype, for_device: bool) -> torch.Tensor:
    """A host buffer that bytes pass through on their way to or from a device tensor; pinned
    when ``for_device`` and CUDA is available, so copies run without a pageable intermediate."""
    if for_device and torch.cuda.is_available():
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as e:  # page-locked memory refused (limits): copies just sync
            log.warning("pinned host memory unavailable, using pageable memory: %s", e)
    return torch.empty(shape, dtype=dtype)


def wait_for_device_copies(devices: Iterable[torch.device]) -> None:
    """Block until the asynchronous host-to-device copies queued for ``devices`` are done."""
    for device in devices:
        torch.cuda.synchronize(device)


def settle_device_work() -> None:
    """Wait for the kernels queued on the current CUDA device (any stream, the caller's too),
    so copies issued from other threads, whose current stream is the default one, see
    finished tensors and never race a kernel still using them; a no-op without CUDA."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
