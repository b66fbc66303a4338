"""TensorAwareStateDict: holes, CPU copies, and node-local round trips that keep each shard once."""

from __future__ import annotations

import gc
import io
import os

import pytest
import torch
import torch.distributed as dist

import dcpbridge as db
import dcpbridge.mcore.tensor_aware_state_dict as tasd_module
from dcpbridge.engine.ownership import write_id
from dcpbridge.mcore.restore_plan import Manifest, ShardMeta, plan_restore
from dcpbridge.planners.distribution import Holding, distribute
from tests.e2e.test_errors import _expect
from tests.engine.test_fully_parallel import _model, _OutOfMemory, _replicas
from tests.support import layouts as L
from tests.support.collective_counts import count_collectives
from tests.support.dist_pool import Rank

TASD = db.TensorAwareStateDict


class LocalManager:
    """The simplest node-local checkpoint manager: one directory per rank, two torch.save files."""

    def __init__(self, root: str, rank: int) -> None:
        self.dir = os.path.join(root, f"rank{rank}")

    def save(self, state: db.TensorAwareStateDict) -> None:
        os.makedirs(self.dir, exist_ok=True)
        state.copy_tensors_to_cpu()
        tensors = state.pop_tensors()
        torch.save(state, os.path.join(self.dir, "state.pt"))
        torch.save(tensors, os.path.join(self.dir, "tensors.pt"))

    def load(self) -> db.TensorAwareStateDict:
        state = torch.load(os.path.join(self.dir, "state.pt"), weights_only=False)
        assert state.is_hollow
        state.insert_tensors(torch.load(os.path.join(self.dir, "tensors.pt"), weights_only=True))
        state.restore_tensor_device()
        return state


def _sample() -> dict:
    """One of each leaf kind: tensors (one a fused pair via a factory), an object, plain state."""
    w, idx = L.full("w").clone(), L.full("idx").clone()

    def halves(key, data, replica_id):
        a, b = data.chunk(2)
        return {
            "a": db.ShardedTensor.from_box(f"{key}.a", a, tuple(a.shape), (0, 0)),
            "b": db.ShardedTensor.from_box(f"{key}.b", b, tuple(b.shape), (0, 0)),
        }

    return {
        "w": db.ShardedTensor.from_box("w", w, (12, 8), (0, 0)),
        "layers": [
            db.ShardedTensorFactory("fused", idx, halves, lambda d: torch.cat([d["a"], d["b"]])),
            db.ShardedTensor.from_box("empty", torch.zeros(0, 3), (0, 3), (0, 0)),
        ],
        "rng": db.ShardedObject("rng", {"seed": 11}, (1,), (0,)),
        "iteration": 7,
        "cache": db.LocalNonpersistentObject("not saved"),
    }


def _template() -> dict:
    sd = _sample()
    sd["w"] = db.ShardedTensor.from_box("w", torch.zeros(12, 8), (12, 8), (0, 0))
    sd["layers"][0].data = torch.zeros_like(sd["layers"][0].data)
    sd["rng"] = db.ShardedObject("rng", None, (1,), (0,))
    sd["cache"] = db.LocalNonpersistentObject("template's")
    return sd


def _check_sample(out: dict) -> None:
    assert torch.equal(out["w"], L.full("w"))
    assert torch.equal(out["layers"][0], L.full("idx"))
    assert out["layers"][1].shape == (0, 3)
    assert out["rng"] == {"seed": 11}
    assert out["iteration"] == 7
    assert out["cache"] == "template's"


# -- one process -------------------------------------------------------------------------------


def test_pop_insert_round_trip_and_holes():
    state, distribution = TASD.from_state_dict(_sample())
    assert distribution is not None
    assert set(distribution.keepers) == {  # key, offset and size
        ("w", (0, 0), (12, 8)),
        ("fused.a", (0, 0), (6, 6)),
        ("fused.b", (0, 0), (6, 6)),
    }
    before = list(state.tensors)
    popped = state.pop_tensors()
    assert state.is_hollow
    assert [a is b for a, b in zip(popped, before)] == [True] * 3
    assert all(s.data is None for s in state.shards if isinstance(s, db.ShardedTensor))
    assert "pop_tensors" in _expect(state.pop_tensors, db.HollowStateError)
    _expect(lambda: state.tensors, db.HollowStateError)
    _expect(state.copy_tensors_to_cpu, db.HollowStateError)
    _expect(lambda: state.insert_tensors(popped[:2]), db.InvalidShardError)
    wrong = [popped[0].double(), *popped[1:]]
    assert "'w'" in _expect(lambda: state.insert_tensors(wrong), db.InvalidShardError)
    assert state.is_hollow  # a refused insert changes nothing
    state.insert_tensors(popped)
    assert not state.is_hollow
    assert [a is b for a, b in zip(state.tensors, before)] == [True] * 3
    _expect(lambda: state.insert_tensors(popped), db.HollowStateError)
    _expect(state.init_tensors, db.HollowStateError)
    _check_sample(state.to_state_dict(_template()))


@pytest.mark.parametrize("algo", ["fully_parallel", "atomic"])
def test_save_writes_what_the_state_keeps_and_load_returns_it(tmp_path, algo):
    """``db.save`` takes a TensorAwareStateDict as the sharded state dict it stands for."""
    state, _ = TASD.from_state_dict(_sample(), algo=algo)
    db.save(state, str(tmp_path / "ck"))
    _check_sample(db.load(_template(), str(tmp_path / "ck")))
    state.pop_tensors()
    assert "sharded_state_dict_for_save" in _expect(
        lambda: db.save(state, str(tmp_path / "hollow")), db.HollowStateError
    )
    assert not (tmp_path / "hollow" / "dcpbridge.json").exists()


def test_init_tensors_recreates_popped_layout():
    state, _ = TASD.from_state_dict(_sample(), algo="atomic")
    popped = state.pop_tensors()
    state.init_tensors()
    fresh = list(state.tensors)
    assert [(t.shape, t.dtype, t.device) for t in fresh] == [
        (t.shape, t.dtype, t.device) for t in popped
    ]
    assert not any(a is b for a, b in zip(fresh, popped))


def test_cpu_copies_are_snapshots_and_the_hollow_state_pickles():
    sample = _sample()
    state, _ = TASD.from_state_dict(sample, algo="atomic")
    state.copy_tensors_to_cpu()
    sample["w"].data.add_(1)  # training goes on: the copy must not see it
    tensors = state.pop_tensors()
    assert all(t.is_contiguous() for t in tensors)
    assert len(tensors) == 4  # atomic keeps the empty shard too
    assert state._orig_devices == [torch.device("cpu")] * 4
    hollow_bytes, tensor_bytes = io.BytesIO(), io.BytesIO()
    torch.save(state, hollow_bytes)
    torch.save(tensors, tensor_bytes)
    assert len(hollow_bytes.getvalue()) < 4096  # no tensor data in the hollow state
    hollow_bytes.seek(0)
    tensor_bytes.seek(0)
    restored = torch.load(hollow_bytes, weights_only=False)
    restored.insert_tensors(torch.load(tensor_bytes, weights_only=True))
    restored.restore_tensor_device()
    assert restored._orig_devices is None
    _check_sample(restored.to_state_dict(_template(), algo="atomic"))


def test_bad_arguments_are_clear_errors():
    assert "fully_parallel" in _expect(
        lambda: TASD.from_state_dict({}, algo="x"), db.InvalidArgumentError
    )
    state, _ = TASD.from_state_dict(_sample())
    msg = _expect(
        lambda: state.to_state_dict(_template(), exchange_algo="gather"), db.InvalidArgumentError
    )
    assert "'broadcast', 'p2p'" in msg
    no_data = {"w": db.ShardedTensor.from_box("w", torch.zeros(2), (2,), (0,))}
    no_data["w"].data = None
    assert "'w'" in _expect(lambda: TASD.from_state_dict(no_data), db.InvalidShardError)


def _meta(key: str, n: int = 4, dtype: torch.dtype = torch.float32) -> ShardMeta:
    return ShardMeta(key, (0,), (n,), (n,), dtype)


def test_plan_restore_sources_and_problems():
    a, b, c = _meta("a"), _meta("b"), _meta("c")
    manifests = {
        0: Manifest(kept=(a,), wanted=(a, b, c)),
        1: Manifest(kept=(b,), wanted=(a, b, _meta("d"))),
        2: Manifest(kept=(b,), wanted=(a, _meta("c", dtype=torch.float16))),
    }
    plan = plan_restore(manifests, local_only=False)
    assert [(t.meta.key, t.src, t.dsts) for t in plan.transfers] == [
        ("a", 0, (1, 2)),
        ("b", 1, (0,)),  # lowest keeper sends; rank 2 kept b but nobody needs its copy
    ]
    assert [(g.key, g.ranks) for g in plan.missing] == [("c", (0, 2)), ("d", (1,))]
    assert plan.requested_not_kept() == {0: {"c"}, 1: {"d"}, 2: {"c"}}
    assert [(g.key, g.ranks) for g in plan.duplicates] == [("b", (1, 2))]
    assert plan.kept_not_requested() == set()
    local = plan_restore(manifests, local_only=True)
    assert local.transfers == []
    assert [(g.key, g.ranks) for g in local.missing] == [
        ("a", (1, 2)),
        ("b", (0,)),
        ("c", (0, 2)),
        ("d", (1,)),
    ]
    assert local.kept_not_requested() == set()  # rank 2's b is wanted by ranks 0 and 1
    idle = plan_restore({0: Manifest(kept=(a, b), wanted=(a,))}, local_only=True)
    assert idle.kept_not_requested() == {"b"} and idle.requested_not_kept() == {}
    wrong = plan_restore(
        {0: Manifest(kept=(a,)), 1: Manifest(wanted=(_meta("a", 5),))}, local_only=False
    )
    assert wrong.shape_mismatches == [
        "'a' at offset (0,): rank 1 requests local shape (5,) of (5,), torch.float32, "
        "rank 0 kept local shape (4,) of (4,), torch.float32"
    ]
    with pytest.raises(db.ShapeMismatchError):
        wrong.check(validate=False)
    alone = plan_restore({0: Manifest(kept=(a,), wanted=(_meta("a", 5),))}, local_only=True)
    assert alone.shape_mismatches == [
        "'a' at offset (0,): rank 0 requests local shape (5,) of (5,), torch.float32, "
        "rank 0 kept local shape (4,) of (4,), torch.float32"
    ]
    assert alone.missing == [] and alone.transfers == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_copy_and_restore_to_cuda():
    w = L.full("w").cuda()
    state, _ = TASD.from_state_dict({"w": db.ShardedTensor.from_box("w", w, (12, 8), (0, 0))})
    state.copy_tensors_to_cpu(non_blocking=True)
    torch.cuda.synchronize()
    (cpu,) = state.tensors
    assert cpu.device.type == "cpu" and cpu.is_pinned()
    state.insert_tensors(state.pop_tensors())
    state.restore_tensor_device(non_blocking=False)
    (back,) = state.tensors
    assert back.device == w.device and torch.equal(back, w)


# -- data-parallel replicas on 4 ranks -----------------------------------------------------------


def _dp_state(rank: int, fill: bool) -> dict:
    sd = _replicas(rank, fill)
    sd["rng"] = db.ShardedObject("rng", torch.tensor([rank] if fill else [-1]), (4,), (rank,))
    sd["iteration"] = 7
    return sd


def dp_round_trip(r: Rank, root: str, exchange_algo: str) -> dict:
    calls = {}
    with count_collectives() as counted:
        state, distribution = TASD.from_state_dict(
            _dp_state(r.rank, True), parallelization_group=r.group
        )
    calls["build"] = dict(counted)
    kept = {write_id(s): s.numel * 4 for s in state.shards if isinstance(s, db.ShardedTensor)}
    with count_collectives() as counted:
        again, same = TASD.from_state_dict(
            _dp_state(r.rank, True), parallelization_group=r.group, cached_metadata=distribution
        )
    calls["cached"] = dict(counted)
    assert same is distribution
    assert [write_id(s) for s in again.shards if isinstance(s, db.ShardedTensor)] == list(kept)
    LocalManager(root, r.rank).save(state)
    del state, again
    gc.collect()
    restored = LocalManager(root, r.rank).load()
    template = _dp_state(r.rank, False)
    with count_collectives() as counted:
        out = restored.to_state_dict(
            template, exchange_algo=exchange_algo, parallelization_group=r.group
        )
    calls["restore"] = dict(counted)
    for k, t in _model().items():
        assert torch.equal(out[k], t), k
        assert out[k] is template[k].data  # filled in place
    assert torch.equal(out["rng"], torch.tensor([r.rank]))
    assert out["iteration"] == 7
    return {"keepers": distribution.keepers, "kept": kept, "calls": calls}


@pytest.mark.parametrize("exchange_algo", ["broadcast", "p2p"])
def test_data_parallel_round_trip_keeps_each_shard_once(pool, tmp_path, exchange_algo):
    results = pool.run(dp_round_trip, 4, str(tmp_path), exchange_algo)
    sizes = {(k, (0,) * t.ndim, tuple(t.shape)): t.numel() * 4 for k, t in _model().items()}
    expected = distribute([[Holding(s, n) for s, n in sizes.items()]] * 4, only_main=False)
    assert len(expected) == len(sizes)
    for rank, res in enumerate(results):
        assert res["keepers"] == expected
        assert set(res["kept"]) == {s for s, k in expected.items() if k == rank}
        restore = {"all_gather": 2}  # the manifests, then the exchange's buffers
        if exchange_algo == "p2p":
            restore["p2p"] = 1
        else:
            restore["broadcast_tensor"] = len(sizes)  # every shard is needed by 3 other ranks
        assert res["calls"] == {"build": {"all_gather": 1}, "cached": {}, "restore": restore}
    per_rank = [sum(res["kept"].values()) for res in results]
    assert sum(per_rank) == sum(sizes.values())
    assert max(per_rank) / min(per_rank) <= 1.05, per_rank
    for rank in range(4):
        assert os.path.getsize(tmp_path / f"rank{rank}" / "tensors.pt") < per_rank[rank] + 16384


# -- TP=2 x DP=2, the data-parallel groups as parallelization groups ------------------------------


def _tp_dp_state(tp: int, dp: int, fill: bool) -> dict:
    w = L.full("w").chunk(2)[tp].clone()
    norm = L.full("vec").clone()
    if not fill:
        w, norm = torch.zeros_like(w), torch.zeros_like(norm)
    return {
        "w": db.ShardedTensor.from_rank_offsets("w", w, (0, tp, 2), replica_id=(0, 0, dp)),
        "norm": db.ShardedTensor.from_box("vec", norm, (10,), (0,), replica_id=(0, tp, dp)),
        "step": 3,
    }


def tp_dp_round_trip(r: Rank, root: str) -> dict:
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp, tp = divmod(r.rank, 2)
    group = dp_groups[tp]
    state, distribution = TASD.from_state_dict(
        _tp_dp_state(tp, dp, True), parallelization_group=group
    )
    kept = sorted(write_id(s) for s in state.shards)
    LocalManager(root, r.rank).save(state)
    del state
    restored = LocalManager(root, r.rank).load()
    out = restored.to_state_dict(
        _tp_dp_state(tp, dp, False), exchange_algo="p2p", parallelization_group=group
    )
    assert torch.equal(out["w"], L.full("w").chunk(2)[tp])
    assert torch.equal(out["norm"], L.full("vec"))
    assert out["step"] == 3
    return {"keepers": distribution.keepers, "kept": kept}


def test_tensor_and_data_parallel_groups_restore_alone(pool, tmp_path):
    results = pool.run(tp_dp_round_trip, 4, str(tmp_path), default_group=True)
    for tp in range(2):
        w_shard, vec = ("w", (6 * tp, 0), (6, 8)), ("vec", (0,), (10,))
        # w (192 B) goes first to group rank 0, vec (40 B) to the less-loaded group rank 1 —
        # in the tp=1 group too, where no member holds vec as a main replica
        assert results[tp]["keepers"] == results[2 + tp]["keepers"] == {w_shard: 0, vec: 1}
        assert results[tp]["kept"] == [w_shard]
        assert results[2 + tp]["kept"] == [vec]


def tp_dp_save_and_load(r: Rank, path: str) -> None:
    """Each data-parallel group keeps every shard once; across the groups, only the kept
    copies of main replicas are written (two groups each kept ``vec``)."""
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp, tp = divmod(r.rank, 2)
    state, _ = TASD.from_state_dict(_tp_dp_state(tp, dp, True), parallelization_group=dp_groups[tp])
    db.save(state, path)
    out = db.load(_tp_dp_state(tp, dp, False), path)
    assert torch.equal(out["w"], L.full("w").chunk(2)[tp])
    assert torch.equal(out["norm"], L.full("vec")) and out["step"] == 3


def test_state_kept_by_data_parallel_groups_saves_and_loads(pool, tmp_path):
    """Saving such a state raised ShardingValidationError: every kept shard was marked a main
    replica, so the copies the two groups kept of a tensor-parallel replica both wrote."""
    pool.run(tp_dp_save_and_load, 4, str(tmp_path / "ck"), default_group=True, timeout=120)
    whole = db.load({"vec": torch.zeros(10)}, str(tmp_path / "ck"))
    assert torch.equal(whole["vec"], L.full("vec"))


# -- failures raise on every rank ----------------------------------------------------------------


def _w_state(rank: int, fill: bool = True) -> dict:
    w = L.full("w").clone() if fill else torch.zeros(12, 8)
    return {"w": db.ShardedTensor.from_box("w", w, (12, 8), (0, 0), replica_id=rank)}


def failure_case(r: Rank, case: str) -> object:
    g = r.group
    if case == "build":
        sd = _w_state(r.rank)
        if r.rank == 0:
            sd["f"] = db.ShardedTensorFactory("f", torch.zeros(2), _bad_build, lambda d: d)
        return _expect(lambda: TASD.from_state_dict(sd, parallelization_group=g), ValueError)
    if case == "stale_cache":
        _, distribution = TASD.from_state_dict(_w_state(r.rank), parallelization_group=g)
        other = _w_state(r.rank)
        other["v"] = db.ShardedTensor.from_box("vec", L.full("vec"), (10,), (0,))
        return _expect(
            lambda: TASD.from_state_dict(
                other, parallelization_group=g, cached_metadata=distribution
            ),
            db.InvalidArgumentError,
        )
    algo = "atomic" if case.startswith("duplicate") else "fully_parallel"
    state, _ = TASD.from_state_dict(_w_state(r.rank), algo=algo, parallelization_group=g)
    template = _w_state(r.rank, fill=False)
    if case == "duplicate":
        return _expect(
            lambda: state.to_state_dict(template, algo="fully_parallel", parallelization_group=g),
            db.ShardingValidationError,
        )
    if case == "duplicate_unvalidated":  # each rank uses its own copy: nothing is sent
        with count_collectives() as counted:
            out = state.to_state_dict(
                template,
                algo="fully_parallel",
                validate_access_integrity=False,
                parallelization_group=g,
            )
        assert torch.equal(out["w"], L.full("w"))
        return dict(counted)
    if case == "hollow" and r.rank == 1:
        state.pop_tensors()
    if case == "dtype" and r.rank == 3:
        template["w"] = db.ShardedTensor.from_box("w", torch.zeros(12, 8).half(), (12, 8), (0, 0))
    if case.startswith("missing") and r.rank == 2:
        template["extra"] = db.ShardedTensor.from_box("extra", torch.zeros(3), (3,), (0,))
    if case == "missing_return_all":
        out, missing, unexpected = state.to_state_dict(
            template, parallelization_group=g, strict="return_all"
        )
        assert torch.equal(out["w"], L.full("w")) and "extra" not in out
        return missing, unexpected
    errors = {
        "hollow": db.HollowStateError,
        "dtype": db.DTypeMismatchError,
        "missing": db.MissingKeysError,
    }
    return _expect(lambda: state.to_state_dict(template, parallelization_group=g), errors[case])


def _bad_build(key, data, replica_id):
    raise ValueError(f"cannot build {key!r}")


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("build", ["rank 0", "cannot build 'f'"]),
        ("stale_cache", ["cached_metadata", "without it"]),
        ("duplicate", ["kept by more than one rank", "'w' at offset (0, 0) (ranks [0, 1, 2, 3])"]),
        ("hollow", ["rank 1", "to_state_dict: the tensors were popped"]),
        ("dtype", ["'w'", "rank 3 requests", "torch.float16", "torch.float32"]),
        (
            "missing",
            [
                "1 key(s) requested but not in the state kept by the group",
                "(Megatron calls them 'unexpected'): 'extra' (rank 2)",
            ],
        ),
    ],
)
def test_failures_raise_on_every_rank(pool, case, needles):
    messages = pool.run(failure_case, 4, case)
    for needle in needles:
        assert needle in messages[0], (needle, messages[0])
    if case != "stale_cache":
        assert len(set(messages)) == 1, "every rank sees the same report"


def test_missing_shards_returned_and_duplicates_tolerated_without_validation(pool):
    results = pool.run(failure_case, 4, "missing_return_all")  # Megatron's (missing, unexpected)
    assert results == [(set(), set()), (set(), set()), (set(), {"extra"}), (set(), set())]
    calls = pool.run(failure_case, 4, "duplicate_unvalidated")
    assert calls == [{"all_gather": 1}] * 4


def _dtensor_refused(r: Rank) -> str:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh.from_group(r.group or dist.group.WORLD, "cpu")
    state = {"w": distribute_tensor(torch.zeros(4), mesh, [Shard(0)])}
    with pytest.raises(db.SerializationError) as e:
        TASD.from_state_dict(state, parallelization_group=r.group)
    return str(e.value)


def test_a_dtensor_is_refused_with_what_to_do_instead(pool):
    """Megatron's split has no place for a DTensor; the error said only 'dtensor'."""
    (message,) = pool.run(_dtensor_refused, 1)
    assert message.startswith("'w' is torch.distributed.tensor.DTensor, a DTensor, which")
    assert "save DTensors with dcpbridge.save or CheckpointManager" in message


@pytest.mark.parametrize("algo", ["atomic", "fully_parallel"])
def test_a_factory_building_a_factory_is_a_checkpoint_error(algo):
    """As ``save`` refuses it (SerializationError, a CheckpointError), not a bare TypeError."""

    def inner(key, data, replica_id):
        return {"x": db.ShardedTensor.from_box(f"{key}.x", data, tuple(data.shape), (0,))}

    def outer(key, data, replica_id):
        return {"f": db.ShardedTensorFactory(f"{key}.in", data, inner, lambda p: p["x"])}

    sd = {"f": db.ShardedTensorFactory("w", torch.ones(3), outer, lambda p: p["f"])}
    with pytest.raises(db.SerializationError, match="'w' built another factory"):
        TASD.from_state_dict(sd, algo=algo)


def _param_state(rank: int, fill: bool) -> dict:
    """The weight as an nn.Parameter (a model's sharded state dict holds them), replicated."""
    w = torch.nn.Parameter(L.full("w").clone() if fill else torch.zeros(12, 8))
    return {"w": db.ShardedTensor.from_box("w", w, (12, 8), (0, 0), replica_id=rank)}


def params_restore(r: Rank, exchange_algo: str) -> None:
    state, _ = TASD.from_state_dict(_param_state(r.rank, True), parallelization_group=r.group)
    template = _param_state(r.rank, False)
    out = state.to_state_dict(template, exchange_algo=exchange_algo, parallelization_group=r.group)
    assert out["w"] is template["w"].data and isinstance(out["w"], torch.nn.Parameter)
    assert torch.equal(out["w"], L.full("w")) and out["w"].requires_grad


@pytest.mark.parametrize("exchange_algo", ["broadcast", "p2p"])
def test_restore_fills_parameters_in_place(pool, exchange_algo):
    """Template Parameters are filled in place, on the rank that kept the shard and on the one
    it is sent to; copying into them raised torch's RuntimeError ('a leaf Variable that
    requires grad is being used in an in-place operation')."""
    pool.run(params_restore, 2, exchange_algo, timeout=120)
    state, _ = TASD.from_state_dict(_param_state(0, True), algo="atomic")
    template = _param_state(0, False)
    assert torch.equal(state.to_state_dict(template)["w"], L.full("w"))
    assert torch.equal(template["w"].data, L.full("w"))


# -- tied template keys ------------------------------------------------------------------------


def _ab_state(a: float, b: float, replica_id: int = 0) -> dict:
    """Two keys 'a' and 'b' of 4 elements, filled with ``a`` and ``b``."""
    return {
        k: db.ShardedTensor.from_box(k, torch.full((4,), v), (4,), (0,), replica_id=replica_id)
        for k, v in (("a", a), ("b", b))
    }


def _tied_template(p: torch.nn.Parameter) -> dict:
    """'a' and 'b' asked into one memory (tied weights)."""
    return {k: db.ShardedTensor.from_box(k, p.data, (4,), (0,)) for k in ("a", "b")}


@pytest.mark.parametrize("algo", ["atomic", "fully_parallel"])
def test_tied_template_keys_kept_with_different_values_raise_naming_both(algo):
    """Each key was copied into the shared memory, the last one silently winning; as
    ``load`` does, tied keys kept with different values raise ``TiedTensorsError``."""
    state, _ = TASD.from_state_dict(_ab_state(1.0, 2.0), algo=algo)
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(db.TiedTensorsError) as e:
        state.to_state_dict(_tied_template(p))
    assert "'a' and 'b' share one tensor's memory" in str(e.value)


@pytest.mark.parametrize("algo", ["atomic", "fully_parallel"])
def test_tied_template_keys_kept_alike_fill_their_one_memory(algo):
    state, _ = TASD.from_state_dict(_ab_state(3.0, 3.0), algo=algo)
    p = torch.nn.Parameter(torch.zeros(4))
    out = state.to_state_dict(_tied_template(p))
    assert torch.equal(p.data, torch.full((4,), 3.0))
    assert out["a"].data_ptr() == out["b"].data_ptr() == p.data_ptr()


def tied_restore(r: Rank, exchange_algo: str, b: float) -> str:
    """Both ranks hold 'a' (1.0) and 'b' (``b``) as replicas; rank 1 asks them tied (each
    received into its template where the other rank kept it), rank 0 untied."""
    state, _ = TASD.from_state_dict(_ab_state(1.0, b, r.rank), parallelization_group=r.group)
    p = torch.nn.Parameter(torch.zeros(4))
    template = _tied_template(p) if r.rank == 1 else _ab_state(0.0, 0.0, r.rank)
    try:
        out = state.to_state_dict(
            template, exchange_algo=exchange_algo, parallelization_group=r.group
        )
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    assert torch.equal(out["a"], torch.full((4,), 1.0))
    assert torch.equal(out["b"], torch.full((4,), b))
    return "restored"


@pytest.mark.parametrize("exchange_algo", ["broadcast", "p2p"])
def test_a_conflicting_tie_on_one_rank_raises_on_every_rank(pool, exchange_algo):
    """Rank 1's tied keys, kept with different values (one received from rank 0), silently
    took the last one's; now every rank raises naming both, and alike values restore."""
    got = pool.run(tied_restore, 2, exchange_algo, 2.0, timeout=60, grace=5)
    assert (
        got
        == [
            "TiedTensorsError: rank 1: 'a' and 'b' share one tensor's memory in the load "
            "template (tied weights), but the checkpoint holds different values for them: give "
            "each its own tensor to load both"
        ]
        * 2
    )
    assert pool.run(tied_restore, 2, exchange_algo, 1.0, timeout=60) == ["restored"] * 2


def tied_atomic_alone(r: Rank) -> str:
    """``atomic`` without validation runs no collective: rank 1's conflicting tie raises
    there alone (as any of its failures does), rank 0 restores."""
    state, _ = TASD.from_state_dict(_ab_state(1.0, 2.0), algo="atomic")
    template = _tied_template(torch.nn.Parameter(torch.zeros(4))) if r.rank else _ab_state(0.0, 0.0)
    try:
        state.to_state_dict(
            template, validate_access_integrity=False, parallelization_group=r.group
        )
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return "restored"


def test_a_tie_restored_alone_raises_alone(pool):
    got = pool.run(tied_atomic_alone, 2, timeout=30, grace=5)
    assert got[0] == "restored"
    assert got[1].startswith("TiedTensorsError: 'a' and 'b' share one tensor's memory")


# -- buffers that cannot be allocated ----------------------------------------------------------


def out_of_memory_restore(r: Rank, exchange_algo: str, failing: int) -> str:
    """Rank 0 alone keeps 'vec'; rank 1 asks it into a strided view (received through a
    buffer); rank 2, if any, asks nothing (a bystander of the broadcast, through scratch).
    Rank ``failing`` cannot allocate."""
    vec = L.full("vec").clone() if r.rank == 0 else None
    kept = {"vec": db.ShardedTensor.from_box("vec", vec, (10,), (0,))} if vec is not None else {}
    state, _ = TASD.from_state_dict(kept, parallelization_group=r.group)
    into = {0: torch.zeros(10), 1: torch.zeros(10, 2)[:, 0]}
    template = {}
    if r.rank in into:
        template["vec"] = db.ShardedTensor.from_box("vec", into[r.rank], (10,), (0,))
    if r.rank == failing:
        tasd_module.torch = _OutOfMemory("torch")
    try:
        out = state.to_state_dict(
            template, exchange_algo=exchange_algo, parallelization_group=r.group
        )
    except db.CheckpointError as e:  # carried to every rank as the protocol does
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    finally:
        tasd_module.torch = torch
    assert all(torch.equal(t, L.full("vec")) for t in out.values())
    return "restored"


@pytest.mark.parametrize(
    ("exchange_algo", "ranks", "what"),
    [
        ("p2p", 2, "receive buffer of 'vec' (offset (0,), (10,) torch.float32, 40 bytes)"),
        ("broadcast", 2, "receive buffer of 'vec' (offset (0,), (10,) torch.float32, 40 bytes)"),
        ("broadcast", 3, "broadcast scratch buffer (40 bytes, for 'vec' at offset (0,))"),
    ],
)
def test_a_restore_buffer_that_cannot_be_allocated_fails_every_rank(
    pool, exchange_algo, ranks, what
):
    """A rank that could not allocate its receive or scratch buffer (made after the plan was
    agreed) raised a bare RuntimeError alone, leaving the others waiting in the exchange.
    Buffers are now made inside a collective step: every rank raises StagingError."""
    failing = ranks - 1
    got = pool.run(out_of_memory_restore, ranks, exchange_algo, failing, timeout=30, grace=5)
    assert (
        got
        == [
            f"StagingError: rank {failing}: to_state_dict: cannot allocate the {what} on cpu: "
            "DefaultCPUAllocator: can't allocate memory"
        ]
        * ranks
    )
    assert (
        pool.run(out_of_memory_restore, ranks, exchange_algo, -1, timeout=30)
        == ["restored"] * ranks
    )


# -- a replica sharded otherwise than its main replica -------------------------------------------


def _vec_split(rank: int, fill: bool, busy: bool = False) -> dict:
    """Rank 0 holds 'vec' whole (main replica); ranks 1 and 2 hold its halves as replicas:
    rank 1's half starts at rank 0's offset, with another size. ``busy``: rank 0 also keeps
    'w' (so the keeper of the least loaded member is another rank)."""
    vec = L.full("vec").clone() if fill else torch.zeros(10)
    if rank == 0:
        out = {"vec": db.ShardedTensor.from_box("vec", vec, (10,), (0,))}
        if busy:
            w = L.full("w").clone() if fill else torch.zeros(12, 8)
            out["w"] = db.ShardedTensor.from_box("w", w, (12, 8), (0, 0))
        return out
    half = vec[5 * (rank - 1) : 5 * rank].clone()
    return {"vec": db.ShardedTensor.from_box("vec", half, (10,), (5 * (rank - 1),), replica_id=1)}


def vec_split_round_trip(r: Rank, path: str, exchange_algo: str, busy: bool) -> bool:
    sd = _vec_split(r.rank, True, busy)
    state, _ = TASD.from_state_dict(sd, parallelization_group=r.group)
    db.save(state, path, process_group=r.group)
    template = _vec_split(r.rank, False, busy)
    out = state.to_state_dict(template, exchange_algo=exchange_algo, parallelization_group=r.group)
    return all(torch.equal(out[k], sd[k].data) for k in sd)


@pytest.mark.parametrize("busy", [False, True])
@pytest.mark.parametrize("exchange_algo", ["broadcast", "p2p"])
def test_a_replica_sharded_otherwise_than_its_main_is_kept_apart(
    pool, tmp_path, exchange_algo, busy
):
    """A shard was named by key and offset only: rank 1's half and rank 0's whole 'vec' (both
    at offset 0) were one shard, kept once, so the save raised ShardingValidationError and
    the restore ShapeMismatchError (or lost the other's bytes); each is now kept (key,
    offset and size, as db.save names shards)."""
    path = str(tmp_path / "ck")
    got = pool.run(vec_split_round_trip, 3, path, exchange_algo, busy, timeout=60)
    assert got == [True] * 3
    assert torch.equal(db.load({"vec": torch.zeros(10)}, path)["vec"], L.full("vec"))


@pytest.mark.parametrize("algo", ["atomic", "fully_parallel"])
def test_template_keys_sharing_part_of_one_memory_are_refused(algo):
    """'a' and 'b' asked into overlapping slices of one tensor were each copied into the
    shared elements, one silently taking the other's values; as ``load`` does, refused."""
    state, _ = TASD.from_state_dict(_ab_state(1.0, 2.0), algo=algo)
    t = torch.zeros(6)
    template = {
        "a": db.ShardedTensor.from_box("a", t[0:4], (4,), (0,)),
        "b": db.ShardedTensor.from_box("b", t[2:6], (4,), (0,)),
    }
    with pytest.raises(db.InvalidRequestError) as e:
        state.to_state_dict(template)
    assert "'a' and 'b' share part of one tensor's memory" in str(e.value)
    assert torch.equal(t, torch.zeros(6))  # nothing filled
