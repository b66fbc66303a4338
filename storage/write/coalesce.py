"""Many small writes made few large ones: the coalescing buffer a rank's data file is written
through, and the appender of one item whose bytes arrive in pieces (checksummed as they pass)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

import torch

from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.document import ITEM_ALIGN

SMALL_ITEM = 256 << 10
_COALESCE_BYTES = 8 << 20
# The most one write() call hands the kernel. Larger writes make ext4 (6.x) fill the page
# cache with 2 MiB folios; on VMs whose balloon reports free memory to the host (these
# machines: virtio_balloon), such folios are often memory the host took back and refaults
# page by page. Measured, 320 MiB written + fsynced: 2 MiB writes 0.55-0.68 s, 1 MiB 0.15-0.19 s.
_WRITE_PIECE = 1 << 20
ALIGN = ITEM_ALIGN
_PADDING = memoryview(bytes(ALIGN))


class CoalescingFile:
    """Writes many small items as few large writes; large items go straight through.

    Small items are copied into one reused buffer (``copy_in`` takes a raw address, so a
    tensor's bytes arrive with a single memmove and no Python objects per item). With
    ``background``, a full buffer is written (and ``written`` told) on a writer thread while
    the next one fills: the write's kernel copy and the storage's write-behind overlap the
    per-item work. ``flush`` waits for it; ``close`` must follow, also after a failure.
    """

    def __init__(
        self,
        f: BinaryIO,
        written: Callable[[int, int], None] | None = None,
        *,
        background: bool = False,
    ) -> None:
        self._f = f
        self._written = written  # told (start, nbytes) of each write that went out
        self._out = 0  # bytes handed to ``f`` so far
        self._buf, self._view, self._addr = _coalescing_buffer()
        self._spare: tuple[bytearray, memoryview, int] | None = None  # the writer thread's
        self._background = background
        self._writes: ThreadPoolExecutor | None = None
        self._pending: ThreadFuture[None] | None = None
        self._fill = 0
        self.pos = 0

    def align(self) -> int:
        """Pad with zeros to the next ``ALIGN`` boundary and return that position."""
        pad = -self.pos % ALIGN
        if pad:
            self.write(_PADDING[:pad])
        return self.pos

    def write(self, data: memoryview) -> None:
        n = len(data)
        self.pos += n
        if n < SMALL_ITEM:
            self._view[self._fill : self._fill + n] = data
            self._advance(n)
            return
        self.flush()
        self._emit(data)

    def copy_in(self, address: int, n: int) -> memoryview:
        """Append ``n`` (< ``SMALL_ITEM``) bytes at ``address``; a view of the copy, valid
        until the next call."""
        start = self._fill
        if n:
            ctypes.memmove(self._addr + start, address, n)
        self.pos += n
        view = self._view[start : start + n]
        self._advance(n)
        return view

    def _advance(self, n: int) -> None:
        self._fill += n
        if self._fill >= _COALESCE_BYTES:
            if self._background:
                self._hand_off()
            else:
                self.flush()

    def _hand_off(self) -> None:
        """Write the full buffer on the writer thread; fill the other one meanwhile."""
        self._wait()  # the previous hand-off is out: its buffer is free again
        if self._writes is None:
            self._writes = ThreadPoolExecutor(1, thread_name_prefix="dcpb-coalesce")
            self._spare = _coalescing_buffer()
        assert self._spare is not None
        self._pending = self._writes.submit(self._emit, self._view[: self._fill])
        self._spare, (self._buf, self._view, self._addr) = (
            (self._buf, self._view, self._addr),
            self._spare,
        )
        self._fill = 0

    def _wait(self) -> None:
        """Wait for the writer thread's write; raise its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def flush(self) -> None:
        self._wait()
        if self._fill:
            self._emit(self._view[: self._fill])
            self._fill = 0

    def close(self, *, failed: bool = False) -> None:
        """Wait for a write still on the writer thread and end it (after ``failed``, that
        write's own failure is not raised: the first one is what the caller reports)."""
        try:
            self._wait()
        except Exception:
            if not failed:
                raise
        finally:
            if self._writes is not None:
                self._writes.shutdown()
                self._writes = None

    def _emit(self, data: memoryview) -> None:
        _write_all(self._f, data)
        if self._written is not None:
            self._written(self._out, len(data))
        self._out += len(data)


def _coalescing_buffer() -> tuple[bytearray, memoryview, int]:
    """A coalescing buffer, a view of it and its address."""
    buf = bytearray(_COALESCE_BYTES + SMALL_ITEM)
    return buf, memoryview(buf), ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _write_all(f: BinaryIO, data: memoryview) -> None:
    for at in range(0, len(data), _WRITE_PIECE):
        piece = data[at : at + _WRITE_PIECE]
        while len(piece):
            n = f.write(piece)
            if n is None:  # buffered/remote writers consume everything
                break
            piece = piece[n:]


class ItemAppender:
    """Appends one item to ``out`` from its bytes in parts (at the next aligned position),
    checksumming them as they pass; for items whose bytes arrive in pieces."""

    def __init__(
        self,
        out: CoalescingFile,
        nbytes: int,
        sizes: tuple[int, ...] | None,
        dtype: torch.dtype | None,
        block: int,
    ) -> None:
        self._out = out
        self.start = out.align()
        self.written = 0
        grid = checksum.item_grid(nbytes, sizes, dtype, block) if block else None
        self._hasher = checksum.Hasher(grid) if grid is not None else None

    def add(self, part: memoryview) -> None:
        part = part.cast("B") if part.format != "B" or part.ndim != 1 else part
        if self._hasher is not None:
            self._hasher.update(part)
        self._out.write(part)
        self.written += len(part)

    def digests(self) -> tuple[str, ...] | None:
        return self._hasher.finish() if self._hasher is not None else None
