"""ShardedTensor / ShardedObject construction, validation and nested state-dict surgery."""

from __future__ import annotations

import pytest
import torch

import dcpbridge as db
from dcpbridge.model.state import HOLE, apply_factories, extract, fill_holes, is_sharded, merge


def test_from_rank_offsets_even_split_with_prepended_axis():
    data = torch.zeros(3, 5)
    sh = db.ShardedTensor.from_rank_offsets(
        "dec.fc1", data, (0, 2, 4), (1, 1, 2), replica_id=(0, 0, 1), prepend_axis_num=1
    )
    assert sh.global_shape == (4, 6, 5)
    assert sh.global_offset == (2, 3, 0)
    assert sh.axis_fragmentations == (4, 2, 1)
    assert sh.local_shape == (3, 5)
    assert sh.global_slice() == (2, slice(3, 6), slice(0, 5))


def test_from_box_uneven_and_empty():
    empty = db.ShardedTensor.from_box("v", torch.zeros(0), (10,), (4,))
    assert empty.numel == 0 and empty.axis_fragmentations is None
    sh = db.ShardedTensor.from_box("v", torch.zeros(6), (10,), (4,))
    assert sh.global_slice() == (slice(4, 10),)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"global_offset": (8,)}, "does not fit the global size 10"),
        ({"global_shape": (10, 2)}, "must have 1 dims"),
        ({"dtype": torch.float16}, "data dtype torch.float32 != dtype torch.float16"),
        ({"local_shape": (5,)}, "data shape (4,) != local_shape (5,)"),
        ({"replica_id": -1}, "replica_id must be"),
        ({"axis_fragmentations": (3,)}, "inconsistent with global size 10"),
        ({"key": ""}, "non-empty string"),
        ({"key": "__common__"}, "reserved"),
    ],
)
def test_sharded_tensor_validation_names_the_key(kwargs, needle):
    base = {
        "key": "layer.w",
        "data": torch.zeros(4),
        "dtype": torch.float32,
        "local_shape": (4,),
        "global_shape": (10,),
        "global_offset": (4,),
        "axis_fragmentations": None,
    }
    with pytest.raises(db.InvalidShardError) as info:
        db.ShardedTensor(**(base | kwargs))
    assert needle in str(info.value)
    if "key" not in kwargs:
        assert "'layer.w'" in str(info.value)


def test_from_rank_offsets_rejects_bad_offsets():
    with pytest.raises(db.InvalidShardError, match="rank offset 2 is not in"):
        db.ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 2, 2))
    with pytest.raises(db.InvalidShardError, match="out of range for 1 dims or given twice"):
        db.ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 0, 2), (0, 1, 2))


def test_sharded_object_unique_key_and_validation():
    obj = db.ShardedObject("rng", 1, (2, 4), (1, 3))
    assert obj.unique_key == "rng/shard_1.3_2.4"
    with pytest.raises(db.InvalidShardError, match="not inside global_shape"):
        db.ShardedObject("rng", 1, (2,), (2,))


def test_extract_and_merge_keep_list_positions():
    a = db.ShardedTensor.from_box("a", torch.zeros(1), (1,), (0,))
    tree = {"x": [1, a, {"y": 2}], "z": {"only": a}, "e": {}, "t": (a, 3)}
    sharded, common = extract(tree, is_sharded)
    assert sharded == {"x": [HOLE, a, HOLE], "z": {"only": a}, "t": (a, HOLE)}
    assert common == {"x": [1, HOLE, {"y": 2}], "e": {}, "t": (HOLE, 3)}
    saved = fill_holes(common)
    assert saved == {"x": [1, None, {"y": 2}], "e": {}, "t": (None, 3)}
    loaded = {"x": [HOLE, "A", HOLE], "z": {"only": "A"}, "t": ("A", HOLE)}
    assert fill_holes(merge(saved, loaded)) == {
        "x": [1, "A", {"y": 2}],
        "e": {},
        "t": ("A", 3),
        "z": {"only": "A"},
    }


def test_factories_are_built_and_nesting_is_refused():
    def build(key, data, replica_id):
        return {"half": db.ShardedTensor.from_box(key, data[:1], (2,), (0,))}

    f = db.ShardedTensorFactory("k", torch.zeros(2), build, lambda d: d["half"])
    built = apply_factories({"f": f})
    assert built["f"]["half"].key == "k"

    def nested(key, data, replica_id):
        return {"again": f}

    with pytest.raises(TypeError, match="nesting"):
        apply_factories({"f": db.ShardedTensorFactory("k", torch.zeros(2), nested, lambda d: d)})
