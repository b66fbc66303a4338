"""The local tier on real gloo ranks: nodes are ``{node}`` directories with 2 ranks each.

Local steps beyond the persistent one restore bit-exact after a node's directory is wiped
(its parts come from the copies), into another world size and split, and fall back to the
persistent step (with a log line) when the local tier cannot serve a step or a byte is bad.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

import dcpbridge as db
from dcpbridge.engine import local_tier
from dcpbridge.storage.backends.store import Storage
from tests.support.collective_counts import record_collectives
from tests.support.dist_pool import Rank, RankFailure

SHAPE = (16, 12)
STEPS = 6  # persistent every 4, local every step: persistent 4, local 5 and 6


def weights(step: int) -> torch.Tensor:
    """The global weight after ``step`` steps (elementwise, so any sharding agrees)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(SHAPE, generator=g)
    for s in range(1, step + 1):
        w.mul_(0.5).add_(s)
    return w


def piece(w: torch.Tensor, rank: int, size: int, axis: int) -> torch.Tensor:
    return w.chunk(size, dim=axis)[rank].clone()


def state(w_local: torch.Tensor, rank: int, size: int, step: int) -> dict:
    return {
        "w": db.ShardedTensor.from_rank_offsets("w", w_local, (0, rank, size)),
        "rng": db.ShardedObject("rng", {"rank": rank, "step": step}, (size,), (rank,)),
        "step": step,
    }


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _capture() -> Captured:
    handler = Captured()
    logger = logging.getLogger("dcpbridge")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def manager(r: Rank, root: str, local: str, **kwargs) -> db.CheckpointManager:
    options = dict(every=4, local_every=1, replicas=1, ranks_per_node=2, async_save=False)
    options.update(kwargs)
    return db.CheckpointManager(root, local_dir=local, process_group=r.group, **options)


def train(r: Rank, root: str, local: str, kwargs: dict) -> dict:
    """Steps 1..STEPS; returns rank 0's on_commit calls and the log."""
    calls: list[tuple[int, str, str]] = []

    def on_commit(*args) -> None:
        calls.append(args)
        if args[0] == 2:
            raise RuntimeError("tracker down")  # logged, never raised

    log = _capture()
    mgr = manager(r, root, local, on_commit=on_commit, **kwargs)
    w = piece(weights(0), r.rank, r.size, 0)
    started = time.perf_counter()
    stalls = []
    for step in range(1, STEPS + 1):
        w.mul_(0.5).add_(step)
        t = time.perf_counter()
        mgr.save(step, state(w, r.rank, r.size, step))
        stalls.append(time.perf_counter() - t)
    mgr.close()
    logging.getLogger("dcpbridge").removeHandler(log)
    return {
        "calls": calls,
        "log": log.lines,
        "stall": stalls[-1],
        "seconds": time.perf_counter() - started,
    }


def restore(r: Rank, root: str, local: str, axis: int, rpn: int) -> dict:
    """Restart in ``r.size`` ranks split on ``axis``: the chosen step, bit-exact, the log and
    the load's collectives."""
    log = _capture()
    mgr = manager(r, root, local, ranks_per_node=rpn)
    latest = mgr.latest_step()
    tmpl = {
        "w": db.ShardedTensor.from_rank_offsets(
            "w", torch.zeros(SHAPE).chunk(r.size, dim=axis)[r.rank].clone(), (axis, r.rank, r.size)
        )
    }
    t = time.perf_counter()
    with record_collectives() as calls:
        out = mgr.load(tmpl)
    seconds = time.perf_counter() - t
    got = out["step"]
    assert torch.equal(out["w"], piece(weights(got), r.rank, r.size, axis)), (r.rank, got)
    mgr.close()
    logging.getLogger("dcpbridge").removeHandler(log)
    return {"latest": latest, "step": got, "log": log.lines, "seconds": seconds, "calls": calls}


def restore_counted(r: Rank, root: str, local: str) -> tuple[list, list[tuple[str, str]]]:
    """A restart in the same layout: bit-exact, the collectives its load issued and its
    listings of local directories (method, the directory's name)."""
    mgr = manager(r, root, local)
    tmpl = {"w": db.ShardedTensor.from_rank_offsets("w", torch.zeros(4, 12), (0, r.rank, 4))}
    listed: list[tuple[str, str]] = []
    originals = {m: getattr(Storage, m) for m in ("list_names", "file_sizes")}

    def counting(method: str):
        def listing(self):
            if "persistent" not in self.location.root:
                listed.append((method, os.path.basename(self.location.root)))
            return originals[method](self)

        return listing

    for method in originals:
        setattr(Storage, method, counting(method))
    try:
        with record_collectives() as calls:
            out = mgr.load(tmpl)
    finally:
        for method, original in originals.items():
            setattr(Storage, method, original)
    assert torch.equal(out["w"], piece(weights(out["step"]), r.rank, 4, 0)) and out["step"] == 6
    mgr.close()
    return calls, listed


def node_dir(tmp_path, node: int) -> str:
    return str(tmp_path / f"node{node}")


def _train(pool, tmp_path, **kwargs) -> tuple[str, str, list[dict]]:
    root, local = str(tmp_path / "persistent"), str(tmp_path / "node{node}")
    out = pool.run(train, 4, root, local, kwargs, timeout=120)
    return root, local, out


def test_a_wiped_node_restores_the_newest_local_step_from_the_copies(pool, tmp_path):
    root, local, out = _train(pool, tmp_path)
    for node in (0, 1):
        assert sorted(os.listdir(node_dir(tmp_path, node))) == ["step_00000006"]
    # a local step's document packs its items as columns however few (every rank of a restore
    # decodes its node's copy); a persistent step of as few items lists them as objects
    doc = json.loads((tmp_path / "node1" / "step_00000006" / "dcpbridge.json").read_bytes())
    assert doc["version"] == 4 and set(doc["items"]) >= {"offsets", "checksums"}
    doc = json.loads((tmp_path / "persistent" / "step_00000004" / "dcpbridge.json").read_bytes())
    assert "items" not in doc and doc["tensors"]["w"]["chunks"][0]["checksums"]
    calls = out[0]["calls"]
    assert [(s, t) for s, t, _ in calls] == [
        (1, "local"),
        (2, "local"),
        (3, "local"),
        (4, "persistent"),
        (4, "local"),
        (5, "local"),
        (6, "local"),
    ]
    assert calls[3][2].endswith("step_00000004") and "node0" in calls[-1][2]
    assert out[1]["calls"] == []  # rank 0 only
    assert any("on_commit(2, 'local'" in line and "tracker down" in line for line in out[0]["log"])
    # every node holds its ranks' parts: one all-gather agrees on the step (and carries rank
    # 0's listing of the persistent tier and each rank's finding, planned before it, that it
    # reads its own node's files only), one confirms the read; nothing on the training group,
    # no request exchange, no transfers
    counted = pool.run(restore_counted, 4, root, local, timeout=120)
    assert [calls for calls, _ in counted] == [[("all_gather", "MainThread", "SideGroup")] * 2] * 4
    # each rank lists its node's directory and the step's once (the survey's); the read takes
    # the sizes it reported
    assert [listed for _, listed in counted] == [
        [("list_names", f"node{r // 2}"), ("file_sizes", "step_00000006")] for r in range(4)
    ]
    shutil.rmtree(node_dir(tmp_path, 1))  # node 1 died; its replacement starts empty
    back = pool.run(restore, 4, root, local, 0, 2, timeout=120)
    assert [b["step"] for b in back] == [6] * 4 and [b["latest"] for b in back] == [6] * 4
    # node 1's ranks read from node 0's copies: the requests and the serving of the document
    # and of the data are agreed (two all-gathers each) between the survey and the read
    assert [b["calls"] for b in back] == [[("all_gather", "MainThread", "SideGroup")] * 6] * 4
    assert any("from the local tier" in line for line in back[0]["log"])
    print(
        f"local save stall (4 ranks, {SHAPE}): {max(o['stall'] for o in out) * 1e3:.1f} ms; "
        f"restore {max(b['seconds'] for b in back) * 1e3:.1f} ms"
    )


def test_copies_and_commit_behind_the_training_loop(pool, tmp_path):
    root, local, out = _train(pool, tmp_path, async_save=True)
    assert sorted(s for s, t, _ in out[0]["calls"] if t == "local") == list(range(1, STEPS + 1))
    assert sorted(os.listdir(node_dir(tmp_path, 1))) == ["step_00000006"]
    shutil.rmtree(node_dir(tmp_path, 0))
    back = pool.run(restore, 4, root, local, 1, 2, timeout=120)  # columns now
    assert [b["step"] for b in back] == [6] * 4
    print(f"local save stall, copies behind: {max(o['stall'] for o in out) * 1e3:.1f} ms")


def test_fewer_ranks_and_another_split_restore_the_newest_local_step(pool, tmp_path):
    root, local, _ = _train(pool, tmp_path)
    back = pool.run(restore, 2, root, local, 1, 2, timeout=120)  # one node: own parts + copies
    assert [b["step"] for b in back] == [6, 6]
    shutil.rmtree(node_dir(tmp_path, 0))  # rank 0 (node 0, empty) fetches from rank 1 (node 1)
    back = pool.run(restore, 2, root, local, 1, 1, timeout=120)
    assert [b["step"] for b in back] == [6, 6]
    assert any("from the local tier" in line for line in back[0]["log"])


def test_all_nodes_wiped_fall_back_to_the_persistent_step(pool, tmp_path):
    root, local, _ = _train(pool, tmp_path)
    for node in (0, 1):
        shutil.rmtree(node_dir(tmp_path, node))
    back = pool.run(restore, 4, root, local, 0, 2, timeout=120)
    assert [b["step"] for b in back] == [4] * 4 and back[0]["latest"] == 4
    assert any("loading persistent step 4" in line for line in back[0]["log"])


def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("both", [False, True], ids=["one-copy", "both-copies"])
def test_a_flipped_byte_never_loads_wrong_data(pool, tmp_path, both):
    root, local, _ = _train(pool, tmp_path)
    step_dir = os.path.join(node_dir(tmp_path, 0), "step_00000006")
    victim = next(n for n in sorted(os.listdir(step_dir)) if n.startswith("__0_"))
    _flip(os.path.join(step_dir, victim))
    if both:  # its copy on node 1 too
        _flip(os.path.join(node_dir(tmp_path, 1), "step_00000006", victim))
    back = pool.run(restore, 4, root, local, 0, 2, timeout=120)
    retry = next(x for x in back[0]["log"] if "reading it from the copies" in x)
    assert victim in retry
    if not both:  # node 0's ranks read the file from node 1's copy
        assert [b["step"] for b in back] == [6] * 4
        assert any("from the local tier's copies" in x for x in back[0]["log"])
        return
    assert [b["step"] for b in back] == [4] * 4
    line = next(x for x in back[0]["log"] if "loading persistent step 4" in x)
    assert "could not be restored" in line and victim in line


def test_only_the_ranks_that_read_a_bad_part_read_it_again_from_another_copy(pool, tmp_path):
    """Restored in columns, every rank reads every file: node 0's ranks read rank 2's file
    from their own good copy, node 1's from the damaged original. The second try changes only
    what node 1's ranks read (to node 0's copy), never node 0's to the damaged file."""
    root, local, _ = _train(pool, tmp_path)
    step_dir = os.path.join(node_dir(tmp_path, 1), "step_00000006")
    victim = next(n for n in sorted(os.listdir(step_dir)) if n.startswith("__2_"))
    _flip(os.path.join(step_dir, victim))
    back = pool.run(restore, 4, root, local, 1, 2, timeout=120)
    assert [b["step"] for b in back] == [6] * 4
    assert any(victim in x for x in back[0]["log"] if "reading it from the copies" in x)
    assert any("from the local tier's copies" in x for x in back[0]["log"])


def test_a_truncated_copy_no_rank_reads_never_fails_the_restore(pool, tmp_path):
    """Node 0's copy of rank 2's file is cut short; in the saved layout only node 1's ranks
    read that file (their own): the step loads at the first try on every rank."""
    root, local, _ = _train(pool, tmp_path)
    step_dir = os.path.join(node_dir(tmp_path, 0), "step_00000006")
    victim = next(n for n in sorted(os.listdir(step_dir)) if n.startswith("__2_0"))
    os.truncate(os.path.join(step_dir, victim), 10)
    back = pool.run(restore, 4, root, local, 0, 2, timeout=120)
    assert [b["step"] for b in back] == [6] * 4
    assert not any("failed verification" in x for x in back[0]["log"])


def no_space(r: Rank, root: str, local: str) -> dict:
    local_tier.free_bytes = lambda path: 1000
    return train(r, root, local, {})


def test_not_enough_space_skips_the_local_step_and_training_continues(pool, tmp_path):
    root, local = str(tmp_path / "persistent"), str(tmp_path / "node{node}")
    try:
        out = pool.run(no_space, 4, root, local, timeout=120)
    finally:
        pool.kill()  # the workers' free_bytes is patched: start afresh
    assert [(s, t) for s, t, _ in out[0]["calls"]] == [(4, "persistent")]
    skipped = [x for x in out[0]["log"] if "skipped: not enough space" in x]
    assert len(skipped) == STEPS
    assert not any(
        os.path.exists(node_dir(tmp_path, n)) and os.listdir(node_dir(tmp_path, n)) for n in (0, 1)
    )
    back = pool.run(restore, 4, root, local, 0, 2, timeout=120)
    assert [b["step"] for b in back] == [4] * 4


def killed_mid_local_save(r: Rank, root: str, local: str) -> None:
    original = local_tier.LocalTier._send_copies

    def die(self, sizes, mine):
        if self.group.rank == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, sizes, mine)

    mgr = manager(r, root, local)
    w = piece(weights(0), r.rank, r.size, 0)
    for step in range(1, STEPS + 1):
        w.mul_(0.5).add_(step)
        if step == STEPS:
            local_tier.LocalTier._send_copies = die
        mgr.save(step, state(w, r.rank, r.size, step))


def test_a_rank_killed_mid_local_save_leaves_the_previous_local_step(pool, tmp_path):
    root, local = str(tmp_path / "persistent"), str(tmp_path / "node{node}")
    try:
        with pytest.raises(RankFailure):  # the others wait for rank 3 in the agreement
            pool.run(killed_mid_local_save, 4, root, local, timeout=60, grace=5)
    finally:
        pool.kill()
    back = pool.run(restore, 4, root, local, 0, 2, timeout=120)
    assert [b["step"] for b in back] == [STEPS - 1] * 4


def copy_fails_once(r: Rank, root: str, local: str) -> dict:
    """Rank 1's copy transfer of step STEPS fails after the bytes moved (its partner saw
    nothing wrong); the next local step must still commit everywhere, without waiting."""
    from dcpbridge.engine import collectives

    original = collectives.SideGroup.exchange
    log = _capture()
    mgr = manager(r, root, local, async_save=False)
    w = piece(weights(0), r.rank, r.size, 0)
    try:
        for step in range(1, STEPS + 2):
            w.mul_(0.5).add_(step)
            if step == STEPS and r.rank == 1:

                def flaky(self, sends, recvs):
                    original(self, sends, recvs)
                    collectives.SideGroup.exchange = original
                    raise RuntimeError("connection reset by peer")

                collectives.SideGroup.exchange = flaky
            mgr.save(step, state(w, r.rank, r.size, step))
        mgr.close()
    finally:
        collectives.SideGroup.exchange = original
        logging.getLogger("dcpbridge").removeHandler(log)
    return {"log": log.lines}


def test_a_failed_copy_transfer_skips_that_step_on_every_rank_and_the_next_commits(pool, tmp_path):
    root, local = str(tmp_path / "persistent"), str(tmp_path / "node{node}")
    out = pool.run(copy_fails_once, 4, root, local, timeout=120)
    for rank in range(4):
        failed = [x for x in out[rank]["log"] if f"local step {STEPS} not committed" in x]
        assert len(failed) == 1 and "connection reset by peer" in failed[0], rank
    for node in (0, 1):
        assert sorted(os.listdir(node_dir(tmp_path, node))) == [f"step_{STEPS + 1:08d}"]
    back = pool.run(restore, 4, root, local, 0, 2, timeout=120)
    assert [b["step"] for b in back] == [STEPS + 1] * 4


def two_runs(r: Rank, tmp: str) -> dict:
    """Run A trains (persistent 4, local 5 and 6); run B, another root, reuses its
    ``local_dir``, finds nothing to resume and saves local step 1; A restarts."""
    local = os.path.join(tmp, "node{node}")
    run_a, run_b = os.path.join(tmp, "runA"), os.path.join(tmp, "runB")
    a = manager(r, run_a, local, ranks_per_node=1)
    w = piece(weights(0), r.rank, r.size, 0)
    for step in range(1, STEPS + 1):
        w.mul_(0.5).add_(step)
        a.save(step, state(w, r.rank, r.size, step))
    a.close()
    b = manager(r, run_b, local, ranks_per_node=1)
    out: dict = {"b_latest": b.latest_step()}
    tmpl = {
        "w": db.ShardedTensor.from_rank_offsets(
            "w", torch.zeros(SHAPE[0] // 2, SHAPE[1]), (0, r.rank, 2)
        )
    }
    try:
        b.load(tmpl)
    except db.CheckpointError as e:
        out["b_load"] = f"{type(e).__name__}: {e}"
    b.save(1, state(torch.full((SHAPE[0] // 2, SHAPE[1]), -1.0), r.rank, r.size, 1))
    b.close()
    out["held"] = sorted(os.listdir(local.replace("{node}", str(r.rank))))
    a = manager(r, run_a, local, ranks_per_node=1)
    out["a_latest"] = a.latest_step()
    got = a.load(tmpl)
    assert torch.equal(got["w"], piece(weights(got["step"]), r.rank, r.size, 0))
    out["a_step"] = got["step"]
    a.close()
    return out


def test_a_run_never_resumes_from_another_runs_local_steps(pool, tmp_path):
    """Local steps belong to their manager's root: a job with another root that reuses the
    same ``local_dir`` (a new run, the same /dev/shm path) never loads them (before, run B
    resumed from run A's local step 6, silently), and its first local commit removes them."""
    for out in pool.run(two_runs, 2, str(tmp_path), timeout=120):
        assert out["b_latest"] is None
        assert out["b_load"].startswith("NotACheckpointError: ") and "runB" in out["b_load"]
        assert out["held"] == ["step_00000001"]  # run B's; run A's step 6 removed
        assert (out["a_latest"], out["a_step"]) == (4, 4)  # A: its persistent step, not B's 1


_ONE_PROCESS = dict(every=2, local_every=1, replicas=0)


def _single_process_steps(tmp_path) -> str:
    """Steps 1-3 of one process (persistent 2, local 3) under ``tmp_path``; its local_dir."""
    local = str(tmp_path / "shm")
    mgr = db.CheckpointManager(str(tmp_path / "run"), local_dir=local, **_ONE_PROCESS)
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    mgr.close()
    return local


def _restart_loads_persistent_step_2(tmp_path, caplog) -> None:
    """A restart of ``_single_process_steps`` offers and loads persistent step 2."""
    local = str(tmp_path / "shm")
    mgr = db.CheckpointManager(str(tmp_path / "run"), local_dir=local, **_ONE_PROCESS)
    with caplog.at_level(logging.WARNING, logger="dcpbridge"):
        assert mgr.latest_step() == 2
        out = mgr.load({"w": torch.zeros(4)})
    assert torch.equal(out["w"], torch.full((4,), 2.0))
    mgr.close()


def test_a_local_step_whose_marker_names_another_step_is_ignored(tmp_path, caplog):
    """A step directory renamed or copied by hand (its marker names another step) does not
    count: ``latest_step`` once offered it and the load then fell back; now it is skipped
    with a warning naming the marker."""
    local = _single_process_steps(tmp_path)
    os.rename(os.path.join(local, "step_00000003"), os.path.join(local, "step_00000009"))
    _restart_loads_persistent_step_2(tmp_path, caplog)
    assert "local.json names step 3, not its directory's 9" in caplog.text


def test_a_deeply_nested_marker_is_ignored_not_raised(tmp_path, caplog):
    """A damaged ``local.json`` nested too deep for the JSON decoder is hostile input like any
    other bad marker: the step is skipped with a warning (it raised ``RecursionError`` out of
    ``latest_step`` and ``load``)."""
    local = _single_process_steps(tmp_path)
    with open(os.path.join(local, "step_00000003", "local.json"), "wb") as f:
        f.write(b"[" * 200_000)
    _restart_loads_persistent_step_2(tmp_path, caplog)
    assert "step_00000003/local.json is not a local step marker" in caplog.text


def marker_fails_on_node1(r: Rank, root: str, local: str) -> dict:
    """Steps 1..STEPS; node 1's lead fails to publish the marker of the last step."""
    log = _capture()
    mgr = manager(r, root, local)
    publish = Storage.commit_file

    def failing(self, name, data, temp_name, **kwargs):
        if name == local_tier.MARKER and f"step_{STEPS:08d}" in self.location.root:
            raise OSError(28, "No space left on device")
        return publish(self, name, data, temp_name, **kwargs)

    if r.rank == 2:
        Storage.commit_file = failing
    w = piece(weights(0), r.rank, r.size, 0)
    try:
        for step in range(1, STEPS + 1):
            w.mul_(0.5).add_(step)
            mgr.save(step, state(w, r.rank, r.size, step))
        mgr.close()
    finally:
        Storage.commit_file = publish
    logging.getLogger("dcpbridge").removeHandler(log)
    return {"log": log.lines}


def test_a_commit_that_fails_on_one_node_publishes_the_step_on_none(pool, tmp_path):
    """Where one node's lead cannot publish the marker, the step is not committed on any rank,
    so nothing of it stays on any node: a restart loads the previous local step (before, node
    0 kept its marker and a restart loaded a step every rank had logged as failed, never
    passed to ``on_commit`` nor uploaded; and a failed step's files stayed until the next
    local save, whose space check they could make fail)."""
    root, local = str(tmp_path / "persistent"), str(tmp_path / "node{node}")
    out = pool.run(marker_fails_on_node1, 4, root, local, timeout=120)
    for rank in range(4):
        failed = [x for x in out[rank]["log"] if f"local step {STEPS} not committed" in x]
        assert len(failed) == 1 and "No space left on device" in failed[0], rank
    for node in (0, 1):  # nothing of the failed step is left; the previous one stays
        assert sorted(os.listdir(node_dir(tmp_path, node))) == [f"step_{STEPS - 1:08d}"], node
    back = pool.run(restore, 4, root, local, 0, 2, timeout=120)
    assert [b["step"] for b in back] == [STEPS - 1] * 4


def test_nodes_sharing_one_local_dir_commit_every_step(pool, tmp_path):
    """A ``local_dir`` without ``{node}`` on a file system every node sees (one machine, or a
    shared mount): the nodes' leads publish the same marker in the same folder. Before, they
    raced on one temp file name, so every local step failed on some rank (logged as not
    committed, yet published) and retention never ran: every step's folder stayed."""
    root, local = str(tmp_path / "persistent"), str(tmp_path / "shared")
    out = pool.run(train, 4, root, local, {}, timeout=120)
    assert not [x for o in out for x in o["log"] if "not committed" in x]
    assert [s for s, t, _ in out[0]["calls"] if t == "local"] == list(range(1, STEPS + 1))
    assert sorted(os.listdir(local)) == [f"step_{STEPS:08d}"]
    back = pool.run(restore, 4, root, local, 0, 2, timeout=120)
    assert [b["step"] for b in back] == [STEPS] * 4


def train_with_cells(r: Rank, root: str, local: str) -> None:
    """Steps 1..STEPS with a per-rank cell (a data loader's state) beside the weight."""
    mgr = manager(r, root, local)
    w = piece(weights(0), r.rank, r.size, 0)
    for step in range(1, STEPS + 1):
        w.mul_(0.5).add_(step)
        cell = db.PerRankState("loader", {"rank": r.rank, "step": step}, r.rank, r.size)
        mgr.save(step, {**state(w, r.rank, r.size, step), "loader": cell})
    mgr.close()


def restore_dropping_cells(r: Rank, root: str, local: str) -> dict:
    """A restart in ``r.size`` ranks that asks to start the loaders' streams fresh."""
    log = _capture()
    mgr = manager(r, root, local, ranks_per_node=1)
    shape = (SHAPE[0] // r.size, SHAPE[1])
    tmpl = {
        "w": db.ShardedTensor.from_rank_offsets("w", torch.zeros(shape), (0, r.rank, r.size)),
        "loader": db.PerRankState("loader", {"fresh": True}, r.rank, r.size),
    }
    out = mgr.load(tmpl, reshard_data_state="drop")
    assert torch.equal(out["w"], piece(weights(out["step"]), r.rank, r.size, 0)), r.rank
    mgr.close()
    logging.getLogger("dcpbridge").removeHandler(log)
    return {"step": out["step"], "loader": out["loader"].value, "log": log.lines}


def test_a_local_restore_honours_reshard_data_state(pool, tmp_path):
    """``load(..., reshard_data_state="drop")`` on a job of another data-parallel size drops
    the per-rank cells of the local step as it does of a persistent one (before, the local
    tier's load ignored the option, raised ``DataLayoutError`` and fell back to the older
    persistent step)."""
    root, local = str(tmp_path / "persistent"), str(tmp_path / "node{node}")
    pool.run(train_with_cells, 4, root, local, timeout=120)
    back = pool.run(restore_dropping_cells, 2, root, local, timeout=120)
    assert [b["step"] for b in back] == [STEPS] * 2, "\n".join(back[0]["log"])
    assert [b["loader"] for b in back] == [{"fresh": True}] * 2
    assert not [x for x in back[0]["log"] if "loading persistent step" in x], back[0]["log"]


def test_a_misspelt_load_option_raises_whichever_tier_answers(tmp_path):
    """An option ``dcpbridge.load`` does not take raises ``InvalidArgumentError`` naming it,
    from the local tier as from the persistent one (before, the local tier's load ignored it
    and the persistent one raised ``TypeError``)."""
    options = dict(every=2, local_dir=str(tmp_path / "shm"), local_every=1, replicas=0)
    mgr = db.CheckpointManager(str(tmp_path / "run"), **options)
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    for step in (None, 2):  # local step 3; persistent step 2
        with pytest.raises(db.InvalidArgumentError, match="unknown options \\['allow_pikle'\\]"):
            mgr.load({"w": torch.zeros(4)}, step=step, allow_pikle=True)
    out = mgr.load({"w": torch.zeros(4)}, verify_checksums=True)
    assert torch.equal(out["w"], torch.full((4,), 3.0))
    mgr.close()


def _reaped(pid: int, seconds: float) -> int | None:
    """The exit status of child ``pid``, or None (it is killed) if it runs past ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def closed_then_forked(r: Rank, root: str, local: str) -> dict:
    """Save a local step, close the manager twice and drop it with the collector off; then
    a forked child collects the garbage: its exit status (None: it hung), and whether the
    side group dropped its backend."""
    gc.collect()  # earlier tests' garbage: not this test's to collect in the child
    gc.disable()  # the manager's cycles stay uncollected until the child runs
    try:
        mgr = manager(r, root, local, ranks_per_node=1)
        mgr.save(1, state(piece(weights(1), r.rank, r.size, 0), r.rank, r.size, 1))
        side = mgr._local.group
        assert side._gloo is not None
        mgr.close()
        mgr.close()  # idempotent
        released = side._gloo is None
        del mgr, side
        pid = os.fork()
        if pid == 0:  # the child: what a DataLoader worker does when it first collects
            gc.collect()
            os._exit(0)
        status = _reaped(pid, 30.0)
    finally:
        gc.enable()
    gc.collect()
    return {"status": status, "released": released}


def test_close_releases_the_side_group_before_a_forked_child_collects_it(pool, tmp_path):
    """``close`` shuts the local tier's gloo side group down and drops it: a closed manager
    kept the backend alive in its reference cycles, and a forked DataLoader worker whose
    first collection destroyed it (without the parent's threads) crashed."""
    root, local = str(tmp_path / "persistent"), str(tmp_path / "node{node}")
    for out in pool.run(closed_then_forked, 2, root, local, timeout=120):
        status = out["status"]
        assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, out
        assert out["released"], out


def test_a_failed_resave_of_the_local_step_keeps_the_committed_one(tmp_path, caplog):
    """Saving local step 3 again, where the new save fails after its directory was prepared
    (a common value that cannot be staged), keeps the committed step 3 loadable: the
    prepare removed it first, so the failure left no local step at all."""
    local = _single_process_steps(tmp_path)
    mgr = db.CheckpointManager(str(tmp_path / "run"), local_dir=local, **_ONE_PROCESS)
    unstageable = (torch.ones(2, requires_grad=True) * 2,)  # deepcopy refuses a non-leaf
    with caplog.at_level(logging.WARNING, logger="dcpbridge"):
        assert mgr.save(3, {"w": torch.full((4,), 9.0), "extra": unstageable})
        mgr.wait()
    assert "local step 3 not committed" in caplog.text and "staging failed" in caplog.text
    assert sorted(os.listdir(local)) == ["step_00000003"]
    assert mgr.latest_step() == 3
    out = mgr.load({"w": torch.zeros(4)})
    assert torch.equal(out["w"], torch.full((4,), 3.0))
    mgr.save(3, {"w": torch.full((4,), 9.0)})  # a re-save that commits replaces it
    mgr.close()
    assert sorted(os.listdir(local)) == ["step_00000003"]
    restarted = db.CheckpointManager(str(tmp_path / "run"), local_dir=local, **_ONE_PROCESS)
    assert torch.equal(restarted.load({"w": torch.zeros(4)})["w"], torch.full((4,), 9.0))
    restarted.close()


def test_a_restart_after_a_resave_killed_mid_way_offers_the_committed_step(tmp_path):
    """A save of committed local step 3 killed after its prepare set step 3 aside (what
    ``_clear`` leaves: ``step_00000003.previous`` and the new, uncommitted ``step_00000003``)
    loses nothing: the next manager puts the committed one back, and it loads."""
    local = _single_process_steps(tmp_path)
    step3 = os.path.join(local, "step_00000003")
    os.rename(step3, step3 + ".previous")
    os.mkdir(step3)
    with open(os.path.join(step3, "__0_0.00ff.bin"), "wb") as f:
        f.write(b"half")
    mgr = db.CheckpointManager(str(tmp_path / "run"), local_dir=local, **_ONE_PROCESS)
    assert sorted(os.listdir(local)) == ["step_00000003"]
    assert mgr.latest_step() == 3
    assert torch.equal(mgr.load({"w": torch.zeros(4)})["w"], torch.full((4,), 3.0))
    mgr.close()


def test_a_resave_over_a_committed_step_and_its_older_set_aside_copy_commits(tmp_path):
    """Where a committed step 3 and an older set-aside copy of it are both there (a save
    killed after its commit, before retention), saving step 3 again removes the old copy
    first and commits: the committed step is never moved into the old copy's folder."""
    local = _single_process_steps(tmp_path)
    step3 = os.path.join(local, "step_00000003")
    shutil.copytree(step3, step3 + ".previous")
    mgr = db.CheckpointManager(str(tmp_path / "run"), local_dir=local, **_ONE_PROCESS)
    mgr.save(3, {"w": torch.full((4,), 7.0)})
    mgr.close()
    assert sorted(os.listdir(local)) == ["step_00000003"]
    assert "step_00000003" not in os.listdir(step3)
    restarted = db.CheckpointManager(str(tmp_path / "run"), local_dir=local, **_ONE_PROCESS)
    assert torch.equal(restarted.load({"w": torch.zeros(4)})["w"], torch.full((4,), 7.0))
    restarted.close()


def test_a_local_step_folder_spelt_otherwise_is_no_local_step(tmp_path):
    """``step_3`` (or ``step_`` with non-ASCII digits, or ``step_3.previous``) beside
    ``step_00000003`` is no local step, as in the persistent tier: it was read as step 3, so
    retention deleted such a folder and a re-save of step 3 took it for its own uncommitted
    directory. Only ``step_url``'s spelling is a local step; other folders stay untouched."""
    local = _single_process_steps(tmp_path)
    step3 = os.path.join(local, "step_00000003")
    others = ["step_3", "step_3.previous", "step_\u0663"]  # U+0663: Arabic-Indic digit 3
    before = sorted(os.listdir(step3))
    shutil.copytree(step3, os.path.join(local, "step_3"))
    shutil.copytree(step3, os.path.join(local, "step_3.previous"))
    os.mkdir(os.path.join(local, "step_\u0663"))
    mgr = db.CheckpointManager(str(tmp_path / "run"), local_dir=local, **_ONE_PROCESS)
    assert sorted(os.listdir(local)) == sorted(["step_00000003", *others])
    mgr.save(3, {"w": torch.full((4,), 7.0)})  # a re-save of committed local step 3
    mgr.wait()
    assert mgr.latest_step() == 3
    assert torch.equal(mgr.load({"w": torch.zeros(4)})["w"], torch.full((4,), 7.0))
    mgr.save(5, {"w": torch.full((4,), 5.0)})  # retention keeps local step 5 alone
    mgr.close()
    assert sorted(os.listdir(local)) == sorted(["step_00000005", *others])
    for name in others[:2]:
        assert sorted(os.listdir(os.path.join(local, name))) == before


_HOLDER = """
import sys, time, torch
import dcpbridge as db
mgr = db.CheckpointManager(sys.argv[1], local_dir=sys.argv[2], every=2, local_every=1, replicas=0)
mgr.save(1, {"w": torch.ones(4)})
mgr.wait()
print("saved", flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(120)
def test_a_local_dir_another_live_manager_uses_is_refused_untouched(tmp_path):
    """Two jobs on one node with the same ``local_dir``: the second manager raises before it
    touches the directory, while the first one lives (was: accepted, and its clearing and
    retention removed the first job's local steps, even one being written). A closed or
    killed manager leaves the directory to the next job, whose first commit removes the
    older run's steps."""
    local = str(tmp_path / "shm")
    a = db.CheckpointManager(str(tmp_path / "runA"), local_dir=local, **_ONE_PROCESS)
    for step in (1, 2, 3):
        a.save(step, {"w": torch.full((4,), float(step))})
    with pytest.raises(db.InvalidArgumentError) as refused:
        db.CheckpointManager(str(tmp_path / "runB"), local_dir=local, **_ONE_PROCESS)
    assert str(refused.value).startswith(f"local_dir {local} (node 0) is in use by another live")
    assert "need their own local_dir" in str(refused.value)
    a.save(4, {"w": torch.full((4,), 4.0)})
    a.save(5, {"w": torch.full((4,), 5.0)})
    a.wait()
    assert sorted(os.listdir(local)) == ["step_00000005"]
    assert a.latest_step() == 5
    assert torch.equal(a.load({"w": torch.zeros(4)})["w"], torch.full((4,), 5.0))
    a.close()
    b = db.CheckpointManager(str(tmp_path / "runB"), local_dir=local, **_ONE_PROCESS)
    assert b.latest_step() is None  # another run's step: never resumed from
    b.save(1, {"w": torch.full((4,), -1.0)})
    b.close()  # waits for the local commit
    assert sorted(os.listdir(local)) == ["step_00000001"]
    with _held_by_a_job(_HOLDER, str(tmp_path / "runC"), local):
        with pytest.raises(db.InvalidArgumentError, match="in use by another live"):
            db.CheckpointManager(str(tmp_path / "runB"), local_dir=local, **_ONE_PROCESS)
        assert sorted(os.listdir(local)) == ["step_00000001"]  # run C's local step 1
    b = db.CheckpointManager(str(tmp_path / "runB"), local_dir=local, **_ONE_PROCESS)
    b.close()  # a killed job's lock went with it


_FORKING_HOLDER = """
import os, sys, time, torch
import dcpbridge as db
mgr = db.CheckpointManager(sys.argv[1], local_dir=sys.argv[2], every=2, local_every=1, replicas=0)
mgr.save(1, {"w": torch.ones(4)})
mgr.wait()
pid = os.fork()
if pid == 0:  # a worker the job forked, ending as a Python process ends
    sys.exit(0)
os.waitpid(pid, 0)
print("saved", flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(120)
def test_a_forked_child_ending_leaves_its_parents_local_dir_locked(tmp_path):
    """A process the job forked (a data worker) inherits the manager's locked descriptor; its
    ordinary exit ran the lock's finalizer, whose unlock released the parent's lock: another
    job's manager was then accepted on the directory the live job still writes into."""
    local = str(tmp_path / "shm")
    with _held_by_a_job(_FORKING_HOLDER, str(tmp_path / "runA"), local):
        with pytest.raises(db.InvalidArgumentError, match="in use by another live"):
            db.CheckpointManager(str(tmp_path / "runB"), local_dir=local, **_ONE_PROCESS)
        assert sorted(os.listdir(local)) == ["step_00000001"]


@contextlib.contextmanager
def _held_by_a_job(script: str, root: str, local: str) -> Iterator[None]:
    """Run ``script`` (a job holding ``local``) in a process of its own until it printed
    "saved"; killed at the end."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    holder = subprocess.Popen(
        [sys.executable, "-c", script, root, local],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": path},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "saved\n"
        yield
    finally:
        holder.kill()
        holder.wait(10)


EXIT_WITH_A_LOCAL_STEP_BEHIND = """
import os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
import dcpbridge as db
from dcpbridge.storage.write import writer as W

rank, root, behind, peer = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[5]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4], DCPB_PEER_TIMEOUT="2")
inner = W.FsspecCheckpointWriter.write_data

def slow(self, plan, planner):  # the local step is still writing when the interpreter exits
    if peer == "killed" and rank == 1:
        os._exit(0)  # dies mid-write (no exit hook runs): the survivor's exit must not hang
    time.sleep(1.0)
    return inner(self, plan, planner)

W.FsspecCheckpointWriter.write_data = slow
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
mgr = db.CheckpointManager(os.path.join(root, "run"), every=1, async_save=True,
                           local_dir=os.path.join(root, "node{node}"), ranks_per_node=1,
                           replicas=1, persist_behind=behind)
rows = torch.arange(32, dtype=torch.float32).view(8, 4)[rank * 4 : rank * 4 + 4] + 1
mgr.save(3, {"w": db.ShardedTensor.from_rank_offsets("w", rows, (0, rank, 2)), "step": 3})
print("RESULT returned", rank, flush=True)
"""


def _exit_result(tmp_path, behind: bool, peer: str) -> list[str]:
    """Run the 2-rank script whose ranks exit with a local step in flight (no ``close``)."""
    from tests.support.dist_pool import run_scripts
    from tests.support.s3_server import free_port

    args = (str(tmp_path), str(int(behind)), str(free_port()), peer)
    return run_scripts(EXIT_WITH_A_LOCAL_STEP_BEHIND, *args, timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("behind", [False, True], ids=["local", "persist_behind"])
def test_a_local_step_in_flight_at_exit_commits(tmp_path, behind):
    """A script that ends with a local step in flight (``async_save``, no ``close``): the
    tier's daemon thread was killed mid-way by the interpreter's exit, leaving the step
    uncommitted (a marker's temp file), and with ``persist_behind`` the persistent step it
    uploads was lost entirely. The exit now drains the tier like async saves: the local step
    (with its copy on the other node) and the persistent one commit, bit-exact."""
    results = _exit_result(tmp_path, behind, "alive")
    assert results == ["RESULT returned 0", "RESULT returned 1"], results
    full = torch.arange(32, dtype=torch.float32).view(8, 4) + 1
    for node in (0, 1):
        marker = json.loads((tmp_path / f"node{node}" / "step_00000003" / "local.json").read_text())
        assert marker["step"] == 3
    mgr = db.CheckpointManager(str(tmp_path / "run"), every=1)
    assert mgr.all_steps() == [3]
    out = mgr.load({"w": db.ShardedTensor.from_box("w", torch.zeros(8, 4), (8, 4), (0, 0))})
    assert torch.equal(out["w"], full) and out["step"] == 3
    mgr.close()


@pytest.mark.timeout(120)
def test_a_local_step_at_exit_whose_peer_died_fails_without_hanging_the_exit(tmp_path):
    """The exit's drain of a local step waits for the step's peers: one killed mid-write
    (no exit drain of its own) fails the step on the survivor within the peer timeout
    (liveness), whose exit then ends (0) with nothing committed in either tier."""
    started = time.monotonic()
    results = _exit_result(tmp_path, True, "killed")
    assert results == ["RESULT returned 0", "RESULT returned 1"], results  # (before the write)
    assert time.monotonic() - started < 60
    assert not list(tmp_path.glob("node*/step_*/local.json"))
    assert not (tmp_path / "run" / "step_00000003" / "dcpbridge.json").exists()
