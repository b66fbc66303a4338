"""A writer process: data files written by a long-lived child process, so that writing never
holds the training process's GIL.

The parent plans and commits as usual; only ``write_data`` moves. Tensor data that was staged
in shared memory (``shared.SharedSegment``) travels as (segment, offset, size); anything else
(objects, data outside shared memory) as bytes. The child is started on first use, reused by
later saves and started again when found dead. A child that dies during a write fails that
write (``WriterProcessError``); the engine then fails the save on every rank and removes its
files, as for any failed write.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from dcpbridge.storage.errors import CheckpointError, WriterProcessError
from dcpbridge.storage.format.document import data_file_name
from dcpbridge.storage.format.paths import Location, resolve
from dcpbridge.storage.write import shared
from dcpbridge.storage.write.items import shown_data, tensor_bytes
from dcpbridge.storage.write.writer import MOST_FILES, FsspecCheckpointWriter, _RankTarget

log = logging.getLogger(__name__)

CHILD_MODULE = "dcpbridge.storage.write.process_main"
# The child's entry: ``dcpbridge`` and ``torch.distributed.checkpoint`` as bare packages, then
# the module. Their ``__init__``s (the whole library; all of DCP: planners, state-dict loaders,
# DTensor's ops) are not run: the child moves bytes with ``dcpbridge.storage`` and DCP's plan
# and metadata types alone, and starts in about half the CPU time.
BOOT = (
    "import importlib.util as u, runpy, sys\n"
    "for n in ('dcpbridge', 'torch.distributed.checkpoint'):\n"
    "    sys.modules[n] = u.module_from_spec(u.find_spec(n))\n"
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
)


@dataclass(frozen=True, slots=True)
class SharedRef:
    """Item data in a shared segment: ``nbytes`` at ``offset``."""

    segment: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Inline:
    """Item data sent as bytes; ``stream`` if the item is a ``BYTE_IO`` object."""

    data: bytes
    stream: bool


@dataclass(frozen=True, slots=True)
class WriteJob:
    """One rank's ``write_data`` for the child: where, how, the plan and its items' data."""

    url: str
    storage_options: dict[str, Any]
    thread_count: int | None
    sync_files: bool
    checksums: bool
    checksum_block_size: int
    plan: SavePlan
    data: list[SharedRef | Inline]
    digest: Any
    reuse_from: str | None = None  # incremental: the sibling whose equal chunks are referenced


@dataclass(frozen=True, slots=True)
class Failure:
    """What the child reports of a failed job: the exception, its cause, its traceback text."""

    error: BaseException
    cause: BaseException | None
    trace: str


def describe(datas: list[Any]) -> tuple[list[SharedRef | Inline], list[shared.SharedSegment]]:
    """Each resolved item's data as a reference into shared memory or as bytes; the segments
    the references name."""
    refs: list[SharedRef | Inline] = []
    segments: dict[int, shared.SharedSegment] = {}
    for data in datas:
        if isinstance(data, io.BytesIO):
            refs.append(Inline(data.getvalue(), True))
            continue
        where = shared.locate(data) if isinstance(data, torch.Tensor) else None
        if where is None:
            refs.append(Inline(bytes(tensor_bytes(data)), False))
            continue
        segment, offset = where
        segments[segment.id] = segment
        refs.append(SharedRef(segment.id, offset, data.nbytes))
    return refs, list(segments.values())


def portable_failure(error: BaseException, trace: str) -> Failure:
    """``error`` in a form that survives pickling (its type is kept when it pickles)."""

    def portable(e: BaseException | None) -> BaseException | None:
        if e is None:
            return None
        try:
            pickle.loads(pickle.dumps(e))
            return e
        except Exception:
            return RuntimeError(f"{type(e).__name__}: {e}")

    error_ = portable(error)
    assert error_ is not None
    return Failure(error_, portable(error.__cause__), trace)


def raise_failure(failure: Failure, url: str) -> None:
    """Raise the child's failure here: its ``CheckpointError`` as it was (cause restored),
    anything else as ``WriterProcessError`` caused by it."""
    error = failure.error
    error.__cause__ = failure.cause
    error.add_note(f"raised in dcpbridge's writer process:\n{failure.trace}")
    if isinstance(error, CheckpointError):
        raise error
    raise WriterProcessError(
        f"{url}: the writer process failed: {type(error).__name__}: {error}"
    ) from error


class WriterProcess:
    """The long-lived child that writes; one per async saver, restarted when found dead."""

    child_module = CHILD_MODULE  # what the child runs as ``__main__``

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._mapped: set[int] = set()
        # a child died before taking a job and the thread writer took over ("auto"): later
        # "auto" saves go to the thread at once, not spawning children that die (seconds each)
        self.broken = False

    @property
    def pid(self) -> int | None:
        """The child's process id (None before the first start)."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the child unless it runs (its imports then overlap the caller's work); if a
        write holds it, that write starts it when needed."""
        if self._lock.acquire(blocking=False):
            try:
                self._ensure()
            finally:
                self._lock.release()

    def write(self, job: WriteJob, segments: list[shared.SharedSegment]) -> Any:
        """Run ``job`` in the child; its reply (results and file names), or raise.

        A child found dead before it took the job is replaced and the job sent again; one
        that dies after taking it fails the job (its files are the caller's to remove).
        """
        with self._lock:
            for attempt in (0, 1):
                self._ensure()
                try:
                    self._send(job, segments)
                    self._receive_start()
                except (OSError, EOFError) as e:
                    self._discard()
                    if attempt:
                        died = self._died(job.url, "before it took the job", e)
                        died.before_job = True  # type: ignore[attr-defined]  # nothing written
                        raise died from e
                    continue
                except Exception as e:  # the job does not pickle: nothing was sent
                    raise WriterProcessError(
                        f"{job.url}: could not hand the write to the writer process: "
                        f"{type(e).__name__}: {e}"
                    ) from e
                try:
                    kind, payload = self._recv()
                except (OSError, EOFError) as e:
                    self._discard()
                    raise self._died(job.url, "while writing", e) from e
                if kind == "error":  # outside the try: its StorageError is no death (an OSError)
                    raise_failure(payload, job.url)
                return payload

    def close(self) -> None:
        """End the child (it finishes nothing half-way: only idle children are asked)."""
        with self._lock:
            self._discard()

    # -- helpers --------------------------------------------------------------------------

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._discard()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with mine, theirs:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    BOOT,
                    self.child_module,
                    str(theirs.fileno()),
                    str(os.getpid()),
                ],
                pass_fds=(theirs.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
            )
            self._conn = Connection(mine.detach())
        self._mapped = set()

    def _send(self, job: WriteJob, segments: list[shared.SharedSegment]) -> None:
        conn, proc = self._conn, self._proc
        assert conn is not None and proc is not None
        for segment in segments:
            if segment.id not in self._mapped:
                conn.send(("map", segment.id, segment.nbytes))
                send_handle(conn, segment.fd, proc.pid)
                self._mapped.add(segment.id)
        gone = self._mapped - shared.live_ids()
        conn.send(("write", job, sorted(gone)))
        self._mapped -= gone

    def _recv(self) -> Any:
        """The child's next message; EOFError once it has exited (even if a forked process
        still holds its end of the socket, which would keep the socket from closing)."""
        conn, proc = self._conn, self._proc
        assert conn is not None and proc is not None
        while not conn.poll(1.0):
            if proc.poll() is not None and not conn.poll(0):
                raise EOFError(f"the writer process exited with code {proc.returncode}")
        return conn.recv()

    def _receive_start(self) -> None:
        if self._recv() != "started":
            raise EOFError("the writer process answered out of turn")

    def _died(self, url: str, when: str, error: BaseException) -> WriterProcessError:
        code = self._last_code
        return WriterProcessError(
            f"{url}: the writer process (pid {self._last_pid}) ended {when}"
            f"{'' if code is None else f' with exit code {code}'}: {type(error).__name__}: "
            f"{error}"
        )

    _last_pid: int | None = None
    _last_code: int | None = None

    def _discard(self) -> None:
        """Drop the child: close the socket (an idle child exits on it), reap or kill it."""
        proc, conn = self._proc, self._conn
        self._proc, self._conn, self._mapped = None, None, set()
        if conn is not None:
            conn.close()
        if proc is None:
            return
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._last_pid, self._last_code = proc.pid, proc.returncode


class ProcessWriter:
    """``inner`` (a ``FsspecCheckpointWriter``) whose ``write_data`` runs in ``process``;
    everything else (planning, commit, cleanup) runs here, as ``inner`` does it. With
    ``fallback``, a process that dies before it takes the job (it cannot start: its
    interpreter fails to import the writer) leaves the write to ``inner``, here, with a
    warning, marks ``process`` broken (later "auto" saves take the thread) and calls
    ``on_fallback``."""

    def __init__(
        self,
        inner: FsspecCheckpointWriter,
        process: WriterProcess,
        fallback: bool = False,
        on_fallback: Callable[[], None] | None = None,
    ) -> None:
        self.inner = inner
        self.process = process
        self.fallback = fallback
        self.on_fallback = on_fallback

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        inner = self.inner
        target = plan.storage_data
        location = inner.location
        if not isinstance(target, _RankTarget) or location is None or location.process_local:
            return inner.write_data(plan, planner)  # memory:// lives in this process only
        datas = list(map(shown_data(planner), plan.items))
        refs, segments = describe(datas)
        digest_of = getattr(planner, "plan_digest", None)
        job = WriteJob(
            _for_child(location.url, location, inner.storage_options),
            inner.storage_options,
            inner.thread_count,
            inner.sync_files,
            inner.checksums,
            inner.checksum_block_size,
            dataclasses.replace(plan, planner_data=None),
            refs,
            digest_of(plan) if digest_of is not None else None,
            None
            if inner.reuse_from is None
            else _for_child(inner.reuse_from, location, inner.storage_options),
        )
        # until the child says what it wrote, every name it may write is this save's to remove
        inner._save_id = target.save_id
        most = MOST_FILES if inner.thread_count is None else inner.thread_count
        inner._written = {data_file_name(target.rank, i, target.save_id) for i in range(most)}
        try:
            results, names = self.process.write(job, segments)
        except WriterProcessError as e:
            if not (self.fallback and getattr(e, "before_job", False)):
                raise
            log.warning(
                "%s; the thread writer writes this save and every later 'auto' one of this process",
                e,
            )
            self.process.broken = True
            if self.on_fallback is not None:
                self.on_fallback()
            return inner.write_data(plan, planner)  # it took nothing: no file of it exists
        inner._written = set(names)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut


def _for_child(url: str, location: Location, storage_options: dict[str, Any]) -> str:
    """``url`` (at or beside ``location``) as the writer process must name it: a local path
    made absolute here, since the process stays in the directory it started in while this
    one may have moved on (its data files would land elsewhere than the commit)."""
    if not location.is_local:
        return url
    return location.root if url == location.url else resolve(url, storage_options).root
