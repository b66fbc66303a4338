"""Tied weights in a load template: keys that share one tensor's memory load when the
checkpoint holds the same values for them, and raise ``TiedTensorsError`` naming both (on
every rank) when it holds different ones, instead of one key silently taking the other's."""

from __future__ import annotations

import pytest
import torch

import dcpbridge as db
from dcpbridge.model.ties import untie
from tests.support.dist_pool import Rank

# a staged small item, a small item read straight into its tensor, a whole chunk
SIZES = [4, 4096, 1 << 18]


def _save(path: str, a: torch.Tensor, b: torch.Tensor) -> None:
    db.save({"a": a, "b": b, "other": torch.arange(8.0)}, path)


@pytest.mark.parametrize("n", SIZES)
def test_tied_plain_tensors_stored_alike_load_into_their_one_memory(tmp_path, n):
    _save(str(tmp_path), torch.full((n,), 3.0), torch.full((n,), 3.0))
    t = torch.zeros(n)
    out = db.load({"a": t, "b": t, "other": torch.zeros(8)}, str(tmp_path))
    assert out["a"] is t and out["b"] is t
    assert torch.equal(t, torch.full((n,), 3.0))
    assert torch.equal(out["other"], torch.arange(8.0))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["plain", "sharded", "parameter views"])
def test_tied_keys_stored_with_different_values_raise_naming_both(tmp_path, n, kind):
    _save(str(tmp_path), torch.full((n,), 1.0), torch.full((n,), 2.0))
    p = torch.nn.Parameter(torch.zeros(n))
    if kind == "plain":
        template = {"a": p.data, "b": p.data}
    elif kind == "sharded":
        template = {k: db.ShardedTensor.from_box(k, p.data, (n,), (0,)) for k in ("a", "b")}
    else:  # what module.state_dict() hands out for a tied parameter: two detached views
        template = {"a": p.detach(), "b": p.detach()}
    with pytest.raises(db.TiedTensorsError) as e:
        db.load(template, str(tmp_path))
    assert "'a' and 'b' share one tensor's memory" in str(e.value)


@pytest.mark.parametrize("stored", [(3.0, 3.0), (1.0, 2.0)], ids=["alike", "different"])
@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_a_tied_one_element_strided_view_is_compared(tmp_path, stored, kind):
    """Tied keys held in a one-element strided view (``t[1:3:2]``: contiguous to torch, stride
    2): comparing their bytes raised a bare RuntimeError (``view`` of a stride-2 flat tensor)
    instead of loading them alike or raising ``TiedTensorsError``."""
    _save(str(tmp_path), torch.tensor([stored[0]]), torch.tensor([stored[1]]))
    t = torch.zeros(4)[1:3:2]
    assert t.is_contiguous() and t.stride() == (2,)
    if kind == "plain":
        template = {"a": t, "b": t}
    else:
        template = {k: db.ShardedTensor.from_box(k, t, (1,), (0,)) for k in ("a", "b")}
    if stored[0] != stored[1]:
        with pytest.raises(db.TiedTensorsError, match="'a' and 'b' share one tensor's memory"):
            db.load(template, str(tmp_path))
        return
    out = db.load(template, str(tmp_path))
    assert out["a"] is t and out["b"] is t and t.tolist() == [3.0]


@pytest.mark.parametrize("stored", [(1.0, 2.0), (3.0, 3.0)], ids=["different", "alike"])
def test_tied_plain_tensors_of_a_torch_dist_common_state(tmp_path, stored):
    """torch_dist keeps plain tensors in common.pt, filled after the reads: one key silently
    took the other's values."""
    a, b = (torch.full((4,), v) for v in stored)
    db.save({"a": a, "b": b}, str(tmp_path), format="torch_dist")
    t = torch.zeros(4)
    if stored[0] != stored[1]:
        with pytest.raises(db.TiedTensorsError, match="'a' and 'b' share one tensor's memory"):
            db.load({"a": t, "b": t}, str(tmp_path))
    else:
        out = db.load({"a": t, "b": t}, str(tmp_path))
        assert out["a"] is t and out["b"] is t and torch.equal(t, a)


def test_a_tied_key_absent_from_the_checkpoint_takes_the_stored_one(tmp_path):
    db.save({"b": torch.full((6,), 5.0)}, str(tmp_path))
    t = torch.zeros(6)
    out, _, unexpected = db.load({"a": t, "b": t}, str(tmp_path), strict="return_all")
    assert torch.equal(t, torch.full((6,), 5.0)) and out["b"] is t
    assert "a" in unexpected  # Megatron's naming: requested, not stored


def test_only_one_memory_under_two_keys_is_a_tie():
    base = torch.zeros(4, 4)
    shards = [
        db.ShardedTensor.from_box("a", base, (4, 4), (0, 0)),
        db.ShardedTensor.from_box("a", base, (4, 4), (0, 0)),  # one box asked twice: a copy
        db.ShardedTensor.from_box("b", base[:2], (2, 4), (0, 0)),  # a part of it: not a tie
        db.ShardedTensor.from_box("c", base.t(), (4, 4), (0, 0)),  # other strides
        db.ShardedTensor.from_box("d", base, (4, 4), (0, 0)),  # tied to "a"
        db.ShardedTensor.from_box("e", torch.zeros(0), (0,), (0,)),
        db.ShardedTensor.from_box("f", torch.zeros(0), (0,), (0,)),
    ]
    out, ties = untie(shards)
    assert [(kept.key, scratch.key) for kept, scratch in ties.pairs] == [("a", "d")]
    assert out[:4] == shards[:4] and out[5:] == shards[5:]
    assert out[4] is not shards[4] and out[4].data.data_ptr() != base.data_ptr()
    assert shards[4].data is base  # the template keeps its own tensors


def run_tied_on_one_rank(r: Rank, path: str) -> str:
    """Rank 0 ties "a" and "b"; rank 1 does not: both must raise."""
    t = torch.zeros(4)
    template = {"a": t, "b": t} if r.rank == 0 else {"a": torch.zeros(4), "b": torch.zeros(4)}
    try:
        db.load(template, path, process_group=r.group)
    except db.TiedTensorsError as e:
        return f"TiedTensorsError: {e}"
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_a_conflicting_tie_on_one_rank_raises_on_every_rank(pool, tmp_path):
    _save(str(tmp_path), torch.full((4,), 1.0), torch.full((4,), 2.0))
    got = pool.run(run_tied_on_one_rank, 2, str(tmp_path))
    assert got[0] == got[1]  # the same error, naming the rank, on both
    assert got[0].startswith("TiedTensorsError: rank 0: 'a' and 'b' share one tensor's memory")


def _views(kind: str) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A template buffer and, per key, (the view of it the key loads into, its stored value)."""
    t = torch.zeros(4, 8)
    a = torch.arange(32.0).reshape(4, 8)
    if kind == "slice":
        return t, {"a": (t, a), "b": (t[1:3], -torch.arange(16.0).reshape(2, 8) - 1)}
    ints = torch.arange(32, dtype=torch.int32).reshape(4, 8)
    return t, {"a": (t, a), "b": (t.view(torch.int32), ints)}


@pytest.mark.parametrize("kind", ["slice", "dtype view"])
def test_keys_sharing_part_of_one_memory_are_refused(tmp_path, kind):
    """Two keys whose template tensors share memory other than as a whole tie (one a slice
    of the other, or the same bytes in another dtype) were both read into the shared bytes:
    one key silently came back with the other's values. Now refused, naming both."""
    _, views = _views(kind)
    shape = {k: tuple(v.shape) for k, (v, _) in views.items()}
    db.save(
        {
            k: db.ShardedTensor.from_box(k, s, shape[k], (0,) * s.ndim)
            for k, (_, s) in views.items()
        },
        str(tmp_path),
    )
    template = {
        k: db.ShardedTensor.from_box(k, v, shape[k], (0,) * v.ndim) for k, (v, _) in views.items()
    }
    with pytest.raises(db.InvalidRequestError) as e:
        db.load(template, str(tmp_path))
    assert "'a' and 'b' share part of one tensor's memory" in str(e.value)


def test_interleaved_views_of_one_tensor_load_exactly(tmp_path):
    """Parts of a fused tensor that interleave in memory without sharing an element (q, k, v
    heads of one qkv weight) are not a tie: each loads its own stored values."""
    heads, d, h = 2, 3, 4
    fused = torch.zeros(heads, 3, d, h)
    parts = {n: fused[:, i] for i, n in enumerate("qkv")}
    stored = {
        n: torch.randn(heads, d, h, generator=torch.Generator().manual_seed(i))
        for i, n in enumerate("qkv")
    }
    db.save(
        {n: db.ShardedTensor.from_box(n, s, s.shape, (0, 0, 0)) for n, s in stored.items()},
        str(tmp_path),
    )
    template = {n: db.ShardedTensor.from_box(n, v, v.shape, (0, 0, 0)) for n, v in parts.items()}
    out = db.load(template, str(tmp_path))
    for n in "qkv":
        assert torch.equal(out[n].view(torch.int32), stored[n].view(torch.int32)), n
        assert torch.equal(fused[:, "qkv".index(n)], stored[n])


def run_overlap_on_one_rank(r: Rank, path: str) -> str:
    """Rank 0 asks "b" as a slice of "a"'s tensor; rank 1 gives each its own: both raise."""
    t = torch.zeros(4)
    template = {"a": t, "b": t[:2]} if r.rank == 0 else {"a": torch.zeros(4), "b": torch.zeros(2)}
    try:
        db.load(template, path, process_group=r.group)
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_shared_memory_on_one_rank_raises_on_every_rank(pool, tmp_path):
    _save(str(tmp_path), torch.full((4,), 1.0), torch.full((2,), 2.0))
    got = pool.run(run_overlap_on_one_rank, 2, str(tmp_path), timeout=60)
    assert got[0] == got[1]
    assert got[0].startswith("InvalidRequestError: rank 0: 'a' and 'b' share part of one tensor")


def run_overlap_received(r: Rank, path: str) -> list[float] | str:
    """Both ranks ask "a" (4 elements) and "b" as a slice of it, fully parallel: one rank
    receives "a" and reads "b", so the planner alone never sees the two meet."""
    t = torch.zeros(4)
    template = {"a": t, "b": db.ShardedTensor.from_box("b", t[:2], (2,), (0,), replica_id=r.rank)}
    template["a"] = db.ShardedTensor.from_box("a", t, (4,), (0,), replica_id=r.rank)
    try:
        db.load(template, path, process_group=r.group, fully_parallel=True)
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return t.tolist()


def test_shared_memory_across_a_fully_parallel_hand_off_is_refused(pool, tmp_path):
    db.save(
        {
            "a": db.ShardedTensor.from_box("a", torch.full((4,), 1.0), (4,), (0,)),
            "b": db.ShardedTensor.from_box("b", torch.full((2,), 2.0), (2,), (0,)),
        },
        str(tmp_path),
    )
    got = pool.run(run_overlap_received, 2, str(tmp_path), timeout=60)
    assert all("'a' and 'b' share part of one tensor's memory" in g for g in got), got
