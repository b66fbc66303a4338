"""Other processes reading a manager's root while its job saves there: a loader, `fsck`."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dcpbridge as db
from dcpbridge.engine import incremental
from dcpbridge.engine.incremental import fsck
from tests.support.dist_pool import Rank

STEPS = 30
N = 48


def _state(step: int) -> dict[str, Any]:
    """A shared base (reused by incremental saves) and a part that tells the step apart."""
    base = torch.arange(N * N, dtype=torch.float32).reshape(N, N)
    return {"base": base, "ad": torch.full((4, N), float(step)), "step": step}


def _template() -> dict[str, torch.Tensor]:
    return {"base": torch.zeros(N, N), "ad": torch.zeros(4, N)}


def _writer(root: str, async_save: bool, pause: float = 0.0) -> None:
    """The training job: STEPS incremental saves ``pause`` seconds apart, two kept (retention
    after every commit)."""
    mgr = db.CheckpointManager(
        root, every=1, keep_last=2, async_save=async_save, incremental=True, writer="thread"
    )
    for step in range(1, STEPS + 1):
        mgr.save(step, _state(step))
        time.sleep(pause)
    mgr.close()


def _start_writer(
    root: str, async_save: bool, pause: float = 0.0
) -> multiprocessing.process.BaseProcess:
    """The writer job, in a process of its own (a fork server without this one's threads)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    job = ctx.Process(target=_writer, args=(root, async_save, pause))
    job.start()
    return job


def _beside(root: str, async_save: bool, look: Callable[[], None]) -> int:
    """Run ``look`` in a loop while a writer process saves under ``root``; the rounds run."""
    job = _start_writer(root, async_save)
    rounds, deadline = 0, time.monotonic() + 60
    try:
        while job.is_alive() and time.monotonic() < deadline:
            look()
            rounds += 1
    finally:
        job.join(60)
        if job.is_alive():
            job.kill()
    assert job.exitcode == 0
    return rounds


@pytest.mark.timeout(90)
@pytest.mark.parametrize("async_save", [False, True])
def test_a_loader_beside_the_writer_gets_the_bytes_or_a_checkpoint_error(tmp_path, async_save):
    """Loading the oldest kept step (the one retention deletes next) while the job saves:
    exact bytes, or a CheckpointError for a step deleted meanwhile, never another error."""
    root = str(tmp_path / "run")
    outcomes: dict[str, int] = {}

    def look() -> None:
        reader = db.CheckpointManager(root, async_save=False)
        steps = reader.all_steps()
        if not steps:
            return
        step = steps[0]
        try:
            out = reader.load(_template(), step=step)
        except db.CheckpointError as e:
            failed: BaseException | None = e
        else:
            failed = None
        if failed is not None:
            assert f"step_{step:08d}" in str(failed)
            outcomes[type(failed).__name__] = outcomes.get(type(failed).__name__, 0) + 1
            return
        expected = _state(step)
        assert torch.equal(out["base"], expected["base"]), step
        assert torch.equal(out["ad"], expected["ad"]) and out["step"] == step
        outcomes["ok"] = outcomes.get("ok", 0) + 1

    _beside(root, async_save, look)
    assert outcomes.get("ok", 0) > 0
    assert db.CheckpointManager(root).all_steps() == [STEPS - 1, STEPS]  # the reader removed none


@pytest.mark.timeout(90)
def test_fsck_beside_the_writer_reports_no_missing_or_unreadable_files(tmp_path, monkeypatch):
    """A step that retention deletes while fsck looks is gone, not a complete step missing
    its files: fsck beside a live job reports no missing or unreadable checkpoint."""
    root = str(tmp_path / "run")
    files_in = incremental.files_in

    def slow_files_in(location: Any) -> list[str]:
        time.sleep(0.01)  # widen the window between reading the documents and listing
        return files_in(location)

    monkeypatch.setattr(incremental, "files_in", slow_files_in)
    reports = []

    def look() -> None:
        found = fsck(root)
        reports.append((found.missing, found.unreadable))

    rounds = _beside(root, False, look)
    assert rounds > 10
    assert [r for r in reports if r != ([], [])] == []
    found = fsck(root)
    assert found.checkpoints == [f"step_{s:08d}" for s in (STEPS - 1, STEPS)]
    assert (found.orphans, found.missing, found.unreadable) == ([], [], [])


def _ready(rank: Rank) -> int:
    """Nothing: starts the pool's ranks."""
    return rank.rank


def _load_oldest_in_a_loop(rank: Rank, root: str) -> list[str]:
    """An evaluation job of 2 ranks: load rank 0's oldest kept step until the writer's last
    step is there; the outcome of every round (the same on every rank, or the job diverged)."""
    mgr = db.CheckpointManager(root, async_save=False, process_group=rank.group)
    outcomes: list[str] = []
    deadline = time.monotonic() + 60
    while True:
        steps = mgr.all_steps() if rank.rank == 0 else []
        chosen = [steps[0] if steps else None, STEPS in steps or time.monotonic() > deadline]
        dist.broadcast_object_list(chosen, src=0, group=rank.group)
        step, last = chosen
        if last:
            return outcomes
        if step is None:
            continue
        try:
            out = mgr.load(_template(), step=step)
        except db.CheckpointError as e:
            outcomes.append(f"{step} {type(e).__name__}")
            continue
        expected = _state(step)
        same = torch.equal(out["base"], expected["base"]) and torch.equal(out["ad"], expected["ad"])
        outcomes.append(f"{step} {'ok' if same and out['step'] == step else 'WRONG BYTES'}")


@pytest.mark.timeout(120)
def test_a_two_rank_loader_beside_the_writer_fails_alike_on_every_rank(pool, tmp_path):
    """A step deleted by retention during a 2-rank load fails that load on both ranks (the
    ranks stay in step), and a load that returns has the exact bytes."""
    root = str(tmp_path / "run")
    pool.run(_ready, 2)  # the ranks up before the writer starts
    job = _start_writer(root, False, pause=0.15)
    try:
        ranks = pool.run(_load_oldest_in_a_loop, 2, root, timeout=90)
    finally:
        job.join(60)
    assert job.exitcode == 0
    assert ranks[0] == ranks[1]
    assert not [o for o in ranks[0] if o.endswith("WRONG BYTES")]
    assert any(o.endswith(" ok") for o in ranks[0]), ranks[0]


def test_fsck_fix_keeps_the_files_of_a_save_that_commits_while_it_looks(tmp_path, monkeypatch):
    """fsck --fix reads the commit files, then lists and removes orphans: the data files of a
    save that commits in between were removed after its commit, leaving a "complete" step
    that fails to load. The commit lands here exactly there (as fsck lists that folder)."""
    root = tmp_path / "run"
    db.save(_state(1), str(root / "step_00000001"))
    inflight = root / "step_00000002"
    db.save(_state(2), str(inflight))
    commit = (inflight / "dcpbridge.json").read_bytes()
    (inflight / "dcpbridge.json").unlink()  # its data files written, its commit not yet
    files_in = incremental.files_in

    def committing_files_in(location: Any) -> list[str]:
        if location.url.rstrip("/").endswith("step_00000002"):
            (inflight / "dcpbridge.json").write_bytes(commit)  # the save commits now
        return files_in(location)

    monkeypatch.setattr(incremental, "files_in", committing_files_in)
    report = fsck(str(root), fix=True)
    assert report.orphans == [] and report.missing == [], report
    for step in (1, 2):
        out = db.load(_template(), str(root / f"step_{step:08d}"))
        assert all(torch.equal(out[k], v) for k, v in _state(step).items() if k != "step")
