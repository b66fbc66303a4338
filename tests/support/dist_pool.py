"""A pool of gloo worker processes, spawned once and reused to run test bodies on N ranks.

Each worker joins a world of ``size`` ranks and pre-creates sub-groups of the first
1..size ranks, so a test can run on 2 or 3 ranks (a sub-group) or on all of them (the
default group). Results come back as ``torch.save`` bytes (tensors sent through pipes as
shared memory break once the sender exits). A test that exceeds its timeout kills the pool,
which the next test respawns, so one hung collective cannot stall the session.

Ranks are forked from a server that imported torch and dcpbridge; a pool whose ranks must not
import some packages forks them from one fresh interpreter of its own that blocked them first.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import importlib
import io
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from tests.support import import_block, preloaded
from tests.support.s3_server import free_port


@dataclass(frozen=True)
class Rank:
    """What a test body learns about where it runs."""

    rank: int
    size: int
    group: Any  # the sub-group of the first ``size`` ranks; None means the default group


@contextlib.contextmanager
def children_allowed() -> Iterator[None]:
    """Let a test body start processes of its own (DataLoader workers) in a pool worker, a
    daemon process: those workers watch their parent and end with their iterator."""
    config = mp.current_process()._config  # type: ignore[attr-defined]
    was = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = was


class RankFailure(AssertionError):
    """One or more ranks of a pooled test raised or hung."""


def _dumps(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _worker(rank: int, size: int, port: int, conn: Connection, log_path: str) -> None:
    # a rank inherits its parent's start method (forkserver, spawn); a torchrun rank forks its
    # DataLoader workers (spawning them re-imports torch in each: seconds per epoch)
    mp.set_start_method("fork", force=True)
    os.setpgid(0, 0)  # its own process group: what it starts is killed with it (``kill``)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks of a hung rank, on demand
    faulthandler.enable(all_threads=True)  # and of a crashed one, or of its DataLoader workers:
    # they inherit it, and keep it instead of torch's handlers (which only name the signal)
    from torch.utils.data._utils import signal_handling

    signal_handling._set_worker_signal_handlers = faulthandler.enable
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401  (must precede init_process_group)

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=120),
    )
    groups = {n: dist.new_group(list(range(n))) for n in range(1, size + 1)}
    conn.send(("ready", rank))
    while True:
        task = conn.recv()
        if task is None:
            break
        module, name, args, nprocs, default_group = task
        try:
            fn = getattr(importlib.import_module(module), name)
            group = None if default_group else groups[nprocs]
            value = fn(Rank(rank, nprocs, group), *args)
            conn.send(("ok", _dumps(value)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    conn.close()
    dist.destroy_process_group()
    atexit._run_exitfuncs()
    os._exit(0)


def _blocked_parent(
    size: int,
    port: int,
    conns: list[Connection],
    log_dir: str,
    blocked: tuple[str, ...],
    preload: tuple[str, ...],
    reply: Connection,
) -> None:
    """A fresh interpreter in which ``blocked`` cannot be imported: it imports torch (and
    ``preload``) once, forks the ``size`` ranks and waits for them (each rank a fresh
    interpreter instead would import torch again: seconds of CPU per rank)."""
    fd = os.open(os.path.join(log_dir, "parent.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import_block.install(blocked)  # before anything that could import them
    import torch.distributed.checkpoint  # noqa: F401  (what _worker imports)

    for name in preload:
        importlib.import_module(name)
    ctx = mp.get_context("fork")
    ranks = []
    with children_allowed():
        for rank in range(size):
            log = os.path.join(log_dir, f"rank{rank}.log")
            args = (rank, size, port, conns, log)
            ranks.append(ctx.Process(target=_forked_rank, args=args, daemon=True))
            ranks[-1].start()
    for conn in conns:
        conn.close()
    reply.send([p.pid for p in ranks])
    for p in ranks:
        p.join()


def _forked_rank(rank: int, size: int, port: int, conns: list[Connection], log: str) -> None:
    for other, conn in enumerate(conns):
        if other != rank:
            conn.close()  # a rank's pipe ends with it (the others' copies would keep it open)
    _worker(rank, size, port, conns[rank], log)


class _Forked:
    """A rank that the pool's blocked parent forked (not our child): watched through a pidfd,
    which turns readable when the process ends."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)

    def is_alive(self) -> bool:
        return not wait([self.sentinel], 0)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        wait([self.sentinel], timeout)

    def close(self) -> None:
        os.close(self.sentinel)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc; none elsewhere)."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            with (
                contextlib.suppress(OSError, IndexError, ValueError),
                open(f"/proc/{entry}/stat") as f,
            ):
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


class WorkerPool:
    """``size`` gloo ranks that run test functions on demand; ``blocked`` packages cannot be
    imported in them (readers of other tools, run where dcpbridge is absent), ``preload``
    modules are imported before their ranks are forked (only with ``blocked``)."""

    def __init__(
        self, size: int = 4, *, blocked: tuple[str, ...] = (), preload: tuple[str, ...] = ()
    ) -> None:
        if preload and not blocked:
            raise ValueError("preload is for pools with blocked packages")
        self.size, self.blocked, self.preload = size, blocked, preload
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._parent: mp.process.BaseProcess | None = None
        self._logdir = tempfile.mkdtemp(prefix="dcpb-pool-")

    def _start(self) -> None:
        if self.blocked:
            self._start_blocked()
            self._wait_ready()
            return
        ctx = preloaded.context()  # forked from a server that imported torch and dcpbridge
        port = free_port()
        for rank in range(self.size):
            parent, child = ctx.Pipe()
            log = os.path.join(self._logdir, f"rank{rank}.log")
            p = ctx.Process(
                target=_worker,
                args=(rank, self.size, port, child, log),
                daemon=True,
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self._wait_ready()

    def _start_blocked(self) -> None:
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(self.size)]
        reply, their_reply = ctx.Pipe()
        args = (self.size, free_port(), [c for _, c in pipes], self._logdir, self.blocked)
        self._parent = ctx.Process(
            target=_blocked_parent, args=(*args, self.preload, their_reply), daemon=True
        )
        self._parent.start()
        for _, child in pipes:
            child.close()
        their_reply.close()
        self._conns = [parent for parent, _ in pipes]
        with reply:
            try:
                if not reply.poll(120):
                    raise EOFError
                self._procs = [_Forked(pid) for pid in reply.recv()]
            except EOFError:
                self.kill()
                raise RuntimeError(
                    f"pool ranks were not forked:\n{self._log_tail('parent')}"
                ) from None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.kill()
                raise RuntimeError(f"pool worker {rank} did not start:\n{self._log_tail(rank)}")
            conn.recv()

    def _log_tail(self, rank: int | str, lines: int = 30) -> str:
        name = f"rank{rank}" if isinstance(rank, int) else rank
        try:
            with open(os.path.join(self._logdir, f"{name}.log")) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def run(
        self,
        fn: Callable[..., Any],
        nprocs: int,
        *args: Any,
        timeout: float = 60.0,
        default_group: bool = False,
        grace: float = 20.0,
    ) -> list[Any]:
        """Run ``fn(Rank, *args)`` on ranks ``0..nprocs-1``; return their results in rank order.
        Once a rank failed, the others get ``grace`` seconds (not the full timeout) to finish."""
        if not 1 <= nprocs <= self.size:
            raise ValueError(f"nprocs must be in 1..{self.size}")
        if default_group and nprocs != self.size:
            raise ValueError("the default group spans all pool ranks")
        if not self._procs:
            self._start()
        task = (fn.__module__, fn.__qualname__, args, nprocs, default_group)
        for conn in self._conns[:nprocs]:
            conn.send(task)
        pending = {conn: rank for rank, conn in enumerate(self._conns[:nprocs])}
        # a dead rank's pipe may stay open in a child it forked: its process sentinel tells too
        ended = {self._procs[rank].sentinel: conn for conn, rank in pending.items()}
        results: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while pending:
            watched = [*pending, *(s for s, conn in ended.items() if conn in pending)]
            ready = wait(watched, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for obj in ready:
                conn = ended.get(obj, obj)
                if conn not in pending:
                    continue
                rank = pending.pop(conn)
                try:
                    if obj is not conn and not conn.poll():
                        raise EOFError
                    results[rank] = conn.recv()
                except EOFError:
                    results[rank] = ("error", f"worker died:\n{self._log_tail(rank)}")
                if results[rank][0] == "error":
                    deadline = min(deadline, time.monotonic() + grace)
        hung = sorted(pending.values())
        stacks = ""
        if hung:
            for rank in hung:
                with contextlib.suppress(OSError):
                    os.kill(self._procs[rank].pid, signal.SIGUSR1)
            time.sleep(1)
            stacks = "\n".join(f"--- rank {r} stacks ---\n{self._log_tail(r, 60)}" for r in hung)
        errors = {r: v for r, (status, v) in results.items() if status == "error"}
        if errors or hung:
            parts = [
                f"--- rank {r} raised ---\n{tb}--- its log ---\n{self._log_tail(r, 60)}"
                for r, tb in sorted(errors.items())
            ]
            if hung:
                parts.append(f"--- ranks {hung} did not finish within {timeout:.0f}s ---\n{stacks}")
            self.kill()  # what the failure left behind in a rank does not reach the next test
            raise RankFailure("\n".join(parts))
        return [torch.load(io.BytesIO(results[r][1]), weights_only=False) for r in range(nprocs)]

    def kill(self) -> None:
        for p in self._procs:
            # each rank leads its process group: this also ends what it started (megatron's
            # Manager, torch's checkpoint process), even where the rank itself was killed
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        if self._parent is not None:  # a blocked pool's parent, once its ranks are gone
            self._parent.kill()
            self._parent.join(timeout=10)
            for p in self._procs:
                p.close()
        self._procs, self._conns, self._parent = [], [], None

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for p in self._procs:
            p.join(timeout=10)
        self.kill()
        shutil.rmtree(self._logdir, ignore_errors=True)


def run_scripts(script: str, *args: str, ranks: int = 2, timeout: float = 60) -> list[str]:
    """Run ``python -c script RANK *args`` as ``ranks`` fresh processes (for what a reused pool
    worker cannot do: a process group destroyed and made again, the interpreter's exit);
    asserts each exits 0 and returns the lines each printed that start with ``RESULT``."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(ranks)
    ]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * ranks, outs
    return [line for out in outs for line in out.splitlines() if line.startswith("RESULT")]
