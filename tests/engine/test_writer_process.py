"""``async_save(..., writer="process")``: data written by a long-lived writer process from
shared memory, loaded bit-exact; the process reused, restarted after ``kill -9``, and a kill
in the middle of a save failing it on every rank with nothing left behind.

The pool's ranks keep their writer processes between these tests (one start per rank).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dcpbridge as db
from dcpbridge.engine.async_save import AsyncSaver
from dcpbridge.engine.collectives import Group
from dcpbridge.engine.writer_process import attach, process_of
from dcpbridge.storage.write.process import Failure, WriterProcess, raise_failure
from tests.support.dist_pool import Rank

pytestmark = pytest.mark.timeout(300)


def _state(r: Rank, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * seed + r.rank)
    return {
        "w": torch.randn(64, 1000, generator=g),
        "h": torch.randn(3, 333, generator=g).to(torch.bfloat16),
        "i": torch.randint(-(2**40), 2**40, (1000,), generator=g),
        "t": torch.randn(77, 5, generator=g).t(),  # not contiguous
    }


def _sharded(state: dict[str, torch.Tensor], r: Rank, step: int) -> dict:
    out: dict = {
        k: db.ShardedTensor.from_rank_offsets(k, v, (0, r.rank, r.size)) for k, v in state.items()
    }
    out["rng"] = db.ShardedObject("rng", {"rank": r.rank, "step": step}, (r.size,), (r.rank,))
    out["step"] = step  # common state, written by rank 0
    return out


def _check_load(r: Rank, path: str, state: dict[str, torch.Tensor], step: int) -> None:
    tmpl = _sharded({k: torch.zeros_like(v) for k, v in state.items()}, r, -1)
    tmpl["rng"] = db.ShardedObject("rng", None, (r.size,), (r.rank,))
    got = db.load(tmpl, path, process_group=r.group)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert got["rng"] == {"rank": r.rank, "step": step} and got["step"] == step


def _writer_process(r: Rank) -> WriterProcess:
    """This rank's async saver's writer process (attached, so started, if it was not)."""
    area = AsyncSaver.for_group(Group.resolve(r.group), 1).area
    writer, wrap = attach(area, "process", "a test's saver")
    assert writer == "process" and wrap is not None
    return wrap.keywords["process"]


def _save(r: Rank, path: str, state: dict, step: int, **kwargs) -> db.AsyncSaveHandle:
    return db.async_save(
        _sharded(state, r, step), path, process_group=r.group, writer="process", **kwargs
    )


def saves_through_one_process(r: Rank, root: str) -> list[int | None]:
    pids = []
    for step, background in ((1, False), (2, True)):
        state = _state(r, step)
        path = os.path.join(root, f"step{step}")
        _save(r, path, state, step, background_staging=background).result(120)
        pids.append(_writer_process(r).pid)
        _check_load(r, path, state, step)
    return pids


def test_saves_through_the_writer_process_load_bit_exact(pool, tmp_path):
    for first, second in pool.run(saves_through_one_process, 2, str(tmp_path), timeout=240):
        assert first is not None and first == second  # one process, reused


def saves_to_s3(r: Rank, url: str, options: dict) -> str:
    state = _state(r, 6)
    handle = _save(r, url, state, 6, storage_options=options)
    handle.result(120)
    tmpl = _sharded({k: torch.zeros_like(v) for k, v in state.items()}, r, -1)
    got = db.load(tmpl, url, process_group=r.group, storage_options=options)
    assert all(torch.equal(got[k], v) for k, v in state.items()) and got["step"] == 6
    return handle.writer


@pytest.mark.s3
def test_the_writer_process_writes_to_s3(pool, s3_server):
    url, options = f"s3://{s3_server.new_bucket()}/ck", s3_server.storage_options()
    assert pool.run(saves_to_s3, 2, url, options, timeout=240) == ["process", "process"]
    names = {k.rsplit("/", 1)[-1] for k in s3_server.keys(url[5:].split("/")[0])}
    assert "dcpbridge.json" in names and {n[:5] for n in names} >= {"__0_0", "__1_0"}, names


def restarts_after_kill(r: Rank, root: str) -> tuple[int | None, int | None]:
    process = _writer_process(r)
    killed = process.pid
    assert killed is not None
    os.kill(killed, signal.SIGKILL)  # between saves
    mgr = db.CheckpointManager(
        root, every=1, async_save=True, process_group=r.group, writer="process"
    )
    state = _state(r, 3)
    mgr.save(3, _sharded(state, r, 3))
    mgr.close()  # waits for the commit (and would raise its failure)
    assert mgr.all_steps() == [3]
    _check_load(r, mgr.step_url(3), state, 3)
    return killed, process.pid


def test_a_writer_process_killed_between_saves_is_restarted_by_the_next(pool, tmp_path):
    for killed, now in pool.run(restarts_after_kill, 2, str(tmp_path), timeout=240):
        assert now is not None and now != killed


def killed_mid_save(r: Rank, root: str) -> tuple[str, list[str]]:
    process = _writer_process(r)
    if r.rank == 1:  # a child that writes its files, then hangs instead of replying
        process.child_module = "tests.support.held_writer"
        process.close()
    try:
        handle = _save(r, root, _state(r, 4), 4)
        if r.rank == 1:
            deadline = time.monotonic() + 120
            while not any(n.startswith("__1_") for n in os.listdir(root)):
                assert time.monotonic() < deadline, "the held writer never wrote"
                time.sleep(0.05)
            os.kill(process.pid, signal.SIGKILL)  # type: ignore[arg-type]
        with pytest.raises(db.WriterProcessError) as failed:
            handle.result(120)
    finally:
        vars(process).pop("child_module", None)
    dist.barrier(group=r.group)  # every rank's cleanup is done
    leftovers = sorted(os.listdir(root))
    state = _state(r, 5)
    _save(r, root, state, 5).result(120)  # a fresh writer process takes the next save
    _check_load(r, root, state, 5)
    return str(failed.value), leftovers


def test_a_writer_process_killed_mid_save_fails_it_on_every_rank(pool, tmp_path):
    for message, leftovers in pool.run(killed_mid_save, 2, str(tmp_path), timeout=240):
        assert "rank 1" in message and "the writer process" in message
        assert "while writing" in message and "exit code -9" in message
        assert leftovers == []  # no commit file, no data file


def test_a_child_failure_is_raised_with_its_cause():
    cause = OSError(28, "No space left on device")
    storage = db.StorageError("file:///x: write __0_0.bin failed")
    with pytest.raises(db.StorageError) as kept:
        raise_failure(Failure(storage, cause, "trace"), "file:///x")
    assert kept.value is storage and kept.value.__cause__ is cause
    with pytest.raises(db.WriterProcessError, match="MemoryError: out") as wrapped:
        raise_failure(Failure(MemoryError("out"), None, "trace"), "file:///x")
    assert isinstance(wrapped.value.__cause__, MemoryError)


def _save_through(
    child: str, path: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.Tensor, Any, WriterProcess]:
    """An async save of one random tensor to ``path`` whose data a fresh writer process
    running module ``child`` (a test's stand-in) writes: (the tensor, its handle, the process)."""
    area = AsyncSaver.for_group(Group.resolve(None), 1).area
    monkeypatch.setattr(WriterProcess, "child_module", child)
    running = process_of(area)
    if running is not None:
        running.close()  # the next save starts ``child``
    t = torch.randn(64, 33, generator=torch.Generator().manual_seed(seed))
    state = {"t": db.ShardedTensor.from_box("t", t, (64, 33), (0, 0))}
    handle = db.async_save(state, path, writer="process")
    process = process_of(area)
    assert process is not None
    return t, handle, process


def test_a_storage_fault_in_the_writer_process_is_its_storage_error(tmp_path, monkeypatch):
    """A write that fails in the writer process with a storage fault (a full disk) fails the
    save with that ``StorageError`` (cause kept), not as a death of the process, which stays
    up for the next save (was: a "writer process ended" error, and the process restarted)."""
    _, handle, process = _save_through(
        "tests.support.full_disk_writer", str(tmp_path / "ck"), 7, monkeypatch
    )
    try:
        with pytest.raises(db.StorageError) as failed:
            handle.result(60)
        alive = process._proc is not None and process._proc.poll() is None
    finally:
        process.close()  # the next save starts a plain child
    assert alive  # it did not die: storage failed
    assert not isinstance(failed.value, db.WriterProcessError), failed.value
    assert "No space left on device" in str(failed.value) and "write __0_" in str(failed.value)
    assert isinstance(failed.value.__cause__, OSError) and failed.value.__cause__.errno == 28
    assert not (tmp_path / "ck").exists()  # no data file, no commit, not the folder it made


def test_a_sigterm_to_the_process_group_lets_the_writer_process_finish(tmp_path, monkeypatch):
    """A scheduler's SIGTERM reaches every process of the job (Slurm signals them all), the
    writer process too: it finishes the save it is writing, so the save in flight commits
    and the trainer's ``save_on_signal`` can write its final checkpoint (was: the writer
    process died of it, failing the save in flight, and with it the final save)."""
    gate = tmp_path / "gate"
    monkeypatch.setenv("DCPB_TEST_GATE", str(gate))
    t, handle, process = _save_through(
        "tests.support.gated_writer", str(tmp_path / "ck"), 8, monkeypatch
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "gate.taken").exists():  # the job is in the writer process
            assert time.monotonic() < deadline, "the gated writer never took the job"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGTERM)  # type: ignore[arg-type]
        time.sleep(0.2)  # a default handler would have ended it by now
        gate.touch()
        handle.result(60)  # was: WriterProcessError (exit code -15)
    finally:
        gate.touch()
        process.close()  # the next save starts a plain child
    tmpl = {"t": db.ShardedTensor.from_box("t", torch.zeros(64, 33), (64, 33), (0, 0))}
    assert torch.equal(db.load(tmpl, str(tmp_path / "ck"))["t"], t)


def test_writer_choice_is_checked(tmp_path):
    t = {"a": db.ShardedTensor.from_box("a", torch.ones(2), (2,), (0,))}
    with pytest.raises(db.InvalidArgumentError, match="writer must be"):
        db.async_save(t, str(tmp_path), writer="threads")
    with pytest.raises(db.InvalidArgumentError, match="format 'dcpbridge'"):
        db.async_save(t, str(tmp_path), writer="process", format="torch_dist")
    with pytest.raises(db.InvalidArgumentError, match="writer must be"):
        db.CheckpointManager(str(tmp_path), every=1, writer="proc")


def test_a_relative_path_is_written_where_the_save_commits_it(tmp_path, monkeypatch):
    """A relative checkpoint path names the same directory for the data files (the writer
    process's) and the commit (this process's), also after a change of directory."""
    started_in, saved_in = tmp_path / "started", tmp_path / "saved"
    started_in.mkdir()
    saved_in.mkdir()
    monkeypatch.chdir(started_in)
    area = AsyncSaver.for_group(Group.resolve(None), 1).area
    _, wrap = attach(area, "process", "a test's saver")
    assert wrap is not None
    wrap.keywords["process"].close()  # the next save starts it here, in ``started_in``
    t = torch.randn(64, 33, generator=torch.Generator().manual_seed(5))
    state = {"t": db.ShardedTensor.from_box("t", t, (64, 33), (0, 0))}
    db.async_save(state, "first", writer="process").result(120)
    monkeypatch.chdir(saved_in)  # the training script moves on; the writer process does not
    handle = db.async_save(state, "ck", writer="process")
    handle.result(120)
    assert handle.writer == "process"
    assert not (started_in / "ck").exists()  # its data files landed here, without a commit
    tmpl = {"t": db.ShardedTensor.from_box("t", torch.zeros(64, 33), (64, 33), (0, 0))}
    assert torch.equal(db.load(tmpl, str(saved_in / "ck"))["t"], t)  # was: data file missing


_TRAINER = """
import sys, time, torch
import dcpbridge as db
from dcpbridge.engine.async_save import AsyncSaver
from dcpbridge.engine.collectives import Group
from dcpbridge.engine.writer_process import process_of
from dcpbridge.storage.write.process import WriterProcess
WriterProcess.child_module = "tests.support.gated_writer"
t = torch.randn(64, 33)
db.async_save({"t": db.ShardedTensor.from_box("t", t, (64, 33), (0, 0))}, sys.argv[1],
              writer="process")
area = AsyncSaver.for_group(Group.resolve(None), 1).area
with open(sys.argv[2], "w") as f:
    f.write(str(process_of(area).pid))
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"  # exited, not yet reaped


@pytest.mark.timeout(120)
def test_a_writer_process_whose_trainer_was_killed_ends_without_writing(tmp_path):
    """The trainer SIGKILLed mid-save (an OOM kill, a node agent): its writer process went on
    writing files nobody would commit, into a step folder a restarted job may already use
    again; it now ends within a second of its parent."""
    gate, pidfile, ck = tmp_path / "gate", tmp_path / "child.pid", tmp_path / "ck"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "DCPB_TEST_GATE": str(gate), "PYTHONPATH": path}
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(ck), str(pidfile)], cwd=root, env=env
    )
    child = None
    try:
        deadline = time.monotonic() + 90
        while not ((tmp_path / "gate.taken").exists() and pidfile.exists()):
            assert time.monotonic() < deadline and trainer.poll() is None, "no job taken"
            time.sleep(0.05)
        child = int(pidfile.read_text())
        trainer.kill()
        trainer.wait(10)
        deadline = time.monotonic() + 5
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child), "the writer process outlived its trainer"
        gate.touch()
        time.sleep(0.5)
        assert not any(n.endswith(".bin") for n in os.listdir(ck)) if ck.exists() else True
    finally:
        gate.touch()
        trainer.kill()
        if child is not None and not _gone(child):
            os.kill(child, signal.SIGKILL)


_DYING_TRAINER = """
import os, signal, sys, torch
import dcpbridge as db
from dcpbridge.storage.write.process import WriterProcess
when, pidfile = sys.argv[2], sys.argv[3]
sent, started = WriterProcess._send, WriterProcess._receive_start

def send(self, job, segments):  # the job is in the socket; the child may still be importing
    sent(self, job, segments)
    with open(pidfile, "w") as f:
        f.write(str(self.pid))
    if when == "start":
        os.kill(os.getpid(), signal.SIGKILL)

def receive_start(self):  # the child took the job and writes it
    started(self)
    os.kill(os.getpid(), signal.SIGKILL)

WriterProcess._send, WriterProcess._receive_start = send, receive_start
t = torch.randn(256, 1024)
db.async_save({"t": db.ShardedTensor.from_box("t", t, (256, 1024), (0, 0))}, sys.argv[1],
              writer="process").result(120)
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("when", ["start", "mid"])
def test_a_writer_process_whose_trainer_dies_exits_quietly(tmp_path, when):
    """The trainer killed right after handing its writer process a save (while the child
    still imports, or once it writes): the child ends without a traceback on the job's
    stderr (was: a ``BrokenPipeError`` or ``ConnectionResetError`` traceback, answering
    a parent that was gone)."""
    pidfile, err = tmp_path / "child.pid", tmp_path / "stderr"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    with open(err, "wb") as stderr:  # the child inherits it: it outlives the trainer
        trainer = subprocess.run(
            [sys.executable, "-c", _DYING_TRAINER, str(tmp_path / "ck"), when, str(pidfile)],
            cwd=root,
            env={**os.environ, "PYTHONPATH": path},
            stderr=stderr,
            timeout=120,
        )
    assert trainer.returncode == -signal.SIGKILL, err.read_text()
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 20
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _gone(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the writer process outlived its trainer")
    assert "Traceback" not in err.read_text() and "Error" not in err.read_text(), err.read_text()
