"""``async_save``: the caller waits at most for staging; writing and the commit run in the background.

Per process group there is one writer thread, one dedicated gloo group for its collectives
(so they never interleave with the training loop's), one staging area whose buffers are reused
by later saves, and (once a save stages in the background) one staging thread, which never
communicates. Saves complete in submission order; at most ``max_in_flight`` are outstanding.
A saver whose process group is destroyed is closed: its queued saves run to their end (they
fail where the group's peers or store are gone), then its threads end and its buffers and
writer process are freed; it happens when the group object is collected or, where something
still holds it, at the next ``async_save`` of this process.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  # its exit hook first: the drain runs before it
import contextlib
import logging
import os
import queue
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from dcpbridge.engine.cache import PerGroup
from dcpbridge.engine.collectives import Group, StoreGroup
from dcpbridge.engine.staging import BufferSet, DeviceCopies, StagingArea, hold_streams
from dcpbridge.engine.writer_process import process_of
from dcpbridge.errors import InvalidArgumentError

log = logging.getLogger(__name__)


class AsyncSaveHandle:
    """A save running in the background; ``result()`` waits and re-raises its failure."""

    def __init__(self, checkpoint_dir: str, writer: str = "thread") -> None:
        self.checkpoint_dir = checkpoint_dir
        self.writer = writer  # who writes its data files: "thread" (here) or "process"
        self._done = threading.Event()
        self._staged = threading.Event()
        self._error: BaseException | None = None
        self._reported = False
        self._buffers: BufferSet | None = None
        self._copies: list[DeviceCopies] = []  # its GPU staging copies (set once staged)

    def done(self) -> bool:
        """Whether the save has ended, committed or failed (``result()`` says which)."""
        return self._done.is_set()

    def wait_done(self) -> None:
        """Wait until the save ended, committed or failed; its failure is neither raised nor
        reported here (``result()`` still raises it)."""
        self._done.wait()

    @property
    def staged(self) -> bool:
        """Whether the save is done reading the caller's tensors (they may change now)."""
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Wait until the save no longer reads the caller's tensors: staged, or staging failed
        (that failure is raised on every rank by ``result()``, never here)."""
        if not self._staged.wait(timeout):
            raise TimeoutError(
                f"async save to {self.checkpoint_dir} still staging after {timeout}s"
            )

    def hold_streams(self) -> None:
        """Make the current CUDA streams' later kernels wait for this save's staging copies
        (on the GPU; call after ``wait_staged``): for a save that left the caller's streams
        free (``defer_stream_wait``), before anything modifies the saved tensors."""
        hold_streams(self._copies)

    def _set_buffers(self, buffers: BufferSet | None) -> None:
        self._buffers = buffers
        self._copies = list(buffers.copies) if buffers is not None else []

    def result(self, timeout: float | None = None) -> None:
        """Wait until the checkpoint is committed (or failed: then raise, on every rank)."""
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"async save to {self.checkpoint_dir} still running after {timeout}s"
            )
        self._reported = True
        if self._error is not None:
            raise self._error

    wait = result

    def reported(self) -> None:
        """Its failure reached the caller another way: a later ``async_save`` must not
        raise it again."""
        self._reported = True

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()


class AsyncSaver:
    """The background machinery of one process group."""

    _by_group: PerGroup[AsyncSaver] = PerGroup()  # forgotten with their process group
    _every: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()  # drained at exit
    _inherited: list[AsyncSaver] = []  # a forked child's copies of its parent's savers

    def __init__(self, group: Group, max_in_flight: int) -> None:
        self.group = StoreGroup.for_group(group, "async-save")
        self.max_in_flight = max_in_flight
        self.area = StagingArea(max_in_flight)
        self._inflight: deque[AsyncSaveHandle] = deque()
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="dcpb-async-save", daemon=True)
        self._thread.start()
        self._stagings: queue.Queue[Any] = queue.Queue()
        self._stager: threading.Thread | None = None  # started by the first background stage
        self._pid = os.getpid()  # its threads and writer process are this process's only
        self._pg = None if group.pg is None else weakref.ref(group.pg)
        self._closing = False
        AsyncSaver._every.add(self)
        if group.pg is not None:  # a group destroyed and collected takes its saver along
            weakref.finalize(group.pg, AsyncSaver._stop_ref, weakref.ref(self)).atexit = False

    @classmethod
    def for_group(cls, group: Group, max_in_flight: int) -> AsyncSaver:
        """The saver of ``group`` (created collectively on first use by every member)."""
        if max_in_flight < 1:
            raise InvalidArgumentError(f"max_in_flight must be >= 1, got {max_in_flight}")
        cls.close_orphans()
        saver = cls._by_group.get(group, "async-save", lambda: AsyncSaver(group, max_in_flight))
        if saver._pid != os.getpid():  # a forked child: the parent's saver has no threads here
            cls._by_group.discard(saver)
            cls._inherited.append(saver)  # the parent's: never torn down by the child
            saver = cls._by_group.get(group, "async-save", lambda: AsyncSaver(group, max_in_flight))
        saver.area.max_sets = max(saver.area.max_sets, max_in_flight)
        saver.max_in_flight = max_in_flight
        return saver

    @classmethod
    def close_orphans(cls) -> None:
        """Close this process's savers whose process group was destroyed (before a new group's
        saver allocates buffers of its own)."""
        for saver in list(cls._every):
            pg = saver._pg() if saver._pg is not None else None
            if saver._pg is not None and (pg is None or Group.destroyed(pg)):
                saver.close()

    def close(self) -> None:
        """Let the queued saves end, then end the threads and free the buffers and the writer
        process; the saver takes no more saves (idempotent)."""
        AsyncSaver._by_group.discard(self)
        self._stop()
        if self._pid == os.getpid() and self._thread is not threading.current_thread():
            self._thread.join()

    def _stop(self) -> None:
        """Queue the end behind the saves already queued (no wait: a finalizer calls it)."""
        if self._closing or self._pid != os.getpid():  # a forked child has no threads to end
            return
        if sys.is_finalizing():  # the process ends: its teardown must not race the exit's
            return
        self._closing = True
        if self._stager is not None:
            self._stagings.put(None)
        self._jobs.put(None)

    @staticmethod
    def _stop_ref(ref: weakref.ref[AsyncSaver]) -> None:
        saver = ref()
        if saver is not None:
            saver._stop()

    def wait_for_capacity(self) -> None:
        """Wait for the oldest saves until fewer than ``max_in_flight`` are outstanding.

        Raises a waited-for save's failure (unless ``result()`` already did): this happens at
        the same call on every rank, since every rank submits the same sequence of saves.
        """
        while len(self._inflight) >= self.max_in_flight:
            oldest = self._inflight[0]
            oldest.wait_done()  # interrupted (Ctrl-C): it stays in flight, drained at exit
            if self._inflight and self._inflight[0] is oldest:  # (another thread's call may
                self._inflight.popleft()  # have taken it off meanwhile)
            if oldest._error is not None and not oldest._reported:
                oldest._reported = True
                raise oldest._error

    def submit(
        self,
        checkpoint_dir: str,
        job: Callable[[], Any],
        buffers: BufferSet | None,
        stage: Callable[[], BufferSet | None] | None = None,
        writer: str = "thread",
    ) -> AsyncSaveHandle:
        """Queue ``job`` (which owns ``buffers`` until it ends) behind earlier saves; with
        ``stage``, the staging thread first runs it (it returns the buffers and must carry its
        own failures into ``job``) and ``job`` waits for it; ``writer`` is the handle's."""
        if self._closing:
            raise InvalidArgumentError("this async saver was closed: its process group is gone")
        handle = AsyncSaveHandle(checkpoint_dir, writer)
        handle._set_buffers(buffers)
        if stage is None:
            handle._staged.set()
        else:
            if self._stager is None:
                self._stager = threading.Thread(
                    target=self._stage_loop, name="dcpb-async-stage", daemon=True
                )
                self._stager.start()
            self._stagings.put((handle, stage))
        self._inflight.append(handle)
        self._jobs.put((handle, job))
        return handle

    def drain(self) -> None:
        """Wait for every save in flight (at exit); a failed one is logged, whatever it raised
        (a base exception of its thread must not end the exit's own work)."""
        while self._inflight:
            handle = self._inflight[0]
            handle.wait_done()
            self._inflight.popleft()
            if handle._error is not None:  # reported where the caller waits; here only logged
                error = handle._error
                log.warning(
                    "async save to %s failed: %s: %s",
                    handle.checkpoint_dir,
                    type(error).__name__,
                    error,
                )

    def _stage_loop(self) -> None:
        """Stage queued saves in order; local work only (no collective ever runs here)."""
        while True:
            item = self._stagings.get()
            if item is None:
                return
            handle, stage = item
            try:
                handle._set_buffers(stage())
            except BaseException as e:  # ``stage`` carries its failures; this is a last resort
                log.error("async save to %s: staging crashed: %s", handle.checkpoint_dir, e)
            finally:
                handle._staged.set()

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                self._release()
                return
            handle, job = item
            error = None
            handle._staged.wait()
            buffers = handle._buffers
            try:
                if buffers is not None:
                    buffers.wait_ready()
                job()
            except BaseException as e:
                error = e
            finally:
                if buffers is not None:
                    self.area.release(buffers)
                handle._buffers = None  # back in the area: a handle the caller keeps holds none
                handle._finish(error)

    def _release(self) -> None:
        """The closed saver's last act (its saves are done): end its staging thread and
        writer process, and drop its buffers."""
        if self._stager is not None:
            self._stager.join()
        process = process_of(self.area)
        if process is not None:
            process.close()
        self.area.clear()


_exit_drains: list[Callable[[], None]] = []


def drain_at_exit(drain: Callable[[], None]) -> None:
    """Have the exit drain run ``drain`` first: it waits for other background saves of this
    process (the local tier's), which need the same exit hook's place as async saves."""
    _exit_drains.append(drain)


def _wait_for_saves_at_exit() -> None:
    """Finish outstanding saves before the interpreter exits, so the last checkpoint lands;
    a closing saver's thread ends first too (its teardown must not race the interpreter's).
    Runs among threading's exit hooks, before ``concurrent.futures``' (after it, executors
    refuse new work, which the writes need), and again at exit (a no-op by then)."""
    for drain in list(_exit_drains):
        try:
            drain()
        except BaseException as e:  # the exit's own work (joining threads) must go on
            log.warning("dcpbridge: draining background saves at exit failed: %r", e)
    for saver in list(AsyncSaver._every):
        if saver._pid != os.getpid():  # a forked child's copy: the parent's saves, not its own
            continue
        saver.drain()
        if saver._closing and saver._pid == os.getpid():
            saver._thread.join()


# CPython's hook run before threads are joined (concurrent.futures registers its own there);
# elsewhere (another interpreter) the at-exit one alone
with contextlib.suppress(AttributeError, RuntimeError):
    threading._register_atexit(_wait_for_saves_at_exit)  # type: ignore[attr-defined]
atexit.register(_wait_for_saves_at_exit)
