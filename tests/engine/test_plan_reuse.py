"""A save of an unchanged structure reuses the previous local write items (only the data is
checked again); new data is what gets written, and bad data is still refused by name."""

from __future__ import annotations

import os

import pytest
import torch

import dcpbridge as db
from dcpbridge.engine.bridge import BridgeSavePlanner
from dcpbridge.engine.cache import SAVE_CACHES, save_cache
from dcpbridge.engine.collectives import Group
from tests.support.dist_pool import Rank

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(4, 3, generator=g)
    return {
        "a": db.ShardedTensor.from_box("a", torch.randn(5, generator=g), (5,), (0,)),
        "top": db.ShardedTensor.from_box("m", rows[:2].clone(), (4, 3), (0, 0)),
        "bottom": db.ShardedTensor.from_box("m", rows[2:].clone(), (4, 3), (2, 0)),
        "lay": db.ShardedTensor.from_box(
            "l", torch.randn(2, generator=g), (1, 2), (0, 0), prepend_axis_num=1
        ),
        "rest": db.ShardedTensor.from_box("s", torch.randn(2, generator=g), (4,), (0,)),
        "skip": db.ShardedTensor.from_box("s", torch.randn(2), (4,), (0,), replica_id=1),
        "more": db.ShardedTensor.from_box("s", torch.randn(2, generator=g), (4,), (2,)),
        "rng": db.ShardedObject("rng", {"seed": seed}, (1,), (0,)),
        "plain": torch.full((2,), float(seed)),
        "step": seed,
    }


def _template() -> dict[str, object]:
    return {
        "a": db.ShardedTensor.from_box("a", torch.zeros(5), (5,), (0,)),
        "m": db.ShardedTensor.from_box("m", torch.zeros(4, 3), (4, 3), (0, 0)),
        "l": db.ShardedTensor.from_box("l", torch.zeros(1, 2), (1, 2), (0, 0)),
        "s": db.ShardedTensor.from_box("s", torch.zeros(4), (4,), (0,)),
        "rng": db.ShardedObject("rng", None, (1,), (0,)),
        "plain": torch.zeros(2),
    }


def test_the_second_save_reuses_the_items_and_writes_the_new_data(tmp_path):
    SAVE_CACHES.clear()
    first = _state(1)
    db.save(first, str(tmp_path / "one"))
    entry = save_cache(Group.resolve(None), True, "dcpbridge").entry
    assert entry is not None and entry.tensor_writes is not None
    assert len(entry.tensor_writes.items) == 7  # a, m twice, l, s twice (main replicas), plain
    second = _state(2)
    db.save(second, str(tmp_path / "two"))
    assert save_cache(Group.resolve(None), True, "dcpbridge").entry is entry  # reused
    out = db.load(_template(), str(tmp_path / "two"))
    assert torch.equal(out["a"], second["a"].data)
    assert torch.equal(out["m"], torch.cat([second["top"].data, second["bottom"].data]))
    assert torch.equal(out["l"][0], second["lay"].data)
    assert torch.equal(out["s"], torch.cat([second["rest"].data, second["more"].data]))
    assert out["rng"] == {"seed": 2} and out["step"] == 2
    assert torch.equal(out["plain"], torch.full((2,), 2.0))
    old = db.load(_template(), str(tmp_path / "one"))
    assert torch.equal(old["a"], first["a"].data) and old["step"] == 1


def test_a_reused_plan_keeps_its_columns_so_the_commit_joins_the_written_arrays(
    tmp_path, monkeypatch
):
    """The re-plan puts its tensor items back where the first plan had them (objects between
    them): the writer reports by those places and the commit's table is joined from arrays,
    not rebuilt from every ``WriteResult``; the bytes load back exact."""
    import dcpbridge.storage.write.written as written

    SAVE_CACHES.clear()
    db.save(_state(1), str(tmp_path / "one"))

    def refuse(*args, **kwargs):
        raise AssertionError("the table was rebuilt from the WriteResult objects")

    monkeypatch.setattr(written, "table_from_written", refuse)
    second = _state(2)
    db.save(second, str(tmp_path / "two"))
    out = db.load(_template(), str(tmp_path / "two"))
    assert torch.equal(out["m"], torch.cat([second["top"].data, second["bottom"].data]))
    assert torch.equal(out["s"], torch.cat([second["rest"].data, second["more"].data]))
    assert out["rng"] == {"seed": 2} and out["step"] == 2
    assert torch.equal(out["plain"], torch.full((2,), 2.0))


def test_data_swapped_after_the_structure_vote_is_refused_on_the_reused_plan(tmp_path):
    SAVE_CACHES.clear()
    db.save(_state(1), str(tmp_path / "one"))
    bad = _state(2)
    bad["top"].data = torch.zeros(3, 3)  # not the declared local shape (2, 3)
    with pytest.raises(db.ShardingValidationError, match="'m'") as info:
        db.save(bad, str(tmp_path / "one"))
    assert any(entry.name == "_replan" for entry in info.traceback)  # the reused plan refused it
    out = db.load(_template(), str(tmp_path / "one"))  # the first checkpoint is intact
    assert out["step"] == 1


def test_a_planner_given_shards_in_another_order_plans_afresh():
    state = _state(1)
    shards = [v for v in state.values() if isinstance(v, (db.ShardedTensor, db.ShardedObject))]
    first = BridgeSavePlanner(shards, {}, {"keys": {}, "empty": []})
    first.set_up_planner(None, None, True)
    items = first.create_local_plan().items
    assert first.tensor_writes is not None
    swapped = BridgeSavePlanner(shards[::-1], {}, {"keys": {}, "empty": []})
    swapped.reuse_tensor_writes(first.tensor_writes)
    swapped.set_up_planner(None, None, True)
    again = swapped.create_local_plan().items
    assert sorted(i.index.fqn for i in again) == sorted(i.index.fqn for i in items)
    assert swapped.tensor_writes is not first.tensor_writes  # recorded anew
    for item in again:
        if item.tensor_data is not None:
            data = swapped.resolve_data(item)
            source = next(
                s
                for s in shards
                if isinstance(s, db.ShardedTensor)
                and s.key == item.index.fqn
                and s.global_offset == tuple(item.index.offset)
            )
            assert data.data_ptr() == source.data.data_ptr()
    same = BridgeSavePlanner(shards, {}, {"keys": {}, "empty": []})
    same.reuse_tensor_writes(first.tensor_writes)
    same.set_up_planner(None, None, True)
    reused = same.create_local_plan().items
    assert all(any(r is i for i in items) for r in reused if r.tensor_data is not None)


def plain_then_dtensor_copies(r: Rank, root: str, clear: bool) -> str:
    """Save a plain tensor ``a``, then, under the same path, a DTensor whose copies (one per
    rank, each on a mesh of its own) differ; returns the second save's error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (r.size, 1), mesh_dim_names=("dp", "tp"))["tp"]
    SAVE_CACHES.clear()
    db.save({"a": torch.arange(4.0)}, f"{root}/one")
    if clear:
        SAVE_CACHES.clear()
    copy = DTensor.from_local(torch.arange(4.0) + 100 * r.rank, mesh, [Shard(0)])
    with pytest.raises(db.ShardingValidationError) as raised:
        db.save({"a": copy}, f"{root}/two")
    return str(raised.value)


@pytest.mark.parametrize("clear", [True, False], ids=["fresh", "cached"])
def test_a_plain_tensor_turned_dtensor_under_its_path_is_planned_afresh(pool, tmp_path, clear):
    """The structure tells the common state's paths from the DTensors' paths: a plain tensor
    replaced by differing off-mesh DTensor copies under the same path is refused, as a first
    save of them is, instead of reusing the plain tensor's plan (rank 0's copy written,
    the others' silently dropped)."""
    errors = pool.run(plain_then_dtensor_copies, 4, str(tmp_path), clear, default_group=True)
    assert all("'a'" in e and "overlap" in e for e in errors), errors
    assert not os.path.exists(tmp_path / "two" / "dcpbridge.json")
