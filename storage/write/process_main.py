"""The writer process's loop (``dcpbridge.storage.write.process_main FD``): map the
shared segments it is sent, run each write job with ``FsspecCheckpointWriter``, reply.

It ends when its parent closes the socket (or exits), never in the middle of a job: it ignores
SIGINT and SIGTERM, which a terminal or a scheduler sends to the trainer's processes too. A
parent killed outright ends it at once, mid-job: nothing it writes would be committed; it exits
with status 1 and prints nothing (the socket broken under a message is no error of its own).
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem

from dcpbridge.storage.write.process import Inline, SharedRef, WriteJob, portable_failure
from dcpbridge.storage.write.shared import map_segment
from dcpbridge.storage.write.writer import FsspecCheckpointWriter


class _Resolved:
    """The planner side of ``write_data`` in the child: each item's data as the parent sent it."""

    def __init__(self, job: WriteJob, segments: dict[int, torch.Tensor]) -> None:
        self._data: dict[int, Any] = {}
        for item, ref in zip(job.plan.items, job.data):
            if isinstance(ref, SharedRef):
                data: Any = segments[ref.segment][ref.offset : ref.offset + ref.nbytes]
            elif isinstance(ref, Inline) and ref.stream:
                data = io.BytesIO(ref.data)
            else:
                data = torch.frombuffer(bytearray(ref.data), dtype=torch.uint8)
            self._data[id(item)] = data
        self._digest = job.digest

    def resolve_data(self, item: WriteItem) -> Any:
        return self._data[id(item)]

    def plan_digest(self, plan: Any) -> Any:
        return self._digest


def run(job: WriteJob, segments: dict[int, torch.Tensor]) -> tuple[list[Any], list[str]]:
    """Write ``job``'s files; (write results, names of the files written)."""
    writer = FsspecCheckpointWriter(
        job.url,
        storage_options=job.storage_options,
        thread_count=job.thread_count,
        sync_files=job.sync_files,
        checksums=job.checksums,
        checksum_block_size=job.checksum_block_size,
        reuse_from=job.reuse_from,
    )
    results = writer.write_data(job.plan, _Resolved(job, segments)).wait()  # type: ignore[arg-type]
    return results, sorted(writer._written)


def serve(conn: Connection) -> None:
    """Answer the parent until it hangs up."""
    segments: dict[int, torch.Tensor] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "map":
            _, segment, nbytes = message
            segments[segment] = map_segment(recv_handle(conn), nbytes)
            continue
        _, job, unmapped = message
        for segment in unmapped:
            segments.pop(segment, None)
        conn.send("started")
        try:
            reply: tuple[str, Any] = ("ok", run(job, segments))
        except BaseException as e:
            reply = ("error", portable_failure(e, traceback.format_exc()))
        conn.send(reply)


def _end_with(parent: int) -> None:
    """End this process once ``parent`` is gone (a SIGKILLed trainer never hangs up: the job
    in hand would go on writing files nobody commits, into a folder a restarted job may use)."""
    while os.getppid() == parent:
        time.sleep(0.25)
    os._exit(1)


def main(argv: list[str]) -> int:
    # a Ctrl-C, or a scheduler's SIGTERM to every process of the job (Slurm), is the trainer's
    # to handle (its save_on_signal); this process ends when the trainer hangs up or exits
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    torch.set_num_threads(1)
    # the trainer that started it (it may have died while this process imported torch: then
    # this process's parent is already another, which must not be watched instead)
    parent = int(argv[2]) if len(argv) > 2 else os.getppid()
    threading.Thread(target=_end_with, args=(parent,), daemon=True).start()
    with Connection(int(argv[1])) as conn:
        try:
            serve(conn)
        except (ConnectionError, EOFError):  # the trainer died mid-message: nothing to answer
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
