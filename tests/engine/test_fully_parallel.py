"""Fully-parallel save/load: exact writer/reader assignment, balance, caching and hand-off."""

from __future__ import annotations

import json
import os
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dcpbridge as db
from dcpbridge.engine import fully_parallel as fp_module
from dcpbridge.engine.cache import SAVE_CACHES
from dcpbridge.planners.distribution import Holding, distribute
from tests.support import layouts as L
from tests.support.collective_counts import count_collectives
from tests.support.dist_pool import Rank


def test_distribute_exact_owners():
    a, b, c, x = ("a", (0,)), ("b", (0,)), ("c", (0,)), ("x", (0,))
    holdings = [
        [Holding(a, 100), Holding(b, 50), Holding(x, 7, main=False)],
        [Holding(a, 100), Holding(c, 10), Holding(x, 7, main=False)],
        [Holding(a, 100), Holding(b, 50)],
    ]
    # c (1 holder) -> 1; b (2 holders, 50) -> 0; a (3 holders) -> least loaded: 2; x: no main
    assert distribute(holdings) == {c: 1, b: 0, a: 2}
    assert distribute(holdings, only_main=False)[x] in (0, 1)


def _model() -> dict[str, torch.Tensor]:
    """A small transformer-shaped parameter set: the sizes a real DP split must balance."""
    h, layers = 64, 6
    shapes = {"embedding.weight": (512, h), "final_norm.weight": (h,)}
    for i in range(layers):
        shapes |= {
            f"layers.{i}.qkv.weight": (3 * h, h),
            f"layers.{i}.proj.weight": (h, h),
            f"layers.{i}.fc1.weight": (4 * h, h),
            f"layers.{i}.fc2.weight": (h, 4 * h),
            f"layers.{i}.norm1.weight": (h,),
            f"layers.{i}.norm2.weight": (h,),
        }
    return {k: L.full(k, s, torch.float32) for k, s in shapes.items()}


def _replicas(rank: int, fill: bool) -> dict:
    """Every rank holds the whole model: data-parallel replicas, replica_id = dp rank."""
    return {
        k: db.ShardedTensor.from_box(
            k,
            t.clone() if fill else torch.zeros_like(t),
            tuple(t.shape),
            (0,) * t.ndim,
            replica_id=rank,
        )
        for k, t in _model().items()
    }


def fp_save_twice(r: Rank, root: str) -> list[dict]:
    SAVE_CACHES.clear()
    counts = []
    for i in range(2):
        with count_collectives() as calls:
            db.save(
                _replicas(r.rank, True),
                os.path.join(root, str(i)),
                process_group=r.group,
                fully_parallel=True,
            )
        counts.append(dict(calls))
    return counts


def test_fully_parallel_save_exact_owners_balance_and_cache(pool, tmp_path):
    counts = pool.run(fp_save_twice, 4, str(tmp_path))
    # first save: vote + the writer exchange (all_gather) + plan + commit; second: no exchange
    assert counts[0][0] == {"all_gather": 2, "gather": 2, "scatter": 1, "broadcast": 1}
    assert counts[0][1] == {"all_gather": 1, "gather": 1, "broadcast": 1}
    model = _model()
    sizes = {(k, (0,) * t.ndim): t.numel() * 4 for k, t in model.items()}
    expected = distribute([[Holding(s, n) for s, n in sizes.items()]] * 4)
    for i in range(2):
        doc = json.loads((tmp_path / str(i) / "dcpbridge.json").read_text())
        owners = {
            (k, (0,) * len(v["shape"])): v["chunks"][0]["rank"] for k, v in doc["tensors"].items()
        }
        assert owners == expected
    per_rank = [sum(n for s, n in sizes.items() if expected[s] == r) for r in range(4)]
    assert max(per_rank) / min(per_rank) <= 1.05, per_rank
    out = db.load(_replicas(0, False), str(tmp_path / "1"))
    assert all(torch.equal(out[k], t) for k, t in model.items())


def fp_two_main_replicas(r: Rank, path: str) -> str:
    """Both ranks claim the main replica of one box, with different bytes."""
    data = torch.arange(8.0) + 100 * r.rank
    sd = {"w": db.ShardedTensor.from_box("w", data, (8,), (0,), replica_id=(0, 0, 0))}
    with pytest.raises(db.ShardingValidationError) as raised:
        db.save(sd, path, process_group=r.group, fully_parallel=True)
    return str(raised.value)


def test_fully_parallel_refuses_two_main_replicas_of_one_shard(pool, tmp_path):
    """Spreading the writes must not pick one of two differing "main" copies silently."""
    path = str(tmp_path / "twice")
    first, second = pool.run(fp_two_main_replicas, 2, path, timeout=60)
    assert first == second
    assert "'w' at offset (0,)" in first and "ranks [0, 1]" in first, first
    assert not os.path.exists(os.path.join(path, "dcpbridge.json"))


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def fp_load(r: Rank, path: str) -> tuple[int, int, int]:
    def template() -> dict[str, Any]:
        tmpl = _replicas(r.rank, False)
        tmpl[f"own{r.rank}"] = db.ShardedTensor.from_box("vec", torch.zeros(10), (10,), (0,))
        return tmpl

    def check(out: dict[str, Any]) -> None:
        for k, t in _model().items():
            assert torch.equal(out[k], t), k
        assert torch.equal(out[f"own{r.rank}"], L.full("vec"))

    db.load(_replicas(r.rank, False), path, process_group=r.group)  # warm the metadata cache
    before_io = _rchar()
    with count_collectives() as calls:
        out = db.load(template(), path, process_group=r.group, fully_parallel=True)
    nread = _rchar() - before_io
    check(out)
    with count_collectives() as again:  # same boxes: the read owners are reused
        check(db.load(template(), path, process_group=r.group, fully_parallel=True))
    return nread, calls["p2p"], calls["all_gather"] - again["all_gather"]


def _save_model_and_vec(r: Rank, path: str) -> None:
    sd = _replicas(r.rank, True)
    sd["vec"] = db.ShardedTensor.from_box(
        "vec", L.full("vec").clone(), (10,), (0,), replica_id=r.rank
    )
    db.save(sd, path, process_group=r.group)


def test_fully_parallel_load_reads_each_box_once(pool, tmp_path):
    path = str(tmp_path / "ck")
    pool.run(_save_model_and_vec, 4, path)
    results = pool.run(fp_load, 4, path)
    model_bytes = sum(t.numel() * 4 for t in _model().values())
    vec_bytes = 10 * 4
    total = sum(n for n, _, _ in results)
    # every model tensor read by one rank of the group; 'vec' is needed by all 4 ranks: read
    # once too. A rank's read plan may also read the gap between two of its ranges where that
    # is cheaper than another request, never more than 2x what it needs (read_plan.ReadTuning)
    needed = model_bytes + vec_bytes
    assert needed <= total <= 2 * needed + 4 * 8192
    assert max(n for n, _, _ in results) <= 2 * 1.5 * model_bytes / 4
    assert all(p2p == 1 for _, p2p, _ in results)
    assert all(saved == 1 for _, _, saved in results)  # no exchange of boxes the second time


def fp_box_in_two_dtypes(r: Rank, path: str, cast: bool) -> str | list[float]:
    """Both ranks ask the whole of 'vec', rank 1 in float64."""
    dtype = torch.float64 if r.rank == 1 else torch.float32
    sd = {"vec": db.ShardedTensor.from_box("vec", torch.zeros(10, dtype=dtype), (10,), (0,))}
    try:
        out = db.load(sd, path, process_group=r.group, fully_parallel=True, allow_dtype_cast=cast)
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    assert out["vec"].dtype == dtype
    return out["vec"].tolist()


def test_a_box_asked_in_two_dtypes_is_never_handed_over_as_bytes(pool, tmp_path):
    """One box requested in float32 on rank 0 and float64 on rank 1: rank 0 read it and
    sent its float32 bytes, which rank 1 took as float64 values (garbage, silently). Now
    each dtype is its own box: the float64 request raises on every rank as it does without
    fully_parallel, or with allow_dtype_cast loads the stored values on both."""
    path = str(tmp_path / "ck")
    pool.run(_save_model_and_vec, 2, path)
    expected = "DTypeMismatchError: rank 1: 'vec': stored as torch.float32, requested as "
    assert all(e.startswith(expected) for e in pool.run(fp_box_in_two_dtypes, 2, path, False))
    values = L.full("vec").tolist()
    assert pool.run(fp_box_in_two_dtypes, 2, path, True) == [values, values]


def fp_torch_dist_common_tensors(r: Rank, path: str, phase: str) -> Any:
    """Plain tensors of a torch_dist checkpoint live in common.pt, which every rank reads."""
    if phase == "save":
        sd = {"scale": torch.full((3,), 0.5), "big": torch.arange(1000.0)}
        db.save(sd, path, process_group=r.group, format="torch_dist")
        return None
    template = {"scale": torch.zeros(3), "big": torch.zeros(1000)}
    out = db.load(template, path, process_group=r.group, fully_parallel=True)
    return out["scale"], out["big"]


def test_fully_parallel_load_of_torch_dist_common_tensors(pool, tmp_path):
    """Each box's reader filled it from common.pt only after handing it to the others, who
    got the template's zeros."""
    path = str(tmp_path / "td")
    pool.run(fp_torch_dist_common_tensors, 2, path, "save", timeout=60)
    for scale, big in pool.run(fp_torch_dist_common_tensors, 2, path, "load", timeout=60):
        assert torch.equal(scale, torch.full((3,), 0.5)) and torch.equal(big, torch.arange(1000.0))


def tp_dp_save_and_load(r: Rank, root: str) -> None:
    """TP=2 x DP=2 (rank = dp * 2 + tp) with the data-parallel groups as parallelization groups."""
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp, tp = divmod(r.rank, 2)
    dp_group = dp_groups[tp]
    w = L.full("w").chunk(2)[tp].clone()
    norm = L.full("vec").clone()
    sd = {
        "w": db.ShardedTensor.from_rank_offsets("w", w, (0, tp, 2), replica_id=(0, 0, dp)),
        "norm": db.ShardedTensor.from_box("vec", norm, (10,), (0,), replica_id=(0, tp, dp)),
    }
    db.save(sd, root, fully_parallel=True, parallelization_group=dp_group)
    tmpl = {
        "w": db.ShardedTensor.from_rank_offsets("w", torch.zeros_like(w), (0, tp, 2)),
        "norm": db.ShardedTensor.from_box("vec", torch.zeros(10), (10,), (0,)),
    }
    out = db.load(tmpl, root, fully_parallel=True, parallelization_group=dp_group)
    assert torch.equal(out["w"], w) and torch.equal(out["norm"], norm)


def test_fully_parallel_with_data_parallel_subgroups(pool, tmp_path):
    pool.run(tp_dp_save_and_load, 4, str(tmp_path / "ck"), default_group=True)
    doc = json.loads((tmp_path / "ck" / "dcpbridge.json").read_text())
    w_writers = sorted(c["rank"] for c in doc["tensors"]["w"]["chunks"])
    # one writer per TP shard, each from that shard's DP group ({0, 2} for tp 0, {1, 3} for tp 1)
    assert len(w_writers) == 2 and w_writers[0] in (0, 2) and w_writers[1] in (1, 3)
    assert [c["rank"] for c in doc["tensors"]["vec"]["chunks"]] in ([0], [2])  # tp-0 group only


def fp_one_element_strided(r: Rank, path: str) -> list[list[float]]:
    """Both ranks ask boxes of one element; rank 1's tensors are strided views (contiguous to
    torch, as a size-1 dim's stride does not count, yet not a flat run of stride 1)."""
    if r.rank == 0:
        one, row = torch.zeros(1), torch.zeros(1, 1)
    else:
        one = torch.zeros(4)[1:3:2]  # shape (1,), stride (2,)
        row = torch.zeros(3, 4)[1:2, 2:4:2]  # shape (1, 1), strides (4, 2)
        assert one.is_contiguous() and row.is_contiguous() and one.stride() == (2,)
    sd = {
        "vec": db.ShardedTensor.from_box("vec", one, (10,), (7,)),
        "proj": db.ShardedTensor.from_box("layers.0.proj.weight", row, (64, 64), (3, 5)),
    }
    out = db.load(sd, path, process_group=r.group, fully_parallel=True)
    assert out["vec"] is one and out["proj"] is row
    return [one.tolist(), row.flatten().tolist()]


def test_fully_parallel_hands_over_one_element_strided_boxes(pool, tmp_path):
    """A box of one element in a strided view (``t[1:3:2]``) that another rank read and sent:
    its flat byte view raised RuntimeError on this rank only, which left the other rank
    waiting in the exchange (a hang until the process group's timeout). Now both get it."""
    path = str(tmp_path / "ck")
    pool.run(_save_model_and_vec, 2, path)
    vec = L.full("vec")
    want = [[vec[7].item()], [_model()["layers.0.proj.weight"][3, 5].item()]]
    assert pool.run(fp_one_element_strided, 2, path, timeout=30, grace=5) == [want, want]


def fp_shard_held_twice_on_a_rank(r: Rank, root: str, fully_parallel: bool) -> None:
    """Each rank holds ``tied`` twice (rank 0: its main replica and a replica, rank 1: two
    replicas), as a shared embedding and output layer are: one copy of it is written."""
    tied = torch.arange(6.0) * 3
    own = torch.arange(4.0) + 10 * r.rank
    sd = {
        "emb": db.ShardedTensor.from_box("tied", tied.clone(), (6,), (0,), replica_id=2 * r.rank),
        "out": db.ShardedTensor.from_box(
            "tied", tied.clone(), (6,), (0,), replica_id=2 * r.rank + 1
        ),
        "own": db.ShardedTensor.from_box("own", own, (2, 4), (r.rank, 0), prepend_axis_num=1),
    }
    path = f"{root}/{fully_parallel}"
    db.save(sd, path, process_group=r.group, fully_parallel=fully_parallel)
    tmpl = {
        "tied": db.ShardedTensor.from_box("tied", torch.zeros(6), (6,), (0,)),
        "own": db.ShardedTensor.from_box("own", torch.zeros(2, 4), (2, 4), (0, 0)),
    }
    out = db.load(tmpl, path, process_group=r.group)
    assert torch.equal(out["tied"], tied)
    assert torch.equal(out["own"], torch.stack([torch.arange(4.0), torch.arange(4.0) + 10]))


@pytest.mark.parametrize("fully_parallel", [False, True])
def test_a_shard_a_rank_holds_twice_is_written_once(pool, tmp_path, fully_parallel):
    """Spreading the writes assigns a shard, not one of a rank's copies of it: a rank holding
    a shard twice writes it once (it raised "saves the chunk twice" with fully_parallel)."""
    pool.run(fp_shard_held_twice_on_a_rank, 2, str(tmp_path), fully_parallel, timeout=60)


def _save_vec_and_plain(r: Rank, path: str) -> None:
    vec = L.full("vec").clone()
    sd = {"vec": db.ShardedTensor.from_box("vec", vec, (10,), (0,), replica_id=r.rank)}
    db.save({**sd, "p": torch.arange(4.0)}, path, process_group=r.group)


def fp_missing_box(r: Rank, path: str, strict: str) -> Any:
    """Both ranks ask for 'vec' (stored), 'gone' (not stored) non-strictly, and plain 'p'
    in another shape than stored (the checkpoint's value is returned)."""
    sd = {
        "vec": db.ShardedTensor.from_box("vec", torch.zeros(10), (10,), (0,)),
        "gone": db.ShardedTensor.from_box("gone", torch.full((4,), 7.0), (4,), (0,)),
        "p": torch.zeros(2),
    }
    out = db.load(sd, path, process_group=r.group, fully_parallel=True, strict=strict)
    state, _, unexpected = out if isinstance(out, tuple) else (out, None, None)
    return sorted(state), unexpected, state["vec"].tolist(), state["p"].tolist()


@pytest.mark.parametrize("strict", ["return_all", "ignore_all"])
def test_a_box_storage_does_not_fill_is_not_handed_over(pool, tmp_path, strict):
    """A box the checkpoint lacks, read by one rank for both: the reader skipped it, then
    sent its template's untouched values, which the other rank returned as loaded (not
    reported missing). Now each rank plans such boxes itself, as without fully_parallel."""
    path = str(tmp_path / "ck")
    pool.run(_save_vec_and_plain, 2, path)
    got = pool.run(fp_missing_box, 2, path, strict)
    for state_keys, unexpected, vec, plain in got:
        assert state_keys == ["p", "vec"]
        assert vec == L.full("vec").tolist()
        assert plain == [0.0, 1.0, 2.0, 3.0]
        if strict == "return_all":
            assert unexpected == {"gone"}


def fp_replicas_in_other_boxes(r: Rank, root: str, fully_parallel: bool) -> list[float]:
    """Rank 0 holds 'vec' whole (its main replica) and a tensor only it has; ranks 1 and 2
    hold halves of 'vec' as replicas (another sharding of the same tensor)."""
    vec, solo = L.full("vec"), torch.arange(1000.0)
    if r.rank == 0:
        sd = {
            "vec": db.ShardedTensor.from_box("vec", vec.clone(), (10,), (0,)),
            "solo": db.ShardedTensor.from_box("solo", solo, (1000,), (0,)),
        }
    else:
        lo = 5 * (r.rank - 1)
        half = vec[lo : lo + 5].clone()
        sd = {"vec": db.ShardedTensor.from_box("vec", half, (10,), (lo,), replica_id=r.rank)}
    path = f"{root}/{fully_parallel}"
    db.save(sd, path, process_group=r.group, fully_parallel=fully_parallel)
    tmpl = {"vec": db.ShardedTensor.from_box("vec", torch.zeros(10), (10,), (0,))}
    return db.load(tmpl, path, process_group=r.group)["vec"].tolist()


@pytest.mark.parametrize("fully_parallel", [False, True])
def test_replicas_sharded_otherwise_than_the_main_one(pool, tmp_path, fully_parallel):
    """A replica whose box starts where the main replica's does but is smaller: spreading
    the writes took it for the main's shard (same key and offset) and gave it the write, so
    the rest of the main's box was written by nobody and the save failed (only with
    fully_parallel). Now a shard is its key, offset and size: the main's box is written."""
    got = pool.run(fp_replicas_in_other_boxes, 3, str(tmp_path), fully_parallel, timeout=60)
    assert got == [L.full("vec").tolist()] * 3


def _column_halves(key: str, data: torch.Tensor, replica_id: Any) -> dict[int, db.ShardedTensor]:
    """Two column halves of ``data``: views that are not contiguous."""
    return {
        i: db.ShardedTensor.from_rank_offsets(f"{key}.{i}", half, replica_id=replica_id)
        for i, half in enumerate(data.chunk(2, dim=1))
    }


def _joined(parts: dict[int, torch.Tensor]) -> torch.Tensor:
    return torch.cat([parts[0], parts[1]], dim=1)


def fp_factory_of_a_parameter(r: Rank, path: str) -> list[float]:
    """Both ranks hold 'w' as a factory of column halves over an nn.Parameter (the template
    optimizer_sharded_state_dict needs), data-parallel replicas."""
    w = torch.nn.Parameter(L.full("w").clone())
    sd = {"w": db.ShardedTensorFactory("w", w, _column_halves, _joined, replica_id=r.rank)}
    db.save(sd, path, process_group=r.group, fully_parallel=True)
    fresh = torch.nn.Parameter(torch.zeros(12, 8))
    tmpl = {"w": db.ShardedTensorFactory("w", fresh, _column_halves, _joined)}
    out = db.load(tmpl, path, process_group=r.group, fully_parallel=True)
    return out["w"].flatten().tolist()


def test_fully_parallel_load_of_a_factory_over_a_parameter(pool, tmp_path):
    """Each rank read one half and received the other into a strided view of the Parameter,
    copied into place with autograd on: torch's RuntimeError ('Output 0 of Split is a view
    ... modified inplace') on the receiving rank, where the load without fully_parallel
    works. Now received boxes are copied into place as the reader fills them, detached."""
    got = pool.run(fp_factory_of_a_parameter, 2, str(tmp_path / "ck"), timeout=60, grace=10)
    assert got == [L.full("w").flatten().tolist()] * 2


def fp_tied_keys(r: Rank, path: str) -> list[float] | str:
    """Both ranks tie 'a' and 'b' (one tensor under two keys, as tied embeddings are)."""
    t = torch.zeros(4)
    tmpl = {
        "a": db.ShardedTensor.from_box("a", t, (4,), (0,), replica_id=r.rank),
        "b": db.ShardedTensor.from_box("b", t, (4,), (0,), replica_id=r.rank),
    }
    try:
        db.load(tmpl, path, process_group=r.group, fully_parallel=True)
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return t.tolist()


@pytest.mark.parametrize("b_value", [1.0, 2.0])
def test_fully_parallel_load_checks_tied_keys(pool, tmp_path, b_value):
    """Tied keys stored with different values: each rank read one key and received the
    other after the read step's tie check, which never saw them meet; rank 0 returned 'b's
    values, rank 1 'a's, silently. Now tied shards are read by their own rank: the load
    raises TiedTensorsError on every rank as without fully_parallel (equal values load)."""
    a, b = torch.full((4,), 1.0), torch.full((4,), b_value)
    sd = {
        "a": db.ShardedTensor.from_box("a", a, (4,), (0,)),
        "b": db.ShardedTensor.from_box("b", b, (4,), (0,)),
    }
    db.save(sd, str(tmp_path))
    got = pool.run(fp_tied_keys, 2, str(tmp_path), timeout=60, grace=10)
    if b_value == 1.0:
        assert got == [[1.0] * 4] * 2
    else:
        expected = (
            "TiedTensorsError: ranks [0, 1]: 'a' and 'b' share one tensor's memory in the load "
            "template (tied weights), but the checkpoint holds different values for them: "
            "give each its own tensor to load both"
        )
        assert got == [expected, expected]


def fp_plain_tensor_of_each_rank(r: Rank, root: str, fully_parallel: bool) -> list[float]:
    """Each rank's plain tensor 'p' holds its rank; a large replicated shard keeps rank 0
    (the coordinator) busiest, so the balance would pick another rank for 'p'."""
    sd = {
        "big": db.ShardedTensor.from_box(
            "big", torch.arange(1000.0), (1000,), (0,), replica_id=r.rank
        ),
        "p": torch.full((8,), float(r.rank)),
    }
    path = f"{root}/{fully_parallel}"
    db.save(sd, path, process_group=r.group, fully_parallel=fully_parallel)
    return db.load({"p": torch.zeros(8)}, path, process_group=r.group)["p"].tolist()


@pytest.mark.parametrize("fully_parallel", [False, True])
def test_fully_parallel_save_keeps_the_coordinators_plain_tensors(pool, tmp_path, fully_parallel):
    """A plain tensor is common state: the coordinator's value is saved. Spreading the
    writes assigned it to the least-loaded rank like a replicated shard, so another rank's
    value was saved, silently (only with fully_parallel). Now the coordinator writes it."""
    got = pool.run(fp_plain_tensor_of_each_rank, 4, str(tmp_path), fully_parallel, timeout=60)
    assert got == [[0.0] * 8] * 4


def fp_group_wider_than_the_job(r: Rank, root: str, op: str) -> str:
    """Ranks {0, 1} and {2, 3} each save and load their own checkpoint (other values) on
    their own process group, passing the whole world as parallelization group."""
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine, half = halves[r.rank // 2], r.rank // 2
    vec = L.full("vec") + half
    sd = {"vec": db.ShardedTensor.from_box("vec", vec.clone(), (10,), (0,), replica_id=r.rank % 2)}
    path = f"{root}/{op}{half}"
    world = dist.group.WORLD
    tmpl = {"vec": db.ShardedTensor.from_box("vec", torch.zeros(10), (10,), (0,))}
    try:
        if op == "save":
            db.save(sd, path, process_group=mine, fully_parallel=True, parallelization_group=world)
        else:
            db.save(sd, path, process_group=mine)
            dist.barrier()
            db.load(
                tmpl, path, process_group=mine, fully_parallel=True, parallelization_group=world
            )
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    loaded = db.load(tmpl, path, process_group=mine)["vec"]
    return "loaded" if torch.equal(loaded, vec) else "other values"


@pytest.mark.parametrize("op", ["save", "load"])
def test_a_parallelization_group_beyond_the_process_group_is_refused(pool, tmp_path, op):
    """A fully-parallel load whose parallelization group spans ranks of another load sent
    ranks 2 and 3 the box rank 0 read from the other checkpoint: other values, silently
    (a save failed on 'more than one main replica'). Now both refuse the group on every
    rank, before any exchange."""
    got = pool.run(fp_group_wider_than_the_job, 4, str(tmp_path), op, timeout=60, grace=10)
    outside = [[2, 3], [2, 3], [0, 1], [0, 1]]
    for rank, message in enumerate(got):
        assert message == (
            f"InvalidArgumentError: parallelization_group has ranks outside the "
            f"process_group: {outside[rank]} (global ranks); it must be a subgroup of it"
        ), (rank, message)


class _OutOfMemory(types.ModuleType):
    """torch, except that ``torch.empty`` fails as an exhausted allocator does."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")


def fp_receiver_out_of_memory(r: Rank, path: str) -> str:
    """Both ranks ask 'vec' whole into a strided view (received through a buffer); rank 1
    cannot allocate that buffer."""
    tmpl = {"vec": db.ShardedTensor.from_box("vec", torch.zeros(10, 2)[:, 0], (10,), (0,))}
    if r.rank == 1:
        fp_module.torch = _OutOfMemory("torch")
    try:
        db.load(tmpl, path, process_group=r.group, fully_parallel=True)
    except db.CheckpointError as e:  # carried to every rank as the protocol does
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"  # (then the failed rank's stack)
    finally:
        fp_module.torch = torch
    return "loaded"


def test_a_hand_off_buffer_that_cannot_be_allocated_fails_every_rank(pool, tmp_path):
    """The receiving rank allocated its buffer after the reads, alone: its RuntimeError left
    the reader waiting in the exchange (a hang until the process group's timeout). Buffers
    are now made inside the load's first collective step: every rank raises."""
    path = str(tmp_path / "ck")
    pool.run(_save_model_and_vec, 2, path)
    got = pool.run(fp_receiver_out_of_memory, 2, path, timeout=30, grace=5)
    assert (
        got
        == [
            "StagingError: rank 1: fully-parallel load: cannot allocate the exchange buffer of "
            "'vec' (offset (0,), (10,) torch.float32, 40 bytes) on cpu: DefaultCPUAllocator: "
            "can't allocate memory"
        ]
        * 2
    )


def fp_common_tensor_into_shards(r: Rank, path: str) -> tuple[tuple[int, ...], bool, bool]:
    """Both ranks ask for the same column half of a plain tensor a save kept as common state."""
    half = torch.zeros(4, 4)
    template = {"w": db.ShardedTensor.from_rank_offsets("w", half, (1, 0, 2), replica_id=r.rank)}
    out = db.load(template, path, process_group=r.group, fully_parallel=True)
    filled = torch.equal(half, torch.arange(32.0).reshape(4, 8)[:, :4])
    return tuple(out["w"].shape), out["w"] is half, filled


def test_fully_parallel_load_of_a_common_tensor_returns_the_template_box(pool, tmp_path):
    """A plain tensor saved as common state, loaded into ShardedTensor boxes: a rank that got
    its box from another rank returned the whole stored tensor at that key (its template's
    box filled, the result holding a (4, 8) tensor where the template asked for (4, 4)), as
    if the key were common state the template lacks. Every rank returns its filled box."""
    path = str(tmp_path / "ck")
    full = torch.arange(32.0).reshape(4, 8)
    db.save({"w": full, "step": 1}, path)
    assert pool.run(fp_common_tensor_into_shards, 2, path, timeout=60) == [((4, 4), True, True)] * 2
