"""Plans that carry their chunks as columns: the coordinator's answers (metadata, worded
errors) are exactly those it gives from the write items one by one."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest
import torch
from torch.distributed.checkpoint.planner import SavePlan

import dcpbridge as db
from dcpbridge.planners import ShardedSavePlanner, ShardingValidationError, build_metadata
from dcpbridge.planners.save_planner import describe_plan, plan_local_writes
from dcpbridge.planners.walk import iter_leaves


def _plan(shards: list, *, coordinator: bool = False, columns: bool = True) -> SavePlan:
    """A rank's plan as ``create_local_plan`` makes it (``columns=False``: as an older or
    foreign planner sends it, items only)."""
    local = plan_local_writes(iter_leaves({"s": shards}), is_coordinator=coordinator)
    if columns:
        describe_plan(local.items, local.summary)
    return SavePlan(local.items, planner_data=local.summary)


def _both(ranks: list[list]) -> tuple[list[SavePlan], list[SavePlan]]:
    """(plans with columns, the same plans without) of every rank's shards."""
    with_cols = [_plan(s, coordinator=r == 0) for r, s in enumerate(ranks)]
    without = [_plan(s, coordinator=r == 0, columns=False) for r, s in enumerate(ranks)]
    assert all(p.planner_data.columns is not None for p in with_cols)
    return with_cols, without


def _chunks(md) -> dict:
    out = {}
    for key, entry in md.state_dict_metadata.items():
        chunks = getattr(entry, "chunks", None)
        out[key] = None if chunks is None else [(list(c.offsets), list(c.sizes)) for c in chunks]
    return out


def _layout(rng: random.Random, ranks: int) -> list[list]:
    """Every rank's shards of a few tensors split over the ranks on a random dim (some of
    them 3-d, some 0-d, some with empty pieces, some replicated), plus objects."""
    shards: list[list] = [[] for _ in range(ranks)]
    for t in range(6):
        ndim = rng.choice([0, 1, 2, 3])
        shape = [rng.randint(1, 5) * ranks for _ in range(ndim)]
        if ndim == 0:
            value = torch.tensor(float(t))
            shards[0].append(db.ShardedTensor.from_box(f"t{t}", value, (), ()))
            continue
        dim = rng.randrange(ndim)
        step = shape[dim] // ranks
        full = torch.randn(shape)
        for r in range(ranks):
            offsets = [0] * ndim
            offsets[dim] = r * step
            piece = full.narrow(dim, r * step, step)
            shards[r].append(db.ShardedTensor.from_box(f"t{t}", piece, tuple(shape), offsets))
        whole = torch.randn(shape)  # on rank 0; the last rank holds an empty piece
        shards[0].append(db.ShardedTensor.from_box(f"e{t}", whole, tuple(shape), [0] * ndim))
        none = whole.narrow(dim, 0, 0)
        shards[ranks - 1].append(db.ShardedTensor.from_box(f"e{t}", none, tuple(shape), [0] * ndim))
    for r in range(ranks):
        shards[r].append(db.ShardedObject("rng", r, (ranks,), (r,), replica_id=0))
    shards[0].append(db.ShardedObject("cfg", {"a": 1}, (1,), (0,)))
    return shards


@pytest.mark.parametrize("seed", range(4))
def test_columns_give_the_metadata_the_items_give(seed):
    rng = random.Random(seed)
    with_cols, without = _both(_layout(rng, rng.choice([1, 2, 5])))
    a, b = build_metadata(with_cols), build_metadata(without)
    assert _chunks(a) == _chunks(b)
    assert a.planner_data == b.planner_data
    assert list(a.state_dict_metadata) == list(b.state_dict_metadata)
    table = a.state_dict_metadata["t1"].chunks.table  # the columns were used, not the items
    assert table.sources is not None and b.state_dict_metadata["t1"].chunks.table.sources is None


def _row_shards(rows: list[tuple[int, int]], shape=(8, 4)) -> list:
    w = torch.zeros(shape)
    return [db.ShardedTensor.from_box("layers.w", w[o : o + n], shape, (o, 0)) for o, n in rows]


@pytest.mark.parametrize("columns", [True, False])
def test_overlapping_and_missing_chunks_are_worded_naming_the_key(columns):
    plans = [
        _plan(_row_shards([(0, 4)]), coordinator=True, columns=columns),
        _plan(_row_shards([(2, 4)]), columns=columns),
    ]
    with pytest.raises(
        ShardingValidationError,
        match=r"'layers\.w': shards overlap: rank 0 \[0:4, 0:4\] and rank 1 \[2:6, 0:4\] both "
        r"write \[2:4, 0:4\]",
    ):
        build_metadata(plans)
    plans = [
        _plan(_row_shards([(0, 4)]), coordinator=True, columns=columns),
        _plan(_row_shards([(6, 2)]), columns=columns),
    ]
    with pytest.raises(
        ShardingValidationError,
        match=r"'layers\.w' \(global shape \(8, 4\)\): elements \[4:6, 0:4\] are not written "
        r"by any rank; main replicas cover 24 of 32 elements \(ranks writing it: \[0, 1\]",
    ):
        build_metadata(plans)


def test_outside_and_disagreeing_shards_are_worded_with_columns():
    w = torch.zeros(4, 4)
    inside = db.ShardedTensor.from_box("w", w, (8, 4), (0, 0))
    other = db.ShardedTensor.from_box("w", w, (8, 5), (4, 0))
    with pytest.raises(ShardingValidationError, match=r"'w': ranks disagree on the global shape"):
        build_metadata([_plan([inside], coordinator=True), _plan([other])])
    plan = _plan([inside], coordinator=True)
    # a chunk beyond the shape (only a broken planner makes one): reported, not indexed
    bad = dataclasses.replace(plan.items[0], index=dataclasses.replace(plan.items[0].index))
    td = bad.tensor_data
    moved = dataclasses.replace(td, chunk=dataclasses.replace(td.chunk, offsets=torch.Size([6, 0])))
    items = [dataclasses.replace(bad, tensor_data=moved)]
    describe_plan(items, plan.planner_data)
    with pytest.raises(
        ShardingValidationError, match=r"'w': rank 0 shard \[6:10, 0:4\] lies outside"
    ):
        build_metadata([SavePlan(items, planner_data=plan.planner_data)])


def test_a_plan_whose_items_changed_after_its_columns_is_read_item_by_item():
    """Columns describe one list: a plan holding another list (or a planner whose items were
    replaced in place) gets no trust, and its real items are checked."""
    mine, theirs = _row_shards([(0, 4)]), _row_shards([(4, 4)])
    plans = [_plan(mine, coordinator=True), _plan(theirs)]
    swapped = list(plans[0].items)  # rank 1 now writes rank 0's chunk: an overlap
    plans[1] = dataclasses.replace(plans[1], items=swapped)
    with pytest.raises(ShardingValidationError, match="shards overlap"):
        build_metadata(plans)

    planner = ShardedSavePlanner()
    planner.set_up_planner({"s": mine}, is_coordinator=True)
    plan = planner.create_local_plan()
    assert planner.plan_digest(plan) == plan.planner_data.columns.digest
    assert planner.plan_digest(dataclasses.replace(plan, planner_data=None)) is not None
    plan.items[0] = _plan(theirs).items[0]  # in place: the same list, another item
    assert planner.plan_digest(plan) is None
    assert planner.plan_digest(dataclasses.replace(plan, items=list(plan.items))) is None


def test_columns_travel_with_their_plan():
    """Pickled as a gather sends it, a plan's columns still describe its items."""
    plan = _plan(_row_shards([(0, 8)]), coordinator=True)
    back = pickle.loads(pickle.dumps(plan))
    assert back.planner_data.columns.describes(back)
    assert back.planner_data.digest == plan.planner_data.digest
    assert not back.planner_data.columns.describes(plan)
    md = build_metadata([back])
    assert md.state_dict_metadata["layers.w"].chunks.table.sources is not None
