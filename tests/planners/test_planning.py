"""Pure planning functions: no process group, no files."""

from __future__ import annotations

import time

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

import dcpbridge as db
from dcpbridge.planners import (
    Placed,
    ShardingValidationError,
    build_metadata,
    coverage_problems,
    find_gap,
    find_overlaps,
    plan_local_reads,
    plan_local_writes,
)
from dcpbridge.planners.walk import STATE_WALKER, iter_leaves
from dcpbridge.storage.backends.regions import plan_extents


def _grid(rows: int, cols: int, r: int, c: int) -> list[Placed]:
    out = []
    for i in range(r):
        for j in range(c):
            out.append(Placed((i * rows // r, j * cols // c), (rows // r, cols // c), i * c + j))
    return out


def test_coverage_of_an_exact_grid_is_clean():
    assert coverage_problems("w", (64, 64), _grid(64, 64, 8, 8)) == []


def test_overlap_and_gap_are_located():
    chunks = [Placed((0, 0), (4, 8), 0), Placed((3, 0), (4, 8), 1)]
    ((a, b),) = find_overlaps(chunks)
    assert (a.rank, b.rank) == (0, 1)
    gap = find_gap((10, 8), [Placed((0, 0), (4, 8), 0), Placed((6, 0), (4, 8), 1)])
    assert gap == ((4, 0), (2, 8))
    problems = coverage_problems(
        "w", (10, 8), [Placed((0, 0), (4, 8), 0), Placed((6, 0), (4, 8), 1)]
    )
    assert len(problems) == 1 and "[4:6, 0:8]" in problems[0]


def test_zero_size_chunks_neither_overlap_nor_cover():
    chunks = [
        Placed((0,), (5,), 0),
        Placed((5,), (0,), 1),
        Placed((5,), (5,), 2),
        Placed((5,), (0,), 3),
    ]
    assert coverage_problems("v", (10,), chunks) == []
    assert coverage_problems("s", (), [Placed((), (), 0)]) == []
    assert "overlap" in coverage_problems("s", (), [Placed((), (), 0), Placed((), (), 1)])[0]


def test_overlap_check_is_fast_when_split_along_the_small_dim():
    """4096 column shards of a (4096, 4096) tensor: the sweep must pick the split dim."""
    chunks = [Placed((0, i), (4096, 1), i) for i in range(4096)]
    t0 = time.perf_counter()
    assert coverage_problems("w", (4096, 4096), chunks) == []
    assert time.perf_counter() - t0 < 5  # quadratic would be ~16M box tests


def _plan(rank: int, shards: list, coordinator: bool = False):
    plan = plan_local_writes(iter_leaves({"s": shards}), is_coordinator=coordinator)
    from torch.distributed.checkpoint.planner import SavePlan

    return SavePlan(plan.items, planner_data=plan.summary)


def test_save_plan_skips_replicas_and_empty_shards_and_builds_metadata():
    w = torch.arange(12.0).reshape(4, 3)
    r0 = [
        db.ShardedTensor.from_rank_offsets("w", w[:2], (0, 0, 2), replica_id=(0, 0, 0)),
        db.ShardedTensor.from_box("e", torch.zeros(0), (3,), (0,)),
    ]
    r1 = [
        db.ShardedTensor.from_rank_offsets("w", w[2:], (0, 1, 2), replica_id=(0, 0, 0)),
        db.ShardedTensor.from_box("e", torch.zeros(3), (3,), (0,)),
    ]
    r2 = [  # a DP replica of rank 0's shard: not written
        db.ShardedTensor.from_rank_offsets("w", w[:2], (0, 0, 2), replica_id=(0, 0, 1)),
        db.ShardedTensor.from_box("e", torch.zeros(0), (3,), (3,)),
    ]
    plans = [_plan(0, r0, True), _plan(1, r1), _plan(2, r2)]
    assert [len(p.items) for p in plans] == [1, 2, 0]
    md = build_metadata(plans)
    chunks = md.state_dict_metadata["w"].chunks
    assert [(list(c.offsets), list(c.sizes)) for c in chunks] == [
        ([0, 0], [2, 3]),
        ([2, 0], [2, 3]),
    ]
    assert list(md.state_dict_metadata["e"].size) == [3]


def test_object_grid_must_be_saved_exactly_once():
    objs = [db.ShardedObject("rng", i, (3,), (i,), replica_id=0) for i in range(2)]
    with pytest.raises(
        ShardingValidationError,
        match=r"2 of 3 shards are saved; no main replica saves offsets \[\(2,\)\]",
    ):
        build_metadata([_plan(0, objs, True)])
    dup = [db.ShardedObject("c", 1, (1,), (0,))]
    with pytest.raises(ShardingValidationError, match=r"written by ranks \[0, 1\]"):
        build_metadata([_plan(0, dup, True), _plan(1, dup)])


def _metadata(shape, boxes):
    shards = [db.ShardedTensor.from_box("w", torch.zeros(s), shape, o) for o, s in boxes]
    return build_metadata([_plan(0, shards, True)])


def test_read_plan_is_the_exact_overlap():
    md = _metadata((8, 6), [((0, 0), (4, 6)), ((4, 0), (4, 6))])  # saved split on dim 0
    req = db.ShardedTensor.from_box("w", torch.zeros(8, 3), (8, 6), (0, 3))  # want columns 3..5
    reads = plan_local_reads(iter_leaves([req]), md)
    got = sorted(
        (
            tuple(i.storage_index.offset),
            tuple(i.storage_offsets),
            tuple(i.dest_offsets),
            tuple(i.lengths),
        )
        for i in reads.items
    )
    assert got == [
        ((0, 0), (0, 3), (0, 0), (4, 3)),
        ((4, 0), (0, 3), (4, 0), (4, 3)),
    ]
    assert reads.dests.keys() == {MetadataIndex("w", (0, 3))}


def test_read_plan_uses_the_chunk_index_for_many_chunks():
    boxes = [((i,), (1,)) for i in range(1000)]
    md = _metadata((1000,), boxes)
    req = db.ShardedTensor.from_box("w", torch.zeros(10), (1000,), (500,))
    reads = plan_local_reads(iter_leaves([req]), md)
    assert sorted(i.storage_index.offset[0] for i in reads.items) == list(range(500, 510))


def test_read_plan_errors_name_the_key():
    md = _metadata((8,), [((0,), (8,))])
    with pytest.raises(db.ShapeMismatchError, match=r"'w'.*\(8,\), requested \(9,\)"):
        plan_local_reads(
            iter_leaves([db.ShardedTensor.from_box("w", torch.zeros(9), (9,), (0,))]), md
        )
    with pytest.raises(db.DTypeMismatchError, match="float64"):
        plan_local_reads(
            iter_leaves(
                [db.ShardedTensor.from_box("w", torch.zeros(8, dtype=torch.float64), (8,), (0,))]
            ),
            md,
        )
    missing = plan_local_reads(
        iter_leaves([db.ShardedTensor.from_box("x", torch.zeros(1), (1,), (0,))]), md
    )
    assert missing.missing == ["x"] and not missing.items


def test_extents_dim0_slice_is_one_exact_range():
    ext = plan_extents((8, 1024), (2, 0), (3, 1024), 4, min_piece_bytes=16 << 10)
    assert [(e.start, e.stop) for e in ext] == [(2 * 1024, 5 * 1024)]


def test_extents_dim1_slice_is_one_range_per_row_when_rows_are_big():
    ext = plan_extents((4, 16384), (0, 8192), (4, 8192), 4, min_piece_bytes=16 << 10)
    assert [(e.start, e.stop, e.box_offsets) for e in ext] == [
        (r * 16384 + 8192, r * 16384 + 16384, (r, 0)) for r in range(4)
    ]
    assert all(e.contiguous for e in ext)


def test_extents_small_rows_are_read_as_one_span():
    ext = plan_extents((4, 64), (0, 32), (4, 32), 4, min_piece_bytes=16 << 10)
    assert [(e.start, e.stop) for e in ext] == [(32, 4 * 64)]
    assert not ext[0].contiguous


def test_extents_zero_dim_and_empty():
    assert [(e.start, e.stop) for e in plan_extents((), (), (), 4, min_piece_bytes=1)] == [(0, 1)]
    assert plan_extents((4,), (2,), (0,), 4, min_piece_bytes=1) == []


def test_an_object_name_with_a_trailing_newline_is_not_a_sharded_object():
    """``key/shard_0_2\\n`` is no ShardedObject storage name (the pattern ended in ``$``,
    which matches before a trailing newline, so it parsed as ``key``'s cell 0 of 2)."""
    from dcpbridge.planners.protocol import parse_object_name

    assert parse_object_name("key/shard_0_2") == ("key", (0,), (2,))
    assert parse_object_name("key/shard_0_2\n") is None


def _mixed_tree() -> tuple[dict, torch.Tensor, torch.Tensor]:
    t, u = torch.zeros(2), torch.ones(3)
    inner = {"c": t, "d": [t, {"e": 2}], "g": 5}
    return {"a": 1, "b": inner, "f": u, 3: "x", "h": (1, 2), "i": [u, 7]}, t, u


def test_leaves_come_in_dcp_order_with_their_keys_paths_and_slots():
    tree, t, u = _mixed_tree()
    got = [(leaf.path, leaf.obj_path, leaf.slot, leaf.value) for leaf in STATE_WALKER.leaves(tree)]
    inner = tree["b"]
    assert [g[:3] for g in got] == [
        ("a", ("a",), "a"),
        ("b.c", ("b", "c"), "c"),
        ("b.d.0", ("b", "d", 0), 0),
        ("b.d.1.e", ("b", "d", 1, "e"), "e"),
        ("b.g", ("b", "g"), "g"),
        ("f", ("f",), "f"),
        ("3", ("3",), 3),
        ("h", ("h",), "h"),
        ("i.0", ("i", 0), 0),
        ("i.1", ("i", 1), 1),
    ]
    assert [g[3] for g in got][:3] == [1, t, t] and got[3][3] == 2 and got[5][3] is u
    parents = [leaf.parent for leaf in STATE_WALKER.leaves(tree)]
    assert parents[1] is inner and parents[3] is inner["d"][1] and parents[6] is tree


def test_leaves_refuse_two_entries_of_one_key_wherever_they_meet():
    for tree in ({1: 1, "1": 2}, {"a": {"b": 1}, "a.b": 2}, {"a": [1, torch.zeros(1)], "a.1": 3}):
        with pytest.raises(db.SerializationError, match="flatten to the same key"):
            list(STATE_WALKER.leaves(tree))


def test_leaves_of_the_bare_type_come_as_themselves_in_the_same_order():
    tree, t, u = _mixed_tree()
    full = list(STATE_WALKER.leaves(tree))
    bare = list(STATE_WALKER.leaves(tree, bare=torch.Tensor))
    assert len(bare) == len(full) == 10
    for leaf, got in zip(full, bare):
        if type(leaf.value) is torch.Tensor:  # in a mapping, a list, after a container
            assert got is leaf.value
        else:
            assert (got.path, got.obj_path, got.value) == (leaf.path, leaf.obj_path, leaf.value)
    values = [g for g in bare if type(g) is torch.Tensor]
    assert [id(v) for v in values] == [id(t), id(t), id(u), id(u)]
    with pytest.raises(db.SerializationError, match="flatten to the same key"):
        list(STATE_WALKER.leaves({"a": [1, torch.zeros(1)], "a.1": 3}, bare=torch.Tensor))


def test_rebuild_takes_known_values_by_id_and_asks_for_the_others():
    tree, _, u = _mixed_tree()
    marker = object()
    asked = []

    def fn(leaf):
        asked.append(leaf.path)
        return leaf.path

    out = STATE_WALKER.rebuild(tree, fn, known={id(u): marker})
    assert out["f"] is marker and out["i"] == ["i.0", "i.1"]  # a list's leaves: by fn only
    assert out["b"] == {"c": "b.c", "d": ["b.d.0", {"e": "b.d.1.e"}], "g": "b.g"}
    assert "f" not in asked and "i.0" in asked and out[3] == "3" and out["h"] == "h"
