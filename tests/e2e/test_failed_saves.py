"""Saves that fail part-way: interrupted on some ranks (KeyboardInterrupt), a commit that cannot
be written, a torch_dist data file that cannot be written. Every rank raises promptly, nothing
of the failed save looks complete (or stays, where the format allows), and the previous
checkpoint loads where the format keeps it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import dcpbridge as db
from tests.support.dist_pool import Rank, run_scripts
from tests.support.limits import file_size_limit
from tests.support.s3_server import free_port

ROWS = 1 << 17  # 512 KiB of float32 per rank: written in one large write
META = "dcpbridge.json"


def _state(r: Rank, value: float) -> dict[str, Any]:
    local = torch.arange(ROWS, dtype=torch.float32) + value * 1000 + r.rank * ROWS
    return {
        "a": db.ShardedTensor.from_box("a", local, (r.size * ROWS,), (r.rank * ROWS,)),
        "step": int(value),
    }


def save_value(r: Rank, path: str, value: float) -> None:
    db.save(_state(r, value), path, process_group=r.group)


def load_value(r: Rank, path: str) -> int:
    template = _state(r, 0.0)
    del template["step"]
    template["a"].data.zero_()
    out = db.load(template, path, process_group=r.group)
    assert torch.equal(out["a"], _state(r, float(out["step"]))["a"].data)
    return out["step"]


def _outcome(r: Rank, path: str) -> str:
    try:
        save_value(r, path, 2.0)
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


def save_interrupted(r: Rank, path: str, victims: list[int], where: str) -> str:
    """Save value 2 to ``path``; ranks in ``victims`` get a KeyboardInterrupt at ``where``."""
    from dcpbridge.storage.backends import store as backends
    from dcpbridge.storage.write import writer

    if r.rank not in victims:
        return _outcome(r, path)
    if where == "write":  # after the first large write of this rank's data file
        cls, name = writer.CoalescingFile, "write"
        original = cls.write

        def write(self: Any, data: memoryview) -> None:
            original(self, data)
            if len(data) >= 1 << 18:
                raise KeyboardInterrupt

        patched: Any = write
    else:  # "commit": the temp commit file is written, the rename is interrupted
        cls, name = backends.LocalStorage, "commit_file"
        original = cls.commit_file
        real_os = backends.os

        class InterruptingOs:
            def __getattr__(self, attr: str) -> Any:
                return getattr(real_os, attr)

            def link(self, src: str, dst: str) -> None:
                raise KeyboardInterrupt

            def replace(self, src: str, dst: str) -> None:
                raise KeyboardInterrupt

        def commit_file(self: Any, *args: Any, **kwargs: Any) -> None:
            backends.os = InterruptingOs()  # type: ignore[assignment]
            try:
                original(self, *args, **kwargs)
            finally:
                backends.os = real_os

        patched = commit_file
    setattr(cls, name, patched)
    try:
        return _outcome(r, path)
    finally:
        setattr(cls, name, original)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("victims", "where"),
    [([1], "write"), ([0], "write"), ([0, 1], "write"), ([0], "commit")],
    ids=["rank1-write", "rank0-write", "both-write", "rank0-commit"],
)
def test_an_interrupted_save_raises_everywhere_and_leaves_nothing(pool, tmp_path, victims, where):
    """The interrupted ranks raise their KeyboardInterrupt, the others a
    ``DistributedCheckpointError`` naming them (no rank waits for the process group's
    timeout); the files of the interrupted save are removed on every rank."""
    path = str(tmp_path / "ck")
    pool.run(save_value, 2, path, 1.0)
    before = sorted(os.listdir(path))
    outcomes = pool.run(save_interrupted, 2, path, victims, where, timeout=30)
    for rank, text in enumerate(outcomes):
        if rank in victims:
            assert text == "KeyboardInterrupt", text
        else:
            assert text.startswith("DistributedCheckpointError: "), text
            assert f"rank {victims[0]}: KeyboardInterrupt" in text, text
    assert sorted(os.listdir(path)) == before  # no data file, no temp commit file
    assert pool.run(load_value, 2, path) == [1, 1]
    pool.run(save_value, 2, path, 3.0)  # the ranks are in step: the next save works
    assert pool.run(load_value, 2, path) == [3, 3]


def save_with_commit_too_large(r: Rank, path: str) -> str:
    """Save value 2; the coordinator's commit file cannot be written (RLIMIT_FSIZE: EFBIG,
    as a full disk would fail it)."""
    from dcpbridge.storage.backends import store as backends

    original = backends.LocalStorage.commit_file

    def commit_file(self: Any, *args: Any, **kwargs: Any) -> None:
        with file_size_limit(64):
            original(self, *args, **kwargs)

    if r.rank == 0:
        backends.LocalStorage.commit_file = commit_file  # type: ignore[method-assign]
    try:
        return _outcome(r, path)
    finally:
        backends.LocalStorage.commit_file = original  # type: ignore[method-assign]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("first", [True, False], ids=["first-commit", "replacing"])
def test_a_commit_that_cannot_be_written_leaves_no_temp_file(pool, tmp_path, first):
    path = str(tmp_path / "ck")
    if not first:
        pool.run(save_value, 2, path, 1.0)
    before = sorted(os.listdir(path)) if not first else []
    outcomes = pool.run(save_with_commit_too_large, 2, path)
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(f"StorageError: rank 0: {path}: commit {META}: "), outcomes[0]
    assert "File too large" in outcomes[0]
    if first:  # not even the folder the save made
        assert not os.path.exists(path)
        with pytest.raises(db.NotACheckpointError):
            db.load({}, path)
        return
    assert sorted(os.listdir(path)) == before  # not even a partial dcpbridge.json.tmp-*
    assert pool.run(load_value, 2, path) == [1, 1]
    assert not any(p.name.startswith(f"{META}.tmp") for p in Path(path).iterdir())


def save_torch_dist_with_a_full_disk_on_rank_1(r: Rank, path: str, threads: int) -> str:
    """A torch_dist save whose data file on rank 1 stops growing at 64 KiB (EFBIG)."""
    try:
        with file_size_limit(64 << 10 if r.rank == 1 else None):
            db.save(
                _state(r, 2.0),
                path,
                process_group=r.group,
                format="torch_dist",
                thread_count=threads,
            )
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_torch_dist_save_that_cannot_write_fails_everywhere(pool, tmp_path, threads):
    """torch's writer loses the exceptions of its extra threads (with their files' items: the
    save used to commit a checkpoint without rank 1's data) and reports a failed write inside
    ``torch.save`` as a RuntimeError: both ranks must raise ``StorageError`` naming rank 1's
    file, and nothing is published."""
    path = str(tmp_path / "ck")
    outcomes = pool.run(save_torch_dist_with_a_full_disk_on_rank_1, 2, path, threads)
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(f"StorageError: rank 1: {path}: write __1_"), outcomes[0]
    assert "File too large" in outcomes[0]
    assert not os.path.exists(os.path.join(path, "metadata.json"))
    assert os.listdir(path) == []  # both ranks removed their data files
    with pytest.raises(db.NotACheckpointError):
        db.load({}, path, allow_pickle=True)


def async_save_interrupted_while_staging(r: Rank, path: str) -> list[str]:
    """Rank 1's async_save is interrupted while it stages; no rank calls ``result()``: both
    ranks save again (the call that waits for the failed save), then once more."""
    from dcpbridge.engine import save as save_module

    original = save_module.stage

    def stage(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    seen = []
    if r.rank == 1:
        save_module.stage = stage
    try:
        db.async_save(_state(r, 2.0), path, process_group=r.group)
        seen.append("returned")
    except KeyboardInterrupt:
        seen.append("KeyboardInterrupt")
    finally:
        save_module.stage = original
    try:  # waits for the failed save (max_in_flight=1): raises it and starts nothing
        db.async_save(_state(r, 3.0), path, process_group=r.group)
        seen.append("started")
    except db.CheckpointError as e:
        seen.append(f"{type(e).__name__}: {e}")
    db.async_save(_state(r, 4.0), path, process_group=r.group).result()  # the ranks in step
    seen.append("saved again")
    return seen


@pytest.mark.timeout(120)
def test_an_async_save_interrupted_while_staging_fails_on_every_rank_in_step(pool, tmp_path):
    """The interrupted rank raises its KeyboardInterrupt at once; its peer's background save
    fails naming it (instead of waiting for the process group's timeout). The interrupted
    rank's save was marked reported, so its next ``async_save`` started a new save while the
    peer's raised the failure and started nothing: the ranks' later calls paired wrongly
    (one checkpoint of two different steps' shards, then a hang). Now the interrupted rank,
    which holds no handle, is told at that same call too, like its peer."""
    path = str(tmp_path / "ck")
    pool.run(save_value, 2, path, 1.0)
    seen = pool.run(async_save_interrupted_while_staging, 2, path, timeout=60)
    assert [s[0] for s in seen] == ["returned", "KeyboardInterrupt"], seen
    for s in seen:
        assert s[1].startswith("DistributedCheckpointError: "), seen
        assert "rank 1: " in s[1] and "interrupted while staging" in s[1], seen
        assert s[2] == "saved again"
    assert pool.run(load_value, 2, path) == [4, 4]


class _Uncopyable:
    def __deepcopy__(self, memo: Any) -> Any:
        raise RuntimeError("cannot copy this object")


def async_save_failing_after_staging_tensors(r: Rank, path: str) -> list[str]:
    """Rank 1's staging fails after its tensors took a staging buffer; both save again."""
    seen = []
    state = _state(r, 2.0)
    if r.rank == 1:  # staged after the tensors: the buffer set is already taken
        state["obj"] = db.ShardedObject("obj", _Uncopyable(), (2,), (1,))
    else:
        state["obj"] = db.ShardedObject("obj", 0, (2,), (0,))
    try:
        db.async_save(state, path, process_group=r.group).result()
        seen.append("saved")
    except db.CheckpointError as e:  # the failing rank's own, or the peer's news of it
        seen.append(f"{type(e).__name__}: {e} (cause: {e.__cause__!r})")
    db.async_save(_state(r, 3.0), path, process_group=r.group).result()  # no staging buffer leak
    seen.append("saved again")
    return seen


@pytest.mark.timeout(120)
def test_a_failed_staging_returns_its_buffers(pool, tmp_path):
    """Staging that fails after taking a buffer set gives it back: the next async_save of the
    process (one save in flight: one set) does not wait for it forever."""
    path = str(tmp_path / "ck")
    seen = pool.run(async_save_failing_after_staging_tensors, 2, path, timeout=60)
    assert [s[1] for s in seen] == ["saved again", "saved again"], seen
    assert all(s[0].startswith("StagingError") for s in seen), seen  # raised on every rank
    assert "cannot copy this object" in seen[1][0], seen
    assert pool.run(load_value, 2, path) == [3, 3]


def save_overlapping(r: Rank, path: str, fmt: str) -> str:
    """Rank 0 holds rows 0:3, rank 1 rows 2:4 of one (4, 2) tensor, integrity check off."""
    rows = (0, 3) if r.rank == 0 else (2, 4)
    local = torch.full((rows[1] - rows[0], 2), float(r.rank))
    sd = {"w": db.ShardedTensor.from_box("w", local, (4, 2), (rows[0], 0)), "step": 1}
    try:
        db.save(sd, path, process_group=r.group, validate_access_integrity=False, format=fmt)
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


@pytest.mark.parametrize(
    ("fmt", "why"),
    [
        ("dcpbridge", "chunks [0, 0]+[3, 2] and [2, 0]+[2, 2] overlap"),
        ("torch_dist", "'w': its chunks hold 10 elements, its size (4, 2) has 8"),
    ],
)
def test_overlapping_shards_without_the_integrity_check_are_never_committed(
    pool, tmp_path, fmt, why
):
    """With ``validate_access_integrity=False`` a torch_dist save of shards that overlap was
    committed, and its load then refused it (Megatron's would take either rank's row 2).
    Both formats now refuse to commit on every rank, and leave nothing."""
    path = tmp_path / "ck"
    for text in pool.run(save_overlapping, 2, str(path), fmt):
        assert text.startswith("InvalidArgumentError: rank 0: ") and why in text, text
        assert "refusing to commit invalid metadata" in text
    assert not path.exists() or sorted(os.listdir(path)) == []


_KILLED_TORCH_DIST_SAVE = """
import os, sys, torch
import dcpbridge as db
from dcpbridge.formats import torch_dist

def killed(self, metadata, results):  # the process dies once the data files are written
    os._exit(3)

torch_dist.TorchDistWriter.finish = killed
db.save({"w": db.ShardedTensor.from_box("w", torch.full((4,), 7.0), (4,), (0,))}, sys.argv[1],
        format="torch_dist")
"""


@pytest.mark.timeout(120)
def test_a_killed_torch_dist_save_leaves_no_older_metadata_over_its_new_data(tmp_path):
    """A torch_dist save rewrites the data files of the checkpoint its directory held (fixed
    names) but left that checkpoint's ``.metadata`` and ``common.pt``: killed after its data,
    ``dcp.load`` read the new bytes through the old metadata (a 7.0 where 1.0 was saved)."""
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "td")
    db.save(
        {"w": db.ShardedTensor.from_box("w", torch.ones(4), (4,), (0,))}, path, format="torch_dist"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_TORCH_DIST_SAVE, path],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    names = set(os.listdir(path))
    assert {".metadata", "common.pt", "metadata.json"}.isdisjoint(names), names
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match=r"\.metadata"):  # torch's own reader
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=path, no_dist=True)
    with pytest.raises(db.IncompleteCheckpointError):
        db.load({"w": torch.zeros(4)}, path)


# Two fresh ranks (a destroyed group cannot be reused in the pool), saving ``state(value)``
_TWO_RANKS = """
import json, os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
import dcpbridge as db
from dcpbridge.storage import FsspecCheckpointWriter
rank, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=10))
def state(value):
    local = torch.full((1024,), value)
    return {"a": db.ShardedTensor.from_box("a", local, (2048,), (rank * 1024,)), "step": value}
"""
# then the coordinator's next commit destroys the group before rank 1 hears of it
_DESTROY_AFTER_COMMIT = """
original = FsspecCheckpointWriter.finish
def finish_then_destroy(self, metadata, results):
    original(self, metadata, results)
    dist.destroy_process_group()  # the job tears its group down while rank 1 waits to hear
if rank == 0:
    FsspecCheckpointWriter.finish = finish_then_destroy
"""

DESTROYED_MID_COMMIT = (
    _TWO_RANKS
    + "db.save(state(1.0), path)"
    + _DESTROY_AFTER_COMMIT
    + """
try:
    db.save(state(2.0), path)
    print("RESULT saved", flush=True)
except Exception as e:
    print("RESULT", type(e).__name__, str(e).splitlines()[0], flush=True)
os._exit(0)
"""
)


@pytest.mark.timeout(120)
def test_a_group_destroyed_mid_commit_says_the_checkpoint_may_be_committed(tmp_path):
    """The job destroyed its process group after the coordinator committed, before it told
    rank 1: the coordinator raised torch's ValueError (not a CheckpointError) and rank 1 a
    CollectiveError saying nothing of the commit, though the checkpoint was complete. Every
    rank now raises CollectiveError saying what it knows of the commit, naming the URL."""
    path = str(tmp_path / "ck")
    got = run_scripts(DESTROYED_MID_COMMIT, str(free_port()), path, timeout=90)
    coordinator, other = (g.split(" ", 2) for g in got)
    assert coordinator[:2] == other[:2] == ["RESULT", "CollectiveError"], got
    assert coordinator[2].startswith("rank 0 of 2: broadcast with the other ranks failed: the ")
    assert "process group was destroyed" in coordinator[2]
    assert coordinator[2].endswith(
        f"; the checkpoint {path} was committed before that: it is complete, though the "
        "other ranks may report this save as failed"
    )
    assert other[2].startswith("rank 1 of 2: broadcast with the other ranks failed")
    assert other[2].endswith(
        f"; the coordinator may have committed the checkpoint {path} before that (then it is "
        "complete): check it before relying on it or saving it again"
    )
    template = {"a": db.ShardedTensor.from_box("a", torch.zeros(2048), (2048,), (0,))}
    out = db.load(template, path)
    assert out["step"] == 2.0 and torch.equal(out["a"], torch.full((2048,), 2.0))


MANAGER_DESTROYED_MID_COMMIT = (
    _TWO_RANKS
    + """
mgr = db.CheckpointManager(path, every=1, keep_best=1, best_metric="loss", async_save=False)
mgr.save(1, state(1.0), metrics={"loss": 1.0})
mgr.wait()
"""
    + _DESTROY_AFTER_COMMIT
    + """
try:
    mgr.save(2, state(2.0), metrics={"loss": 0.5})
    mgr.wait()
except db.CheckpointError as e:
    print("RESULT", type(e).__name__, flush=True)
if rank == 0:
    with open(os.path.join(mgr.step_url(2), "manager.json")) as f:
        print("RESULT metrics", json.dumps(json.load(f)["metrics"]), flush=True)
os._exit(0)
"""
)


@pytest.mark.timeout(120)
def test_a_manager_save_committed_before_its_group_went_keeps_its_metrics(tmp_path):
    """A manager's save whose commit landed before the exchange after it failed: rank 0
    treated the committed step as a failed save and removed its metrics sidecar (a new step;
    a re-save got the replaced save's back), so ``keep_best`` ranked the step having none.
    Its metrics now stay with the committed step."""
    root = str(tmp_path / "run")
    got = run_scripts(MANAGER_DESTROYED_MID_COMMIT, str(free_port()), root, timeout=90)
    assert sorted(got) == ["RESULT CollectiveError"] * 2 + ['RESULT metrics {"loss": 0.5}'], got
    template = {"a": db.ShardedTensor.from_box("a", torch.zeros(2048), (2048,), (0,))}
    out = db.load(template, os.path.join(root, "step_00000002"))
    assert torch.equal(out["a"], torch.full((2048,), 2.0))


def save_bits_torch_dist(r: Rank, path: str) -> str:
    """A torch_dist save over a good one: ``b``'s only writer (rank 1) holds it as bits16."""
    raw = torch.arange(8, dtype=torch.int16).view(torch.bits16)
    sd = {
        "w": db.ShardedTensor.from_box("w", torch.full((2,), 9.0), (4,), (2 * r.rank,)),
        "b": db.ShardedTensor.from_box("b", raw, (8,), (0,), replica_id=1 - r.rank),
    }
    try:
        db.save(sd, path, process_group=r.group, format="torch_dist")
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


def test_a_torch_dist_save_of_a_dtype_torch_cannot_write_keeps_the_older_checkpoint(pool, tmp_path):
    """torch's DCP writer cannot size bits (and uint1..7, int1..7) elements: a torch_dist save
    of such a tensor raised torch's ``TypeError`` from the write, after the checkpoint the
    directory held had been unpublished (its ``.metadata`` and ``common.pt`` removed). It is
    refused while planning, on every rank, naming the key, and the older checkpoint loads."""
    path = str(tmp_path / "ck")
    w = torch.arange(4, dtype=torch.float32)
    db.save({"w": db.ShardedTensor.from_box("w", w, (4,), (0,))}, path, format="torch_dist")
    before = sorted(os.listdir(path))
    for text in pool.run(save_bits_torch_dist, 2, path):
        assert text.startswith("SerializationError: ") and "'b'" in text, text
        assert "torch.bits16" in text and "torch_dist" in text, text
    assert sorted(os.listdir(path)) == before
    out = db.load({"w": db.ShardedTensor.from_box("w", torch.zeros(4), (4,), (0,))}, path)
    assert torch.equal(out["w"], w)


class _InterruptedState:
    """A Stateful whose ``state_dict`` is interrupted (a Ctrl-C while a load asks for it)."""

    def state_dict(self) -> dict[str, Any]:
        raise KeyboardInterrupt

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def load_interrupted_in_state_dict(r: Rank, path: str, parallel: bool) -> list[str]:
    """Rank 1's Stateful is interrupted in ``state_dict()`` as the load asks for its
    template; then both ranks load again."""
    template: dict[str, Any] = {"a": _state(r, 0.0)["a"]}
    if r.rank == 1:
        template["app"] = _InterruptedState()
    seen = []
    try:
        db.load(
            template,
            path,
            process_group=r.group,
            strict="assume_ok_unexpected",
            fully_parallel=parallel,
        )
        seen.append("loaded")
    except KeyboardInterrupt:
        seen.append("KeyboardInterrupt")
    except db.CheckpointError as e:
        seen.append(f"{type(e).__name__}: {e}")
    seen.append(str(load_value(r, path)))  # the ranks are in step: the next load works
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("parallel", [False, True], ids=["plain", "fully-parallel"])
def test_a_load_interrupted_in_a_stateful_state_dict_fails_its_peers(pool, tmp_path, parallel):
    """A Stateful's ``state_dict()`` interrupted on rank 1 while a load built its template
    raised there before any collective, so rank 0 waited in the load's first exchange for
    the process group's timeout. The interrupt is carried into that exchange: rank 1 raises
    its KeyboardInterrupt, rank 0 a ``DistributedCheckpointError`` naming it, and both load
    again."""
    path = str(tmp_path / "ck")
    pool.run(save_value, 2, path, 1.0)
    seen = pool.run(load_interrupted_in_state_dict, 2, path, parallel, timeout=60)
    assert seen[1] == ["KeyboardInterrupt", "1"], seen
    assert seen[0][0].startswith("DistributedCheckpointError: "), seen
    assert "rank 1: KeyboardInterrupt" in seen[0][0], seen
    assert seen[0][1] == "1"


def async_saves_interrupted_in_state_dict(r: Rank, root: str, kind: str) -> list[str]:
    """Four saves; rank 1's Stateful is interrupted in ``state_dict()`` at the second (as the
    save sorts its state). Each call is recorded; nothing waits on a handle in between."""
    extra: dict[str, Any] = {}
    if kind == "manager-local":
        extra = {"local_dir": os.path.join(root, "shm{node}"), "ranks_per_node": 1}
    mgr = None
    if kind != "async_save":
        mgr = db.CheckpointManager(
            os.path.join(root, "run"), every=1, process_group=r.group, **extra
        )
    app = _InterruptedState()
    seen = []
    for step in range(1, 5):
        state: dict[str, Any] = {**_state(r, float(step))}
        if r.rank == 1 and step == 2:
            state["app"] = app
        try:
            if mgr is None:
                db.async_save(state, os.path.join(root, str(step)), process_group=r.group)
            else:
                mgr.save(step, state)
            seen.append("saved")
        except KeyboardInterrupt:
            seen.append("KeyboardInterrupt")
        except db.CheckpointError as e:
            seen.append(f"{type(e).__name__}: {e}")
    if mgr is not None:
        mgr.close()
        seen.append(str(mgr.all_steps()))
    else:
        db.async_save(_state(r, 5.0), os.path.join(root, "5"), process_group=r.group).result(60)
    seen.append(
        str(
            load_value(
                r, os.path.join(root, "run", "step_00000004") if mgr else os.path.join(root, "4")
            )
        )
    )
    return seen


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["async_save", "manager", "manager-local"])
def test_an_async_save_interrupted_in_a_stateful_state_dict_keeps_the_ranks_in_step(
    pool, tmp_path, kind
):
    """A Stateful's ``state_dict()`` interrupted on rank 1 as an async save sorted its state:
    rank 1 raised its KeyboardInterrupt at once, while rank 0 deferred the failure (known in
    the same vote) to its next call, which then started nothing; rank 1's next call started a
    save, so the ranks' calls paired wrongly from there (later saves failed or hung). Rank 0
    now raises ``DistributedCheckpointError`` naming rank 1 in the same call, and the next
    saves of both commit."""
    seen = pool.run(async_saves_interrupted_in_state_dict, 2, str(tmp_path), kind, timeout=120)
    assert seen[1][:4] == ["saved", "KeyboardInterrupt", "saved", "saved"], seen
    assert seen[0][0] == "saved" and seen[0][2:4] == ["saved", "saved"], seen
    assert seen[0][1].startswith("DistributedCheckpointError: "), seen
    assert "rank 1: KeyboardInterrupt" in seen[0][1], seen
    if kind != "async_save":
        assert seen[0][4] == seen[1][4] == "[1, 3, 4]", seen
    assert seen[0][-1] == seen[1][-1] == "4", seen


def manager_saves_interrupted_while_staging(r: Rank, root: str, behind: bool) -> list[str]:
    """Four saves of an async CheckpointManager; rank 1's second is interrupted while it
    stages (after the save's collective decisions)."""
    from dcpbridge.engine import save as save_module

    original = save_module.stage

    def stage(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    extra: dict[str, Any] = {}
    if behind:  # staged for the local step, uploaded from it behind
        extra = {
            "local_dir": os.path.join(root, "shm{node}"),
            "ranks_per_node": 1,
            "persist_behind": True,
        }
    mgr = db.CheckpointManager(os.path.join(root, "run"), every=1, process_group=r.group, **extra)
    seen = []
    for step in range(1, 5):
        if r.rank == 1 and step == 2:
            save_module.stage = stage
        try:
            mgr.save(step, _state(r, float(step)))
            seen.append("saved")
        except KeyboardInterrupt:
            seen.append("KeyboardInterrupt")
        except db.CheckpointError as e:
            seen.append(f"{type(e).__name__}: {e}")
        finally:
            save_module.stage = original
    mgr.close()
    seen.append(str(mgr.all_steps()))
    seen.append(str(load_value(r, os.path.join(root, "run", "step_00000004"))))
    return seen


@pytest.mark.timeout(180)
@pytest.mark.parametrize("behind", [False, True], ids=["async", "persist-behind"])
def test_a_manager_save_interrupted_while_staging_keeps_the_ranks_in_step(pool, tmp_path, behind):
    """Rank 1's async manager save interrupted while staging: its peers' save of that step
    fails in the background and their next ``save`` raises it and starts nothing, but rank 1's
    manager kept no pending save, so its next ``save`` started one: from there the ranks'
    calls paired wrongly (step 4 failed with missing files, then rank 1 hung). Rank 1's next
    ``save`` now raises that step's failure too, and step 4 commits on both."""
    seen = pool.run(manager_saves_interrupted_while_staging, 2, str(tmp_path), behind, timeout=120)
    assert seen[0][:2] == ["saved", "saved"] and seen[1][:2] == ["saved", "KeyboardInterrupt"]
    for rank in (0, 1):
        assert seen[rank][2].startswith("DistributedCheckpointError: rank 1: "), seen
        assert "was interrupted while staging" in seen[rank][2], seen
        assert seen[rank][3:] == ["saved", "[1, 4]", "4"], seen


@pytest.mark.parametrize("how", ["save", "async_save", "plain_dcp"])
def test_a_failed_write_removes_the_folder_its_save_made(tmp_path, monkeypatch, how):
    """Rule 3: a save whose write failed (a full disk) removed its data files but left the
    folder it had made, an empty checkpoint-looking directory. The folder goes with them; one
    that was there before the save stays."""
    import torch.distributed.checkpoint as dcp

    from dcpbridge.storage.backends.store import LocalStorage

    def full_disk(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LocalStorage, "open_write", full_disk)

    def save(path: str) -> None:
        if how == "save":
            db.save({"w": torch.ones(2)}, path)
        elif how == "async_save":
            db.async_save({"w": torch.ones(2)}, path, writer="thread").result()
        else:
            writer = db.FsspecCheckpointWriter(path)
            dcp.save({"w": torch.ones(2)}, storage_writer=writer, no_dist=True)

    # plain dcp.save raises DCP's CheckpointException (a BaseException) around our error
    with pytest.raises(BaseException, match="No space left on device"):
        save(str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()
    (tmp_path / "there").mkdir()
    with pytest.raises(BaseException, match="No space left on device"):
        save(str(tmp_path / "there"))
    assert (tmp_path / "there").is_dir() and not list((tmp_path / "there").iterdir())


def save_failing_beside_the_folder_s_maker(r: Rank, path: str, where: str) -> str:
    """Rank 0 makes ``path`` (rank 1 plans a moment later and finds it there); then rank 0's
    write fails past 64 KiB (a full disk) after rank 1 wrote, and rank 1 removes its files a
    moment after rank 0's cleanup, or (``where="plan"``) rank 1's planning fails."""
    from dcpbridge.storage.write.writer import FsspecCheckpointWriter as Writer

    prepare, write, abort = Writer.prepare_local_plan, Writer.write_data, Writer.abort

    def late_prepare(self: Any, plan: Any) -> Any:
        time.sleep(0.5)  # rank 0 made the folder by now
        if where == "plan":
            raise db.StorageError("rank 1 cannot plan")
        return prepare(self, plan)

    def late_write(self: Any, plan: Any, planner: Any) -> Any:
        time.sleep(0.5)  # rank 1's data file is written by now
        return write(self, plan, planner)

    def late_abort(self: Any) -> None:
        time.sleep(0.5)  # rank 0's cleanup is over by now
        abort(self)

    if r.rank == 0:
        Writer.write_data = late_write  # type: ignore[method-assign]
    else:
        Writer.prepare_local_plan, Writer.abort = late_prepare, late_abort  # type: ignore[method-assign]
    state = {"a": db.ShardedTensor.from_box("a", torch.ones(1 << 16), (2 << 16,), (r.rank << 16,))}
    try:
        with file_size_limit(64 << 10 if r.rank == 0 else None):
            db.save(state, path, process_group=r.group)
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        Writer.prepare_local_plan, Writer.write_data, Writer.abort = prepare, write, abort  # type: ignore[method-assign]
    return "saved"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["write", "plan"])
def test_a_failed_save_on_two_ranks_removes_the_folder_it_made(pool, tmp_path, where):
    """Rule 3: only the rank whose ``makedirs`` made the folder removed it, as it cleaned up
    its own files; another rank's files were still there then, so once that rank removed
    them an empty checkpoint-looking folder stayed (a failed plan removed nothing at all).
    The folder now goes once every rank's cleanup is done; one there before stays."""
    for existed in (False, True):
        path = tmp_path / f"ck{existed}"
        if existed:
            path.mkdir()
        seen = pool.run(save_failing_beside_the_folder_s_maker, 2, str(path), where, timeout=60)
        assert seen[0] == seen[1], seen
        if where == "write":
            assert seen[0].startswith("StorageError: rank 0: "), seen
            assert "File too large" in seen[0], seen
        else:
            assert seen[0] == "StorageError: rank 1: rank 1 cannot plan", seen
        assert path.is_dir() == existed, seen
        if existed:
            assert not list(path.iterdir())
