"""Faults during a save: a rank killed with SIGKILL in each phase, and two jobs saving to one
path at once, on local disk and on the S3 server.

A killed save runs in two freshly spawned gloo ranks (their process group has a short timeout,
so a survivor never waits long). The rank to be killed pauses at the chosen point through a
wrapper this test installs in that process only, tells the test through a file, and is then
killed with SIGKILL. The survivor must raise a ``CheckpointError``; the previous checkpoint at
the path must still load bit-exact (or, once the commit landed, the new one), and the next save
to the path must succeed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex

import dcpbridge as db
from dcpbridge.storage import resolve
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.write.stream import StreamWriter, new_save_id
from tests.support import preloaded
from tests.support.backends import Backend, local_backend, s3_backend
from tests.support.dist_pool import Rank
from tests.support.limits import file_size_limit
from tests.support.s3_server import free_port

ROWS = 3 << 19  # 6 MiB of float32 per rank and tensor: the S3 uploads are multipart
PART = 5 << 20
PG_TIMEOUT = timedelta(seconds=10)
STAGING_SURVIVOR_TIMEOUT = timedelta(seconds=2)
META = "dcpbridge.json"


def _state(rank: int, value: float) -> dict[str, Any]:
    """Two tensors split over 2 ranks and some common state, all derived from ``value``."""
    sd: dict[str, Any] = {"step": int(value), "cfg": {"value": value}}
    for n, key in enumerate(("a", "b")):
        local = torch.arange(ROWS, dtype=torch.float32) + value * 1000 + n + rank * ROWS
        sd[key] = db.ShardedTensor.from_box(key, local, (2 * ROWS,), (rank * ROWS,))
    return sd


def _check_loads(path: str, options: dict[str, Any] | None, value: float) -> None:
    """``path`` loads, in this one process, exactly the state saved with ``value``."""
    template = {
        key: db.ShardedTensor.from_box(key, torch.zeros(2 * ROWS), (2 * ROWS,), (0,))
        for key in ("a", "b")
    }
    out = db.load(template, path, storage_options=options)
    assert out["step"] == int(value) and out["cfg"] == {"value": value}
    for n, key in enumerate(("a", "b")):
        want = torch.arange(2 * ROWS, dtype=torch.float32) + value * 1000 + n
        assert torch.equal(out[key], want), f"{key} differs from the state saved with {value}"


# -- pauses, installed in the process that will be killed -------------------------------------


def _pause(signal_file: str) -> None:
    """Tell the test this process reached its phase, then wait to be killed."""
    Path(signal_file).write_text(str(os.getpid()))
    time.sleep(600)


def _install_pause(phase: str, signal_file: str) -> None:
    """Wrap the step of a save where ``phase`` begins so that it pauses there."""
    from dcpbridge.engine import save as api
    from dcpbridge.storage.backends import s3
    from dcpbridge.storage.backends import store as backends
    from dcpbridge.storage.write import commit, writer

    if phase == "staging":  # async_save copies the shards to host buffers
        api.stage = lambda *a, **k: _pause(signal_file)
    elif phase == "write":  # one item of this rank's data file is written, one is not
        original_write = writer.CoalescingFile.write

        def write(self: Any, data: memoryview) -> None:
            original_write(self, data)
            if len(data) >= 1 << 20:
                self.flush()
                _pause(signal_file)

        writer.CoalescingFile.write = write  # type: ignore[method-assign]
    elif phase == "before_commit":  # every rank's data is durable; no commit attempted
        writer.FsspecCheckpointWriter.finish = lambda *a, **k: _pause(signal_file)
    elif phase == "commit":  # the commit is prepared (temp file written) but not published
        real_os = backends.os

        class PausingOs:
            def __getattr__(self, name: str) -> Any:
                return getattr(real_os, name)

            def replace(self, src: str, dst: str) -> None:
                if dst.endswith(META):
                    _pause(signal_file)
                real_os.replace(src, dst)

            def link(self, src: str, dst: str) -> None:
                if dst.endswith(META):
                    _pause(signal_file)
                real_os.link(src, dst)

        backends.os = PausingOs()  # type: ignore[assignment]
        original_request = s3._request

        def request(fs: Any, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
            if method == "put_object" and path.endswith(META):
                _pause(signal_file)
            return original_request(fs, method, path, *args, **kwargs)

        s3._request = request
    elif phase == "cleanup":  # the commit landed; the replaced files are not removed yet
        commit.remove_replaced_files = lambda *a, **k: _pause(signal_file)
    else:
        raise AssertionError(phase)


# -- the two ranks of a killed save -----------------------------------------------------------


def _rank_main(
    rank: int,
    port: int,
    phase: str,
    victim: int,
    paths: tuple[str, str],
    options: Any,
    workdir: str,
) -> None:
    """One rank: save value 1 to ``paths[0]`` (completes), then value 2 to ``paths[1]``
    (paused and killed on ``victim``)."""
    log = os.open(os.path.join(workdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    import torch.distributed.checkpoint  # noqa: F401  (before init_process_group)

    outcome: dict[str, Any]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=PG_TIMEOUT,
        )
        previous, path = paths
        db.save(_state(rank, 1.0), previous, storage_options=options)
        dist.barrier()
        if rank == victim:
            _install_pause(phase, os.path.join(workdir, "paused"))
        elif phase == "staging":  # the victim pauses before this save's first exchange, so the
            # survivor's first wait on it can only end in the timeout (a store wait: it cannot
            # see a dead peer); a shorter one proves the same
            dist.distributed_c10d._get_default_store().set_timeout(STAGING_SURVIVOR_TIMEOUT)
        if phase == "staging":
            db.async_save(_state(rank, 2.0), path, storage_options=options).result()
        else:
            db.save(_state(rank, 2.0), path, storage_options=options)
        outcome = {"ok": True}
    except BaseException as e:
        outcome = {
            "ok": False,
            "checkpoint_error": isinstance(e, db.CheckpointError),
            "type": type(e).__name__,
            "message": str(e),
            "trace": traceback.format_exc(),
        }
    Path(workdir, f"outcome{rank}.json").write_text(json.dumps(outcome))
    os._exit(0)  # the group is broken: no orderly shutdown


def _killed_save(
    tmp_path: Path, phase: str, victim: int, paths: tuple[str, str], options: Any
) -> dict[str, Any]:
    """Run the two ranks, kill ``victim`` where it pauses; return the survivor's outcome."""
    ctx = preloaded.context()  # fresh processes without importing torch again
    workdir = str(tmp_path / "ranks")
    os.makedirs(workdir)
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, port, phase, victim, paths, options, workdir),
            daemon=True,
        )
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    survivor = 1 - victim
    try:
        deadline = time.monotonic() + 90
        signal_file = Path(workdir, "paused")
        while not signal_file.exists():
            assert time.monotonic() < deadline, f"rank {victim} never paused: {_logs(workdir)}"
            assert procs[victim].is_alive(), f"rank {victim} exited early: {_logs(workdir)}"
            time.sleep(0.05)
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].join(10)
        procs[survivor].join(60)
        assert not procs[survivor].is_alive(), f"rank {survivor} hung: {_logs(workdir)}"
        outcome_file = Path(workdir, f"outcome{survivor}.json")
        assert outcome_file.exists(), f"rank {survivor} died: {_logs(workdir)}"
        return json.loads(outcome_file.read_text())
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)


def _logs(workdir: str) -> str:
    out = []
    for rank in range(2):
        with contextlib.suppress(OSError):
            out.append(
                f"--- rank {rank} ---\n{Path(workdir, f'rank{rank}.log').read_text()[-3000:]}"
            )
    return "\n".join(out)


def save_value(r: Rank, path: str, options: Any, value: float) -> None:
    db.save(_state(r.rank, value), path, process_group=r.group, storage_options=options)


# -- the tests --------------------------------------------------------------------------------

# phase -> (rank killed, which save the path holds afterwards)
PHASES = {
    "staging": (1, 1.0),
    "write": (1, 1.0),
    "before_commit": (0, 1.0),
    "commit": (0, 1.0),
    "cleanup": (0, 2.0),
}


def _backend(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if kind == "local":
        return local_backend(tmp_path)
    return s3_backend(request.getfixturevalue("s3_server"), default_block_size=PART)


def _check_survivor(outcome: dict[str, Any], survivor: int) -> None:
    """The survivor raised a ``CollectiveError`` naming itself (it did not hang)."""
    assert not outcome["ok"], "the survivor's save succeeded without its peer"
    assert outcome["checkpoint_error"], outcome["trace"]
    assert outcome["type"] == "CollectiveError", outcome["message"]
    assert f"rank {survivor} of 2" in outcome["message"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_rank_killed_in_each_phase(kind, phase, request, tmp_path, pool):
    """The killed save goes to the path of the previous checkpoint, which must survive it."""
    backend = _backend(kind, request, tmp_path)
    victim, holds = PHASES[phase]
    path, options = backend.url("ck"), backend.storage_options
    outcome = _killed_save(tmp_path, phase, victim, (path, path), options)
    _check_survivor(outcome, 1 - victim)
    previous = set(json.loads(backend.read("ck", META))["files"]) if holds == 1.0 else None
    _check_loads(path, options, holds)  # one whole checkpoint, bit-exact; nothing incomplete
    left = set(backend.names("ck"))
    if previous is not None:
        extra = left - previous - {META}
        if phase == "staging":
            assert extra == set()
        elif phase == "write":  # the coordinator removed its files; the killed rank's remain
            assert all(n.startswith("__1_") for n in extra), extra
            if kind == "s3":  # nothing of a multipart upload is visible before it completes
                assert extra == set() and backend.s3.multipart_uploads(backend.bucket)
        else:  # the commit may land later (rank 1 cannot tell): rank 1 keeps its files
            assert {n[:4] for n in extra if n.endswith(".bin")} == {"__0_", "__1_"}, extra
    # The next save to the same path (new ranks) succeeds and loads bit-exact.
    pool.run(save_value, 2, path, options, 3.0, timeout=90)
    _check_loads(path, options, 3.0)
    committed = json.loads(backend.read("ck", META))
    names = set(backend.names("ck"))
    assert set(committed["files"]) <= names
    assert not any(".tmp" in n for n in names), names  # a killed commit's temp file is gone


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["before_commit", "commit"])
@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_rank_killed_before_the_first_commit_leaves_no_checkpoint(
    kind, phase, request, tmp_path, pool
):
    """A save to a new path killed when all its data is written is not a checkpoint."""
    backend = _backend(kind, request, tmp_path)
    victim, _ = PHASES[phase]
    old, path, options = backend.url("old"), backend.url("new"), backend.storage_options
    outcome = _killed_save(tmp_path, phase, victim, (old, path), options)
    _check_survivor(outcome, 1 - victim)
    assert any(n.endswith(".bin") for n in backend.names("new"))
    with pytest.raises(db.IncompleteCheckpointError, match=META):
        _check_loads(path, options, 2.0)
    _check_loads(old, options, 1.0)
    pool.run(save_value, 2, path, options, 3.0, timeout=90)
    _check_loads(path, options, 3.0)


# -- two jobs saving to one path at once ------------------------------------------------------


def _small_state(rank: int, job: int) -> dict[str, Any]:
    value = float(job + 1)
    x = torch.full((4096,), value) + torch.arange(4096.0)
    return {"x": db.ShardedTensor.from_box("x", x, (8192,), ((rank % 2) * 4096,)), "job": job}


def _loaded_job(path: str, options: Any, group: Any) -> int:
    """Which job's checkpoint ``path`` holds; raises if its tensor is not entirely that job's."""
    template = {"x": db.ShardedTensor.from_box("x", torch.zeros(8192), (8192,), (0,))}
    out = db.load(template, path, process_group=group, storage_options=options)
    job = out["job"]
    want = torch.full((8192,), float(job + 1)) + torch.arange(4096.0).repeat(2)
    assert torch.equal(out["x"], want), "the checkpoint mixes the jobs' data"
    return job


def save_concurrently(r: Rank, path: str, options: Any, rounds: int) -> list[str]:
    """Ranks 0-1 (job 0) and 2-3 (job 1) save different states to one path at once."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    solo = dist.new_group([0])
    job = r.rank // 2
    outcomes = []
    for _ in range(rounds):
        dist.barrier()
        try:
            db.save(
                _small_state(r.rank, job), path, process_group=groups[job], storage_options=options
            )
            outcomes.append("saved")
        except db.ConcurrentSaveError:  # the other job committed first
            outcomes.append("conflict")
        dist.barrier()
        if r.rank == 0:
            outcomes.append(f"loaded job {_loaded_job(path, options, solo)}")
        dist.barrier()
    return outcomes


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_concurrent_saves_to_one_path_never_mix(kind, request, tmp_path, pool):
    backend = _backend(kind, request, tmp_path)
    path, options = backend.url("ck"), backend.storage_options
    results = pool.run(save_concurrently, 4, path, options, 6, default_group=True, timeout=150)
    loads = [o for o in results[0] if o.startswith("loaded")]
    assert len(loads) == 6
    for outcomes in results:
        assert set(outcomes) <= {"saved", "conflict", "loaded job 0", "loaded job 1"}, outcomes
    saves = [[o for o in results[rank] if not o.startswith("loaded")] for rank in (0, 2)]
    for n, loaded in enumerate(loads):  # the job whose checkpoint is there did commit
        assert saves[int(loaded[-1])][n] == "saved", (n, results)
    # The losers removed their files and each commit those of the one it replaced.
    doc = json.loads(backend.read("ck", META))
    assert set(backend.names("ck")) == {*doc["files"], META}


def _wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.02)


def save_after_another_job_committed(r: Rank, path: str, options: Any, signal_dir: str) -> str:
    """Job 0 (ranks 0-1) reads the commit it will replace, then job 1 (ranks 2-3) saves and
    commits, then job 0 commits: its commit must be refused, on both of its ranks."""
    from dcpbridge.storage.backends import s3
    from dcpbridge.storage.backends import store as backends

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    job = r.rank // 2
    read, committed = Path(signal_dir, "job0-read"), Path(signal_dir, "job1-committed")
    patched = []
    if r.rank == 0:
        for cls in (backends.LocalStorage, s3.S3Storage):
            original = cls.read_committed

            def read_then_wait(self: Any, name: str, _original: Any = original) -> Any:
                current = _original(self, name)
                read.touch()
                _wait_for(committed, "job 1's commit")
                return current

            cls.read_committed = read_then_wait  # type: ignore[method-assign]
            patched.append((cls, original))
    if r.rank == 2:
        _wait_for(read, "job 0's read of the commit")
    try:
        db.save(_small_state(r.rank, job), path, process_group=groups[job], storage_options=options)
        outcome = "saved"
    except db.ConcurrentSaveError as e:
        outcome = f"conflict: {e}"
    finally:
        for cls, original in patched:
            cls.read_committed = original  # type: ignore[method-assign]
    if r.rank == 2:
        committed.touch()
    return outcome


@pytest.mark.timeout(120)
@pytest.mark.parametrize("first", [True, False], ids=["first-commit", "replacing"])
@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_commit_racing_another_is_refused(kind, first, request, tmp_path, pool):
    """Job 0 read the commit before job 1 replaced it: job 0 raises ``ConcurrentSaveError``
    on both ranks, removes its files, and job 1's checkpoint is what the path holds."""
    backend = _backend(kind, request, tmp_path)
    path, options = backend.url("ck"), backend.storage_options
    if not first:
        pool.run(save_value, 2, path, options, 1.0, timeout=90)
    out = pool.run(
        save_after_another_job_committed, 4, path, options, str(tmp_path), default_group=True
    )
    assert out[2] == out[3] == "saved"
    assert out[0] == out[1] and out[0].startswith("conflict: rank 0: "), out
    assert "another save committed" in out[0]
    assert _loaded_job(path, options, None) == 1
    doc = json.loads(backend.read("ck", META))
    assert set(backend.names("ck")) == {*doc["files"], META}


def test_conditional_commit_refuses_a_commit_it_did_not_read(backend):
    """The storage primitive: a commit conditional on what was read lands only if nothing
    else landed since, on every backend."""
    store = storage_for(resolve(backend.url("c"), backend.storage_options))
    store.makedirs()
    absent = store.read_committed("f")
    assert absent.data is None
    store.commit_file("f", b"one", "f.tmp-1", sync=True, replaces=absent)
    with pytest.raises(db.ConcurrentSaveError, match="another save committed"):
        store.commit_file("f", b"two", "f.tmp-2", sync=True, replaces=absent)
    one = store.read_committed("f")
    assert one.data == b"one"
    store.commit_file("f", b"three", "f.tmp-3", sync=True, replaces=one)
    with pytest.raises(db.ConcurrentSaveError, match="another save committed"):
        store.commit_file("f", b"four", "f.tmp-4", sync=True, replaces=one)
    assert store.read_committed("f").data == b"three"
    store.commit_file("f", b"five", "f.tmp-5", sync=True)  # unconditional: replaces
    assert store.read_committed("f").data == b"five"
    assert backend.names("c") == ["f"]


@pytest.mark.s3
def test_a_refused_s3_commit_that_is_already_there_counts_as_committed(s3_server):
    """botocore retries a PUT whose answer was lost; if the first attempt landed, the retry
    is refused (the ETag changed), yet the commit is ours: no error."""
    backend = s3_backend(s3_server)
    store = storage_for(resolve(backend.url("c"), backend.storage_options))
    absent = store.read_committed("f")
    store.commit_file("f", b"one", "", sync=True, replaces=absent)
    store.commit_file("f", b"one", "", sync=True, replaces=absent)  # as a retry would
    with pytest.raises(db.ConcurrentSaveError):
        store.commit_file("f", b"other", "", sync=True, replaces=absent)


# -- offline reshard and the streaming writer clean up after themselves ------------------------

SPLIT2 = {"world_size": 2, "rules": [{"match": "*", "split": {"axis": 0}}]}


def _reshard_source(path: str) -> dict[str, torch.Tensor]:
    """Six 64 KiB tensors and common state in one process's checkpoint; returns the tensors."""
    tensors = {
        f"t{i}": torch.randn(64, 256, generator=torch.Generator().manual_seed(i)) for i in range(6)
    }
    db.save({**{k: v.clone() for k, v in tensors.items()}, "step": 5}, path)
    return tensors


def _corrupt_chunk(path: str, key: str) -> None:
    doc = json.loads(Path(path, META).read_bytes())
    chunk = doc["tensors"][key]["chunks"][0]
    with open(os.path.join(path, chunk["file"]), "r+b") as f:
        f.seek(chunk["offset"] + 100)
        f.write(b"\xde\xad")


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_failed_offline_reshard_leaves_nothing_at_the_destination(kind, request, tmp_path):
    """The last tensor's stored chunk is damaged: the reshard fails after writing a file for
    each earlier item, and removes them all (and the directory it created)."""
    from dcpbridge.formats.layout import parse_layout
    from dcpbridge.formats.sources import open_source
    from dcpbridge.tools.reshard import reshard

    src = str(tmp_path / "src")
    tensors = _reshard_source(src)
    _corrupt_chunk(src, "t5")
    backend = _backend(kind, request, tmp_path)
    dst, options = backend.url("dst"), backend.storage_options
    written: list[int] = []
    source = open_source(src)
    try:
        with pytest.raises(db.ChecksumMismatchError, match="'t5'"):
            reshard(
                source,
                dst,
                parse_layout(SPLIT2),
                storage_options=options,
                max_file_bytes=1,  # one file per item: several files exist when t5 fails
                on_bytes=written.append,
            )
    finally:
        source.close()
    assert sum(written) >= 5 * 64 * 256 * 4  # t0..t4 were written before t5 failed
    if kind == "local":
        assert not os.path.exists(dst)
    else:
        assert backend.everything() == [] and not backend.s3.multipart_uploads(backend.bucket)
    # The destination takes a good reshard afterwards (of the source saved again, undamaged).
    _reshard_source(src)
    source = open_source(src)
    try:
        reshard(source, dst, parse_layout(SPLIT2), storage_options=options)
    finally:
        source.close()
    template = {k: torch.zeros(64, 256) for k in tensors}
    out = db.load(template, dst, storage_options=options)
    assert all(torch.equal(out[k], tensors[k]) for k in tensors) and out["step"] == 5


def reshard_with_full_disk_on_rank_1(r: Rank, src: str, dst: str) -> str:
    """Rank 1's writes fail with EFBIG past 64 KiB, after rank 0 wrote its share."""
    from dcpbridge.engine.collectives import Group
    from dcpbridge.formats.layout import parse_layout
    from dcpbridge.formats.sources import open_source
    from dcpbridge.tools.reshard import reshard

    source = open_source(src)
    try:
        with file_size_limit(64 << 10 if r.rank == 1 else None):
            reshard(source, dst, parse_layout(SPLIT2), group=Group.resolve(r.group))
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        source.close()
    return "resharded"


def test_a_reshard_failing_on_one_worker_leaves_the_destination_as_it_was(pool, tmp_path):
    """Worker 1's disk fills up: both workers raise, every file of the reshard is removed,
    and the checkpoint that was at the destination is untouched and still loads."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _reshard_source(src)
    db.save({"old": torch.arange(10.0), "step": 1}, dst)
    before = {p.name: p.read_bytes() for p in Path(dst).iterdir()}
    errors = pool.run(reshard_with_full_disk_on_rank_1, 2, src, dst)
    assert errors[0] == errors[1] and errors[0].startswith("StorageError: rank 1: "), errors
    assert "File too large" in errors[0]
    assert {p.name: p.read_bytes() for p in Path(dst).iterdir()} == before
    assert torch.equal(db.load({"old": torch.zeros(10)}, dst)["old"], torch.arange(10.0))
    fresh = str(tmp_path / "fresh")
    errors = pool.run(reshard_with_full_disk_on_rank_1, 2, src, fresh)
    assert errors[0].startswith("StorageError: rank 1: ") and not os.path.exists(fresh)


def _write_then_fail(location: Any) -> StreamWriter:
    """Three items in three files, then an item whose source breaks off."""

    def broken() -> Any:
        yield memoryview(b"y" * 10)
        raise RuntimeError("source broke")

    with StreamWriter(location, save_id=new_save_id(), max_file_bytes=1) as sw:
        for i in range(3):
            sw.write_item(MetadataIndex(f"k{i}"), [memoryview(b"x" * 100)], nbytes=100, rank=0)
        assert len(sw.files) == 3
        sw.write_item(MetadataIndex("k3"), broken(), nbytes=20, rank=0)
    return sw


def test_a_stream_writer_leaving_with_an_error_removes_its_files(backend):
    location = resolve(backend.url("s"), backend.storage_options)
    with pytest.raises(RuntimeError, match="source broke"):
        _write_then_fail(location)
    assert backend.data_names("s") == []


@pytest.mark.s3
def test_a_store_without_conditional_puts_still_commits(s3_server, s3_proxy, caplog):
    """A store answering a conditional PUT with 501 NotImplemented gets a plain PUT."""
    backend = s3_backend(s3_server)
    options = s3_server.storage_options(s3_proxy.endpoint_url)
    path = backend.url("ck")
    s3_proxy.inject("PUT", META, "notimplemented")
    db.save({"t": torch.arange(8.0), "step": 2}, path, storage_options=options)
    assert "does not support conditional PUTs" in caplog.text
    assert torch.equal(
        db.load({"t": torch.zeros(8)}, path, storage_options=options)["t"], torch.arange(8.0)
    )
