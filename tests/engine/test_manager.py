"""CheckpointManager on real gloo groups: interval, retention, resume in another world size,
async failures, a rank killed mid-save, preemption signals, local disk and S3."""

from __future__ import annotations

import logging
import os
import signal
import textwrap

import pytest
import torch

import dcpbridge as db
from dcpbridge.engine.retention import SIDECAR, Retention
from dcpbridge.storage import FsspecCheckpointWriter
from tests.support import layouts as L
from tests.support.backends import Backend, local_backend, s3_backend
from tests.support.dist_pool import Rank, RankFailure

SHAPE = (12, 8)


def weights(step: int) -> torch.Tensor:
    """The global weight after ``step`` training steps (elementwise, so any sharding agrees)."""
    w = L.full("w").clone()
    for s in range(1, step + 1):
        w.mul_(0.5).add_(s)
    return w


def rows(w: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return w.chunk(size)[rank].clone()


def state(w_local: torch.Tensor, rank: int, size: int, step: int) -> dict:
    return {
        "w": db.ShardedTensor.from_rank_offsets("w", w_local, (0, rank, size)),
        "rng": db.ShardedObject("rng", {"rank": rank, "step": step}, (size,), (rank,)),
        "step": step,
    }


def template(rank: int, size: int, rng: bool = False) -> dict:
    """What a rank loads; ``rng`` (a per-rank ShardedObject) only in the saving world size."""
    local = torch.zeros(SHAPE).chunk(size)[rank].clone()
    out: dict = {"w": db.ShardedTensor.from_rank_offsets("w", local, (0, rank, size))}
    if rng:
        out["rng"] = db.ShardedObject("rng", None, (size,), (rank,))
    return out


def train(r: Rank, root: str, opts: dict, start: int, stop: int, kwargs: dict) -> dict:
    """Steps ``start+1..stop`` from ``root``'s newest checkpoint (or from scratch)."""
    mgr = db.CheckpointManager(root, storage_options=opts, process_group=r.group, **kwargs)
    w = rows(weights(0), r.rank, r.size)
    if start:
        assert mgr.latest_step() == start
        out = mgr.load(template(r.rank, r.size))
        assert out["step"] == start
        w = out["w"]
    saved = []
    for step in range(start + 1, stop + 1):
        w.mul_(0.5).add_(step)
        if mgr.save(step, state(w, r.rank, r.size, step)):
            saved.append(step)
    mgr.close()
    assert torch.equal(w, rows(weights(stop), r.rank, r.size))
    return {"saved": saved, "steps": mgr.all_steps()}


def check(r: Rank, root: str, opts: dict, step: int | None) -> int:
    """Load ``step`` (default newest) bit-exact; returns the loaded step."""
    mgr = db.CheckpointManager(root, storage_options=opts, process_group=r.group, async_save=False)
    out = mgr.load(template(r.rank, r.size, rng=r.size == 2), step)
    got = out["step"]
    assert r.size != 2 or out["rng"] == {"rank": r.rank, "step": got}
    assert torch.equal(out["w"], rows(weights(got), r.rank, r.size))
    mgr.close()
    return got


def step_dirs(backend: Backend, run: str = "run") -> list[str]:
    """Step directories holding at least one file (object stores may list empty prefixes)."""
    marker = f"/{run}/"
    found = {p.split(marker, 1)[1].split("/", 1)[0] for p in backend.everything() if marker in p}
    return sorted(n for n in found if n.startswith("step_"))


def files_in(backend: Backend, step_dir: str, run: str = "run") -> list[str]:
    marker = f"/{run}/{step_dir}/"
    return sorted(p.split(marker, 1)[1] for p in backend.everything() if marker in p)


def _run_ten_steps(pool, backend: Backend) -> None:
    root = backend.url("run")
    results = pool.run(train, 2, root, backend.storage_options, 0, 10, {"every": 2, "keep_last": 2})
    assert results[0] == results[1] == {"saved": [2, 4, 6, 8, 10], "steps": [8, 10]}
    assert step_dirs(backend) == ["step_00000008", "step_00000010"]
    assert pool.run(check, 2, root, backend.storage_options, None) == [10, 10]
    assert pool.run(check, 2, root, backend.storage_options, 8) == [8, 8]


def test_ten_steps_every_two_keep_last_two_leaves_8_and_10(pool, tmp_path):
    _run_ten_steps(pool, local_backend(tmp_path))


@pytest.mark.s3
def test_ten_steps_on_s3(pool, s3_server):
    _run_ten_steps(pool, s3_backend(s3_server))


def test_resume_on_another_world_size_continues_bit_exact(pool, tmp_path):
    root = str(tmp_path / "run")
    kwargs = {"every": 3, "keep_last": 1}
    first = pool.run(train, 2, root, {}, 0, 6, kwargs)
    assert first[0] == {"saved": [3, 6], "steps": [6]}
    second = pool.run(train, 3, root, {}, 6, 10, kwargs)  # 2 ranks -> 3 ranks
    assert second[0] == {"saved": [9], "steps": [9]}
    assert pool.run(check, 4, root, {}, None, default_group=True) == [9] * 4  # -> 4 ranks


def test_retention_policy():
    steps = [2, 4, 6, 8, 10, 12]
    assert Retention().keep(steps, {}) == set(steps)
    assert Retention(keep_last=2).keep(steps, {}) == {10, 12}
    assert Retention(keep_last=1, keep_every=4).keep(steps, {}) == {4, 8, 12}
    loss = {2: 0.5, 4: 0.1, 6: float("nan"), 8: 0.3, 10: None, 12: 0.9}
    assert Retention(keep_best=2).keep(steps, loss) == {4, 8, 12}  # the newest always stays
    assert Retention(keep_best=1, best_mode="max").keep(steps, loss) == {12}
    assert Retention(keep_last=1, keep_best=1).keep(steps, {2: 0.0, 4: 0.0}) == {
        4,
        12,
    }  # tie: newer
    assert Retention(keep_last=3).keep([], {}) == set()


def keep_every_and_best(r: Rank, root: str) -> list[int]:
    mgr = db.CheckpointManager(
        root,
        every=1,
        keep_last=1,
        keep_every=4,
        keep_best=2,
        best_metric="loss",
        process_group=r.group,
    )
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 0.5, 6: 2.0, 7: 9.0, 8: 8.0, 9: 7.0}
    w = rows(weights(0), r.rank, r.size)
    for step, loss in losses.items():
        # ranks see different local losses: rank 0's value is the one recorded
        mgr.save(step, state(w, r.rank, r.size, step), metrics={"loss": loss + r.rank * 10})
    mgr.close()
    with pytest.raises(db.InvalidArgumentError, match="keep_best ranks checkpoints by 'loss'"):
        mgr.save(10, state(w, r.rank, r.size, 10))
    return mgr.all_steps()


def test_keep_every_and_keep_best_across_restarts(pool, tmp_path):
    root = str(tmp_path / "run")
    # newest (9), multiples of 4 (4, 8), best two by loss (5: 0.5, 2: 1.0)
    assert pool.run(keep_every_and_best, 2, root) == [[2, 4, 5, 8, 9]] * 2
    # a new manager reads the recorded metrics back from each step's sidecar
    mgr = db.CheckpointManager(root, keep_best=1, best_metric="loss", keep_last=1, async_save=False)
    w = weights(0)
    mgr.save(10, state(w, 0, 1, 10), metrics={"loss": 100.0})
    assert mgr.all_steps() == [5, 10]


def async_failure(r: Rank, root: str) -> tuple[str, list[int]]:
    mgr = db.CheckpointManager(root, every=2, process_group=r.group, async_save=True)
    w = rows(weights(0), r.rank, r.size)
    assert mgr.save(2, state(w, r.rank, r.size, 2))
    bad = state(w, r.rank, r.size, 4)
    if r.rank == 1:
        bad["oops"] = db.ShardedObject("oops", lambda: 0, (1,), (0,))
    assert mgr.save(4, bad)  # staged; the failure happens in the background
    assert not mgr.save(5, state(w, r.rank, r.size, 5))  # not a saving step: nothing waits
    with pytest.raises(db.SerializationError) as info:
        mgr.save(6, state(w, r.rank, r.size, 6))  # raises the failure of step 4, saves nothing
    steps = mgr.all_steps()
    assert mgr.save(6, state(w, r.rank, r.size, 6))
    mgr.close()
    return str(info.value), steps + mgr.all_steps()


def test_async_failure_raises_on_every_rank_at_the_next_call(pool, tmp_path):
    root = str(tmp_path / "run")
    (a, steps0), (b, steps1) = pool.run(async_failure, 2, root)
    assert a == b and "rank 1" in a and "oops" in a
    assert steps0 == steps1 == [2, 2, 6]
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000006"]  # step 4 removed


def _die_while_writing(rank: int, dies: int = 1) -> None:
    """Fault injection: this rank's writer writes its data, then the process is SIGKILLed."""
    original = FsspecCheckpointWriter.write_data

    def write_then_die(self, plan, planner):
        original(self, plan, planner).wait()
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == dies:
        FsspecCheckpointWriter.write_data = write_then_die


def killed_mid_save(r: Rank, root: str, opts: dict) -> None:
    mgr = db.CheckpointManager(
        root, every=2, storage_options=opts, process_group=r.group, async_save=False
    )
    w = rows(weights(0), r.rank, r.size)
    for step in range(1, 7):
        w.mul_(0.5).add_(step)
        if step == 6:
            _die_while_writing(r.rank)
        mgr.save(step, state(w, r.rank, r.size, step))


def resave(r: Rank, root: str, opts: dict) -> list[int]:
    mgr = db.CheckpointManager(
        root, every=2, storage_options=opts, process_group=r.group, async_save=False
    )
    out = mgr.load(template(r.rank, r.size))
    w = out["w"]
    for step in (5, 6):
        w.mul_(0.5).add_(step)
        mgr.save(step, state(w, r.rank, r.size, step))
    return mgr.all_steps()


def _kill_mid_save(pool, backend: Backend) -> None:
    root, opts = backend.url("run"), backend.storage_options
    try:
        with pytest.raises(RankFailure, match="worker died"):
            pool.run(killed_mid_save, 2, root, opts, timeout=60)
    finally:
        pool.kill()  # the survivors' process group is broken: start afresh
    assert step_dirs(backend) == ["step_00000002", "step_00000004", "step_00000006"]
    assert any(n.endswith(".bin") for n in files_in(backend, "step_00000006"))  # data, no commit
    mgr = db.CheckpointManager(root, storage_options=opts, async_save=False)
    assert mgr.all_steps() == [2, 4] and mgr.latest_step() == 4  # ...but not complete
    assert pool.run(check, 2, root, opts, None) == [4, 4]
    out = mgr.load(template(0, 1))  # one process reads it too
    assert torch.equal(out["w"], weights(4))
    # the next save replaces the dead save's directory and only complete steps remain
    assert pool.run(resave, 2, root, opts) == [[2, 4, 6]] * 2
    names = files_in(backend, "step_00000006")
    assert "dcpbridge.json" in names and SIDECAR in names
    save_ids = {n.split(".")[1] for n in names if n.endswith(".bin")}
    assert len(save_ids) == 1  # the dead save's files are gone
    assert pool.run(check, 2, root, opts, None) == [6, 6]


def test_a_rank_killed_mid_save_leaves_the_previous_step(pool, tmp_path):
    _kill_mid_save(pool, local_backend(tmp_path))


@pytest.mark.s3
def test_a_rank_killed_mid_save_on_s3(pool, s3_server):
    _kill_mid_save(pool, s3_backend(s3_server))


def best_steps(r: Rank, root: str, resave: bool) -> None:
    """Steps 1 (loss 1) and 2 (loss 5); with ``resave``, step 1 again (loss 100), rank 0
    SIGKILLed once its data is written (the commit never happens)."""
    mgr = db.CheckpointManager(
        root, every=1, keep_best=1, best_metric="loss", process_group=r.group, async_save=False
    )
    if resave:
        _die_while_writing(r.rank, dies=0)
        w = rows(weights(7), r.rank, r.size)
        mgr.save(1, state(w, r.rank, r.size, 7), metrics={"loss": 100.0})
    for step, loss in ((1, 1.0), (2, 5.0)):
        mgr.save(
            step,
            state(rows(weights(step), r.rank, r.size), r.rank, r.size, step),
            metrics={"loss": loss},
        )
    mgr.close()


def test_a_re_save_killed_mid_write_leaves_the_committed_steps_metric(pool, tmp_path):
    """A re-save of a committed step wrote its metrics into the step's manager.json before it
    committed: when rank 0 was killed mid-save, the old checkpoint stayed with the dead save's
    metric, and retention then deleted the best checkpoint (loss 1.0) as the worst."""
    root = str(tmp_path / "run")
    pool.run(best_steps, 2, root, False)
    try:
        with pytest.raises(RankFailure, match="worker died"):
            pool.run(best_steps, 2, root, True, timeout=60)
    finally:
        pool.kill()  # the survivors' process group is broken: start afresh
    mgr = db.CheckpointManager(root, every=1, keep_best=1, best_metric="loss", async_save=False)
    assert mgr.all_steps() == [1, 2]
    mgr.save(3, state(weights(3), 0, 1, 3), metrics={"loss": 3.0})
    assert mgr.all_steps() == [1, 3]  # the best (loss 1.0) and the newest
    out = mgr.load(template(0, 1), step=1)
    assert out["step"] == 1 and torch.equal(out["w"], weights(1))
    mgr.close()
    plain = db.CheckpointManager(root, every=1, async_save=False)  # a re-save that commits
    plain.save(1, state(weights(7), 0, 1, 7), metrics={"loss": 50.0})
    mgr = db.CheckpointManager(root, every=1, keep_best=1, best_metric="loss", async_save=False)
    mgr.save(4, state(weights(4), 0, 1, 4), metrics={"loss": 9.0})
    assert mgr.all_steps() == [3, 4]  # step 1 now holds the loss-50 save: no longer the best


def preempted(r: Rank, root: str, signal_at: int, via_should_stop: bool) -> tuple[int, int]:
    previous = signal.getsignal(signal.SIGUSR2)
    mgr = db.CheckpointManager(root, every=4, process_group=r.group)
    w = rows(weights(0), r.rank, r.size)
    step = 0

    def final() -> tuple[int, dict]:
        return step, state(w, r.rank, r.size, step)

    mgr.save_on_signal(signal.SIGUSR2, final)
    for step in range(1, 20):
        w.mul_(0.5).add_(step)
        if r.rank == 1 and step == signal_at and not via_should_stop:
            os.kill(os.getpid(), signal.SIGUSR2)  # the scheduler signals one rank only
        mgr.save(step, state(w, r.rank, r.size, step))
        if r.rank == 1 and step == signal_at and via_should_stop:
            os.kill(os.getpid(), signal.SIGUSR2)
        if mgr.should_stop():
            break
    mgr.close()
    assert signal.getsignal(signal.SIGUSR2) == previous  # close restored the handler
    return step, mgr.latest_step()


@pytest.mark.parametrize("via_should_stop", [False, True])
def test_a_signal_on_one_rank_saves_on_all_and_stops(pool, tmp_path, via_should_stop):
    root = str(tmp_path / "run")
    assert pool.run(preempted, 2, root, 6, via_should_stop) == [(6, 6)] * 2
    assert pool.run(check, 2, root, {}, None) == [6, 6]
    assert pool.run(check, 2, root, {}, 4) == [4, 4]


def test_save_on_signal_refuses_what_it_cannot_install_with_invalid_argument(tmp_path):
    """Rule 2: a signal number out of range, or a call from another thread than the main
    one, raised the ``ValueError`` of ``signal.signal``."""
    import threading

    mgr = db.CheckpointManager(str(tmp_path), every=1, async_save=False)
    with pytest.raises(db.InvalidArgumentError, match="save_on_signal") as e:
        mgr.save_on_signal(99999)
    assert isinstance(e.value.__cause__, ValueError)
    failures: list[BaseException] = []

    def install() -> None:
        try:
            mgr.save_on_signal(signal.SIGUSR2)
        except BaseException as e:
            failures.append(e)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert [type(f) for f in failures] == [db.InvalidArgumentError]
    assert "main thread" in str(failures[0])
    previous = signal.getsignal(signal.SIGUSR2)
    mgr.save_on_signal(signal.SIGUSR2)  # from the main thread: installed, then restored
    mgr.close()
    assert signal.getsignal(signal.SIGUSR2) == previous


@pytest.mark.timeout(60)
def test_close_from_another_thread_with_save_on_signal_raises_invalid_argument(tmp_path):
    """Rule 2: ``close()`` from a thread other than the main one, with ``save_on_signal``'s
    handler installed, raised the ``ValueError`` of ``signal.signal`` after waiting for the
    save, and left the handler in place half-closed. It now raises ``InvalidArgumentError``
    before doing anything; the main thread's ``close`` then finishes the save and restores
    the handler."""
    import threading

    previous = signal.getsignal(signal.SIGUSR2)
    mgr = db.CheckpointManager(str(tmp_path), every=1, async_save=True)
    mgr.save_on_signal(signal.SIGUSR2)
    mgr.save(1, {"w": torch.ones(2)})
    failures: list[BaseException] = []

    def close() -> None:
        try:
            mgr.close()
        except BaseException as e:
            failures.append(e)

    thread = threading.Thread(target=close)
    thread.start()
    thread.join(30)
    assert [type(f) for f in failures] == [db.InvalidArgumentError]
    assert "main thread" in str(failures[0]) and "save_on_signal" in str(failures[0])
    assert signal.getsignal(signal.SIGUSR2) != previous  # still the manager's: not closed
    mgr.close()
    assert signal.getsignal(signal.SIGUSR2) == previous
    assert mgr.all_steps() == [1]
    assert torch.equal(mgr.load({"w": torch.zeros(2)}, step=1)["w"], torch.ones(2))


def test_uncommitted_directories_are_ignored_then_removed(tmp_path):
    """A killed save's folder is no step; it is removed once a newer step commits (before,
    it may be another job's save in flight), or cleared by a save of its own step."""
    root = tmp_path / "run"
    mgr = db.CheckpointManager(str(root), every=1, async_save=False)
    assert mgr.latest_step() is None and mgr.all_steps() == []
    with pytest.raises(db.NotACheckpointError, match="no complete checkpoint"):
        mgr.load({})
    mgr.save(3, {"w": torch.ones(2)})
    (root / "step_00000007").mkdir()
    (root / "step_00000007" / "__0_0.ab12.bin").write_bytes(b"x" * 10)  # a dead save's data
    (root / "notes").mkdir()  # not a step: left alone
    assert mgr.all_steps() == [3]
    mgr.save(4, {"w": torch.ones(2)})
    assert sorted(os.listdir(root)) == ["notes", "step_00000003", "step_00000004", "step_00000007"]
    with pytest.raises(db.NotACheckpointError, match="step 7"):
        mgr.load({}, step=7)
    mgr.save(8, {"w": torch.ones(2)})
    assert sorted(os.listdir(root)) == ["notes", "step_00000003", "step_00000004", "step_00000008"]
    (root / "step_00000009").mkdir()
    (root / "step_00000009" / "__0_0.ab12.bin").write_bytes(b"x" * 10)
    mgr.save(9, {"w": torch.full((2,), 9.0)})
    assert "__0_0.ab12.bin" not in os.listdir(root / "step_00000009")  # cleared first
    assert torch.equal(mgr.load({"w": torch.zeros(2)})["w"], torch.full((2,), 9.0))


def test_a_damaged_older_step_does_not_stop_the_save_over_a_killed_ones_leftovers(tmp_path, caplog):
    """The save of a step whose folder holds a killed save's files removes them keeping
    what the complete steps reference; where one of those steps' document was unreadable,
    that save raised, and a job resumed below the killed step failed at that step on every
    restart. Now the leftovers stay (logged) and the save goes on."""
    root = tmp_path / "run"
    mgr = db.CheckpointManager(str(root), every=1, async_save=False)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    (root / "step_00000001" / "dcpbridge.json").write_text("{garbage")
    (root / "step_00000003").mkdir()
    (root / "step_00000003" / "__0_0.0123456789abcdef.bin").write_bytes(b"x" * 16)  # killed
    with caplog.at_level(logging.WARNING, logger="dcpbridge"):
        assert mgr.save(3, {"w": torch.full((4,), 3.0)})
    assert "step_00000003" in caplog.text and "not valid JSON" in caplog.text
    assert mgr.all_steps() == [1, 2, 3]
    assert torch.equal(mgr.load({"w": torch.zeros(4)})["w"], torch.full((4,), 3.0))
    mgr.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_of_another_format_in_a_step_folder_is_never_removed(tmp_path):
    """A plain DCP checkpoint saved as ``step_00000000`` (loadable with ``db.load``) has no
    dcpbridge.json: the manager took it for a killed save's folder and its first save
    deleted it. Only a folder holding nothing but what a dcpbridge save writes is such
    leftovers; a save of that step refuses to write over the other files."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "run"
    dcp.save(
        {"w": torch.arange(4.0)},
        storage_writer=dcp.FileSystemWriter(str(root / "step_00000000")),
        no_dist=True,
    )
    before = sorted(os.listdir(root / "step_00000000"))
    (root / "step_00000005").mkdir()  # a killed save's: data, sidecar, a commit's temp file
    for name in ("__0_0.0123456789abcdef.bin", SIDECAR, "dcpbridge.json.tmp.12-ab"):
        (root / "step_00000005" / name).write_bytes(b"x")
    mgr = db.CheckpointManager(str(root), every=1, keep_last=1, async_save=False)
    for step in (1, 2, 6):  # step 6's commit removes the killed save's folder 5
        mgr.save(step, {"w": torch.full((4,), float(step))})
    assert mgr.all_steps() == [6]
    assert sorted(os.listdir(root)) == ["step_00000000", "step_00000006"]
    assert sorted(os.listdir(root / "step_00000000")) == before
    with pytest.raises(db.InvalidArgumentError, match=r"step_00000000.*'\.metadata'"):
        mgr.save(0, {"w": torch.zeros(4)})
    assert sorted(os.listdir(root / "step_00000000")) == before
    out = db.load({"w": torch.zeros(4)}, str(root / "step_00000000"))
    assert torch.equal(out["w"], torch.arange(4.0))
    mgr.close()


@pytest.mark.parametrize(
    "sidecar", ['{"metrics": {"loss": 1' + "0" * 400 + "}}", "[" * 100_000 + "]" * 100_000]
)
def test_a_hostile_sidecar_only_loses_its_own_metric(tmp_path, caplog, sidecar):
    """A metric too large for a float, or nesting too deep to parse, counts as no metric for
    that step (retention as a whole failed and kept every checkpoint)."""
    root = tmp_path / "run"
    opts = {"keep_best": 1, "best_metric": "loss", "keep_last": 1, "async_save": False}
    mgr = db.CheckpointManager(str(root), **opts)
    for step, loss in [(1, 5.0), (2, 1.0), (3, 3.0)]:
        mgr.save(step, {"w": torch.ones(2)}, metrics={"loss": loss})
    assert mgr.all_steps() == [2, 3]
    (root / "step_00000002" / SIDECAR).write_text(sidecar)
    mgr = db.CheckpointManager(str(root), **opts)  # reads the sidecars afresh
    with caplog.at_level(logging.WARNING, logger="dcpbridge"):
        mgr.save(4, {"w": torch.ones(2)}, metrics={"loss": 9.0})
    assert mgr.all_steps() == [3, 4] and "retention" not in caplog.text


@pytest.mark.parametrize("local", [False, True], ids=["persistent", "local-tier"])
@pytest.mark.parametrize("step", ["1", 1.0, True, -1, 10**30])
def test_load_refuses_a_step_that_is_no_step_number(tmp_path, step, local):
    """``load(step="1")`` or ``step=1.0`` raised ValueError from formatting the folder name
    (rule 2) and ``step=True`` loaded step 1; a step is now checked as ``save`` checks it."""
    extra = {"local_dir": str(tmp_path / "local")} if local else {}
    mgr = db.CheckpointManager(str(tmp_path / "run"), every=1, async_save=False, **extra)
    mgr.save(1, {"w": torch.ones(2)})
    with pytest.raises(db.InvalidArgumentError, match="step must be an int from 0 to"):
        mgr.load({"w": torch.zeros(2)}, step=step)
    assert torch.equal(mgr.load({"w": torch.zeros(2)}, step=1)["w"], torch.ones(2))
    mgr.close()


@pytest.mark.parametrize("keep_best", [None, 1])
@pytest.mark.parametrize(
    "value",
    [torch.ones(2), 10**400, "abc", torch.tensor(1.0, device="meta")],
    ids=["two-elements", "huge-int", "str", "meta"],
)
def test_a_metric_that_is_no_number_raises_invalid_argument(tmp_path, keep_best, value):
    """Rule 2: a metric that is no number escaped as ValueError, OverflowError or
    RuntimeError (with keep_best, or where float() overflowed or could not read a tensor)."""
    root = tmp_path / "run"
    mgr = db.CheckpointManager(
        str(root), every=1, async_save=False, keep_best=keep_best, best_metric="loss"
    )
    with pytest.raises(db.InvalidArgumentError, match="metric 'loss' must be a number") as e:
        mgr.save(1, {"w": torch.ones(2)}, metrics={"acc": 1.0, "loss": value})
    assert e.value.__cause__ is not None
    assert not root.exists() or os.listdir(root) == []
    assert mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": torch.tensor([2.0])})
    mgr.close()
    assert mgr.all_steps() == [1]


_BEST_OPTS = {"keep_best": 1, "best_metric": "loss", "async_save": False, "every": 1}


def _best_of_two(root: os.PathLike[str], loss1: float, loss2: float) -> db.CheckpointManager:
    """A keep_best=1 manager on ``root`` that saved steps 1 and 2 with those losses (both kept:
    the newest complete step always is)."""
    mgr = db.CheckpointManager(str(root), **_BEST_OPTS)
    for step, loss in [(1, loss1), (2, loss2)]:
        mgr.save(step, {"w": torch.full((2,), float(step))}, metrics={"loss": loss})
    assert mgr.all_steps() == [1, 2]
    return mgr


def test_a_sidecar_that_cannot_be_read_now_deletes_nothing(tmp_path, caplog, monkeypatch):
    """A storage fault reading the best step's manager.json counted as "no metric" (like a
    hostile one), so retention deleted the best checkpoint. A fault now fails that
    retention (logged, nothing deleted); the next one ranks the step again."""
    from dcpbridge.storage.backends.store import LocalStorage

    root = tmp_path / "run"
    mgr = _best_of_two(root, 1.0, 5.0)
    read = LocalStorage.read_file

    def flaky(self, path: str) -> bytes:
        if path.endswith(f"step_00000001/{SIDECAR}"):
            raise OSError(5, "Input/output error")
        return read(self, path)

    monkeypatch.setattr(LocalStorage, "read_file", flaky)
    mgr = db.CheckpointManager(str(root), **_BEST_OPTS)  # reads the sidecars afresh
    with caplog.at_level(logging.WARNING, logger="dcpbridge"):
        mgr.save(3, {"w": torch.full((2,), 3.0)}, metrics={"loss": 3.0})
    assert mgr.all_steps() == [1, 2, 3]
    assert "retention" in caplog.text and "Input/output error" in caplog.text
    monkeypatch.setattr(LocalStorage, "read_file", read)
    mgr.save(4, {"w": torch.full((2,), 4.0)}, metrics={"loss": 9.0})
    assert mgr.all_steps() == [1, 4]  # the best (loss 1.0) and the newest
    mgr.close()


@pytest.mark.parametrize("scheme", ["local", "memory"])
def test_a_commit_file_that_cannot_be_looked_up_now_is_not_a_partial_step(
    tmp_path, caplog, monkeypatch, scheme
):
    """fsspec's ``exists`` answers False for any failure: a storage fault (an NFS I/O error,
    a 503) looking up a complete step's dcpbridge.json made it look like a killed save's
    folder, and retention deleted the checkpoint. The fault now raises: that retention
    fails (logged) and deletes nothing; ``all_steps`` raises it."""
    import fsspec

    root = str(tmp_path / "run") if scheme == "local" else f"memory://{tmp_path.name}/run"
    fs = fsspec.filesystem("file" if scheme == "local" else "memory")
    mgr = db.CheckpointManager(root, every=1, async_save=False)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((2,), float(step))})
    info = type(fs).info

    def flaky(self, path, **kwargs):
        if str(path).endswith("step_00000001/dcpbridge.json"):
            raise OSError(5, "Input/output error")
        return info(self, path, **kwargs)

    monkeypatch.setattr(type(fs), "info", flaky)
    with caplog.at_level(logging.WARNING, logger="dcpbridge"):
        mgr.save(3, {"w": torch.full((2,), 3.0)})
    assert "retention" in caplog.text and "Input/output error" in caplog.text
    with pytest.raises(db.StorageError, match="Input/output error"):
        mgr.all_steps()
    monkeypatch.setattr(type(fs), "info", info)
    assert mgr.all_steps() == [1, 2, 3]
    assert torch.equal(mgr.load({"w": torch.zeros(2)}, step=1)["w"], torch.ones(2))
    mgr.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("persist_behind", [False, True], ids=["persistent", "behind"])
def test_on_commit_raising_a_base_exception_is_logged_not_raised_nor_hanging(
    tmp_path, caplog, persist_behind
):
    """An ``on_commit`` raising ``asyncio.CancelledError`` (a BaseException: an async
    notifier's cancelled task) escaped the save on rank 0, and on the local tier's thread it
    skipped the upload it came before: the next save waited forever for that persistent step.
    It is logged like any failure of the callback."""
    import asyncio

    def notify(step: int, tier: str, url: str) -> None:
        raise asyncio.CancelledError()

    extra = {"local_dir": str(tmp_path / "shm"), "replicas": 0} if persist_behind else {}
    mgr = db.CheckpointManager(
        str(tmp_path / "run"),
        every=2,
        on_commit=notify,
        persist_behind=persist_behind,
        async_save=persist_behind,  # the local step and its upload on the tier's thread
        **extra,
    )
    with caplog.at_level(logging.WARNING, logger="dcpbridge"):
        for step in range(1, 5):
            mgr.save(step, {"w": torch.full((2,), float(step))})
        mgr.close()
    assert mgr.all_steps() == [2, 4]
    assert "on_commit(4, 'persistent'" in caplog.text and "CancelledError" in caplog.text
    assert torch.equal(mgr.load({"w": torch.zeros(2)}, step=4)["w"], torch.full((2,), 4.0))


@pytest.mark.timeout(60)
def test_a_save_started_by_on_commit_is_waited_for_and_notified(tmp_path):
    """An ``on_commit`` that saves again (one process, async saves): that save became the
    pending one while the manager was finishing the previous, and was then dropped: a later
    ``save`` replaced it (its commit never notified, its failure raised by the other save),
    and ``close`` returned with it still in flight. Now every save is finished in turn."""
    calls: list[tuple[int, str]] = []

    def notify(step: int, tier: str, url: str) -> None:
        calls.append((step, tier))
        if step == 2:  # the commit of step 2 starts a save of its own
            mgr.save(100, {"w": torch.full((2,), 100.0)}, force=True)

    mgr = db.CheckpointManager(str(tmp_path / "run"), every=1, on_commit=notify, async_save=True)
    for step in range(1, 3):
        mgr.save(step, {"w": torch.full((2,), float(step))})
    mgr.close()
    assert calls == [(1, "persistent"), (2, "persistent"), (100, "persistent")]
    assert not mgr.saving
    assert mgr.all_steps() == [1, 2, 100]
    assert torch.equal(mgr.load({"w": torch.zeros(2)}, step=100)["w"], torch.full((2,), 100.0))
    mgr = db.CheckpointManager(str(tmp_path / "run2"), every=1, on_commit=notify, async_save=True)
    calls.clear()
    for step in range(1, 4):  # step 3's save finishes step 2's, whose on_commit saves 100
        mgr.save(step, {"w": torch.full((2,), float(step))})
    mgr.close()
    assert calls == [(1, "persistent"), (2, "persistent"), (100, "persistent"), (3, "persistent")]
    assert torch.equal(mgr.load({"w": torch.zeros(2)})["w"], torch.full((2,), 100.0))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["run", "shm"], ids=["upload", "local-write"])
def test_a_persist_behind_upload_cancelled_fails_that_save_and_does_not_hang(
    tmp_path, monkeypatch, where
):
    """An upload of ``persist_behind``, or the write of the local step it uploads, that raised
    a base exception (``asyncio.CancelledError`` out of an async object-store client) left
    the tier's thread without finishing the persistent save: the next ``wait``/``save``/
    ``close`` waited for it forever, and what it had written stayed. It fails that save
    (raised at the next wait, files removed) and the next persistent save commits."""
    import asyncio

    from dcpbridge.storage.backends import store as backends

    original = backends.LocalStorage.open_write
    cancelled = [True]

    def open_write(self, path: str):  # the persistent tier's uploads, or the local writes
        if cancelled[0] and f"{os.sep}{where}{os.sep}" in path:
            raise asyncio.CancelledError()
        return original(self, path)

    monkeypatch.setattr(backends.LocalStorage, "open_write", open_write)
    mgr = db.CheckpointManager(
        str(tmp_path / "run"),
        every=2,
        local_dir=str(tmp_path / "shm"),
        replicas=0,
        persist_behind=True,
    )
    for step in range(1, 3):
        mgr.save(step, {"w": torch.full((2,), float(step))})
    with pytest.raises(asyncio.CancelledError):
        mgr.wait()
    assert not (tmp_path / "run" / "step_00000002").exists()
    # the local step stays where only its upload failed; a failed local write leaves nothing
    assert (tmp_path / "shm" / "step_00000002").exists() == (where == "run")
    cancelled[0] = False
    for step in range(3, 5):
        mgr.save(step, {"w": torch.full((2,), float(step))})
    mgr.close()
    assert mgr.all_steps() == [4]
    assert torch.equal(mgr.load({"w": torch.zeros(2)}, step=4)["w"], torch.full((2,), 4.0))


@pytest.mark.timeout(60)
def test_an_interrupted_synchronous_local_step_raises_its_interrupt(tmp_path, monkeypatch):
    """A Ctrl-C during a local step written in the call (``async_save=False``) reaches the
    caller unchanged (the tier logs a failure behind the loop, never an interrupt of its
    caller); nothing of the step stays and the next local step commits."""
    from dcpbridge.storage.backends import store as backends

    original = backends.LocalStorage.open_write
    interrupted = [True]

    def open_write(self, path: str):
        if interrupted[0]:
            raise KeyboardInterrupt
        return original(self, path)

    monkeypatch.setattr(backends.LocalStorage, "open_write", open_write)
    mgr = db.CheckpointManager(
        str(tmp_path / "run"), every=10, local_dir=str(tmp_path / "shm"), async_save=False
    )
    with pytest.raises(KeyboardInterrupt):
        mgr.save(1, {"w": torch.full((2,), 1.0)})
    assert not (tmp_path / "shm" / "step_00000001").exists()
    interrupted[0] = False
    mgr.save(2, {"w": torch.full((2,), 2.0)})
    assert mgr.latest_step() == 2
    assert torch.equal(mgr.load({"w": torch.zeros(2)})["w"], torch.full((2,), 2.0))
    mgr.close()


def test_a_sidecar_too_large_for_one_is_not_read(tmp_path, monkeypatch):
    """Rule 4: a manager.json of any size was read whole (a planted one of gigabytes: that
    much memory) to rank its step. One larger than a sidecar can be counts as no metric,
    unread."""
    from dcpbridge.engine import retention
    from dcpbridge.storage.backends.store import LocalStorage

    root = tmp_path / "run"
    mgr = _best_of_two(root, 0.5, 1.0)
    pad = "x" * (retention.MAX_SIDECAR_BYTES + 1)
    (root / "step_00000001" / SIDECAR).write_text(f'{{"metrics": {{"loss": 0.5}}, "p": "{pad}"}}')
    read = LocalStorage.read_file
    reads: list[str] = []

    def counted(self, path: str) -> bytes:
        reads.append(path)
        return read(self, path)

    monkeypatch.setattr(LocalStorage, "read_file", counted)
    mgr = db.CheckpointManager(str(root), **_BEST_OPTS)  # reads the sidecars afresh
    mgr.save(3, {"w": torch.full((2,), 3.0)}, metrics={"loss": 9.0})
    assert not [p for p in reads if p.endswith(f"step_00000001/{SIDECAR}")]
    assert mgr.all_steps() == [2, 3]  # step 1 has no metric: the best is step 2
    mgr.close()


@pytest.mark.timeout(60)
def test_an_interrupted_wait_leaves_the_pending_save_to_the_next_one(tmp_path, monkeypatch):
    """A Ctrl-C while ``wait`` waited for an async save counted as that save's failure: its
    manager.json was removed and the save forgotten, so it committed later with no metric
    and no retention after it. The save stays pending; the next ``wait`` finishes it."""
    import threading

    gate = threading.Event()
    finish = FsspecCheckpointWriter.finish

    def gated(self, *args, **kwargs):
        if "step_00000002" in self._loc.url:
            gate.wait(30)
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(FsspecCheckpointWriter, "finish", gated)
    root = tmp_path / "run"
    mgr = db.CheckpointManager(
        str(root), every=1, keep_best=1, best_metric="loss", async_save=True, writer="thread"
    )
    mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": 1.0})
    mgr.save(2, {"w": torch.full((2,), 2.0)}, metrics={"loss": 0.5})

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            mgr.wait()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert (root / "step_00000002" / SIDECAR).exists()
    gate.set()
    mgr.wait()
    assert mgr.all_steps() == [2]  # retention ran after step 2: the best and the newest
    assert torch.equal(mgr.load({"w": torch.zeros(2)})["w"], torch.full((2,), 2.0))
    mgr.close()


def test_defaults_come_from_the_config_file(tmp_path, monkeypatch):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        textwrap.dedent(
            """
            checkpoint: {every: 3, keep_last: 1, async: false, checksums: false}
            """
        )
    )
    monkeypatch.setenv("DCPBRIDGE_CONFIG", str(cfg))
    mgr = db.CheckpointManager(str(tmp_path / "run"))
    assert (mgr.every, mgr.retention.keep_last, mgr.async_save, mgr.checksums) == (
        3,
        1,
        False,
        False,
    )
    for step in range(1, 8):
        mgr.save(step, {"w": torch.full((2,), float(step))})
    assert mgr.all_steps() == [6]
    explicit = db.CheckpointManager(str(tmp_path / "run"), every=5, keep_last=2)
    assert (explicit.every, explicit.retention.keep_last) == (5, 2)
    with pytest.raises(db.InvalidArgumentError, match="every must be a positive int"):
        db.CheckpointManager(str(tmp_path), every=0)
    with pytest.raises(db.InvalidArgumentError, match="keep_best needs best_metric"):
        db.CheckpointManager(str(tmp_path), keep_best=1)


def test_saves_and_loads_report_what_they_did(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dcpbridge")
    w = torch.randn(256, 256)
    state = {"w": db.ShardedTensor.from_box("w", w, (256, 256), (0, 0)), "it": 1}
    mgr = db.CheckpointManager(str(tmp_path), every=1, async_save=True)
    mgr.save(1, state)
    mgr.close()
    mgr.load({"w": db.ShardedTensor.from_box("w", torch.zeros(256, 256), (256, 256), (0, 0))})
    events = {r.dcpbridge["event"]: r.dcpbridge for r in caplog.records if hasattr(r, "dcpbridge")}
    assert set(events) == {"staged", "saved", "loaded"}
    saved, loaded = events["saved"], events["loaded"]
    assert saved["url"] == mgr.step_url(1) and saved["files"] >= 1
    assert saved["bytes"] >= w.numel() * 4 and set(saved["seconds"]) == {"plan", "write", "commit"}
    assert events["staged"]["bytes"] == w.numel() * 4
    assert loaded["bytes"] == w.numel() * 4 and set(loaded["seconds"]) == {"plan", "read"}
    assert any(
        "dcpbridge saved" in r.getMessage() and "GB/s" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize("scheme", ["local", "memory"])
def test_retention_in_a_root_with_glob_characters_removes_only_its_own_steps(tmp_path, scheme):
    """fsspec's recursive rm expands patterns on object stores: retention under ``run[1]``
    deleted the steps of a sibling ``run1`` and kept its own. Paths are now taken literally."""
    import fsspec

    base = str(tmp_path) if scheme == "local" else f"memory://{tmp_path.name}"
    fs = fsspec.filesystem("file" if scheme == "local" else "memory")
    fs.makedirs(f"{base}/run1/step_00000001", exist_ok=True)
    fs.pipe(f"{base}/run1/step_00000001/keep.bin", b"another run's")
    root = f"{base}/run[1]"
    mgr = db.CheckpointManager(root, every=1, keep_last=1, async_save=False)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((3,), float(step))})
    mgr.close()
    assert mgr.all_steps() == [2]
    assert not fs.exists(f"{base}/run[1]/step_00000001/dcpbridge.json")
    assert fs.cat(f"{base}/run1/step_00000001/keep.bin") == b"another run's"
    out = db.CheckpointManager(root, every=1).load({"w": torch.zeros(3)})
    assert torch.equal(out["w"], torch.full((3,), 2.0))


def test_a_step_folder_name_with_a_trailing_newline_is_not_a_step(tmp_path):
    """A folder ``step_00000002\\n`` beside step 2 is no step: the step-folder pattern ended
    in ``$`` (which matches before a trailing newline), so it counted as a second step 2 and
    ``all_steps`` listed 2 twice. The local tier's step folders are parsed alike."""
    from dcpbridge.engine import step_names

    root = tmp_path / "run"
    mgr = db.CheckpointManager(str(root), async_save=False)
    mgr.save(2, {"w": torch.ones(4)})
    os.mkdir(root / "step_00000002\n")
    assert mgr.all_steps() == [2] and mgr.latest_step() == 2
    mgr.close()
    for pattern in (step_names.STEP_DIR, step_names.ASIDE_DIR):
        name = "step_00000002" + (".previous" if pattern is step_names.ASIDE_DIR else "")
        assert pattern.match(name) and pattern.match(name + "\n") is None


def test_a_step_folder_spelt_otherwise_is_another_checkpoint_not_a_step(tmp_path):
    """``step_2`` (or ``step_`` with non-ASCII digits) beside ``step_00000002`` is not step 2:
    it was read as a second step 2 (``all_steps`` listed 2 twice) and, being taken for a
    step, was not among the checkpoints whose referenced files retention keeps: a committed
    copy of an incremental step lost its data. It is now one of the other checkpoints."""
    import shutil

    root = tmp_path / "run"
    mgr = db.CheckpointManager(str(root), every=1, keep_last=1, async_save=False, incremental=True)
    w = torch.arange(8.0)
    mgr.save(1, {"w": w, "v": torch.ones(4)})
    mgr.save(2, {"w": w, "v": torch.zeros(4)})  # references step 1's file for "w"
    shutil.copytree(root / "step_00000002", root / "step_2")
    os.mkdir(root / "step_\u0663")  # Arabic-Indic digit 3: not a step either
    assert mgr.all_steps() == [2] and mgr.latest_step() == 2
    mgr.save(3, {"w": w + 1, "v": torch.full((4,), 3.0)})  # retention: steps 1 and 2 go
    mgr.close()
    assert mgr.all_steps() == [3]
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000003", "step_2", "step_\u0663"]
    out = db.load({"w": torch.zeros(8), "v": torch.ones(4)}, str(root / "step_2"))
    assert torch.equal(out["w"], w) and torch.equal(out["v"], torch.zeros(4))


@pytest.mark.parametrize("referenced", [False, True])
def test_retention_never_deletes_through_a_linked_step_folder(tmp_path, referenced):
    """A step folder that is a symbolic link (a base checkpoint linked in to resume from)
    had its target's commit file deleted by retention: the checkpoint outside the root was
    destroyed. Retention now removes only the link, or leaves it where a kept step
    references files through it; the target stays whole."""
    base, root = tmp_path / "base", tmp_path / "run"
    w = torch.arange(8.0)
    db.save({"w": w, "v": torch.ones(4)}, str(base))
    before = sorted(os.listdir(base))
    root.mkdir()
    os.symlink(base, root / "step_00000001")
    mgr = db.CheckpointManager(
        str(root), every=1, keep_last=1, async_save=False, incremental=referenced
    )
    assert mgr.all_steps() == [1]
    mgr.save(2, {"w": w, "v": torch.zeros(4)})  # incremental: "w" read through the link
    mgr.close()
    assert sorted(os.listdir(base)) == before
    assert torch.equal(db.load({"w": torch.zeros(8)}, str(base))["w"], w)
    assert mgr.all_steps() == ([1, 2] if referenced else [2])
    out = mgr.load({"w": torch.zeros(8), "v": torch.ones(4)}, step=2)
    assert torch.equal(out["w"], w) and torch.equal(out["v"], torch.zeros(4))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_never_writes_through_a_linked_step_folder(tmp_path, async_save):
    """Saving step 0 again where ``step_00000000`` links to a base checkpoint elsewhere
    wrote the new state into that checkpoint and deleted its data files. The save is
    refused; the base and the link stay as they were."""
    base, root = tmp_path / "base", tmp_path / "run"
    w = torch.arange(8.0)
    db.save({"w": w}, str(base))
    before = {n: (base / n).read_bytes() for n in os.listdir(base)}
    root.mkdir()
    os.symlink(base, root / "step_00000000")
    mgr = db.CheckpointManager(str(root), every=1, async_save=async_save, writer="thread")
    assert mgr.latest_step() == 0

    def save_again() -> None:
        mgr.save(0, {"w": w * 0})
        mgr.wait()  # an async save's failure is raised here

    with pytest.raises(db.InvalidArgumentError, match="step_00000000 is a symbolic link"):
        save_again()
    assert {n: (base / n).read_bytes() for n in os.listdir(base)} == before
    assert os.path.islink(root / "step_00000000")
    mgr.save(1, {"w": w + 1})
    mgr.close()
    assert mgr.all_steps() == [0, 1]
    assert torch.equal(mgr.load({"w": torch.zeros(8)}, step=0)["w"], w)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_re_save_leaves_the_committed_steps_metrics(tmp_path, async_save):
    """A save of a committed step again (after a rollback) that fails leaves that step as
    it was, its recorded metric too: retention still keeps it as the best (was: the failed
    save's metric stayed in its manager.json, and the next save deleted the best step)."""
    root = str(tmp_path)
    mgr = db.CheckpointManager(
        root, every=1, keep_best=1, best_metric="loss", async_save=async_save, writer="thread"
    )
    w = torch.arange(4.0)
    mgr.save(1, {"w": w}, metrics={"loss": 5.0})
    mgr.save(2, {"w": w * 2}, metrics={"loss": 1.0})
    mgr.wait()
    sidecar = os.path.join(root, "step_00000002", SIDECAR)
    with open(sidecar, "rb") as f:
        recorded = f.read()
    bad = torch.randn(8)
    bad.untyped_storage().resize_(0)  # cannot be saved: the re-save fails

    def save_again() -> None:
        mgr.save(2, {"w": w * 3, "bad": bad}, metrics={"loss": 100.0})
        mgr.wait()  # an async save's failure is raised here

    with pytest.raises(db.CheckpointError, match="'bad'"):
        save_again()
    with open(sidecar, "rb") as f:
        assert f.read() == recorded
    mgr.save(3, {"w": w * 4}, metrics={"loss": 3.0})
    mgr.close()
    assert mgr.all_steps() == [2, 3]  # the best (loss 1.0) and the newest
    tmpl = {"w": torch.zeros(4)}
    assert torch.equal(mgr.load(tmpl, step=2)["w"], w * 2)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_save_of_a_new_step_leaves_no_sidecar(tmp_path, async_save):
    """Rule 3: the failed save's manager.json stayed in step_N/ until a later save."""
    root = str(tmp_path)
    mgr = db.CheckpointManager(root, every=1, async_save=async_save, writer="thread")
    w = torch.arange(4.0)
    mgr.save(1, {"w": w}, metrics={"loss": 5.0})
    mgr.wait()
    bad = torch.randn(8)
    bad.untyped_storage().resize_(0)  # cannot be saved

    def save_bad() -> None:
        mgr.save(2, {"w": w * 3, "bad": bad}, metrics={"loss": 1.0})
        mgr.wait()  # an async save's failure is raised here

    with pytest.raises(db.CheckpointError, match="'bad'"):
        save_bad()
    step2 = os.path.join(root, "step_00000002")
    assert not os.path.exists(step2)
    assert mgr.all_steps() == [1]
    mgr.close()


@pytest.mark.parametrize("step", [-1, 10**18, 2**70, True, 1.0])
def test_a_step_whose_folder_could_not_be_found_again_is_refused(tmp_path, step):
    """A step of 19 digits was saved (and retention ran) under a folder name that
    ``all_steps`` never matches: the checkpoint was never found again."""
    mgr = db.CheckpointManager(str(tmp_path), every=1, async_save=False)
    with pytest.raises(db.InvalidArgumentError, match="step must be an int from 0 to"):
        mgr.save(step, {"w": torch.ones(2)})
    assert os.listdir(tmp_path) == []
    mgr.save(10**18 - 1, {"w": torch.ones(2)})  # the largest: found again
    assert mgr.all_steps() == [10**18 - 1]
    mgr.close()


class _StaleView:
    """A store as a stale listing (NFS attribute cache) shows it: the step folders named in
    ``hidden`` are not there (not listed, no commit file)."""

    def __init__(self, store: object, hidden: frozenset[str], whole: bool) -> None:
        self._store, self._hidden, self._whole = store, hidden, whole

    def list_names(self) -> list[str]:
        names = self._store.list_names()  # type: ignore[attr-defined]
        return [] if self._whole else [n for n in names if n not in self._hidden]

    def exists(self, name: str) -> bool:
        return not self._whole and self._store.exists(name)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)


def _stale(hidden: set[str]):
    """Patch the manager's storage so this rank does not see the step folders ``hidden``."""
    from unittest import mock

    from dcpbridge.engine import manager as manager_mod

    real = manager_mod.storage_for

    def storage_for(location):
        store = real(location)
        folder = location.url.rstrip("/").rsplit("/", 1)[-1]
        return _StaleView(store, frozenset(hidden), folder in hidden)

    return mock.patch.object(manager_mod, "storage_for", storage_for)


def stale_listing(r: Rank, root: str, hidden: list[list[str]]) -> dict:
    """Steps 2 and 4 saved; then rank ``i`` misses the step folders ``hidden[i]``."""
    mgr = db.CheckpointManager(root, every=2, process_group=r.group, async_save=False)
    for step in (2, 4):
        mgr.save(step, state(rows(weights(step), r.rank, r.size), r.rank, r.size, step))
    out: dict = {}
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dcpbridge").addHandler(handler)
    try:
        with _stale(set(hidden[r.rank])):
            out["latest"] = mgr.latest_step()
            loaded = mgr.load(template(r.rank, r.size))
            out["loaded"] = loaded["step"]
            assert torch.equal(loaded["w"], rows(weights(loaded["step"]), r.rank, r.size))
    except db.CheckpointError as e:
        out["error"] = (type(e).__name__, str(e))
    finally:
        logging.getLogger("dcpbridge").removeHandler(handler)
    mgr.close()
    out["warned"] = [w for w in warned if "stale listing?" in w][:1]
    return out


@pytest.mark.timeout(120)
def test_ranks_agree_on_the_newest_step_every_rank_sees_committed(pool, tmp_path):
    """Without a local tier, ``latest_step`` was each rank's own listing: where one rank's
    listing was stale (NFS), ranks resumed from different steps (rank 0: 4, rank 1: 2) and a
    ``load(step=mgr.latest_step())`` mixed them. Now every rank gets the newest step that every
    rank sees committed, and ``load`` loads that step."""
    root = str(tmp_path / "run")
    out = pool.run(stale_listing, 2, root, [[], ["step_00000004"]])
    warned = f"dcpbridge: ranks [1] do not see step 4 of {root} committed"
    assert [(o["latest"], o["loaded"]) for o in out] == [(2, 2)] * 2
    assert all(len(o["warned"]) == 1 and o["warned"][0].startswith(warned) for o in out)
    out = pool.run(stale_listing, 2, root + "2", [["step_00000004"], []])  # rank 0 is stale
    assert out == [{"latest": 2, "loaded": 2, "warned": []}] * 2


@pytest.mark.timeout(120)
def test_ranks_that_see_no_common_committed_step_raise_naming_both(pool, tmp_path):
    """Rank 0 sees only step 4 committed, rank 1 only step 2: no step is safe to resume from
    on both, so ``latest_step`` and ``load`` raise on every rank, naming both steps."""
    out = pool.run(stale_listing, 2, str(tmp_path / "run"), [["step_00000002"], ["step_00000004"]])
    assert out[0] == out[1] and set(out[0]) == {"error", "warned"}
    name, message = out[0]["error"]
    assert name == "DistributedCheckpointError"
    assert "rank 0" in message and "step 4" in message
    assert "rank 1" in message and "step 2" in message


def asked_different_steps(r: Rank, root: str) -> tuple[str, str]:
    """Steps 2 and 4 saved; rank 0 loads step 2, rank 1 step 4."""
    mgr = db.CheckpointManager(root, every=2, process_group=r.group, async_save=False)
    for step in (2, 4):
        mgr.save(step, state(rows(weights(step), r.rank, r.size), r.rank, r.size, step))
    with pytest.raises(db.CheckpointError) as info:
        mgr.load(template(r.rank, r.size), step=4 if r.rank else 2)
    mgr.close()
    return type(info.value).__name__, str(info.value)


@pytest.mark.timeout(120)
def test_ranks_that_ask_for_different_steps_raise(pool, tmp_path):
    """``load(step=...)`` with another step on each rank loaded rank 0's step on every rank
    (rank 1 got step 2 for its step 4); now it raises on every rank, naming each one's."""
    out = pool.run(asked_different_steps, 2, str(tmp_path / "run"))
    assert out[0] == out[1]
    name, message = out[0]
    assert name == "InvalidArgumentError"
    assert "different steps" in message and "rank 0: 2" in message and "rank 1: 4" in message


def _held_before_commit(monkeypatch, step_dir: str):
    """Hold the commit of the save into ``step_dir`` (its data files written) until the
    returned gate is set; ``reached`` is set once it waits there."""
    import threading

    reached, gate = threading.Event(), threading.Event()
    finish = FsspecCheckpointWriter.finish

    def held(self, metadata, results):
        if self._loc.url.rstrip("/").endswith(step_dir) and not gate.is_set():
            reached.set()
            assert gate.wait(30)
        return finish(self, metadata, results)

    monkeypatch.setattr(FsspecCheckpointWriter, "finish", held)
    return reached, gate


def _two_managers(tmp_path, monkeypatch, scheme: str, other_step: int):
    """Manager A saves step 6 (async), held before its commit; manager B, on the same root
    (a restarted job beside the old one still running), commits ``other_step`` meanwhile."""
    root = str(tmp_path / "run") if scheme == "local" else f"memory://{tmp_path.name}/run"
    first = db.CheckpointManager(root, every=1, async_save=True, writer="thread")
    second = db.CheckpointManager(root, every=1, async_save=False)
    first.save(4, {"w": torch.full((64,), 4.0)})
    first.wait()
    reached, gate = _held_before_commit(monkeypatch, "step_00000006")
    first.save(6, {"w": torch.full((64,), 6.0)})
    assert reached.wait(30)
    second.save(other_step, {"w": torch.full((64,), float(other_step))})
    gate.set()
    return first, second


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scheme", ["local", "memory"])
def test_another_managers_commit_leaves_a_newer_save_in_flight_alone(tmp_path, monkeypatch, scheme):
    """Manager B's cleanup after its commit of step 5 removed every uncommitted step folder,
    so manager A's step 6, being written, lost its data files: on an object store A then
    committed a step whose data was gone (it could not load), on local disk A's commit
    failed. Only uncommitted folders older than the newest committed step are removed now
    (an old job still running beside its restart is ahead of it)."""
    first, second = _two_managers(tmp_path, monkeypatch, scheme, 5)
    first.wait()
    first.close()
    assert second.all_steps() == [4, 5, 6]
    for step in (4, 5, 6):
        out = second.load({"w": torch.zeros(64)}, step=step)
        assert torch.equal(out["w"], torch.full((64,), float(step)))
    second.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scheme", ["local", "memory"])
def test_a_save_whose_data_files_were_removed_never_commits(tmp_path, monkeypatch, scheme):
    """Where manager B's commit of a newer step (8) removed manager A's step 6 while A wrote
    it, A's commit found its data files gone and raised ``StorageFileNotFoundError`` naming
    them: no commit file names missing data (on an object store A committed step 6 anyway,
    a complete step that could not load)."""
    first, second = _two_managers(tmp_path, monkeypatch, scheme, 8)
    with pytest.raises(db.StorageFileNotFoundError, match=r"step_00000006.*__0_0\.") as info:
        first.wait()
    assert "missing" in str(info.value)
    first.close()
    assert second.all_steps() == [4, 8]
    assert torch.equal(second.load({"w": torch.zeros(64)})["w"], torch.full((64,), 8.0))
    second.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scheme", ["local", "memory"])
def test_a_step_committed_while_cleanup_runs_stays_whole(tmp_path, monkeypatch, scheme):
    """Manager B's cleanup listed manager A's step 3 uncommitted, then A committed it before
    B deleted it: B removed A's commit file first, then the folder, so a step A had reported
    committed vanished. A folder doomed as uncommitted that holds a commit file when its
    deletion starts is left whole now."""
    from dcpbridge.engine import incremental

    root = str(tmp_path / "run") if scheme == "local" else f"memory://{tmp_path.name}/run"
    first = db.CheckpointManager(root, every=1, async_save=True, writer="thread")
    second = db.CheckpointManager(root, every=1, async_save=False)
    reached, gate = _held_before_commit(monkeypatch, "step_00000003")
    first.save(3, {"w": torch.full((64,), 3.0)})
    assert reached.wait(30)
    needed_files = incremental.needed_files

    def commit_first(*args):
        gate.set()  # A commits step 3 after B listed it as uncommitted
        assert first._pending is not None and first._pending[1]._done.wait(30)
        return needed_files(*args)

    monkeypatch.setattr(incremental, "needed_files", commit_first)
    second.save(5, {"w": torch.full((64,), 5.0)})
    first.close()
    assert second.all_steps() == [3, 5]
    assert torch.equal(second.load({"w": torch.zeros(64)}, step=3)["w"], torch.full((64,), 3.0))
    second.close()


@pytest.mark.timeout(60)
def test_an_upload_behind_whose_files_were_removed_never_commits(tmp_path, monkeypatch):
    """With ``persist_behind``, the upload of a local step committed its document even where
    the uploaded data files were gone by then (another job's cleanup of the same root): on
    an object store a complete step that could not load. Now its commit raises, naming them."""
    from dcpbridge.engine import local_persist

    root = f"memory://{tmp_path.name}/run"
    upload_mine = local_persist._upload_mine

    def removed_after(group, job, local, index):
        upload_mine(group, job, local, index)
        if job.url.endswith("step_00000004"):
            job.location.fs.rm(job.location.data_path(index.files[0], index.prefixes))

    monkeypatch.setattr(local_persist, "_upload_mine", removed_after)
    mgr = db.CheckpointManager(
        root, every=2, local_dir=str(tmp_path / "shm"), replicas=0, persist_behind=True
    )
    for step in (1, 2, 3, 4):
        mgr.save(step, {"w": torch.full((8,), float(step))})
    with pytest.raises(db.StorageFileNotFoundError, match=r"step_00000004.*missing at its commit"):
        mgr.wait()
    assert mgr.all_steps() == [2]
    assert torch.equal(mgr.load({"w": torch.zeros(8)}, step=2)["w"], torch.full((8,), 2.0))
    mgr.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_an_upload_behind_over_a_committed_step_removes_the_files_it_replaced(tmp_path, async_save):
    """A step saved again and uploaded behind (``persist_behind``) committed over the step's
    old commit but left that commit's data files in the step folder, as no other save does:
    wasted space until the step went, and orphans for ``fsck``. They are removed once the
    upload commits; the step loads the new bytes."""
    root = tmp_path / "run"
    mgr = db.CheckpointManager(
        str(root),
        every=1,
        async_save=async_save,
        local_dir=str(tmp_path / "shm"),
        replicas=0,
        persist_behind=True,
    )
    mgr.save(8, {"w": torch.full((8,), 1.0)})
    mgr.wait()
    first = sorted(n for n in os.listdir(root / "step_00000008") if n.endswith(".bin"))
    mgr.save(8, {"w": torch.full((8,), 2.0)})
    mgr.wait()
    files = sorted(n for n in os.listdir(root / "step_00000008") if n.endswith(".bin"))
    assert len(files) == len(first) == 1 and files != first
    assert mgr.all_steps() == [8]
    assert torch.equal(mgr.load({"w": torch.zeros(8)}, step=8)["w"], torch.full((8,), 2.0))
    mgr.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scheme", ["local", "memory"])
def test_an_incremental_save_whose_referenced_files_were_removed_never_commits(
    tmp_path, monkeypatch, scheme
):
    """Manager A's incremental step 6 references step 4's data file; manager B's retention
    (keep_last=1 after its step 5) removed step 4 while A wrote, A's step 6 being no commit
    whose references retention keeps. A's commit raises naming the reference; nothing of
    step 6 commits."""
    root = str(tmp_path / "run") if scheme == "local" else f"memory://{tmp_path.name}/run"
    first = db.CheckpointManager(root, every=1, async_save=True, writer="thread", incremental=True)
    second = db.CheckpointManager(root, every=1, keep_last=1, async_save=False)
    same = torch.arange(64.0)
    first.save(4, {"w": same, "v": torch.full((64,), 4.0)})
    first.wait()
    reached, gate = _held_before_commit(monkeypatch, "step_00000006")
    first.save(6, {"w": same, "v": torch.full((64,), 6.0)})  # "w" references step 4's file
    assert reached.wait(30)
    second.save(5, {"w": same, "v": torch.full((64,), 5.0)})  # retention removes step 4
    gate.set()
    with pytest.raises(db.StorageFileNotFoundError, match=r"step_00000006.*\.\./step_00000004/"):
        first.wait()
    first.close()
    assert second.all_steps() == [5]
    second.close()


@pytest.mark.timeout(60)
def test_a_second_threads_call_while_one_is_inside_is_refused(tmp_path, monkeypatch):
    """Two threads calling one manager at once shared its pending save: one thread's
    ``save`` replaced the other's pending handle (a failure never raised, a commit never
    notified or retained). A call from a second thread while one is inside now raises
    ``InvalidArgumentError`` at once, naming both threads; the first call is unaffected, and
    the same thread may enter again (``on_commit`` saving)."""
    import threading

    inner = FsspecCheckpointWriter.write_data
    writing, release = threading.Event(), threading.Event()

    def held(self, plan, planner):  # the first save stays inside its call until released
        writing.set()
        release.wait(30)
        return inner(self, plan, planner)

    monkeypatch.setattr(FsspecCheckpointWriter, "write_data", held)
    mgr = db.CheckpointManager(str(tmp_path / "run"), every=1, async_save=False)
    first = threading.Thread(
        target=mgr.save, args=(1, {"w": torch.ones(4)}), name="trainer", daemon=True
    )
    first.start()
    assert writing.wait(30)
    for call in (lambda: mgr.save(2, {"w": torch.full((4,), 2.0)}), mgr.wait, mgr.close):
        with pytest.raises(db.InvalidArgumentError) as info:
            call()
        msg = str(info.value)
        assert "called from thread 'MainThread' while thread 'trainer' is inside" in msg, msg
        assert "not thread-safe" in msg
    release.set()
    first.join(30)
    assert not first.is_alive()
    mgr.save(3, {"w": torch.full((4,), 3.0)})  # one thread at a time: fine
    mgr.close()
    assert mgr.all_steps() == [1, 3]
    assert torch.equal(mgr.load({"w": torch.zeros(4)}, step=1)["w"], torch.ones(4))
    assert torch.equal(mgr.load({"w": torch.zeros(4)}, step=3)["w"], torch.full((4,), 3.0))
