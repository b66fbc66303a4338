"""Run a function on N local gloo processes and collect the results (benchmarks).

Production jobs use torchrun; this exists so the benchmarks need no launcher.
Results travel as ``torch.save`` bytes: tensors sent through queues as shared memory break once
the sending process exits.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    fn: Callable[..., Any], rank: int, nprocs: int, port: int, args: tuple, queue: Any
) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint  # must be imported before init_process_group

    status, payload = "ok", b""
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=nprocs,
            timeout=timedelta(seconds=300),
        )
        buf = io.BytesIO()
        torch.save(fn(rank, nprocs, *args), buf)
        payload = buf.getvalue()
        dist.destroy_process_group()
    except BaseException:
        status, payload = "error", traceback.format_exc().encode()
    queue.put((rank, status, payload))
    queue.close()
    queue.join_thread()
    atexit._run_exitfuncs()
    os._exit(0)


def run(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float = 600) -> list[Any]:
    """``fn(rank, nprocs, *args)`` on ``nprocs`` spawned gloo ranks; their results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, nprocs, port, args, queue), daemon=True)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(nprocs):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{payload.decode()}")
            else:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(nprocs)]
