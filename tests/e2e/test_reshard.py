"""Save in layout A on N ranks, load in layout B on M ranks, compare bit-exactly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dcpbridge as db
from tests.support import layouts as L
from tests.support.dist_pool import Rank

COMMON = {
    "iteration": 1234,
    "args": {"lr": 3e-4, "betas": [0.9, 0.95], "name": "gpt"},
    "t": torch.arange(3),
}


def save_layout(r: Rank, layout: str, path: str, threads: int = 2) -> None:
    sd: dict = {"common": COMMON}
    for key in L.TENSORS:
        for i, box in enumerate(L.boxes(layout, key, r.rank)):
            sd[f"{key}.{i}"] = L.shard(key, box)
    db.save(sd, path, process_group=r.group, thread_count=threads)


def load_layout(r: Rank, layout: str, path: str) -> int:
    tmpl = {}
    for key in L.TENSORS:
        for i, box in enumerate(L.boxes(layout, key, r.rank)):
            tmpl[f"{key}.{i}"] = L.template(key, box)
    out = db.load(tmpl, path, process_group=r.group)
    checked = 0
    for name, sh in tmpl.items():
        key = sh.key
        box = (sh.global_offset, sh.local_shape)
        assert out[name] is sh.data, "tensors are filled in place"
        assert out[name].dtype == L.TENSORS[key][1]
        assert torch.equal(out[name], L.expected(key, box)), f"{name} {box} differs"
        checked += 1
    assert out["common"]["iteration"] == 1234 and out["common"]["args"] == COMMON["args"]
    assert torch.equal(out["common"]["t"], COMMON["t"])
    return checked


CASES = [
    ("uneven3", "uneven4"),  # 1-D uneven with zero-size shards, 3 -> 4 ranks
    ("rows2", "cols2"),  # dim 0 -> dim 1
    ("rows2", "cols4"),  # dim 0 -> dim 1, 2 -> 4 ranks
    ("rows2", "rows4"),  # 2 -> 4
    ("grid4", "rows3"),  # 4 -> 3, uneven
    ("interleaved2", "grid4"),  # several shards of one key per rank
    ("cols4", "interleaved2"),
]


def test_reshard_matrix(pool, tmp_path):
    for src, dst in CASES:
        path = str(tmp_path / f"{src}-to-{dst}")
        pool.run(save_layout, L.LAYOUTS[src][0], src, path)
        counts = pool.run(load_layout, L.LAYOUTS[dst][0], dst, path)
        assert sum(counts) >= len(L.TENSORS) * L.LAYOUTS[dst][0], (src, dst, counts)


def test_two_to_four_to_one_process(pool, tmp_path):
    """2 ranks save, 4 ranks load and re-save, one plain process (no process group) loads."""
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    pool.run(save_layout, 2, "rows2", first)
    pool.run(_load_then_save, 4, first, second)
    assert not dist.is_initialized()
    assert load_layout(Rank(0, 1, None), "whole1", second) == len(L.TENSORS)


def _load_then_save(r: Rank, src: str, dst: str) -> None:
    load_layout(r, "rows4", src)
    save_layout(r, "rows4", dst)


def test_default_group(pool, tmp_path):
    path = str(tmp_path / "ck")
    pool.run(save_layout, 4, "grid4", path, default_group=True)
    pool.run(load_layout, 4, "cols4", path, default_group=True)


# -- pipeline-style prepended layer axis ------------------------------------------------------

LAYERS, HIDDEN, FFN = 4, 6, 8


def _layer_weight() -> torch.Tensor:
    return L.full("decoder.fc1", (LAYERS, FFN, HIDDEN), torch.float32)


def _layer_bias() -> torch.Tensor:
    return L.full("decoder.norm", (LAYERS, HIDDEN), torch.float32)


def _pipeline_state(tp: int, pp: int, rank: int, fill: bool) -> dict:
    """Per-layer ShardedTensors with a prepended layer axis; fc1 TP-split on dim 0, norm replicated over TP."""
    pp_rank, tp_rank = divmod(rank, tp)
    per_stage = LAYERS // pp
    sd = {}
    for local in range(per_stage):
        layer = pp_rank * per_stage + local
        w = _layer_weight()[layer].chunk(tp, dim=0)[tp_rank].clone()
        b = _layer_bias()[layer].clone()
        if not fill:
            w, b = torch.zeros_like(w), torch.zeros_like(b)
        sd[f"layers.{local}.fc1"] = db.ShardedTensor.from_rank_offsets(
            "decoder.fc1",
            w,
            (0, layer, LAYERS),
            (1, tp_rank, tp),
            replica_id=(0, 0, 0),
            prepend_axis_num=1,
        )
        sd[f"layers.{local}.norm"] = db.ShardedTensor.from_rank_offsets(
            "decoder.norm", b, (0, layer, LAYERS), replica_id=(0, tp_rank, 0), prepend_axis_num=1
        )
    return sd


def save_pipeline(r: Rank, tp: int, pp: int, path: str) -> None:
    db.save(_pipeline_state(tp, pp, r.rank, fill=True), path, process_group=r.group)


def load_pipeline(r: Rank, tp: int, pp: int, path: str) -> None:
    tmpl = _pipeline_state(tp, pp, r.rank, fill=False)
    out = db.load(tmpl, path, process_group=r.group)
    want = _pipeline_state(tp, pp, r.rank, fill=True)
    for name, sh in want.items():
        assert torch.equal(out[name], sh.data), name


def test_pipeline_layouts(pool, tmp_path):
    for (tp, pp), (tp2, pp2) in [((2, 2), (1, 4)), ((4, 1), (2, 2))]:
        path = str(tmp_path / f"tp{tp}pp{pp}")
        pool.run(save_pipeline, tp * pp, tp, pp, path)
        pool.run(load_pipeline, tp2 * pp2, tp2, pp2, path)
    # and into one plain process holding every layer
    load_pipeline(Rank(0, 1, None), 1, 1, str(tmp_path / "tp4pp1"))


# -- data-parallel replicas ----------------------------------------------------------------


def save_replicated(r: Rank, path: str) -> None:
    """TP=2 x DP=2: each weight shard is held by two DP ranks; only dp_rank 0 writes."""
    dp, tp = divmod(r.rank, 2)
    w = L.full("w").chunk(2, dim=0)[tp].clone()
    sd = {"w": db.ShardedTensor.from_rank_offsets("w", w, (0, tp, 2), replica_id=(0, 0, dp))}
    sd["emb"] = db.ShardedTensor.from_box(
        "emb", L.full("vec").clone(), (10,), (0,), replica_id=r.rank
    )
    db.save(sd, path, process_group=r.group)


def load_whole(r: Rank, path: str) -> None:
    tmpl = {
        "w": db.ShardedTensor.from_box("w", torch.zeros(12, 8), (12, 8), (0, 0)),
        "emb": db.ShardedTensor.from_box("emb", torch.zeros(10), (10,), (0,)),
    }
    out = db.load(tmpl, path, process_group=r.group)
    assert torch.equal(out["w"], L.full("w")) and torch.equal(out["emb"], L.full("vec"))


def test_replicated_over_dp(pool, tmp_path):
    path = str(tmp_path / "dp")
    pool.run(save_replicated, 4, path)
    meta = db.load_tensors_metadata(path)
    assert meta["w"].global_shape == (12, 8)
    pool.run(load_whole, 3, path)  # every rank reads everything
    load_whole(Rank(0, 1, None), path)
    import json

    doc = json.loads((tmp_path / "dp" / "dcpbridge.json").read_text())
    assert sorted(c["rank"] for c in doc["tensors"]["w"]["chunks"]) == [0, 1]  # dp_rank 0 only
    assert [c["rank"] for c in doc["tensors"]["emb"]["chunks"]] == [0]


# -- objects, factories, common state --------------------------------------------------------


def save_objects(r: Rank, path: str) -> None:
    sd = {
        "rng": db.ShardedObject(
            "rng", {"seed": 100 + r.rank, "state": torch.arange(r.rank + 2)}, (r.size,), (r.rank,)
        ),
        "shared": db.ShardedObject("sched", {"step": 7}, (1,), (0,), replica_id=r.rank),
        "opt": {"lr": 0.5 + r.rank},  # common state: rank 0's value wins
        "np": db.LocalNonpersistentObject(object()),
    }
    db.save(sd, path, process_group=r.group)


def load_objects(r: Rank, path: str) -> None:
    tmpl = {
        "rng": db.ShardedObject("rng", None, (r.size,), (r.rank,)),
        "shared": db.ShardedObject("sched", None, (1,), (0,), replica_id=r.rank),
        "np": db.LocalNonpersistentObject("mine"),
    }
    out = db.load(tmpl, path, process_group=r.group)
    assert out["rng"]["seed"] == 100 + r.rank
    assert torch.equal(out["rng"]["state"], torch.arange(r.rank + 2))
    assert out["shared"] == {"step": 7}
    assert out["opt"] == {"lr": 0.5}
    assert out["np"] == "mine"
    assert db.load_common_state_dict(path) == {"opt": {"lr": 0.5}}


def test_sharded_objects_and_common_state(pool, tmp_path):
    path = str(tmp_path / "obj")
    pool.run(save_objects, 3, path)
    pool.run(load_objects, 3, path)


FFN_SW = 8


def _swiglu_factory(key: str, tp: int, tp_rank: int, fill: bool) -> db.ShardedTensorFactory:
    """Local fused [gate_part; up_part] whose halves live in separate global halves [gate; up]."""
    gate, up = L.full("gate", (FFN_SW, 4), torch.float32), L.full("up", (FFN_SW, 4), torch.float32)
    local = torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
    if not fill:
        local = torch.zeros_like(local)

    def build(key, data, replica_id):
        g, u = data.chunk(2)
        return {
            "g": db.ShardedTensor.from_rank_offsets(
                key, g, (0, tp_rank, 2 * tp), replica_id=replica_id
            ),
            "u": db.ShardedTensor.from_rank_offsets(
                key, u, (0, tp + tp_rank, 2 * tp), replica_id=replica_id
            ),
        }

    def merge(d):
        return torch.cat([d["g"], d["u"]])

    return db.ShardedTensorFactory(key, local, build, merge)


def save_swiglu(r: Rank, path: str) -> None:
    db.save({"fc1": _swiglu_factory("mlp.fc1", r.size, r.rank, True)}, path, process_group=r.group)


def load_swiglu(r: Rank, path: str) -> None:
    out = db.load(
        {"fc1": _swiglu_factory("mlp.fc1", r.size, r.rank, False)}, path, process_group=r.group
    )
    want = _swiglu_factory("mlp.fc1", r.size, r.rank, True).data
    assert torch.equal(out["fc1"], want)


def test_swiglu_factory_interleaved_across_tp(pool, tmp_path):
    path = str(tmp_path / "swiglu")
    pool.run(save_swiglu, 2, path)
    pool.run(load_swiglu, 4, path)
    load_swiglu(Rank(0, 1, None), path)
    meta = db.load_tensors_metadata(path)
    assert meta["mlp.fc1"].global_shape == (2 * FFN_SW, 4)


def _failing(message: str):
    def fail(*_):
        raise ValueError(message)

    return fail


def save_with_failing_build(r: Rank, path: str) -> str:
    """Rank 1's build_fn raises (a user's bug): every rank raises, naming the factory."""
    f = _swiglu_factory("mlp.fc1", r.size, r.rank, True)
    if r.rank == 1:
        f.build_fn = _failing("bad split")
    try:
        db.save({"fc1": f}, path, process_group=r.group)
    except db.InvalidShardError as e:
        return str(e).splitlines()[0]
    return "saved"


def test_a_failing_build_fn_raises_invalid_shard_error_on_every_rank(pool, tmp_path):
    got = pool.run(save_with_failing_build, 2, str(tmp_path / "ck"), timeout=60)
    assert got == ["rank 1: factory 'mlp.fc1': build_fn failed: ValueError('bad split')"] * 2
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_a_failing_merge_fn_raises_invalid_shard_error_naming_the_factory(pool, tmp_path):
    path = str(tmp_path / "swiglu")
    pool.run(save_swiglu, 2, path)
    f = _swiglu_factory("mlp.fc1", 1, 0, False)
    f.merge_fn = _failing("cannot merge")
    with pytest.raises(db.InvalidShardError, match=r"^factory 'mlp.fc1': merge_fn failed") as e:
        db.load({"fc1": f}, path)
    assert isinstance(e.value.__cause__, ValueError)


def load_with_failing_merge(r: Rank, path: str, fully_parallel: bool) -> tuple[str, ...]:
    """Rank 1's merge_fn raises (a user's bug) after its reads; what each rank raises."""
    f = _swiglu_factory("mlp.fc1", r.size, r.rank, False)
    if r.rank == 1:
        f.merge_fn = _failing("cannot merge")
    try:
        db.load({"fc1": f}, path, process_group=r.group, fully_parallel=fully_parallel)
    except db.CheckpointError as e:
        return type(e).__name__, str(e).splitlines()[0], type(e.__cause__).__name__
    return ("loaded",)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fully_parallel", [False, True])
def test_a_merge_fn_failing_on_one_rank_fails_the_load_on_every_rank(
    pool, tmp_path, fully_parallel
):
    """The merge ran after the load's last collective step: rank 1 raised while rank 0's load
    returned and its training went on, to hang at its next collective. The merge now runs
    inside the read step (a fully-parallel load: in one vote after the hand-off)."""
    path = str(tmp_path / "swiglu")
    pool.run(save_swiglu, 2, path)
    got = pool.run(load_with_failing_merge, 2, path, fully_parallel, timeout=90)
    line = "rank 1: factory 'mlp.fc1': merge_fn failed: ValueError('cannot merge')"
    assert got == [
        ("InvalidShardError", line, "InvalidShardError"),
        ("InvalidShardError", line, "InvalidShardError"),
    ]


# -- allow_shape_mismatch --------------------------------------------------------------------


def load_mismatched(r: Rank, path: str, rows: int) -> torch.Tensor:
    local = (rows + r.size - 1) // r.size
    start = min(r.rank * local, rows)
    size = min(local, rows - start)
    tmpl = {
        "w": db.ShardedTensor.from_box(
            "w", torch.full((size, 8), 9.0), (rows, 8), (start, 0), allow_shape_mismatch=True
        )
    }
    out = db.load(tmpl, path, process_group=r.group)
    want = torch.zeros(size, 8)
    stored = L.full("w")[start : start + size]
    want[: stored.shape[0]] = stored
    assert torch.equal(out["w"], want)
    return out["w"]


def test_allow_shape_mismatch_larger_and_smaller(pool, tmp_path):
    path = str(tmp_path / "mm")
    pool.run(save_layout, 2, "rows2", path)
    pool.run(load_mismatched, 2, path, 16)  # larger: rows 12..15 zero-filled
    pool.run(load_mismatched, 2, path, 8)  # smaller: only the overlap is read
