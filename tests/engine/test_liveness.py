"""Store-backed exchanges see a dead peer: its heartbeat stops and the waiters raise in seconds.

Before, a survivor waited in the async commit or the local tier's agreement until the job
store's timeout (30 minutes by default), since a key-value store cannot tell a dead rank
from a slow one.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dcpbridge as db
from dcpbridge.engine import liveness
from dcpbridge.engine.collectives import Group, StoreGroup
from dcpbridge.engine.liveness import Heartbeat, PeerWatch, get_all, peer_timeout
from dcpbridge.storage import FsspecCheckpointWriter
from tests.e2e import test_local_tier as T
from tests.support.dist_pool import Rank, RankFailure, run_scripts
from tests.support.s3_server import free_port

# -- one process, a real TCPStore ---------------------------------------------------------------


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    return dist.PrefixStore("job", server)


@pytest.fixture
def fast(monkeypatch):
    """A peer is dead after 1 s of silence; beats every 0.25 s."""
    monkeypatch.setenv(liveness.PEER_TIMEOUT_ENV, "1")


def test_a_key_already_set_returns_at_once(store):
    store.set("k", b"v")
    assert get_all(store, ["k"], [1], beat=None, view=None, what="op") == [b"v"]


def test_a_silent_owner_is_named_dead(store, fast):
    """Rank 5 never beat: the heartbeat thread marks its key dead after the peer timeout,
    which wakes the wait; reading it raises, naming rank 5 only. Rank 4's value reads."""
    beat = Heartbeat(store, 4)
    store.set("a", pickle.dumps("four"))
    try:
        started = time.monotonic()
        a, b = get_all(store, ["a", "b"], [4, 5], beat=beat, view=beat.base, what="op")
        assert 1 < time.monotonic() - started < 6
        assert liveness.loads(a, "op") == "four"
        with pytest.raises(db.CollectiveError, match=r"op: rank\(s\) \[5\] stopped answering"):
            liveness.loads(b, "op")
    finally:
        beat.stop()


def test_a_late_value_is_never_replaced_by_the_dead_mark(store, fast):
    beat = Heartbeat(store, 4)
    store.set("b", pickle.dumps("late but here"))
    watched = liveness._Watched(beat.base, ["b"], [5], PeerWatch(beat.base, [5], 1.0))
    try:
        watched.look()
        time.sleep(1.2)
        watched.look()  # rank 5 is silent, but its key is set: nothing to mark
        assert liveness.loads(store.get("b"), "op") == "late but here"
    finally:
        beat.stop()


def test_a_beating_owner_is_waited_for_until_it_answers(store, fast):
    """A live owner may take many peer timeouts: the wait returns when its key comes (set
    on another client: a blocked wait holds the one it runs on, as a blocking ``get`` does)."""
    beat = Heartbeat(store, 2)
    timer = threading.Timer(3, lambda: store.clone().set("late", b"1"))
    timer.start()
    try:
        started = time.monotonic()
        assert get_all(store, ["late"], [2], beat=beat, view=beat.base, what="op") == [b"1"]
        assert time.monotonic() - started >= 2.9  # three peer timeouts
    finally:
        timer.cancel()
        beat.stop()


class _Counting:
    """A store that counts the requests made through it (the store server's load)."""

    def __init__(self, store) -> None:
        self.store, self.requests = store, 0
        self.timeout = store.timeout

    def __getattr__(self, name):
        call = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.requests += 1
            return call(*args, **kwargs)

        return counted


def test_a_long_wait_costs_the_store_few_requests_and_wakes_at_once(store, fast):
    """Waiters polled their keys every 2-50 ms: 16,384 ranks waiting for one slow rank sent
    the job's store some 300,000 requests a second. A wait now blocks in the store (the
    heartbeat thread looks at the peers) and returns as soon as the key is set."""
    beat = Heartbeat(store, 2)
    counting = _Counting(store)
    set_at = []
    other = store.clone()
    # the time taken before the set: after it, the woken waiter could read set_at first
    timer = threading.Timer(2, lambda: (set_at.append(time.monotonic()), other.set("slow", b"1")))
    timer.start()
    try:
        started = time.monotonic()
        get_all(counting, ["slow"], [2], beat=beat, view=beat.base, what="op")
        woke = time.monotonic()
        assert time.monotonic() - started >= 1.9
        assert woke - set_at[0] < 0.1  # woken by the key, not by a poll
        assert counting.requests == 1, counting.requests  # one multi_get, no polls
    finally:
        timer.cancel()
        beat.stop()


def test_a_heartbeat_follows_a_peer_timeout_set_after_it_started(store, monkeypatch):
    """The beat kept the period of the peer timeout it started under: a process whose first
    group came before ``DCPB_PEER_TIMEOUT=1`` beat every 5 s and was named dead while alive."""
    monkeypatch.delenv(liveness.PEER_TIMEOUT_ENV, raising=False)
    beat = Heartbeat(store, 2)
    monkeypatch.setenv(liveness.PEER_TIMEOUT_ENV, "1")
    time.sleep(5.5)  # the beat in flight under the old period has passed
    timer = threading.Timer(3, lambda: store.clone().set("later", b"1"))
    timer.start()
    try:
        get_all(store, ["later"], [2], beat=beat, view=beat.base, what="op")
    finally:
        timer.cancel()
        beat.stop()


def test_a_heartbeat_that_stops_is_noticed(store, fast):
    beat = Heartbeat(store, 3)
    watch = PeerWatch(store, [3], peer_timeout())
    assert watch.silent([3]) == []
    for _ in range(6):
        time.sleep(0.3)
        assert watch.silent([3]) == []  # it beats: never silent
    beat.stop()
    watch.silent([3])  # the last count after it stopped
    time.sleep(1.2)
    assert watch.silent([3]) == [3]


def test_without_heartbeats_the_store_timeout_still_ends_the_wait(store):
    store.set_timeout(timedelta(seconds=1.5))
    with pytest.raises(db.CollectiveError, match=r"op: rank\(s\) \[1\] did not answer within"):
        get_all(store, ["never"], [1], beat=None, view=None, what="op")


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "soon", "inf"])
def test_a_bad_peer_timeout_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv(liveness.PEER_TIMEOUT_ENV, raw)
    with pytest.raises(db.InvalidArgumentError, match=liveness.PEER_TIMEOUT_ENV):
        peer_timeout()


@pytest.mark.parametrize(
    ("raw", "timeout", "beat"),
    [(None, 60, 5), ("0.5", 1, 0.25), ("3", 3, 0.25), ("24", 24, 2), ("600", 600, 5)],
)
def test_the_peer_timeout_and_the_beat_it_sets(monkeypatch, raw, timeout, beat):
    """At least 1 s; a beat a twelfth of it, within 0.25 s and 5 s (the store's load)."""
    if raw is None:
        monkeypatch.delenv(liveness.PEER_TIMEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(liveness.PEER_TIMEOUT_ENV, raw)
    assert (peer_timeout(), liveness.period()) == (timeout, beat)


def _store_group(store, rank: int, beat: Heartbeat) -> StoreGroup:
    """Group rank ``rank`` of three (global ranks 0-2) over ``store``."""
    return StoreGroup(Group(None, rank, 3, 0), store, "t", (0, 1, 2), beat)


def test_a_gather_that_fails_leaves_no_values_in_the_store(store, fast):
    """Rank 2 never answers: the coordinator's gather fails. Rank 1's value (a whole plan, in
    a real save) and rank 2's dead mark stayed in the job's store, since the coordinator,
    their only reader, deleted them only after a success."""
    beats = [Heartbeat(store, 0), Heartbeat(store, 1)]
    try:
        coordinator, other = (_store_group(store, r, beats[r]) for r in (0, 1))
        assert other.gather({"plan": list(range(1000))}) is None
        with pytest.raises(db.CollectiveError, match=r"gather: rank\(s\) \[2\] stopped"):
            coordinator.gather("mine")
        assert [coordinator._store.check([f"0/gather/{r}"]) for r in (1, 2)] == [False, False]
    finally:
        for beat in beats:
            beat.stop()


def test_a_scatter_that_fails_leaves_no_value_in_the_store(store, fast):
    """The coordinator (rank 0) never answers: rank 1's scatter fails and its key, which only
    it reads, is deleted (here the dead mark; a value the coordinator set before dying too)."""
    beat = Heartbeat(store, 1)
    try:
        group = _store_group(store, 1, beat)
        with pytest.raises(db.CollectiveError, match=r"scatter: rank\(s\) \[0\] stopped"):
            group.scatter(None)
        assert not group._store.check(["0/scatter/1"])
    finally:
        beat.stop()


# -- real ranks, one of them killed ---------------------------------------------------------------

PEER_TIMEOUT = "3"


def _outcome(out: str, rank: int, started: float, error: BaseException | None, **more) -> None:
    record = {
        "seconds": time.monotonic() - started,
        "type": type(error).__name__ if error is not None else None,
        "message": str(error) if error is not None else "",
        **more,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def killed_behind_async_save(r: Rank, root: str, out: str) -> None:
    """Rank 1 dies in its background write; rank 0 waits for it in the async commit."""
    os.environ[liveness.PEER_TIMEOUT_ENV] = PEER_TIMEOUT
    mgr = db.CheckpointManager(
        root, every=1, process_group=r.group, async_save=True, writer="thread"
    )
    w = torch.arange(64.0).reshape(8, 8).chunk(r.size)[r.rank].clone()
    sharded = {"w": db.ShardedTensor.from_rank_offsets("w", w, (0, r.rank, r.size))}
    mgr.save(1, sharded)
    mgr.wait()
    if r.rank == 1:
        original = FsspecCheckpointWriter.write_data

        def write_then_die(self, plan, planner):
            original(self, plan, planner).wait()
            os.kill(os.getpid(), signal.SIGKILL)

        FsspecCheckpointWriter.write_data = write_then_die
    mgr.save(2, sharded)
    started, error = time.monotonic(), None
    try:
        mgr.wait()
    except BaseException as e:  # the outcome is the test's
        error = e
    _outcome(out, r.rank, started, error)


@pytest.mark.timeout(120)
def test_a_rank_killed_behind_an_async_save_fails_the_wait_in_seconds(pool, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    try:
        with pytest.raises(RankFailure, match="worker died"):
            pool.run(killed_behind_async_save, 2, str(tmp_path / "run"), str(out), grace=30)
    finally:
        pool.kill()
    survivor = json.loads((out / "rank0.json").read_text())
    assert survivor["type"] == "CollectiveError", survivor
    assert "rank 0 of 2" in survivor["message"]
    assert "rank(s) [1] stopped answering" in survivor["message"], survivor
    assert survivor["seconds"] < 25, survivor  # 3 s of silence, not the store's 120 s
    mgr = db.CheckpointManager(str(tmp_path / "run"), async_save=False)
    assert mgr.all_steps() == [1]  # step 2 never looks complete


def killed_mid_local_copies(r: Rank, root: str, local: str, out: str) -> None:
    """Rank 3 dies before its copies of the last local step; the others wait for it."""
    os.environ[liveness.PEER_TIMEOUT_ENV] = PEER_TIMEOUT
    original = T.local_tier.LocalTier._send_copies

    def die(self, sizes, mine):
        if self.group.rank == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, sizes, mine)

    log = T._capture()
    mgr = T.manager(r, root, local)
    w = T.piece(T.weights(0), r.rank, r.size, 0)
    started = time.monotonic()
    for step in range(1, T.STEPS + 1):
        w.mul_(0.5).add_(step)
        if step == T.STEPS:
            T.local_tier.LocalTier._send_copies = die
            started = time.monotonic()
        mgr.save(step, T.state(w, r.rank, r.size, step))
    _outcome(out, r.rank, started, None, log=log.lines)


@pytest.mark.timeout(180)
def test_a_rank_killed_mid_local_copies_never_holds_the_others(pool, tmp_path):
    root, local = str(tmp_path / "persistent"), str(tmp_path / "node{node}")
    out = tmp_path / "out"
    out.mkdir()
    try:
        with pytest.raises(RankFailure, match="worker died"):
            pool.run(killed_mid_local_copies, 4, root, local, str(out), timeout=90, grace=30)
    finally:
        pool.kill()
    survivors = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    for s in survivors:  # the failed local step is logged, training goes on
        assert s["type"] is None and s["seconds"] < 25, s
        assert any("not committed" in line or "failed" in line for line in s["log"]), s
    assert any("rank(s) [3] stopped answering" in line for s in survivors for line in s["log"])
    back = pool.run(T.restore, 4, root, local, 0, 2, timeout=120)
    assert [b["step"] for b in back] == [T.STEPS - 1] * 4


# -- a process group destroyed in-process ---------------------------------------------------------

DESTROYED_GROUP = """
import gc, os, socket, sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from dcpbridge.engine.collectives import Group, StoreGroup
rank, port = int(sys.argv[1]), int(sys.argv[2])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DCPB_PEER_TIMEOUT="1")
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
group = StoreGroup.for_group(Group.resolve(), "t")
assert group.all_gather(rank) == [0, 1]
del group
dist.barrier()
dist.destroy_process_group()
gc.collect()
time.sleep(3)  # twelve beats: a beat into the old store ends with the store
beating = [t.name for t in threading.enumerate() if t.name == "dcpbridge-heartbeat"]
free = True
if rank == 0:
    with socket.socket() as s:  # as the store binds it: TIME_WAIT leftovers do not count
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            free = False
print("RESULT", beating, free, flush=True)
"""


@pytest.mark.timeout(90)
def test_a_destroyed_process_group_takes_its_heartbeat_and_store_along(tmp_path):
    """After destroy_process_group the heartbeat held the job's store: rank 0's store server
    kept its port (a re-init on MASTER_PORT failed) and the thread beat into it forever."""
    results = run_scripts(DESTROYED_GROUP, str(free_port()), timeout=60)
    assert results == ["RESULT [] True"] * 2


# -- a failed broadcast or all-gather between real ranks -----------------------------------------


def _keys_left(group: StoreGroup, ops: list[str]) -> list[str]:
    """The keys of the group's first exchanges (``ops``, in order) still in the job's store."""
    names = ["value", "readers", "0", "1", "2"]
    keys = [f"{seq}/{op}/{n}" for seq, op in enumerate(ops) for n in names]
    return [k for k in keys if group._store.check([k])]


def failed_store_exchange(r: Rank, op: str, phantom: int, name: str) -> tuple[str | None, list]:
    """Pool ranks 0-2 as a three-rank store group whose group rank ``phantom`` is global rank
    99 to its peers, which never beats: one exchange succeeds, then that rank stays away from
    the next one, which fails on the others."""
    previous = os.environ.get(liveness.PEER_TIMEOUT_ENV)
    os.environ[liveness.PEER_TIMEOUT_ENV] = PEER_TIMEOUT
    try:
        store = dist.distributed_c10d._get_default_store()
        beat = Heartbeat.ensure(store, dist.get_rank())
        members = tuple(99 if g == phantom else g for g in range(3))
        group = StoreGroup(Group(None, r.rank, 3, 0), store, name, members, beat)
        assert getattr(group, op)(r.rank) == ([0, 1, 2] if op == "all_gather" else 0)
        dist.barrier(group=r.group)
        error = None
        if r.rank != phantom:
            try:
                getattr(group, op)(r.rank)
            except db.CollectiveError as e:
                error = str(e)
        dist.barrier(group=r.group)
        return error, _keys_left(group, [op, op])
    finally:
        if previous is None:
            os.environ.pop(liveness.PEER_TIMEOUT_ENV, None)
        else:
            os.environ[liveness.PEER_TIMEOUT_ENV] = previous


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("op", "phantom"), [("broadcast", 0), ("all_gather", 2)])
def test_a_failed_broadcast_or_all_gather_leaves_no_keys_in_the_store(pool, op, phantom):
    """A broadcast or all-gather that failed (a rank counted dead) left its values, the dead
    mark and the reader count in the job's store for the life of the job, one set per failed
    save or vote: only a success counted the readers out. Every reader now counts out of a
    failed exchange too (each saw the same dead ranks), and the last one deletes its keys."""
    name = f"leak-{op}-{time.monotonic_ns()}"
    results = pool.run(failed_store_exchange, 3, op, phantom, name, timeout=90)
    for rank, (error, left) in enumerate(results):
        assert left == [], (rank, left)
        if rank == phantom:
            assert error is None
        else:
            assert f"rank {rank} of 3: {op}: rank(s) [99] stopped answering" in error, error


@pytest.mark.parametrize(("op", "rank", "key"), [("broadcast", 0, "value"), ("all_gather", 1, "1")])
def test_a_rank_counted_dead_fails_instead_of_answering_over_the_mark(store, op, rank, key):
    """A slow rank whose peers marked its key dead wrote its value over the mark and carried
    on alone (its broadcast or all-gather succeeded where every other rank's failed); now the
    mark stays, and the slow rank raises as its peers did."""
    group = StoreGroup(Group(None, rank, 2, 0), store, "late", (0, 1), None)
    mark = liveness.DEAD + b"rank(s) [7] stopped answering"
    group._store.set(f"0/{op}/{key}", mark)
    with pytest.raises(db.CollectiveError) as caught:
        getattr(group, op)("late")
    assert str(caught.value) == (
        f"rank {rank} of 2: {op}: the other ranks gave up on this rank before it answered "
        "(rank(s) [7] stopped answering)"
    )
    assert group._store.get(f"0/{op}/{key}") == mark
