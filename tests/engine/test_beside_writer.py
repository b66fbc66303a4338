"""Other processes reading a manager's root while its job saves there: a loader, `fsck`."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import dcpbridge as db
from dcpbridge.engine import incremental
from dcpbridge.engine.incremental import fsck

STEPS = 30
N = 48


def _state(step: int) -> dict[str, Any]:
    """A shared base (reused by incremental saves) and a part that tells the step apart."""
    base = torch.arange(N * N, dtype=torch.float32).reshape(N, N)
    return {"base": base, "ad": torch.full((4, N), float(step)), "step": step}


def _template() -> dict[str, torch.Tensor]:
    return {"base": torch.zeros(N, N), "ad": torch.zeros(4, N)}


def _writer(root: str, async_save: bool) -> None:
    """The training job: STEPS incremental saves, two kept (retention after every commit)."""
    mgr = db.CheckpointManager(
        root, every=1, keep_last=2, async_save=async_save, incremental=True, writer="thread"
    )
    for step in range(1, STEPS + 1):
        mgr.save(step, _state(step))
    mgr.close()


def _beside(root: str, async_save: bool, look: Callable[[], None]) -> int:
    """Run ``look`` in a loop while a writer process saves under ``root``; the loops run."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    job = ctx.Process(target=_writer, args=(root, async_save))
    job.start()
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
