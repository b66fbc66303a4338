"""``async_save(..., writer="process")``: the async saver's writes go to a long-lived writer
process, staged through shared memory, so writing never holds the training process's GIL.

One writer process per async saver (per process group and rank), started by the first save
that asks for it and reused; the saver's staging buffers then live in shared memory. The
default, ``writer="auto"``, takes the writer process wherever it can write the save, from the
first save large enough to gain from it (``choose_writer``).
"""

from __future__ import annotations

import functools
import logging
import pickle
import subprocess
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.storage import StorageWriter

from dcpbridge.engine.staging import BufferSet, StagingArea
from dcpbridge.errors import InvalidArgumentError, WriterProcessError
from dcpbridge.storage import FsspecCheckpointWriter
from dcpbridge.storage.format.paths import process_local_url
from dcpbridge.storage.write import shared
from dcpbridge.storage.write.process import ProcessWriter, WriterProcess

WRITERS = ("auto", "thread", "process")

log = logging.getLogger(__name__)

_processes: weakref.WeakKeyDictionary[StagingArea, WriterProcess] = weakref.WeakKeyDictionary()


def shared_buffers(nbytes: int) -> BufferSet:
    """A staging buffer set in memory the writer process maps (page-locked once CUDA is in use)."""
    segment = shared.SharedSegment(nbytes, pin=torch.cuda.is_initialized())
    return BufferSet(segment.tensor, shared=segment)


def check_writer(writer: str, format: str) -> None:
    """Refuse an unknown writer, or a writer process where it cannot run ("auto" never is)."""
    if writer not in WRITERS:
        raise InvalidArgumentError(f"writer must be 'auto', 'thread' or 'process', got {writer!r}")
    if writer == "process" and format != "dcpbridge":
        raise InvalidArgumentError(f"writer='process' writes format 'dcpbridge', not {format!r}")
    if writer == "process" and not shared.available():
        raise InvalidArgumentError("writer='process' needs Linux (os.memfd_create)")


AUTO_MIN_BYTES = 64 << 20
"""``writer="auto"`` starts a rank's writer process with a save that stages at least this much
there: below it, writing holds the GIL for milliseconds, less than the process's start costs
(an interpreter importing torch: about 3 CPU seconds and a few hundred MiB)."""


def choose_writer(
    writer: str,
    format: str,
    url: str,
    nbytes: int,
    started: bool,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """The writer ("thread" or "process") of an async save of ``format`` to ``url`` that stages
    ``nbytes`` on this rank: ``writer`` if named; "auto" is the writer process where it can
    write the save (format "dcpbridge", Linux, files another process sees: not ``memory://``,
    ``storage_options`` that pickle, as each write hands them over) once it was ``started``
    or ``nbytes >= AUTO_MIN_BYTES``, else the thread."""
    check_writer(writer, format)
    if writer != "auto":
        return writer
    if format != "dcpbridge" or not shared.available() or process_local_url(url):
        return "thread"
    if not (started or nbytes >= AUTO_MIN_BYTES):
        return "thread"
    return "process" if _portable(storage_options) else "thread"


def _portable(storage_options: dict[str, Any] | None) -> bool:
    """Whether ``storage_options`` can reach the writer process (a session or credential
    object often cannot be pickled)."""
    try:
        pickle.dumps(storage_options)
    except Exception:
        return False
    return True


def attach(
    area: StagingArea, writer: str, what: str, auto: bool = False
) -> tuple[str, Callable[[StorageWriter], StorageWriter] | None]:
    """Set ``area`` (an async saver's) up for ``writer``: (the writer it got, what wraps each
    save's storage writer so that its data is written in the process, or None). A writer
    process that cannot start raises ``WriterProcessError`` naming ``what`` or, where "auto"
    chose it (``auto``), leaves the save to the thread writer with a warning; so does, without
    a new warning, one whose child died before its job in an earlier "auto" save."""
    process = _processes.get(area)
    if writer != "process" or (auto and process is not None and process.broken):
        area.use(None)
        return "thread" if writer == "process" else writer, None
    if process is None:
        process = _processes[area] = WriterProcess()
        # not at exit: the saves drained at exit still need it (it ends when this process does)
        weakref.finalize(area, process.close).atexit = False
    try:
        process.start()
    except (OSError, subprocess.SubprocessError) as e:
        del _processes[area]  # the next save that wants one tries again
        area.use(None)
        error = WriterProcessError(
            f"{what}: the writer process could not start: {type(e).__name__}: {e}"
        )
        if not auto:
            raise error from e
        log.warning("%s; the thread writer writes this save", error)
        return "thread", None
    area.use(shared_buffers)
    return "process", functools.partial(_wrap, process=process, fallback=auto)


def process_of(area: StagingArea) -> WriterProcess | None:
    """The writer process serving ``area``'s saver, if one was attached."""
    return _processes.get(area)


def _wrap(
    writer: StorageWriter,
    *,
    process: WriterProcess,
    fallback: bool,
    on_fallback: Callable[[], None] | None = None,
) -> StorageWriter:
    if isinstance(writer, FsspecCheckpointWriter):
        return ProcessWriter(writer, process, fallback, on_fallback)  # type: ignore[return-value]
    return writer
