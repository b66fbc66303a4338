"""Host memory that a writer process maps too: an anonymous memory file, mapped in both.

The file is a ``memfd`` (Linux): nothing appears in ``/dev/shm``, and its memory is freed
once every process that mapped it has dropped it, so a killed process leaks nothing. Its
descriptor reaches the writer process over a Unix socket (``SCM_RIGHTS``), never by name.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import weakref

import torch

from dcpbridge.storage.errors import InvalidArgumentError

log = logging.getLogger(__name__)

_ids = itertools.count(1)
_by_address: weakref.WeakValueDictionary[int, SharedSegment] = weakref.WeakValueDictionary()


def available() -> bool:
    """Whether this platform can share memory this way (Linux's ``memfd_create``)."""
    return hasattr(os, "memfd_create")


class SharedSegment:
    """``nbytes`` of shared memory as a flat uint8 tensor; ``fd`` lets another process map it.

    With ``pin``, the memory is also page-locked for CUDA (``cudaHostRegister``), so copies
    from GPU tensors into it run asynchronously at full speed, as into pinned buffers."""

    def __init__(self, nbytes: int, pin: bool = False) -> None:
        if not available():
            raise InvalidArgumentError("shared staging memory needs Linux (os.memfd_create)")
        self.id = next(_ids)
        self.nbytes = max(nbytes, 1)
        self.fd = os.memfd_create(f"dcpbridge-staging-{self.id}", os.MFD_CLOEXEC)
        # not at exit: saves drained at exit may still hand this descriptor to a writer process
        weakref.finalize(self, os.close, self.fd).atexit = False
        os.ftruncate(self.fd, self.nbytes)
        self._map = mmap.mmap(self.fd, self.nbytes)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()
        _by_address[self.address] = self
        if pin:
            _pin(self)


def _pin(segment: SharedSegment) -> None:
    """Page-lock ``segment`` for CUDA until it is dropped; pageable (copies just sync) if refused."""
    cudart = torch.cuda.cudart()
    code = cudart.cudaHostRegister(segment.address, segment.nbytes, 0)
    if int(code) != 0:
        log.warning("could not page-lock shared staging memory (CUDA error %s)", int(code))
        return
    # runs before the segment's map is released (weakref callbacks precede attribute clearing)
    weakref.finalize(segment, cudart.cudaHostUnregister, segment.address).atexit = False


def live_ids() -> set[int]:
    """The ids of the segments still in use in this process."""
    return {segment.id for segment in list(_by_address.values())}


def locate(tensor: torch.Tensor) -> tuple[SharedSegment, int] | None:
    """The segment holding ``tensor``'s bytes and their offset in it, if they are there and
    contiguous; else None."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    segment = _by_address.get(tensor.untyped_storage().data_ptr())
    if segment is None:
        return None
    return segment, tensor.data_ptr() - segment.address


def map_segment(fd: int, nbytes: int) -> torch.Tensor:
    """A segment's memory mapped from a received descriptor (closed here: the map keeps it)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault it in once, here
    try:
        view = mmap.mmap(fd, nbytes, flags=flags)
    finally:
        os.close(fd)
    return torch.frombuffer(view, dtype=torch.uint8)
