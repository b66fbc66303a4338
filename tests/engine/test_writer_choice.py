"""``writer="auto"`` (the default of ``async_save`` and ``CheckpointManager``): which writer each
save gets, exactly, and that a sync save never starts a process."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import dcpbridge as db
from dcpbridge.engine import writer_process
from dcpbridge.engine.async_save import AsyncSaver
from dcpbridge.engine.collectives import Group
from dcpbridge.engine.staging import StagingArea
from dcpbridge.engine.writer_process import AUTO_MIN_BYTES, choose_writer, process_of
from dcpbridge.storage.write import shared
from tests.support.dist_pool import Rank, _children

pytestmark = pytest.mark.timeout(300)

BIG = AUTO_MIN_BYTES


@pytest.mark.parametrize(
    ("writer", "format", "url", "nbytes", "started", "chosen"),
    [
        ("auto", "dcpbridge", "/ck", BIG, False, "process"),
        ("auto", "dcpbridge", "/ck", BIG - 1, False, "thread"),  # gains less than a start
        ("auto", "dcpbridge", "/ck", 0, True, "process"),  # once started, kept
        ("auto", "dcpbridge", "s3://bucket/ck", BIG, False, "process"),
        ("auto", "torch_dist", "/ck", BIG, True, "thread"),  # the process writes dcpbridge
        ("auto", "dcpbridge", "memory://ck", BIG, True, "thread"),  # this process's memory
        ("auto", "dcpbridge", "simplecache::memory://ck", BIG, False, "thread"),
        ("thread", "dcpbridge", "/ck", BIG, True, "thread"),
        ("process", "dcpbridge", "/ck", 0, False, "process"),
        ("process", "torch_dist", "/ck", 0, False, None),
        ("bogus", "dcpbridge", "/ck", BIG, False, None),
    ],
)
def test_auto_takes_the_writer_process_where_it_can_write_and_gains(
    writer, format, url, nbytes, started, chosen
):
    if chosen is not None:
        assert choose_writer(writer, format, url, nbytes, started) == chosen
        return
    with pytest.raises(db.InvalidArgumentError) as refused:
        choose_writer(writer, format, url, nbytes, started)
    assert (
        str(refused.value)
        == {
            "process": "writer='process' writes format 'dcpbridge', not 'torch_dist'",
            "bogus": "writer must be 'auto', 'thread' or 'process', got 'bogus'",
        }[writer]
    )


def test_auto_keeps_storage_options_that_do_not_pickle_in_this_process(tmp_path):
    """A save whose storage options cannot reach the writer process gets the thread."""
    unpicklable = {"marker": threading.Lock()}  # a session or credential object, say
    t = torch.randn(BIG // 4, generator=torch.Generator().manual_seed(7))
    state = {"t": db.ShardedTensor.from_box("t", t, tuple(t.shape), (0,))}
    path = str(tmp_path / "ck")
    handle = db.async_save(state, path, storage_options=unpicklable)
    handle.result(120)  # was: WriterProcessError, could not hand the write to the process
    assert handle.writer == "thread"
    tmpl = {"t": db.ShardedTensor.from_box("t", torch.zeros_like(t), tuple(t.shape), (0,))}
    assert torch.equal(db.load(tmpl, path)["t"], t)
    assert choose_writer("auto", "dcpbridge", "/ck", BIG, True, unpicklable) == "thread"
    assert choose_writer("auto", "dcpbridge", "/ck", BIG, True, {"anon": True}) == "process"


def test_without_memfd_auto_is_the_thread_and_process_is_refused(monkeypatch):
    monkeypatch.setattr(shared, "available", lambda: False)
    assert choose_writer("auto", "dcpbridge", "/ck", BIG, True) == "thread"
    with pytest.raises(db.InvalidArgumentError) as refused:
        choose_writer("process", "dcpbridge", "/ck", BIG, False)
    assert str(refused.value) == "writer='process' needs Linux (os.memfd_create)"


def test_a_sync_save_starts_no_process(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_process, "AUTO_MIN_BYTES", 0)  # (async saves would start one)
    before = set(_children(os.getpid()))
    state = {"w": db.ShardedTensor.from_box("w", torch.arange(4096.0), (4096,), (0,))}
    db.save(state, str(tmp_path))
    assert set(_children(os.getpid())) == before
    out = db.load(
        {"w": db.ShardedTensor.from_box("w", torch.zeros(4096), (4096,), (0,))}, str(tmp_path)
    )
    assert torch.equal(out["w"], torch.arange(4096.0))


def _sharded(r: Rank, n: int, scale: float) -> dict:
    w = torch.arange(n, dtype=torch.float32) + 1000 * r.rank + scale
    return {"w": db.ShardedTensor.from_rank_offsets("w", w, (0, r.rank, 2))}


def _loaded(group, r: Rank, path: str, n: int, scale: float, **options) -> bool:
    tmpl = {"w": db.ShardedTensor.from_rank_offsets("w", torch.zeros(n), (0, r.rank, 2))}
    out = db.load(tmpl, path, process_group=group, **options)
    return torch.equal(out["w"], _sharded(r, n, scale)["w"].data)


def _own(r: Rank, n: int) -> dict:
    """A tensor of ``n`` elements that rank ``r`` alone holds (ranks may stage unequal bytes)."""
    key = f"own{r.rank}"
    return {key: db.ShardedTensor.from_box(key, torch.arange(n, dtype=torch.float32), (n,), (0,))}


def _mixed(group, r: Rank, path: str) -> tuple[str, bool, bool]:
    """One save whose rank 0 stages 16 KiB and rank 1 2 KiB: the ranks' writers differ."""
    n = 4096 if r.rank == 0 else 512
    handle = db.async_save(_own(r, n), path, process_group=group)
    handle.result(120)
    key = f"own{r.rank}"
    tmpl = {key: db.ShardedTensor.from_box(key, torch.zeros(n), (n,), (0,))}
    out = db.load(tmpl, path, process_group=group)
    return handle.writer, True, torch.equal(out[key], torch.arange(n, dtype=torch.float32))


@contextlib.contextmanager
def _saver_of(group, threshold: int) -> Iterator[StagingArea]:
    """The async saver's staging area of ``group`` (ranks 0 and 1, new: no writer process
    yet) with ``AUTO_MIN_BYTES`` at ``threshold`` meanwhile; after, its writer process is
    closed and the group destroyed."""
    saved, writer_process.AUTO_MIN_BYTES = writer_process.AUTO_MIN_BYTES, threshold
    area = AsyncSaver.for_group(Group.resolve(group), 1).area
    try:
        yield area
    finally:
        writer_process.AUTO_MIN_BYTES = saved
        process = process_of(area)
        if process is not None:
            process.close()
        dist.destroy_process_group(group)
        gc.collect()


def writers_on_a_new_group(r: Rank, root: str) -> list[tuple[str, bool, bool]]:
    """Saves of a fresh group's ranks 0 and 1 (a fresh saver: no writer process yet), with
    the threshold at 4 KiB: (writer, writer process alive, loaded bit-exact) per save; the
    first one stages unequal bytes, so only rank 0 starts its writer process there."""
    group = dist.new_group([0, 1])
    if r.rank >= 2:
        return []
    got = []
    with _saver_of(group, 4096) as area:
        got.append(_mixed(group, r, os.path.join(root, "mixed")))
        got[-1] = (got[-1][0], process_of(area) is not None, got[-1][2])
        calls = [
            ("small", 512, {}),  # 2 KiB: the thread
            ("torch_dist", 4096, {"format": "torch_dist"}),  # 16 KiB, not dcpbridge's format
            ("big", 4096, {}),  # 16 KiB: the writer process starts
            ("small_after", 512, {}),  # the process is kept
            ("thread", 4096, {"writer": "thread"}),
        ]
        for n, (name, numel, options) in enumerate(calls):
            path = os.path.join(root, name)
            handle = db.async_save(_sharded(r, numel, n), path, process_group=group, **options)
            handle.result(120)
            process = process_of(area)
            alive = process is not None and process.pid in _children(os.getpid())
            load_options = {"allow_pickle": True} if "format" in options else {}
            got.append((handle.writer, alive, _loaded(group, r, path, numel, n, **load_options)))
        mgr = db.CheckpointManager(os.path.join(root, "mgr"), every=1, process_group=group)
        mgr.save(1, _sharded(r, 512, 7))
        got.append((mgr._pending[1].writer, process_of(area) is not None, True))  # type: ignore[index]
        mgr.close()
        got[-1] = (*got[-1][:2], _loaded(group, r, mgr.step_url(1), 512, 7))
    return got


def test_auto_writers_of_successive_saves_are_exact(pool, tmp_path):
    results = pool.run(writers_on_a_new_group, 4, str(tmp_path), default_group=True, timeout=240)
    # rank 0 stages 16 KiB in the first ("mixed") save and keeps its process from there on;
    # rank 1 stages 2 KiB there and starts its process with "big"
    rank0 = [
        ("process", True, True),  # mixed
        ("process", True, True),  # small: the process is kept
        ("thread", True, True),  # torch_dist: the process writes dcpbridge only
        ("process", True, True),  # big
        ("process", True, True),  # small_after
        ("thread", True, True),  # named: this save is written here, the process stays
        ("process", True, True),  # the manager's default is auto too
    ]
    rank1 = [
        ("thread", False, True),  # mixed
        ("thread", False, True),  # small
        ("thread", False, True),  # torch_dist
        ("process", True, True),  # big: the writer process starts
        ("process", True, True),  # small_after: kept
        ("thread", True, True),
        ("process", True, True),
    ]
    assert results == [rank0, rank1, [], []]


@contextlib.contextmanager
def _warnings(log: logging.Logger) -> Iterator[list[str]]:
    got: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: got.append(record.getMessage())  # type: ignore[method-assign]
    log.addHandler(handler)
    try:
        yield got
    finally:
        log.removeHandler(handler)


def unstartable_writer_process(r: Rank, root: str) -> list:
    """Rank 0's writer process cannot start (its interpreter is missing): a named "process"
    fails the save on both ranks; "auto" writes rank 0's part on its thread instead."""
    group = dist.new_group([0, 1])
    if r.rank >= 2:
        return []
    got: list = []
    with _saver_of(group, 0), contextlib.ExitStack() as restore:
        if r.rank == 0:
            restore.callback(setattr, sys, "executable", sys.executable)
            sys.executable = os.path.join(root, "no-such-python")
        named = os.path.join(root, "named")
        handle = db.async_save(_sharded(r, 512, 1), named, process_group=group, writer="process")
        with pytest.raises(db.CheckpointError) as failed:
            handle.result(120)
        got.append((type(failed.value).__name__, str(failed.value)))
        got.append(os.path.exists(os.path.join(named, "dcpbridge.json")))
        auto = os.path.join(root, "auto")
        with _warnings(writer_process.log) as warned:
            handle = db.async_save(_sharded(r, 512, 2), auto, process_group=group)
            handle.result(120)
        got.append((handle.writer, _loaded(group, r, auto, 512, 2), warned))
    return got


def test_a_writer_process_that_cannot_start(pool, tmp_path):
    results = pool.run(
        unstartable_writer_process, 4, str(tmp_path), default_group=True, timeout=240
    )
    python = tmp_path / "no-such-python"
    cause = f"FileNotFoundError: [Errno 2] No such file or directory: '{python}'"
    error = (
        "WriterProcessError",
        f"rank 0: async_save to {tmp_path / 'named'}: the writer process could not start: {cause}",
    )
    warning = f"async_save to {tmp_path / 'auto'}: the writer process could not start: {cause}"
    assert results == [
        [error, False, ("thread", True, [f"{warning}; the thread writer writes this save"])],
        [error, False, ("process", True, [])],
        [],
        [],
    ]


def test_auto_writes_on_the_thread_when_the_writer_process_dies_before_its_job(
    tmp_path, monkeypatch
):
    """A writer process that starts but dies before it takes any job (its interpreter cannot
    import the writer) cannot start either: "auto" writes that save on the thread with a
    warning, as when it cannot be spawned; a named "process" fails it (was: every "auto"
    save failed with WriterProcessError, so the default lost every checkpoint)."""
    from dcpbridge.storage.write import process as writer_module
    from dcpbridge.storage.write.process import WriterProcess

    area = AsyncSaver.for_group(Group.resolve(None), 1).area
    monkeypatch.setattr(WriterProcess, "child_module", "tests.support.no_such_writer")
    monkeypatch.setattr(writer_process, "AUTO_MIN_BYTES", 0)  # "auto" takes the process
    running = process_of(area)
    if running is not None:
        running.close()  # the next save starts the child that cannot import its module
    t = torch.randn(64, 33, generator=torch.Generator().manual_seed(9))
    state = {"t": db.ShardedTensor.from_box("t", t, (64, 33), (0, 0))}
    try:
        with _warnings(writer_module.log) as warned:
            db.async_save(state, str(tmp_path / "auto")).result(60)
        named = db.async_save(state, str(tmp_path / "named"), writer="process")
        with pytest.raises(db.WriterProcessError, match="ended before it took the job"):
            named.result(60)
    finally:
        process = writer_process._processes.pop(area, None)
        if process is not None:
            process.close()  # the next save starts a plain child
    assert len(warned) == 1 and "ended before it took the job" in warned[0], warned
    later = "; the thread writer writes this save and every later 'auto' one of this process"
    assert warned[0].endswith(later), warned
    tmpl = {"t": db.ShardedTensor.from_box("t", torch.zeros(64, 33), (64, 33), (0, 0))}
    assert torch.equal(db.load(tmpl, str(tmp_path / "auto"))["t"], t)
    assert not os.path.exists(tmp_path / "named" / "dcpbridge.json")


def test_auto_stops_spawning_a_writer_process_that_died_before_its_job(tmp_path, monkeypatch):
    """Once a writer process died before its job and the thread wrote the save ("auto"),
    later "auto" saves of this process go to the thread at once, with no new warning (each
    spawned two children that die, seconds of CPU per save), and each handle's ``writer``
    says "thread", the one that wrote (the first said "process")."""
    from dcpbridge.storage.write import process as writer_module
    from dcpbridge.storage.write.process import WriterProcess

    area = AsyncSaver.for_group(Group.resolve(None), 1).area
    monkeypatch.setattr(WriterProcess, "child_module", "tests.support.no_such_writer")
    monkeypatch.setattr(writer_process, "AUTO_MIN_BYTES", 0)  # "auto" takes the process
    running = writer_process._processes.pop(area, None)
    if running is not None:
        running.close()  # the next save starts the child that cannot import its module
    spawned: list[int] = []
    popen = writer_module.subprocess.Popen

    def counted(*args: object, **kwargs: object) -> object:
        spawned.append(1)
        return popen(*args, **kwargs)

    monkeypatch.setattr(writer_module.subprocess, "Popen", counted)
    t = torch.randn(64, 33, generator=torch.Generator().manual_seed(9))
    state = {"t": db.ShardedTensor.from_box("t", t, (64, 33), (0, 0))}
    writers, spawns = [], []
    try:
        with _warnings(writer_module.log) as warned, _warnings(writer_process.log) as chose:
            for i in range(3):
                handle = db.async_save(state, str(tmp_path / f"auto{i}"))
                handle.result(60)
                writers.append(handle.writer)
                spawns.append(len(spawned))
    finally:
        writer_process._processes.pop(area, None)  # the next test starts a plain child
    assert writers == ["thread"] * 3
    assert spawns[1:] == [spawns[0]] * 2 and spawns[0] >= 1
    assert len(warned) == 1 and "ended before it took the job" in warned[0], warned
    assert chose == []
    tmpl = {"t": db.ShardedTensor.from_box("t", torch.zeros(64, 33), (64, 33), (0, 0))}
    for i in range(3):
        assert torch.equal(db.load(tmpl, str(tmp_path / f"auto{i}"))["t"], t)
