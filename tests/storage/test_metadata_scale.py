"""Metadata of many chunks: array shortcuts agree with the per-item rules they replace.

The checksum tile counts of a table, the write results turned into an item table, and the
encoder's trust in a plan the save planner already checked, each compared with the exact,
per-item way on real layouts and on random or damaged ones.
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
import torch

from benchmarks import bench_planning as bp
from dcpbridge.planners import build_metadata
from dcpbridge.planners.errors import ShardingValidationError
from dcpbridge.planners.save_planner import describe_plan
from dcpbridge.storage.errors import InvalidArgumentError
from dcpbridge.storage.format.checksum import tensor_grid
from dcpbridge.storage.format.document import decode_metadata, planned_boxes
from dcpbridge.storage.format.tiling import tile_counts
from dcpbridge.storage.write.commit import index_results
from dcpbridge.storage.write.written import written_table

SAVE_ID = "5eed"


def _random_sizes(rng: random.Random) -> tuple[int, ...]:
    def dim() -> int:
        r = rng.random()
        if r < 0.05:
            return 0
        if r < 0.3:
            return rng.randint(1, 8)
        if r < 0.6:
            return rng.choice([16, 64, 128, 1000, 1024, 3072, 4096, 8192])
        return rng.randint(1, 70_000)

    return tuple(dim() for _ in range(rng.choice([0, 1, 1, 2, 2, 2, 3, 3, 4])))


def test_tile_counts_match_the_checksum_grid_of_every_shape():
    rng = random.Random(0)
    for block in (1, 7, 64, 4096, 1 << 16, 1 << 20, 1 << 22):
        rows = []
        while len(rows) < 3000:
            sizes, itemsize = _random_sizes(rng), rng.choice([1, 2, 4, 8, 16])
            if math.prod(sizes) * itemsize <= 1 << 62:  # larger chunks are refused first
                rows.append((sizes, itemsize))
        width = max(len(s) for s, _ in rows)
        padded = np.ones((len(rows), width), dtype=np.int64)
        for i, (sizes, _) in enumerate(rows):
            padded[i, : len(sizes)] = sizes
        ndim = np.array([len(s) for s, _ in rows], dtype=np.int64)
        itemsizes = np.array([i for _, i in rows], dtype=np.int64)
        got = tile_counts(padded, ndim, itemsizes, block).tolist()
        want = [tensor_grid(s, i, block, tiled=True).count for s, i in rows]
        assert got == want
    assert tile_counts(np.ones((3, 0), dtype=np.int64), np.zeros(3), np.ones(3), 64).tolist() == [
        1,
        1,
        1,
    ]


# -- the save planner's checked boxes, trusted once by the encoder ------------------------------


def _save(ranks: int, tensors: int, *, validate: bool = True, edit=None):
    """(metadata, write results) of an FSDP-like plan; ``edit(plans)`` changes the plans
    as if their planner had made them so (their columns describe the edited items)."""
    plans = bp._plans(ranks, bp._fsdp(ranks, tensors, 2, 8))
    if edit is not None:
        edit(plans)
        for plan in plans:
            describe_plan(plan.items, plan.planner_data)
    metadata = build_metadata(plans, validate=validate)
    return metadata, bp._results(plans, SAVE_ID)


def _encode(metadata, results) -> bytes:
    return index_results(metadata, results, save_id=SAVE_ID, checksums=True)


@pytest.mark.parametrize("ranks", [8, 64])  # a document of JSON rows, and one of columns
def test_a_checked_plan_encodes_what_an_unchecked_one_does(ranks):
    checked, results = _save(ranks, 20)
    boxes = planned_boxes(checked)
    assert boxes is not None and boxes.checked
    assert [list(c.offsets) for c in checked.state_dict_metadata["layers.3.weight"].chunks] == [
        [2 * r, 0] for r in range(ranks)
    ]
    table = written_table(checked, results, checksums=True)
    assert boxes.same_boxes(table) and table.sizes is boxes.sizes  # not gathered twice
    unchecked, _ = _save(ranks, 20, validate=False)
    assert not planned_boxes(unchecked).checked
    a = decode_metadata(_encode(checked, results), where="a").storage_data.items
    b = decode_metadata(_encode(unchecked, results), where="b").storage_data.items
    for column in ("counts", "file", "offset", "nbytes", "rank", "offsets", "sizes", "checksums"):
        assert np.array_equal(getattr(a, column), getattr(b, column)), column
    assert (a.tensors, a.shapes, a.files) == (b.tensors, b.shapes, b.files)


def test_checked_boxes_are_read_only():
    metadata, _ = _save(4, 2)
    boxes = planned_boxes(metadata)
    with pytest.raises(ValueError, match="read-only"):
        boxes.offsets[0, 0] = 1


def _twice(plans) -> None:
    """Rank 1 also writes rank 0's chunk of one tensor instead of its own."""
    mine = plans[1].items
    mine[0] = plans[0].items[0]


def test_an_unchecked_plan_is_still_checked_when_encoded():
    metadata, results = _save(8, 3, validate=False, edit=_twice)
    with pytest.raises(InvalidArgumentError, match=r"refusing to commit.*layers.0.weight.*overlap"):
        _encode(metadata, results)
    with pytest.raises(ShardingValidationError, match="overlap"):
        _save(8, 3, edit=_twice)


def test_results_that_differ_from_the_checked_plan_are_checked_in_full():
    """A writer reporting other boxes than the planner checked gets no trust."""
    metadata, results = _save(8, 3)
    results = [list(r) for r in results]  # as objects only (a writer without columns)
    moved = results[1][0]
    index = dataclasses.replace(moved.index, offset=torch.Size([0, 0]))  # rank 0's chunk
    results[1][0] = dataclasses.replace(moved, index=index)
    with pytest.raises(InvalidArgumentError, match=r"refusing to commit.*layers.0.weight.*overlap"):
        _encode(metadata, results)


def test_results_with_wrong_dims_or_unknown_keys_are_refused():
    metadata, results = _save(4, 2)
    results = [list(r) for r in results]
    wrong = results[2][1]
    flat = dataclasses.replace(wrong.index, offset=torch.Size([4]))
    results[2][1] = dataclasses.replace(wrong, index=flat)
    with pytest.raises(InvalidArgumentError, match="does not have the tensor's 2 dimensions"):
        _encode(metadata, results)
    metadata, results = _save(4, 2)
    results = [list(r) for r in results]
    other = dataclasses.replace(results[0][0].index, fqn="nope")
    results[0][0] = dataclasses.replace(results[0][0], index=other)
    with pytest.raises(InvalidArgumentError, match="'nope', which is not planned"):
        _encode(metadata, results)


def test_a_written_key_no_rank_declares_is_refused():
    def undeclare(plans) -> None:
        for plan in plans:
            del plan.planner_data.tensors["layers.1.weight"]

    with pytest.raises(
        ShardingValidationError, match=r"'layers\.1\.weight' is written but no rank declares it"
    ):
        _save(4, 3, edit=undeclare)
