"""Async save (staging, background commit, failures), plan caching and metadata caching."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import dcpbridge as db
from dcpbridge.engine.async_save import AsyncSaver
from dcpbridge.engine.cache import SAVE_CACHES
from dcpbridge.engine.collectives import Group
from dcpbridge.storage import read_checkpoint_metadata, resolve
from tests.support import layouts as L
from tests.support.collective_counts import count_collectives
from tests.support.dist_pool import Rank, run_scripts
from tests.support.s3_server import free_port


def _state(rank: int, scale: float) -> dict:
    w = L.full("w").chunk(2)[rank].clone() * scale
    return {
        "w": db.ShardedTensor.from_rank_offsets("w", w, (0, rank, 2)),
        "rng": db.ShardedObject("rng", {"seed": int(scale)}, (2,), (rank,)),
        "iteration": int(scale),
    }


def _check(rank: int, path: str, scale: float, group) -> None:
    tmpl = _state(rank, 0.0)
    tmpl["rng"] = db.ShardedObject("rng", None, (2,), (rank,))
    out = db.load(tmpl, path, process_group=group)
    assert torch.equal(out["w"], L.full("w").chunk(2)[rank] * scale)
    assert out["rng"] == {"seed": int(scale)} and out["iteration"] == int(scale)


def async_twice(r: Rank, root: str) -> None:
    first = _state(r.rank, 1.0)
    h1 = db.async_save(first, os.path.join(root, "a"), process_group=r.group)
    first["w"].data.mul_(100)  # training goes on: the staged copy is unaffected
    first["rng"].data["seed"] = -1
    h2 = db.async_save(_state(r.rank, 2.0), os.path.join(root, "b"), process_group=r.group)
    assert h1.done()  # max_in_flight=1: the second call waited for the first
    h2.result(timeout=60)
    _check(r.rank, os.path.join(root, "a"), 1.0, r.group)
    _check(r.rank, os.path.join(root, "b"), 2.0, r.group)


def test_async_save_stages_then_commits_in_background(pool, tmp_path):
    pool.run(async_twice, 2, str(tmp_path))


def test_async_save_single_process(tmp_path):
    state = _state(0, 3.0)
    state["w"] = db.ShardedTensor.from_box("w", L.full("w").clone() * 3, (12, 8), (0, 0))
    state["rng"] = db.ShardedObject("rng", {"seed": 3}, (1,), (0,))
    handle = db.async_save(state, str(tmp_path))
    state["w"].data.zero_()
    handle.result(timeout=60)
    out = db.load(
        {"w": db.ShardedTensor.from_box("w", torch.zeros(12, 8), (12, 8), (0, 0))}, str(tmp_path)
    )
    assert torch.equal(out["w"], L.full("w") * 3) and out["iteration"] == 3


@pytest.mark.timeout(120)
def test_a_free_staging_buffer_is_taken_by_identity_not_by_its_bytes(tmp_path):
    """Two saves in flight leave two free buffer sets of different sizes; a third, smaller
    save takes the smaller one, which is not first in the free list: taking it out must not
    compare the sets' tensors (that raised RuntimeError, failing the save as StagingError)."""
    sizes = {"a": 2 << 20, "b": 1 << 19, "c": 1 << 18}  # float32 elements
    states = {
        n: {"w": torch.arange(k, dtype=torch.float32) + i} for i, (n, k) in enumerate(sizes.items())
    }
    first = db.async_save(states["a"], str(tmp_path / "a"), max_in_flight=2)
    second = db.async_save(states["b"], str(tmp_path / "b"), max_in_flight=2)
    first.result(timeout=60)  # released in order: the big set first, then the smaller one
    second.result(timeout=60)
    db.async_save(states["c"], str(tmp_path / "c"), max_in_flight=2).result(timeout=60)
    for name, state in states.items():
        out = db.load({"w": torch.zeros_like(state["w"])}, str(tmp_path / name))
        assert torch.equal(out["w"], state["w"]), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("background", [False, True])
def test_a_staging_buffer_that_cannot_be_allocated_does_not_hang_later_saves(tmp_path, background):
    """A failed allocation of staging memory fails that save only; the next save stages."""
    huge = torch.zeros(1).expand(2**46)  # 256 TiB to stage: no allocator gives that
    state = {"huge": db.ShardedTensor.from_box("huge", huge, (2**46,), (0,))}
    handle = db.async_save(
        state, str(tmp_path / "huge"), background_staging=background, writer="thread"
    )
    with pytest.raises(db.StagingError, match=r"huge: staging failed") as failed:
        handle.result(timeout=60)
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert not os.path.exists(tmp_path / "huge" / "dcpbridge.json")
    w = L.full("w").clone()
    state = {"w": db.ShardedTensor.from_box("w", w, (12, 8), (0, 0))}
    handle = db.async_save(state, str(tmp_path / "ok"), background_staging=background)
    handle.result(timeout=60)  # it used to wait forever for the failed save's buffer
    tmpl = {"w": db.ShardedTensor.from_box("w", torch.zeros(12, 8), (12, 8), (0, 0))}
    assert torch.equal(db.load(tmpl, str(tmp_path / "ok"))["w"], L.full("w"))


FREED_STORAGE_SAVE = """
import sys, torch, dcpbridge as db
t = torch.randn(1 << 20)
t.untyped_storage().resize_(0)  # freed, as FSDP frees an unsharded parameter's storage
state = {"w": db.ShardedTensor.from_box("w", t, (1 << 20,), (0,))}
try:
    db.async_save(state, sys.argv[1], background_staging=sys.argv[2] == "1").result(timeout=60)
except db.CheckpointError as e:
    print(type(e).__name__, e)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("background", [False, True])
def test_a_tensor_whose_storage_was_freed_fails_its_async_save(tmp_path, background):
    """A tensor whose storage no longer holds its elements (resized to 0 bytes, as FSDP frees
    parameters) fails the save call naming its key, before anything is staged (was: a
    segfault while copying it: the whole training process died). Freed after the call, its
    staging refuses it (``StagingError``)."""
    run = _script(FREED_STORAGE_SAVE, str(tmp_path / "ck"), str(int(background)), timeout=50)
    assert run.stdout.startswith("SerializationError "), run.stdout + run.stderr[-2000:]
    assert "'w': the tensor's storage holds 0 bytes, fewer than its shape" in run.stdout
    assert not os.path.exists(tmp_path / "ck")


@pytest.mark.timeout(60)
def test_an_interrupt_while_verifying_the_staged_copy_does_not_hang_later_saves(
    tmp_path, monkeypatch
):
    """A Ctrl-C during ``verify_staging``'s check gives the staging buffers back. The next
    async_save raises the interrupted save's failure (as on a group's every rank: the call
    that waits for it) instead of waiting for its buffer; the one after saves."""
    from dcpbridge.engine import save as api

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "verify_staged", interrupted)
    w = L.full("w").clone()
    state = {"w": db.ShardedTensor.from_box("w", w, (12, 8), (0, 0))}
    with pytest.raises(KeyboardInterrupt):
        db.async_save(state, str(tmp_path / "a"), verify_staging=True, writer="thread")
    monkeypatch.undo()
    with pytest.raises(db.DistributedCheckpointError, match="interrupted while staging"):
        db.async_save(state, str(tmp_path / "b"), writer="thread")
    handle = db.async_save(state, str(tmp_path / "b"), writer="thread")
    handle.result(timeout=30)  # it used to wait forever for the interrupted save's buffer
    tmpl = {"w": db.ShardedTensor.from_box("w", torch.zeros(12, 8), (12, 8), (0, 0))}
    assert torch.equal(db.load(tmpl, str(tmp_path / "b"))["w"], L.full("w"))
    assert not os.path.exists(tmp_path / "a" / "dcpbridge.json")


def async_failing(r: Rank, root: str) -> tuple[str, str, bool]:
    state = _state(r.rank, 1.0)
    if r.rank == 1:
        state["bad"] = db.ShardedObject("bad", lambda: 0, (1,), (0,))
    handle = db.async_save(state, os.path.join(root, "bad"), process_group=r.group)
    with pytest.raises(db.SerializationError) as first:
        handle.result(timeout=60)
    # unobserved, a failure surfaces at the next async_save, which then starts nothing
    h = db.async_save(state, os.path.join(root, "bad2"), process_group=r.group)
    good = os.path.join(root, "good")
    with pytest.raises(db.SerializationError) as second:
        db.async_save(_state(r.rank, 2.0), good, process_group=r.group)
    assert h.done()
    db.async_save(_state(r.rank, 2.0), good, process_group=r.group).result(60)
    return (
        str(first.value),
        str(second.value),
        os.path.exists(os.path.join(root, "bad", "dcpbridge.json")),
    )


def test_async_failure_surfaces_on_every_rank_and_never_commits(pool, tmp_path):
    (a1, a2, c0), (b1, b2, c1) = pool.run(async_failing, 2, str(tmp_path))
    assert a1 == b1 and "rank 1" in a1 and "'bad/shard_0_1'" in a1
    assert a2 == b2
    assert not c0 and not c1
    assert not os.path.exists(tmp_path / "bad2" / "dcpbridge.json")
    assert os.path.exists(tmp_path / "good" / "dcpbridge.json")  # the next save still works


def async_memory(r: Rank, root: str, saves: int) -> list[int]:
    """RSS after each of ``saves`` async saves of a 64 MiB state into the same directory."""
    tensor = torch.randn(16 << 20)  # 64 MiB
    rss = []
    for i in range(saves):
        tensor[0] = i
        state = {"t": db.ShardedTensor.from_box("t", tensor, tuple(tensor.shape), (0,))}
        db.async_save(state, root, process_group=r.group).result(timeout=120)
        with open("/proc/self/status") as f:
            rss.append(next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS")))
    tmpl = {
        "t": db.ShardedTensor.from_box("t", torch.empty_like(tensor), tuple(tensor.shape), (0,))
    }
    out = db.load(tmpl, root, process_group=r.group)
    assert out["t"][0] == saves - 1 and torch.equal(out["t"], tensor)
    return rss


def test_async_host_memory_is_flat(pool, tmp_path):
    rss = pool.run(async_memory, 1, str(tmp_path), 12)[0]
    steady = rss[2:]  # after the staging buffer exists
    assert max(steady) - min(steady) < 32 << 20, [r >> 20 for r in rss]


def count_cached_saves(r: Rank, root: str) -> list[dict]:
    SAVE_CACHES.clear()
    counts = []
    for i, structure in enumerate(["same", "same", "same", "changed"]):
        state = _state(r.rank, float(i))
        if structure == "changed":
            state["extra"] = db.ShardedTensor.from_rank_offsets(
                "extra", torch.ones(2), (0, r.rank, 2)
            )
        with count_collectives() as calls:
            db.save(state, os.path.join(root, str(i)), process_group=r.group)
        counts.append(dict(calls))
        _check(r.rank, os.path.join(root, str(i)), float(i), r.group)
    return counts


def test_plan_cache_skips_the_plan_exchange(pool, tmp_path):
    counts = pool.run(count_cached_saves, 2, str(tmp_path))
    first, second, third, changed = counts[0]
    full = {"all_gather": 1, "gather": 2, "scatter": 1, "broadcast": 1}  # vote + plan + commit
    assert first == changed == full
    assert second == third == {"all_gather": 1, "gather": 1, "broadcast": 1}  # vote + commit
    assert counts[0] == counts[1]


def test_reader_metadata_cache_is_invalidated_by_a_resave(tmp_path):
    path = str(tmp_path)
    db.save({"a": db.ShardedTensor.from_box("a", torch.ones(3), (3,), (0,))}, path)
    loc = resolve(path)
    first = read_checkpoint_metadata(loc)
    assert read_checkpoint_metadata(loc) is first
    db.save({"b": db.ShardedTensor.from_box("b", torch.ones(3), (3,), (0,))}, path)
    second = read_checkpoint_metadata(loc)
    assert second is not first and "b" in second.state_dict_metadata


def asymmetric_factory(r: Rank, path: str) -> str:
    def build(key, data, replica_id):
        if r.rank == 1:
            raise RuntimeError("factory exploded on rank 1")
        return {"x": db.ShardedTensor.from_rank_offsets(key, data, (0, r.rank, 2))}

    f = db.ShardedTensorFactory("f", torch.ones(2), build, lambda d: d["x"])
    with pytest.raises(db.InvalidShardError) as info:  # on every rank, naming the factory
        db.save({"f": f}, path, process_group=r.group)
    return str(info.value)


def test_a_rank_failing_before_any_collective_fails_all(pool, tmp_path):
    a, b = pool.run(asymmetric_factory, 2, str(tmp_path / "x"), timeout=60)
    assert a == b and a.startswith("rank 1: factory 'f': build_fn failed: RuntimeError(")


def _typed(rank: int, dtype: torch.dtype, step: int) -> dict:
    rows = (torch.arange(2) + 2 * rank + 10 * step).to(dtype)
    if dtype.is_floating_point:
        rows += 0.5
    return {"w": db.ShardedTensor.from_box("w", rows, (4,), (2 * rank,)), "step": step}


def reuse_vote_then_previous_save_lands(r: Rank, root: str) -> list[str]:
    """A save votes to reuse the cached plan of structure A while an async save of structure
    B (same keys and boxes, int32 instead of float32) is in flight; that save lands between
    the vote and the reuse. The voted entry (A's) must be the one reused."""
    import threading

    from dcpbridge.engine import protocol

    SAVE_CACHES.clear()
    db.save(_typed(r.rank, torch.float32, 0), f"{root}/a0", process_group=r.group)
    gate = threading.Event()
    other = db.async_save(
        _typed(r.rank, torch.int32, 1),
        f"{root}/b1",
        process_group=r.group,
        max_in_flight=2,
        before_write=lambda: gate.wait(30),  # held until the next save has voted
    )
    real = protocol.agree

    def agree(group, step, local):  # type: ignore[no-untyped-def]
        out = real(group, step, local)
        if step == "plan":  # the vote is taken: the save in flight lands now
            gate.set()
            other.result(timeout=60)
        return out

    protocol.agree = agree
    try:
        db.async_save(
            _typed(r.rank, torch.float32, 2), f"{root}/a2", process_group=r.group, max_in_flight=2
        ).result(timeout=60)
    finally:
        protocol.agree = real
    seen = []
    for name, dtype, step in (
        ("a0", torch.float32, 0),
        ("b1", torch.int32, 1),
        ("a2", torch.float32, 2),
    ):
        tmpl = {
            "w": db.ShardedTensor.from_box("w", torch.zeros(2, dtype=dtype), (4,), (2 * r.rank,))
        }
        out = db.load(tmpl, f"{root}/{name}", process_group=r.group)
        assert torch.equal(out["w"], _typed(r.rank, dtype, step)["w"].data), name
        assert out["step"] == step
        seen.append(str(out["w"].dtype))
    return seen


@pytest.mark.timeout(120)
def test_a_save_reuses_the_plan_it_voted_for_not_one_that_landed_since(pool, tmp_path):
    """The plan-cache race: the entry reused is read with the vote, not after it."""
    seen = pool.run(reuse_vote_then_previous_save_lands, 2, str(tmp_path), timeout=90)
    assert seen == [["torch.float32", "torch.int32", "torch.float32"]] * 2


def test_staging_refuses_a_tensor_freed_after_the_save_call():
    """With ``background_staging`` the copy runs after the call's checks: a tensor freed in
    between fails its staging by name instead of crashing the copy."""
    from dcpbridge.engine import staging

    t = torch.randn(64)
    shard = db.ShardedTensor.from_box("w", t, (64,), (0,))
    staging._check_backed(shard)  # held: nothing to say
    t.untyped_storage().resize_(0)
    with pytest.raises(db.StagingError, match=r"'w' \(offset \(0,\)\): its storage holds 0 bytes"):
        staging._check_backed(shard)


# -- the background waits' own store client -----------------------------------------------------


def store_op_while_the_commit_waits(r: Rank, root: str) -> float | None:
    """Rank 1's saver is busy for 6 s before its save, so rank 0's background save waits in
    the store for it; meanwhile rank 0's main thread makes a store call: how long it took."""
    saver = AsyncSaver.for_group(Group.resolve(r.group), 2)
    if r.rank == 1:
        saver.submit("busy", lambda: time.sleep(6), None)  # a slow peer's saver
    path = os.path.join(root, "a")
    handle = db.async_save(_state(r.rank, 1.0), path, process_group=r.group, max_in_flight=2)
    took = None
    if r.rank == 0:
        time.sleep(1)  # the background save now waits for rank 1's part of an exchange
        store = dist.distributed_c10d._get_default_store()
        start = time.monotonic()
        store.add("dcpbridge-test/probe", 1)
        took = time.monotonic() - start
    handle.result(timeout=60)
    _check(r.rank, path, 1.0, r.group)
    return took


@pytest.mark.timeout(120)
def test_a_background_wait_does_not_hold_up_the_jobs_store_calls(pool, tmp_path):
    """The async saver waited for its peers on the job's own store client, which serves one
    call at a time: a main-thread store call (creating a process group, a barrier of the
    store) waited behind it, here for seconds, in a job for as long as the slowest rank."""
    took, _ = pool.run(store_op_while_the_commit_waits, 2, str(tmp_path), timeout=90)
    assert took < 2.0, took


# -- a process group destroyed and made again in-process ------------------------------------------

REINIT = """
import gc, os, sys, threading, time
from datetime import timedelta
import torch
import torch.distributed as dist
import dcpbridge as db
from dcpbridge.engine.async_save import AsyncSaver
from dcpbridge.engine.collectives import Group
from dcpbridge.engine.writer_process import process_of

rank, root, held = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "held"
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4], DCPB_PEER_TIMEOUT="2")
ROWS = torch.arange(8, dtype=torch.float32)[rank * 4 : rank * 4 + 4]

def state(scale):
    return {"w": db.ShardedTensor.from_rank_offsets("w", ROWS * scale, (0, rank, 2))}

def exact(name, scale):
    tmpl = {"w": db.ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, 2))}
    return torch.equal(db.load(tmpl, os.path.join(root, name))["w"], ROWS * scale)

def ended(child, seconds):
    deadline = time.monotonic() + seconds
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return child.poll() is not None

dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=20))
kept = Group.resolve().pg if held else None  # a caller that still holds the old group
db.async_save(state(1.0), os.path.join(root, "a"), writer="process").result(60)
saver = AsyncSaver.for_group(Group.resolve(), 1)
child, area, thread = process_of(saver.area)._proc, saver.area, saver._thread
del saver
pending = db.async_save(state(3.0), os.path.join(root, "p"), writer="process")
dist.barrier()
dist.destroy_process_group()
gc.collect()
at_destroy = ended(child, 10)
if held:  # the held group keeps its store server, and with it the port
    os.environ["MASTER_PORT"] = sys.argv[5]
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=20))
db.async_save(state(2.0), os.path.join(root, "b"), writer="thread").result(60)
try:
    pending.result(60)
    fate = "saved"
except db.CheckpointError as e:
    fate = type(e).__name__
committed = os.path.exists(os.path.join(root, "p", "dcpbridge.json"))
# committed only whole (a failure may come after the commit: then the files are complete)
pending_ok = exact("p", 3.0) if committed else fate != "saved"
gc.collect()
after = ended(child, 10)
threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("dcpb-async"))
freed = not thread.is_alive() and area._count == 0 and not area._free  # no staging buffer
print("RESULT", at_destroy, after, freed, threads, exact("b", 2.0), pending_ok, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("held", [False, True])
def test_a_destroyed_groups_async_saver_is_closed_and_a_new_group_saves(tmp_path, held):
    """An AsyncSaver outlived its process group: after destroy_process_group and a new group
    (an in-process restart), its threads, pinned or shared staging buffers and writer process
    stayed for the life of the process (the re-init reuses MASTER_PORT: the saver's store
    client must not keep the old server). Now the saver closes when its group is collected
    (or, where the caller still holds the group, at the next async_save): its pending save
    ends (committed bit-exact, or failed), then the rest is freed."""
    ports = [str(free_port()), str(free_port())]
    mode = "held" if held else "free"
    results = run_scripts(REINIT, str(tmp_path), mode, *ports, timeout=150)
    # with the group held, the saver closes at the next async_save, not at destroy
    expected = f"RESULT {not held} True True ['dcpb-async-save'] True True"
    assert results == [expected] * 2


FORK_DURING_SAVE = """
import os, sys, threading, time, torch, dcpbridge as db
from dcpbridge.storage.write import writer as W

root = sys.argv[1]
gate, inner = threading.Event(), W.FsspecCheckpointWriter.write_data

def held(self, plan, planner):  # the parent's write waits until the child was forked
    gate.wait(30)
    return inner(self, plan, planner)

W.FsspecCheckpointWriter.write_data = held
w = torch.arange(64, dtype=torch.float32)
tmpl = lambda: {"w": db.ShardedTensor.from_box("w", torch.zeros(64), (64,), (0,))}
handle = db.async_save({"w": db.ShardedTensor.from_box("w", w, (64,), (0,))},
                       os.path.join(root, "parent"), writer="thread")
pid = os.fork()
if pid == 0:  # as a forked worker: its own async save, then an ordinary exit (atexit runs)
    W.FsspecCheckpointWriter.write_data = inner
    mine = {"w": db.ShardedTensor.from_box("w", w * 2, (64,), (0,))}
    try:
        db.async_save(mine, os.path.join(root, "child"), writer="thread").result(20)
        print("CHILD", torch.equal(db.load(tmpl(), os.path.join(root, "child"))["w"], w * 2),
              flush=True)
    except TimeoutError:
        print("CHILD hung", flush=True)
    sys.exit(0)
deadline = time.monotonic() + 20
while time.monotonic() < deadline and not os.waitpid(pid, os.WNOHANG)[0]:
    time.sleep(0.05)
else:
    if time.monotonic() >= deadline:
        print("EXIT hung", flush=True)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
gate.set()
handle.result(30)
print("PARENT", torch.equal(db.load(tmpl(), os.path.join(root, "parent"))["w"], w), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_process_forked_during_an_async_save_saves_and_exits(tmp_path):
    """A child forked while an async save is in flight (``os.fork``, as some data workers do)
    inherited the parent's saver, whose writer thread it does not have: its own ``async_save``
    waited forever, and so did its exit (the at-exit drain waited for the parent's save). The
    child now gets a saver of its own and leaves the parent's saves to the parent, which
    commits its save bit-exact."""
    run = _script(FORK_DURING_SAVE, str(tmp_path), timeout=100)
    assert run.stdout.splitlines() == ["CHILD True", "PARENT True"], run.stdout + run.stderr[-2000:]


EXIT_DURING_SAVE = """
import os, sys, time, torch, dcpbridge as db
from dcpbridge.storage.write import writer as W

root, inner = sys.argv[1], W.FsspecCheckpointWriter.write_data

def slow(self, plan, planner):  # still writing when the interpreter begins to exit
    time.sleep(0.5)
    return inner(self, plan, planner)

W.FsspecCheckpointWriter.write_data = slow
w = torch.arange(1 << 16, dtype=torch.float32)
state = {"w": db.ShardedTensor.from_box("w", w, (1 << 16,), (0,)), "step": 7}
db.async_save(state, root, writer="thread", background_staging=sys.argv[2] == "1")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("background", [False, True])
def test_an_async_save_in_flight_at_exit_commits(tmp_path, background):
    """A script that ends with an async save in flight (no ``result()``, no manager
    ``close``): the at-exit drain waits for it, so the checkpoint lands. It ran after
    threading's shutdown hooks, when ``concurrent.futures`` refuses new work, so the thread
    writer's save failed there ("cannot schedule new futures after interpreter shutdown"),
    leaving an empty folder and no checkpoint."""
    ckpt = tmp_path / "ck"
    run = _script(EXIT_DURING_SAVE, str(ckpt), str(int(background)), timeout=100)
    assert "failed" not in run.stderr, run.stderr[-2000:]
    tmpl = {"w": db.ShardedTensor.from_box("w", torch.zeros(1 << 16), (1 << 16,), (0,))}
    out = db.load(tmpl, str(ckpt))
    assert torch.equal(out["w"], torch.arange(1 << 16, dtype=torch.float32))
    assert out["step"] == 7


INTERRUPTED_WAIT_FOR_CAPACITY = """
import os, signal, sys, threading, time, torch, dcpbridge as db
from dcpbridge.storage.write import writer as W

root, inner = sys.argv[1], W.FsspecCheckpointWriter.write_data

def slow(self, plan, planner):  # the first save is still writing at the Ctrl-C and at exit
    time.sleep(2)
    return inner(self, plan, planner)

W.FsspecCheckpointWriter.write_data = slow
w = torch.arange(64, dtype=torch.float32)
state = lambda t: {"w": db.ShardedTensor.from_box("w", t, (64,), (0,))}
first = db.async_save(state(w), os.path.join(root, "a"), writer="thread")
main = threading.main_thread().ident
threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT)).start()
try:  # waits for the first save (max_in_flight=1): interrupted there
    db.async_save(state(w * 2), os.path.join(root, "b"), writer="thread")
except KeyboardInterrupt:
    print("interrupted", first.done(), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_save_whose_wait_for_room_was_interrupted_stays_in_flight(tmp_path):
    """A Ctrl-C while ``async_save`` waits for the previous save (``max_in_flight``) took that
    save off the in-flight list before the wait: nothing waited for it any more, so the
    script's exit killed its write half-way (an empty folder, no checkpoint) and its failure
    could be reported nowhere. It now stays in flight: the exit drains it, bit-exact."""
    run = _script(INTERRUPTED_WAIT_FOR_CAPACITY, str(tmp_path), timeout=100)
    assert run.stdout.splitlines() == ["interrupted False"], run.stdout + run.stderr[-2000:]
    tmpl = {"w": db.ShardedTensor.from_box("w", torch.zeros(64), (64,), (0,))}
    out = db.load(tmpl, str(tmp_path / "a"))
    assert torch.equal(out["w"], torch.arange(64, dtype=torch.float32))
    assert not (tmp_path / "b").exists()


EXIT_AFTER_A_CANCELLED_SAVE = """
import asyncio, os, sys, threading, time, torch, dcpbridge as db
from dcpbridge.storage.write import writer as W

root = sys.argv[1]

def cancelled(self, plan, planner):  # an async storage client's cancellation
    raise asyncio.CancelledError()

def later():
    time.sleep(1.0)
    open(os.path.join(root, "thread-done"), "w").close()

W.FsspecCheckpointWriter.write_data = cancelled
threading.Thread(target=later).start()  # not a daemon: the exit joins it
w = torch.arange(64, dtype=torch.float32)
db.async_save({"w": db.ShardedTensor.from_box("w", w, (64,), (0,))}, os.path.join(root, "ck"),
              writer="thread")
"""


@pytest.mark.timeout(120)
def test_a_save_failing_with_a_base_exception_at_exit_is_logged_and_the_exit_goes_on(tmp_path):
    """The at-exit drain raised a save's base exception (here ``asyncio.CancelledError`` of
    its writer thread) out of threading's exit hooks, which then skipped joining the
    script's own threads: they were killed mid-work. The failure is logged, the exit joins
    them, and the failed save left no checkpoint."""
    run = _script(EXIT_AFTER_A_CANCELLED_SAVE, str(tmp_path), timeout=100)
    assert (tmp_path / "thread-done").exists(), run.stderr[-2000:]
    assert f"async save to {tmp_path / 'ck'} failed: CancelledError" in run.stderr
    assert "Exception ignored" not in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "ck" / "dcpbridge.json").exists()


def _script(code: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with ``args``; it must exit with status 0."""
    run = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run
