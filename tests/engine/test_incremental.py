"""Incremental saves: chunks equal to the previous step's are referenced, not rewritten; every
step loads bit-exact on its own; retention and crashes never break a kept step; fsck finds and
removes what a crash left; a checkpoint copied alone names what it misses."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

import dcpbridge as db
from dcpbridge.engine import incremental
from dcpbridge.engine.incremental import fsck
from dcpbridge.storage import FsspecCheckpointWriter, StorageIndex, resolve
from dcpbridge.storage.read.metadata import read_checkpoint_metadata
from dcpbridge.tools import cli
from tests.support.backends import Backend, local_backend, s3_backend
from tests.support.dist_pool import Rank

DIM, RANK_R = 128, 4


def stored(url: str, opts: dict | None = None) -> dict[tuple, str]:
    """Every stored item's key and the file its bytes are in."""
    index = read_checkpoint_metadata(resolve(url, opts)).storage_data
    assert isinstance(index, StorageIndex)
    return {key: item.file for key, item in index.items.items()}


def own_bytes(url: str, opts: dict | None = None) -> int:
    """Bytes of the items a checkpoint stores in its own files (what its save wrote)."""
    index = read_checkpoint_metadata(resolve(url, opts)).storage_data
    return sum(i.nbytes for i in index.items.values() if not i.file.startswith("../"))


def referenced(url: str, opts: dict | None = None) -> set[str]:
    return {key[0] for key, file in stored(url, opts).items() if file.startswith("../")}


class Lora(torch.nn.Module):
    """A frozen base with a trainable low-rank adapter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = torch.nn.Linear(DIM, DIM)
        self.base.requires_grad_(False)
        self.lora_a = torch.nn.Linear(DIM, RANK_R, bias=False)
        self.lora_b = torch.nn.Linear(RANK_R, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def _clone(sd: dict) -> dict:
    return {k: _clone(v) if isinstance(v, dict) else v.clone() for k, v in sd.items()}


def _zeros(sd: dict) -> dict:
    return {k: _zeros(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in sd.items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        _equal(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a
    )


def _tensors(sd: dict) -> dict:
    return {
        k: _tensors(v) if isinstance(v, dict) else v for k, v in sd.items() if k != "param_groups"
    }


def _lora_run(backend: Backend) -> None:
    root, opts = backend.url("run"), backend.storage_options
    model = Lora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    mgr = db.CheckpointManager(
        root, every=1, keep_last=3, storage_options=opts, optimizers=[opt], incremental=True
    )
    base_keys = {"model.base.weight", "model.base.bias"}
    base_bytes = sum(t.nbytes for t in model.base.state_dict().values())
    snaps = {}
    for step in range(1, 6):
        model(torch.randn(2, DIM)).sum().backward()
        opt.step()
        opt.zero_grad()
        model_sd, optim_sd = get_state_dict(model, opt)
        mgr.save(step, {"model": model_sd, "optim": optim_sd, "step": step})
        mgr.wait()
        snaps[step] = _clone({"model": model_sd, "optim": _tensors(optim_sd)})
        url = mgr.step_url(step)
        if step == 1:
            full = own_bytes(url, opts)
            assert referenced(url, opts) == set()
            continue
        # only the adapters, their AdamW state and the common state are written
        assert base_keys <= referenced(url, opts)
        assert not any(k.startswith(("model.lora", "optim.state")) for k in referenced(url, opts))
        written = own_bytes(url, opts)
        reused = full - written
        assert reused >= base_bytes and written < full - base_bytes + 1024
    mgr.close()
    assert mgr.all_steps() == [3, 4, 5]
    step_1 = backend.names("run/step_00000001")
    assert "dcpbridge.json" not in step_1 and any(n.endswith(".bin") for n in step_1)
    for step in (3, 4, 5):
        out = mgr.load(_zeros(snaps[step]), step=step)
        got = {"model": out["model"], "optim": _tensors(out["optim"])}
        assert _equal(got, snaps[step]) and out["step"] == step
    found = fsck(root, opts)
    assert (
        found.orphans == []
        and found.missing == []
        and found.checkpoints
        == [
            "step_00000003",
            "step_00000004",
            "step_00000005",
        ]
    )


def test_lora_saves_write_only_the_trainable_state(tmp_path):
    _lora_run(local_backend(tmp_path))


@pytest.mark.s3
def test_lora_saves_on_s3(s3_server):
    _lora_run(s3_backend(s3_server))


def test_full_training_writes_what_a_normal_save_writes(tmp_path):
    w = torch.randn(64, 64)
    mgr = db.CheckpointManager(tmp_path / "inc", every=1, async_save=False, incremental=True)
    for step in (1, 2):
        w.add_(1.0)
        state = {"w": w, "v": w[:8] * 2, "step": step}
        mgr.save(step, state)
    db.save(state, tmp_path / "plain")
    url = mgr.step_url(2)
    assert referenced(url) == set()
    sizes = [
        sorted(os.path.getsize(d / n) for n in os.listdir(d) if n.endswith(".bin"))
        for d in (tmp_path / "inc" / "step_00000002", tmp_path / "plain")
    ]
    assert sizes[0] == sizes[1]
    out = mgr.load({"w": torch.zeros(64, 64), "v": torch.zeros(8, 64)})
    assert torch.equal(out["w"], w) and torch.equal(out["v"], w[:8] * 2) and out["step"] == 2


def test_a_changed_chunk_in_a_middle_step_is_written_not_referenced(tmp_path):
    a = torch.arange(300_000, dtype=torch.float32).reshape(600, 500)  # several checksum tiles
    b, c = torch.randn(32, 32), torch.randn(7)
    saved = {}
    for step in (1, 2, 3):
        if step == 2:
            a[-1, -1] += 1  # the last tile only
        saved[step] = {"a": a.clone(), "b": b, "c": c}
        reuse = {} if step == 1 else {"reuse_from": tmp_path / f"s{step - 1}"}
        db.save(saved[step], tmp_path / f"s{step}", **reuse)
    files = {s: stored(str(tmp_path / f"s{s}")) for s in (2, 3)}
    assert not files[2][("a", (0, 0))].startswith("../")  # changed: written
    assert files[2][("b", (0, 0))].startswith("../s1/")
    assert files[3][("a", (0, 0))].startswith("../s2/")
    assert files[3][("b", (0, 0))].startswith("../s1/")  # straight to the original: no chain
    for s in (1, 2, 3):
        out = db.load(_zeros(saved[s]), tmp_path / f"s{s}")
        assert _equal(out, saved[s])


def test_reuse_from_must_be_a_sibling_in_the_same_format(tmp_path):
    state = {"w": torch.ones(4)}
    db.save(state, tmp_path / "run" / "s1")
    with pytest.raises(db.InvalidArgumentError, match="same parent folder"):
        db.save(state, tmp_path / "other" / "s2", reuse_from=tmp_path / "run" / "s1")
    with pytest.raises(db.InvalidArgumentError, match="another checkpoint"):
        db.save(state, tmp_path / "run" / "s1", reuse_from=tmp_path / "run" / "s1")
    with pytest.raises(db.InvalidArgumentError, match="format='dcpbridge'"):
        db.save(
            state, tmp_path / "run" / "s2", reuse_from=tmp_path / "run" / "s1", format="torch_dist"
        )
    with pytest.raises(db.NotACheckpointError):
        db.save(state, tmp_path / "run" / "s2", reuse_from=tmp_path / "run" / "nothing")
    assert not (tmp_path / "run" / "s2" / "dcpbridge.json").exists()


# -- crashes ----------------------------------------------------------------------------------


def _crash_state(step: int) -> dict:
    return {
        "base": torch.arange(40_000, dtype=torch.float32).reshape(200, 200),
        "ad": torch.full((4, 200), float(step)),
        "step": step,
    }


def _template() -> dict:
    return {"base": torch.zeros(200, 200), "ad": torch.zeros(4, 200)}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _crashing_job(root: str, point: str) -> None:
    """Steps 1-4 with keep_last=2, dying at ``point``: in the save of step 4 (data written, no
    commit), or in retention right after the doomed commit files went (the first deletion of
    data): at step 3 (doomed step 1 holds the base later steps need) or at step 4."""
    mgr = db.CheckpointManager(root, every=1, keep_last=2, async_save=False, incremental=True)
    die_at = {"save": 4, "commits": 3, "folder": 4}[point]
    for step in range(1, 5):
        if step == die_at and point == "save":
            write = FsspecCheckpointWriter.write_data

            def write_then_die(self, plan, planner, write=write):
                write(self, plan, planner).wait()
                _die()

            FsspecCheckpointWriter.write_data = write_then_die
        elif step == die_at:
            incremental._remove = incremental._remove_folder = lambda *a: _die()
        mgr.save(step, _crash_state(step))
    os._exit(3)  # not reached: the job was to die


def _job() -> multiprocessing.context.BaseContext:
    """A fork server started once, without the threads this test process may hold."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


@pytest.mark.parametrize(
    ("point", "kept"), [("save", [2, 3]), ("commits", [2, 3]), ("folder", [3, 4])]
)
def test_a_killed_save_or_retention_leaves_kept_steps_loadable_and_fsck_cleans(
    tmp_path, capsys, point, kept
):
    root = str(tmp_path / "run")
    job = _job().Process(target=_crashing_job, args=(root, point))
    job.start()
    job.join(180)
    assert job.exitcode == -signal.SIGKILL
    mgr = db.CheckpointManager(root, async_save=False)
    assert mgr.all_steps() == kept

    def all_load() -> None:
        for step in kept:
            out = mgr.load(_template(), step=step)
            expected = _crash_state(step)
            assert torch.equal(out["base"], expected["base"])
            assert torch.equal(out["ad"], expected["ad"]) and out["step"] == step

    all_load()
    found = fsck(root)
    assert found.orphans and found.missing == []
    needed = incremental.needed_files(resolve(root), [f"step_{s:08d}" for s in kept])
    assert not {tuple(o.split("/", 1)) for o in found.orphans} & needed
    code = cli.main(["fsck", root, "--fix"])
    assert code == 0 and "removed: " in capsys.readouterr().out
    all_load()
    assert fsck(root).orphans == []
    assert all(os.path.exists(f"{root}/{d}/{p}") for d, p in needed)


# -- a checkpoint copied alone ----------------------------------------------------------------


def test_a_checkpoint_copied_alone_names_what_it_misses_and_converts_whole(tmp_path, capsys):
    root = tmp_path / "run"
    mgr = db.CheckpointManager(root, every=1, async_save=False, incremental=True)
    for step in (1, 2):
        mgr.save(step, _crash_state(step))
    copy = tmp_path / "elsewhere" / "step_00000002"
    shutil.copytree(root / "step_00000002", copy)
    assert cli.main(["validate", str(copy)]) == 1
    out = capsys.readouterr().out
    assert "data file ../step_00000001/__0_" in out and "is missing" in out
    whole = root / "whole"
    assert cli.main(["convert", str(root / "step_00000002"), str(whole), "--to", "dcpbridge"]) == 0
    layout = tmp_path / "layout.yaml"
    layout.write_text('mesh: {tp: 2}\nrules:\n  - match: "*"\n    split: {axis: 0, over: tp}\n')
    split = root / "split"
    assert (
        cli.main(["reshard", str(root / "step_00000002"), str(split), "--layout", str(layout)]) == 0
    )
    exported = tmp_path / "model.pt"
    assert cli.main(["convert", str(root / "step_00000002"), str(exported), "--to", "torch"]) == 0
    shutil.rmtree(root / "step_00000001")
    shutil.rmtree(root / "step_00000002")
    plain = torch.load(exported, weights_only=True)
    assert torch.equal(plain["base"], _crash_state(2)["base"])
    assert torch.equal(plain["ad"], _crash_state(2)["ad"])
    for self_contained in (whole, split):
        assert referenced(str(self_contained)) == set()
        out = db.load(_template(), self_contained)
        assert torch.equal(out["base"], _crash_state(2)["base"])
        assert torch.equal(out["ad"], _crash_state(2)["ad"]) and out["step"] == 2


# -- two ranks, fully parallel, async ---------------------------------------------------------


def _two_rank_job(r: Rank, root: str, writer: str) -> list[set[str]]:
    torch.manual_seed(0)
    base = torch.randn(8 * r.size, 64)
    mine = base[8 * r.rank : 8 * (r.rank + 1)]
    mgr = db.CheckpointManager(
        root, every=1, process_group=r.group, fully_parallel=True, incremental=True, writer=writer
    )
    ad = torch.zeros(4, 64)
    refs, saved = [], {}
    for step in (1, 2, 3):
        ad.add_(step)  # replicated: fully_parallel spreads its writes
        state = {
            "base": db.ShardedTensor.from_rank_offsets("base", mine, (0, r.rank, r.size)),
            "ad": db.ShardedTensor.from_rank_offsets("ad", ad, replica_id=r.rank),
            "step": step,
        }
        mgr.save(step, state)
        mgr.wait()
        saved[step] = ad.clone()
        refs.append(referenced(mgr.step_url(step)))
    for step in (1, 2, 3):
        t = {
            "base": db.ShardedTensor.from_rank_offsets(
                "base", torch.zeros(8, 64), (0, r.rank, r.size)
            ),
            "ad": db.ShardedTensor.from_rank_offsets("ad", torch.zeros(4, 64), replica_id=r.rank),
        }
        out = mgr.load(t, step=step)
        assert torch.equal(out["base"], mine) and torch.equal(out["ad"], saved[step])
    mgr.close()
    return refs


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_two_ranks_fully_parallel_async_incremental(pool, tmp_path, writer):
    """The writer process references equal chunks as the thread writer does."""
    refs = pool.run(_two_rank_job, 2, str(tmp_path / "run"), writer, timeout=120)
    assert refs[0] == refs[1] == [set(), {"base"}, {"base"}]


def test_a_step_that_later_steps_reference_is_not_saved_again(tmp_path):
    mgr = db.CheckpointManager(tmp_path, every=1, async_save=False, incremental=True)
    for step in (1, 2):
        mgr.save(step, _crash_state(step))
    with pytest.raises(db.InvalidArgumentError, match="step_00000002 reference its files"):
        mgr.save(1, _crash_state(1))
    out = mgr.load(_template(), step=2)
    assert torch.equal(out["base"], _crash_state(2)["base"])
    mgr.save(2, _crash_state(2))  # nothing references step 2: it may be saved again
    assert mgr.all_steps() == [1, 2]


def test_a_step_below_the_newest_that_retention_removed_is_not_referenced_later(tmp_path):
    """A step retention removed right after its save is not referenced later (saves would fail)."""
    mgr = db.CheckpointManager(tmp_path, every=1, keep_last=1, async_save=False, incremental=True)
    for step in (8, 10):
        mgr.save(step, _crash_state(step))
    mgr.save(9, _crash_state(9))  # below the newest: retention keeps only step 10
    assert mgr.all_steps() == [10]
    mgr.save(11, _crash_state(11))
    assert mgr.all_steps() == [11]
    assert referenced(mgr.step_url(11)) == {"base"}
    out = mgr.load(_template())
    assert torch.equal(out["base"], _crash_state(11)["base"])
    assert torch.equal(out["ad"], _crash_state(11)["ad"]) and out["step"] == 11
    mgr.close()


def test_a_save_over_the_checkpoint_its_reuse_from_references_keeps_those_bytes(tmp_path):
    """Re-saving s1 from s2 (which references s1) keeps the old files the new s1 names too."""
    saved = {1: _crash_state(1), 2: _crash_state(2)}
    db.save(saved[1], tmp_path / "s1")
    db.save(saved[2], tmp_path / "s2", reuse_from=tmp_path / "s1")
    assert referenced(str(tmp_path / "s2")) == {"base"}
    db.save(saved[1], tmp_path / "s1", reuse_from=tmp_path / "s2")
    assert stored(str(tmp_path / "s1"))[("base", (0, 0))].startswith("../s1/")
    for s in (1, 2):
        out = db.load(_template(), tmp_path / f"s{s}")
        assert torch.equal(out["base"], saved[s]["base"])
        assert torch.equal(out["ad"], saved[s]["ad"]) and out["step"] == s
    assert fsck(str(tmp_path)).missing == []


def test_incremental_without_checksums_is_refused_when_the_manager_is_made(tmp_path):
    """incremental=True without checksums fails at once, not at every save after the first."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text("checkpoint: {checksums: false}\n")
    with pytest.raises(db.InvalidArgumentError, match="incremental=True needs checksums"):
        db.CheckpointManager(tmp_path / "run", async_save=False, incremental=True, config=cfg)
    assert not (tmp_path / "run").exists()


def _behind(root, **kwargs) -> db.CheckpointManager:
    """Every step persistent, every second one uploaded from its local step (not incremental)."""
    return db.CheckpointManager(
        root / "run",
        every=1,
        async_save=False,
        incremental=True,
        local_dir=root / "local",
        local_every=2,
        persist_behind=True,
        **kwargs,
    )


def test_a_refused_upload_over_a_referenced_step_keeps_that_step(tmp_path):
    """A refused upload over a referenced step deletes nothing (the later step stays loadable)."""
    mgr = _behind(tmp_path)
    for step in (1, 2, 3):
        mgr.save(step, _crash_state(step))
    assert stored(mgr.step_url(3))[("base", (0, 0))].startswith("../step_00000002/")
    with pytest.raises(db.InvalidArgumentError, match="step_00000003 reference its files"):
        mgr.save(2, _crash_state(2))
    assert mgr.all_steps() == [1, 2, 3]
    for step in (2, 3):
        out = mgr.load(_template(), step=step)
        assert torch.equal(out["base"], _crash_state(step)["base"])
        assert torch.equal(out["ad"], _crash_state(step)["ad"]) and out["step"] == step
    mgr.close()


def test_a_failed_upload_keeps_the_step_saved_there_before(tmp_path, monkeypatch):
    """A failed upload removes what it wrote, never a checkpoint committed there before."""
    from dcpbridge.engine import local_persist

    mgr = _behind(tmp_path)
    mgr.save(2, _crash_state(2))

    def gone(*args: object) -> None:
        raise OSError("bucket gone")

    monkeypatch.setattr(local_persist, "_upload_file", gone)
    for step in (2, 4):
        with pytest.raises(db.CheckpointError, match="bucket gone"):
            mgr.save(step, _crash_state(step + 10))
    assert mgr.all_steps() == [2]
    assert not (tmp_path / "run" / "step_00000004").exists()
    out = mgr.load(_template(), step=2)
    assert torch.equal(out["ad"], _crash_state(2)["ad"]) and out["step"] == 2
    assert fsck(str(tmp_path / "run")).missing == []
    mgr.close()


def test_bytes_the_previous_step_lost_are_written_again_not_referenced(tmp_path):
    """Bytes the previous step references that are gone or cut short are written again."""
    mgr = db.CheckpointManager(tmp_path, every=1, async_save=False, incremental=True)
    for step in (1, 2):
        mgr.save(step, _crash_state(step))
    assert referenced(mgr.step_url(2)) == {"base"}
    shutil.rmtree(tmp_path / "step_00000001")
    mgr.save(3, _crash_state(3))
    assert referenced(mgr.step_url(3)) == set()
    os.truncate(tmp_path / "step_00000003" / stored(mgr.step_url(3))[("base", (0, 0))], 100)
    mgr.save(4, _crash_state(4))
    assert referenced(mgr.step_url(4)) == set()
    out = mgr.load(_template(), step=4)
    assert torch.equal(out["base"], _crash_state(4)["base"])
    assert torch.equal(out["ad"], _crash_state(4)["ad"]) and out["step"] == 4
    mgr.close()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_removed_previous_step_does_not_stop_later_incremental_saves(tmp_path, async_save):
    """The step a manager's incremental saves referenced was remembered: once that step was
    removed from storage (by hand, or another manager's retention), every later save of the
    manager raised ``NotACheckpointError`` naming it. The newest complete step is taken again."""
    mgr = db.CheckpointManager(tmp_path, every=1, async_save=async_save, incremental=True)
    for step in (1, 2):
        mgr.save(step, _crash_state(step))
    mgr.wait()
    shutil.rmtree(tmp_path / "step_00000002")
    for step in (3, 4):
        mgr.save(step, _crash_state(step))
    mgr.wait()
    assert mgr.all_steps() == [1, 3, 4]
    _steps_3_and_4_reference_step_1(mgr)


def test_a_damaged_newest_step_does_not_stop_incremental_saves(tmp_path, caplog):
    """A resumed job references the newest readable step, not a damaged newest one (every save
    would fail)."""
    mgr = db.CheckpointManager(tmp_path, every=1, async_save=False, incremental=True)
    for step in (1, 2):
        mgr.save(step, _crash_state(step))
    mgr.close()
    (tmp_path / "step_00000002" / "dcpbridge.json").write_text("{garbage")
    mgr = db.CheckpointManager(tmp_path, every=1, keep_last=2, async_save=False, incremental=True)
    for step in (3, 4):
        mgr.save(step, _crash_state(step))
    assert "step_00000002" in caplog.text and "not valid JSON" in caplog.text
    assert mgr.all_steps() == [3, 4]
    _steps_3_and_4_reference_step_1(mgr)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_damaged_remembered_step_does_not_fail_later_incremental_saves(
    tmp_path, caplog, async_save
):
    """Rules 1/2: the step a manager's incremental saves reference was checked only to still
    have its commit document; once that document was damaged, every later save failed reading
    it. The save now writes everything (the only other step is unusable), warning once naming
    the step and why, and loads bit-exact without the damaged step; the next references it."""
    mgr = db.CheckpointManager(tmp_path, every=1, async_save=async_save, incremental=True)
    mgr.save(1, _crash_state(1))
    mgr.wait()
    (tmp_path / "step_00000001" / "dcpbridge.json").write_text("{garbage")
    with caplog.at_level("WARNING", logger="dcpbridge"):
        for step in (2, 3):
            mgr.save(step, _crash_state(step))
            mgr.wait()
    warned = [r.getMessage() for r in caplog.records if "skip step 1" in r.getMessage()]
    assert len(warned) == 1 and "not valid JSON" in warned[0], warned
    assert referenced(mgr.step_url(2)) == set()
    assert referenced(mgr.step_url(3)) == {"base"}
    assert stored(mgr.step_url(3))[("base", (0, 0))].startswith("../step_00000002/")
    shutil.rmtree(tmp_path / "step_00000001")
    for step in (2, 3):
        out = mgr.load(_template(), step=step)
        assert torch.equal(out["base"], _crash_state(step)["base"])
        assert torch.equal(out["ad"], _crash_state(step)["ad"]) and out["step"] == step
    mgr.close()


def _steps_3_and_4_reference_step_1(mgr: db.CheckpointManager) -> None:
    """Step 3 references step 1's base bytes; steps 3 and 4 load bit-exact. Closes ``mgr``."""
    assert stored(mgr.step_url(3))[("base", (0, 0))].startswith("../step_00000001/")
    for step in (3, 4):
        out = mgr.load(_template(), step=step)
        assert torch.equal(out["base"], _crash_state(step)["base"])
        assert torch.equal(out["ad"], _crash_state(step)["ad"]) and out["step"] == step
    mgr.close()


def test_retention_keeps_the_files_another_checkpoint_beside_the_steps_references(tmp_path):
    """A checkpoint saved beside the steps with reuse_from=a step keeps that step's bytes."""
    mgr = db.CheckpointManager(tmp_path, every=1, keep_last=1, async_save=False, incremental=True)
    mgr.save(1, _crash_state(1))
    db.save(_crash_state(1), tmp_path / "best", reuse_from=mgr.step_url(1))
    (tmp_path / "notes on the run.txt").write_text("not a checkpoint")
    for step in (2, 3):
        mgr.save(step, {"ad": _crash_state(step)["ad"], "step": step})
    assert mgr.all_steps() == [3]
    out = db.load(_template(), tmp_path / "best")
    assert torch.equal(out["base"], _crash_state(1)["base"])
    assert torch.equal(out["ad"], _crash_state(1)["ad"]) and out["step"] == 1
    assert fsck(str(tmp_path)).missing == []
    mgr.close()


def test_an_incremental_save_of_a_one_element_strided_view(tmp_path):
    """A one-element tensor in a strided view (``t[1:3:2]``, stride 2, contiguous to torch):
    the incremental save's byte view of it raised a bare RuntimeError and the save failed."""
    t = torch.arange(4.0)[1:3:2]
    assert t.is_contiguous() and t.stride() == (2,)
    state = {"x": t, "s": db.ShardedTensor.from_box("s", t, (1,), (0,))}
    db.save(state, tmp_path / "s1")
    db.save(state, tmp_path / "s2", reuse_from=tmp_path / "s1")
    out = db.load(
        {"x": torch.zeros(1), "s": db.ShardedTensor.from_box("s", torch.zeros(1), (1,), (0,))},
        tmp_path / "s2",
    )
    assert out["x"].tolist() == [1.0] and out["s"].tolist() == [1.0]


# -- spread folders and folders of roots ------------------------------------------------------


def _files(folder: str) -> set[str]:
    """Every file under ``folder``, relative to it."""
    return {os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs}


def test_retention_and_fsck_fix_remove_files_in_spread_folders(tmp_path, capsys):
    """Data files in spread folders (``prefixes``) of a doomed step, and orphans there, are
    removed: they were refused as names with a separator, so retention leaked them forever and
    ``fsck --fix`` failed."""
    root = str(tmp_path / "run")
    opts = {"prefixes": 4}
    base = torch.arange(256, dtype=torch.float32)
    mgr = db.CheckpointManager(
        root, every=1, keep_last=1, async_save=False, incremental=True, storage_options=opts
    )
    for step in (1, 2, 3):
        mgr.save(step, {"base": base, "ad": torch.full((8,), float(step)), "step": step})
    mgr.close()
    assert mgr.all_steps() == [3]
    needed = incremental.needed_files(resolve(root), ["step_00000003"])
    kept_of_1 = {p for d, p in needed if d == "step_00000001"}
    assert kept_of_1 and _files(f"{root}/step_00000001") == kept_of_1
    assert not os.path.exists(f"{root}/step_00000002")
    own = sorted(p for d, p in needed if d == "step_00000003")
    folder, name = own[0].split("/")
    orphan = f"{folder}/{name.split('.')[0]}.0123456789abcdef.bin"
    shutil.copy(f"{root}/step_00000003/{own[0]}", f"{root}/step_00000003/{orphan}")
    assert fsck(root).orphans == [f"step_00000003/{orphan}"]
    assert cli.main(["fsck", root, "--fix"]) == 0
    assert f"removed: step_00000003/{orphan}" in capsys.readouterr().out
    assert not os.path.exists(f"{root}/step_00000003/{orphan}")
    out = db.CheckpointManager(root, storage_options=opts).load(
        {"base": torch.zeros(256), "ad": torch.zeros(8)}
    )
    assert torch.equal(out["base"], base) and torch.equal(out["ad"], torch.full((8,), 3.0))


def test_retention_removes_a_referenced_steps_own_subfolders(tmp_path, caplog):
    """A step whose files a kept step references, holding a folder of its own (an
    ``on_commit`` writing ``hf/config.json`` into each step): retention refused the nested
    name and failed at every save, leaving that step's other files (its own data, its
    sidecar) forever. Now everything but the referenced files goes."""

    def add_config(step: int, tier: str, url: str) -> None:
        os.makedirs(f"{url}/hf/sub", exist_ok=True)
        with open(f"{url}/hf/sub/config.json", "w") as f:
            f.write("{}")

    root = str(tmp_path / "run")
    base = torch.arange(64, dtype=torch.float32)
    mgr = db.CheckpointManager(
        root, every=1, keep_last=1, async_save=False, incremental=True, on_commit=add_config
    )
    with caplog.at_level("WARNING", logger="dcpbridge"):
        for step in (1, 2, 3):
            mgr.save(step, {"base": base, "ad": torch.full((8,), float(step)), "step": step})
    mgr.close()
    assert "retention" not in caplog.text
    assert mgr.all_steps() == [3] and sorted(os.listdir(root)) == ["step_00000001", "step_00000003"]
    needed = incremental.needed_files(resolve(root), ["step_00000003"])
    assert _files(f"{root}/step_00000001") == {p for d, p in needed if d == "step_00000001"}
    out = db.load({"base": torch.zeros(64), "ad": torch.zeros(8)}, f"{root}/step_00000003")
    assert torch.equal(out["base"], base) and torch.equal(out["ad"], torch.full((8,), 3.0))


def test_fsck_of_a_folder_of_roots_keeps_their_checkpoints(tmp_path, capsys):
    """``fsck`` of a folder holding manager roots lists none of their committed checkpoints'
    data files as orphans (it listed them all, for ``--fix`` to delete)."""
    runs = tmp_path / "runs"
    states = {}
    for run in ("a", "b"):
        mgr = db.CheckpointManager(runs / run, every=1, async_save=False, incremental=True)
        for step in (1, 2):
            states[run, step] = _crash_state(step)
            mgr.save(step, states[run, step])
        mgr.close()
    before = _files(str(runs))
    found = fsck(str(runs))
    assert found.orphans == [] and found.missing == [] and found.unreadable == []
    assert cli.main(["fsck", str(runs), "--fix"]) == 0
    assert "0 orphaned file(s), 0 missing file(s)" in capsys.readouterr().out
    assert _files(str(runs)) == before
    for run in ("a", "b"):
        out = db.CheckpointManager(runs / run).load(_template(), step=1)
        assert torch.equal(out["base"], states[run, 1]["base"])


@pytest.mark.parametrize("command", ["reshard", "convert"])
def test_reshard_refuses_a_destination_its_source_references(tmp_path, capsys, command):
    """``reshard``/``convert --to dcpbridge --force`` into the step an incremental source
    references would delete the bytes the source reads (the source then fails to load):
    refused before anything is written."""
    root = tmp_path / "run"
    mgr = db.CheckpointManager(root, every=1, async_save=False, incremental=True)
    for step in (1, 2):
        mgr.save(step, _crash_state(step))
    src, dst = str(root / "step_00000002"), str(root / "step_00000001")
    before = _files(dst)
    layout = tmp_path / "layout.yaml"
    layout.write_text('world_size: 1\nrules:\n  - {match: "*", replicate: true}\n')
    extra = ["--layout", str(layout)] if command == "reshard" else ["--to", "dcpbridge"]
    assert cli.main([command, src, dst, *extra, "--force"]) == 1
    err = capsys.readouterr().err
    assert f"the destination {dst} holds data files that the source {src} references" in err
    assert _files(dst) == before
    assert fsck(str(root)).missing == []
    out = mgr.load(_template(), step=2)
    assert torch.equal(out["base"], _crash_state(2)["base"])
    assert torch.equal(out["ad"], _crash_state(2)["ad"])


@pytest.mark.parametrize("fault", [KeyboardInterrupt, OSError], ids=["interrupt", "storage"])
def test_a_first_incremental_save_failing_to_find_its_previous_step_leaves_nothing(
    tmp_path, monkeypatch, fault
):
    """Rule 3: a new manager's first incremental save looks for the step to reference after
    the step's sidecar (``manager.json``) was written; a failure there (a Ctrl-C, a storage
    fault reading the previous document) left that folder behind. It is looked for first."""
    from dcpbridge.engine import manager as manager_mod

    root = str(tmp_path / "run")
    first = db.CheckpointManager(root, every=1, async_save=False, incremental=True)
    first.save(1, {"w": torch.ones(4)})
    first.close()
    mgr = db.CheckpointManager(root, every=1, async_save=False, incremental=True)

    def failing(*args, **kwargs):
        if fault is OSError:
            raise db.StorageError(f"{root}: list: OSError: device gone")
        raise fault()

    with monkeypatch.context() as patch:
        if fault is OSError:  # the listing of the complete steps fails
            patch.setattr(manager_mod.CheckpointManager, "_scan", failing)
        else:  # interrupted reading the previous step's document
            patch.setattr(manager_mod.Previous, "open", failing)
        with pytest.raises((KeyboardInterrupt, db.CheckpointError)):
            mgr.save(2, {"w": torch.full((4,), 2.0)})
    assert sorted(os.listdir(root)) == ["step_00000001"]
    mgr.save(2, {"w": torch.full((4,), 2.0)})
    mgr.close()
    assert mgr.all_steps() == [1, 2]
    assert torch.equal(mgr.load({"w": torch.zeros(4)}, step=2)["w"], torch.full((4,), 2.0))
