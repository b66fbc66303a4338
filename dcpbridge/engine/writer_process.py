"""``async_save(..., writer="process")``: the async saver's writes go to a long-lived writer
process, staged through shared memory, so writing never holds the training process's GIL.

One writer process per async saver (per process group and rank), started by the first save
that asks for it and reused; the saver's staging buffers then live in shared memory.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
from torch.distributed.checkpoint.storage import StorageWriter

from dcpbridge.engine.staging import BufferSet, StagingArea
from dcpbridge.errors import InvalidArgumentError
from dcpbridge.storage import FsspecCheckpointWriter
from dcpbridge.storage.write import shared
from dcpbridge.storage.write.process import ProcessWriter, WriterProcess

WRITERS = ("thread", "process")

_processes: weakref.WeakKeyDictionary[StagingArea, WriterProcess] = weakref.WeakKeyDictionary()


def shared_buffers(nbytes: int) -> BufferSet:
    """A staging buffer set in memory the writer process maps (page-locked once CUDA is in use)."""
    segment = shared.SharedSegment(nbytes, pin=torch.cuda.is_initialized())
    return BufferSet(segment.tensor, shared=segment)


def check_writer(writer: str, format: str) -> None:
    if writer not in WRITERS:
        raise InvalidArgumentError(f"writer must be 'thread' or 'process', got {writer!r}")
    if writer == "process" and format != "dcpbridge":
        raise InvalidArgumentError(f"writer='process' writes format 'dcpbridge', not {format!r}")
    if writer == "process" and not shared.available():
        raise InvalidArgumentError("writer='process' needs Linux (os.memfd_create)")


def attach(area: StagingArea, writer: str) -> Callable[[StorageWriter], StorageWriter] | None:
    """Set ``area`` (an async saver's) up for ``writer``; with a process, what wraps each
    save's storage writer so that its data is written there (None: written in this process)."""
    if writer != "process":
        area.use(None)
        return None
    area.use(shared_buffers)
    process = _processes.get(area)
    if process is None:
        process = _processes[area] = WriterProcess()
        # not at exit: the saves drained at exit still need it (it ends when this process does)
        weakref.finalize(area, process.close).atexit = False
    process.start()
    return functools.partial(_wrap, process=process)


def process_of(area: StagingArea) -> WriterProcess | None:
    """The writer process serving ``area``'s saver, if one was attached."""
    return _processes.get(area)


def _wrap(writer: StorageWriter, *, process: WriterProcess) -> StorageWriter:
    if isinstance(writer, FsspecCheckpointWriter):
        return ProcessWriter(writer, process)  # type: ignore[return-value]
    return writer
