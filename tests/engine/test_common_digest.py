"""Common state that differs across ranks: rank 0's is saved, and the save says what it dropped."""

from __future__ import annotations

import argparse
import os
import time
import warnings

import pytest
import torch

import dcpbridge as db
from dcpbridge.engine import common_digest
from dcpbridge.model.intake import for_save
from tests.support.dist_pool import Rank


def _state(rank: int, common: dict) -> dict:
    w = torch.arange(8, dtype=torch.float32)[rank * 4 : rank * 4 + 4]
    return {"w": db.ShardedTensor.from_rank_offsets("w", w, (0, rank, 2)), **common}


def save_differing_common_state(r: Rank, root: str, how: str) -> tuple[list[str], dict]:
    """Save common state that differs on rank 1 (``how``: "async" or "sync"), then load it:
    (this rank's warnings, the common state loaded)."""
    same = {"iteration": 7, "args": argparse.Namespace(lr=0.1, tags={"a", "b", "c"})}
    mine = {**same, "consumed": 100 + r.rank, "schedule": {"warmup": 10 * (r.rank + 1)}}
    path = os.path.join(root, how)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, common in (("equal", same), (how, mine)):
            target = os.path.join(root, name)
            if how == "async":
                db.async_save(_state(r.rank, common), target, process_group=r.group).result(60)
            else:
                db.save(_state(r.rank, common), target, process_group=r.group)
    seen = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, db.CommonStateMismatchWarning)
    ]
    out = db.load_common_state_dict(path, allow_pickle=True)  # the Namespace
    return seen, {k: out[k] for k in ("iteration", "consumed", "schedule")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["sync", "async"])
def test_common_state_that_differs_across_ranks_is_named_by_a_warning(pool, tmp_path, how):
    """Only rank 0's common state is written; another rank's different values were dropped
    without a word. Now rank 0 warns once per save, naming the keys and ranks (Megatron-Core
    logs the same differences); a save whose common state agrees says nothing."""
    (seen0, out0), (seen1, out1) = pool.run(
        save_differing_common_state, 2, str(tmp_path), how, timeout=90
    )
    assert seen1 == []  # rank 0, which writes the common state, tells
    assert seen0 == [
        "CommonStateMismatchWarning: save: the common state differs across ranks; only rank "
        "0's is saved, the other ranks' values are dropped: 'consumed' (ranks 1), "
        "'schedule.warmup' (ranks 1)"
    ]
    assert out0 == out1 == {"iteration": 7, "consumed": 100, "schedule": {"warmup": 10}}


def test_digests_ignore_dict_and_set_order_and_tensor_values():
    """What differs across processes without differing in value (dict insertion order, a
    set's order under another hash seed) gives equal digests; tensors count by dtype/shape."""
    a = {"x": {"p": 1, "q": [1, 2]}, "s": {"u", "v", "w"}, "t": torch.zeros(3)}
    b = {"t": torch.ones(3), "s": {"w", "v", "u"}, "x": {"q": [1, 2], "p": 1}}
    assert common_digest.key_digests(a) == common_digest.key_digests(b)
    c = {**a, "x": {"p": 1, "q": [2, 1]}, "t": torch.zeros(4)}
    got = common_digest.differing(common_digest.key_digests(a), common_digest.key_digests(c))
    assert got == ["t", "x"]


def test_the_digest_of_a_large_states_common_part_costs_no_measurable_time():
    """20,000 tensors and a Megatron-like common part: the digest reads the common values
    only (well under a millisecond), never the tensors."""
    state = {
        f"layer{i}.weight": db.ShardedTensor.from_rank_offsets(f"layer{i}.weight", torch.zeros(4))
        for i in range(20_000)
    }
    state.update(iteration=1000, args=argparse.Namespace(**{f"opt{i}": i for i in range(300)}))
    objects = for_save(state).objects
    start = time.perf_counter()
    for _ in range(10):
        common_digest.digest(common_digest.key_digests(objects))
    assert (time.perf_counter() - start) / 10 < 0.005
