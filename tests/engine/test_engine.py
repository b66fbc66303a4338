"""The engine's parts on their own: failure-carrying steps, the ownership map, per-group caches."""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist

import dcpbridge as db
from dcpbridge.engine import protocol
from dcpbridge.engine.cache import SAVE_CACHES
from dcpbridge.engine.collectives import Group
from dcpbridge.engine.ownership import WriteOwners, write_id
from tests.support.collective_counts import count_collectives
from tests.support.dist_pool import Rank


def _fails_on(rank: int, failing: set[int], error: Exception) -> int:
    if rank in failing:
        raise error
    return rank


def run_steps(r: Rank, failing: list[int]) -> dict:
    """Each step shape with ``failing`` ranks raising: what every rank sees."""
    group = Group.resolve(r.group)
    bad = set(failing)
    seen: dict = {}
    steps = {
        "decide": lambda local: protocol.decide(group, "plan", local, lambda xs: xs),
        "commit": lambda local: protocol.commit(group, "write", local, sum),
        "agree": lambda local: protocol.agree(group, "vote", local),
        "on_coordinator": lambda local: protocol.on_coordinator(group, "read", local),
    }
    for name, step in steps.items():
        for error in (ValueError("boom"), RuntimeError(f"r{r.rank}")):
            label = f"{name}/{type(error).__name__}"
            try:
                seen[label] = ("ok", step(lambda e=error: _fails_on(r.rank, bad, e)))
            except Exception as e:
                cause = e.__cause__
                seen[label] = (type(e).__name__, str(e), type(cause).__name__, str(cause))
    return seen


def test_every_step_raises_on_every_rank_naming_the_failed_ranks(pool):
    ranks = pool.run(run_steps, 3, [1, 2])
    for label in ("decide", "commit", "agree"):
        same = [seen[f"{label}/ValueError"] for seen in ranks]
        assert same[0] == same[1] == same[2], label
        kind, text, cause, cause_text = same[0]
        assert kind == "ValueError" and "ranks [1, 2]: ValueError: boom" in text
        assert (cause, cause_text) == ("ValueError", "boom")  # the original, as __cause__
        # differing messages are listed per rank; one class for all keeps that class
        kind, text, _, _ = ranks[0][f"{label}/RuntimeError"]
        assert kind == "RuntimeError" and "rank 1: RuntimeError: r1" in text and "rank 2: " in text
    # only the coordinator works in on_coordinator: ranks 1 and 2 failing changes nothing
    assert [seen["on_coordinator/ValueError"] for seen in ranks] == [
        ("ok", 0),
        ("ok", None),
        ("ok", None),
    ]


def run_coordinator_failure(r: Rank) -> list[str]:
    group = Group.resolve(r.group)
    seen = []
    for step in (
        lambda: protocol.decide(group, "plan", lambda: r.rank, lambda xs: 1 / 0),
        lambda: protocol.commit(group, "write", lambda: r.rank, lambda xs: 1 / 0),
        lambda: protocol.on_coordinator(group, "read", lambda: 1 / 0),
    ):
        with pytest.raises(ZeroDivisionError) as info:
            step()
        assert isinstance(info.value.__cause__, ZeroDivisionError)
        seen.append(str(info.value).splitlines()[0])
    return seen


def test_a_coordinator_failure_reaches_every_rank(pool):
    a, b = pool.run(run_coordinator_failure, 2)
    assert a == b == ["rank 0: ZeroDivisionError: division by zero"] * 3


def test_different_failures_raise_a_distributed_error_on_every_rank(pool):
    ranks = pool.run(run_mixed_failures, 2)
    assert ranks[0] == ranks[1]
    assert "rank 0: ValueError: zero" in ranks[0] and "rank 1: shard one" in ranks[0]


def run_mixed_failures(r: Rank) -> str:
    group = Group.resolve(r.group)
    errors = [ValueError("zero"), db.InvalidShardError("shard one")]
    with pytest.raises(db.DistributedCheckpointError) as info:
        protocol.agree(group, "vote", lambda: _fails_on(r.rank, {0, 1}, errors[r.rank]))
    assert isinstance(info.value.__cause__, type(errors[r.rank]))  # this rank's own
    return str(info.value)


def test_a_group_of_one_raises_the_original():
    alone = Group(None, 0, 1, 0)
    error = db.InvalidShardError("mine")
    with pytest.raises(db.InvalidShardError) as info:
        protocol.agree(alone, "vote", lambda: _fails_on(0, {0}, error))
    assert info.value is error
    assert protocol.decide(alone, "plan", lambda: 3, lambda xs: [x * 2 for x in xs]) == 6


def test_write_owners_answer_for_every_item():
    def shard(key: str, offset: int, replica: int | tuple[int, ...]) -> db.ShardedTensor:
        return db.ShardedTensor.from_box(key, torch.zeros(2), (4,), (offset,), replica_id=replica)

    w0, w2, plain = shard("w", 0, 0), shard("w", 2, (0, 1)), shard("step", 0, 0)
    obj = db.ShardedObject("rng", {}, (2,), (1,), replica_id=(0, 0))
    main = WriteOwners(coordinator=False, common_tensors=frozenset({"step"}))
    assert main.writes(w0) and not main.writes(w2) and main.writes(obj)
    assert not main.writes(plain) and not main.writes_common()  # the common state: rank 0's
    spread = WriteOwners(
        coordinator=True,
        common_tensors=frozenset({"step"}),
        assigned={write_id(w0): 1, write_id(plain): 0},
        parallel_rank=1,
    )
    assert spread.writes(w0) and not spread.writes(plain) and spread.writes_common()
    assert not spread.writes(w2)  # not assigned: its main replica decides


def save_on_a_new_group(r: Rank, root: str) -> tuple[int, int, dict]:
    """Save twice on a fresh sub-group, then destroy it: its cache entries go with it."""
    SAVE_CACHES.clear()
    group = dist.new_group([0, 1])
    if r.rank < 2:
        state = {"w": db.ShardedTensor.from_rank_offsets("w", torch.ones(4), (0, r.rank, 2))}
        db.save(state, os.path.join(root, "a"), process_group=group)
        with count_collectives() as calls:
            db.save(state, os.path.join(root, "b"), process_group=group)
    kept = len(SAVE_CACHES.values())
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return kept, len(SAVE_CACHES.values()), dict(calls) if r.rank < 2 else {}


def test_save_caches_are_kept_per_group_and_dropped_with_it(pool, tmp_path):
    results = pool.run(save_on_a_new_group, 4, str(tmp_path), default_group=True)
    assert [(kept, after) for kept, after, _ in results] == [(1, 0), (1, 0), (0, 0), (0, 0)]
    assert results[0][2] == {"all_gather": 1, "gather": 1, "broadcast": 1}  # the cache served


def test_save_options_are_checked():
    with pytest.raises(db.InvalidArgumentError, match="format"):
        db.SaveOptions(format="zip")
    with pytest.raises(TypeError, match="checksum"):
        db.save({}, "unused", checksum=False)
