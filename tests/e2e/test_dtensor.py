"""DTensor, FSDP2 and torch's ShardedTensor in dcpbridge: stored as tensors, exact, any layout."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import dcpbridge as db
from tests.support.dist_pool import Rank

SHAPES = {"w": (6, 8), "b": (8,), "u": (5, 3), "z": (2, 4)}


def full(key: str) -> torch.Tensor:
    """The global value of tensor ``key`` (distinct everywhere, so misplaced bytes show)."""
    shape = SHAPES[key]
    base = 1000.0 * sorted(SHAPES).index(key)
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + base


def mesh_of(r: Rank) -> DeviceMesh:
    """A 1-D CPU mesh over the ranks of this test."""
    return DeviceMesh.from_group(r.group or dist.group.WORLD, "cpu")


def dstate(mesh: DeviceMesh, placements: dict[str, list]) -> dict:
    return {
        "model": {k: distribute_tensor(full(k), mesh, p) for k, p in placements.items()},
        "step": 7,
    }


SAVE_1D = {"w": [Shard(0)], "b": [Replicate()], "u": [Shard(0)], "z": [Shard(0)]}
LOAD_1D = {"w": [Shard(1)], "b": [Shard(0)], "u": [Replicate()], "z": [Shard(1)]}


def save_1d(r: Rank, path: str) -> None:
    db.save(dstate(mesh_of(r), SAVE_1D), path, process_group=r.group)


def load_1d(r: Rank, path: str, placements: dict[str, list]) -> list[str]:
    """Loads into zeroed DTensors; every value must be the same object, filled in place."""
    mesh = mesh_of(r)
    template = {
        "model": {
            k: distribute_tensor(torch.zeros(SHAPES[k]), mesh, p) for k, p in placements.items()
        }
    }
    before = {k: v for k, v in template["model"].items()}
    out = db.load(template, path, process_group=r.group)
    assert out["step"] == 7
    for k, v in out["model"].items():
        assert v is before[k], k
        assert torch.equal(v.full_tensor(), full(k)), k
    return sorted(out["model"])


def test_dtensor_reshards_across_world_sizes_and_placements(pool, tmp_path):
    """Shard(0)/Replicate/uneven/empty shards on 2 ranks, loaded as other placements on 3."""
    path = str(tmp_path / "ck")
    pool.run(save_1d, 2, path)
    with open(os.path.join(path, "dcpbridge.json")) as f:
        doc = json.load(f)
    assert set(doc["tensors"]) == {"model.w", "model.b", "model.u", "model.z"}
    chunks = {
        k: [(c["offsets"], c["rank"]) for c in v["chunks"]] for k, v in doc["tensors"].items()
    }
    assert chunks["model.b"] == [([0], 0)]  # replicated: written once, by coordinate 0
    assert chunks["model.u"] == [([0, 0], 0), ([3, 0], 1)]  # uneven: 3 + 2 rows
    assert set(doc["objects"]) == {"step"}
    assert pool.run(load_1d, 3, path, LOAD_1D) == [["b", "u", "w", "z"]] * 3
    # ... and in one plain process, into plain tensors
    template = {"model": {k: torch.zeros(s) for k, s in SHAPES.items()}}
    out = db.load(template, path)
    assert all(torch.equal(out["model"][k], full(k)) for k in SHAPES)
    assert all(out["model"][k] is template["model"][k] for k in SHAPES)


MESH_2D = {
    "w": [Shard(0), Shard(1)],
    "b": [Replicate(), Shard(0)],
    "u": [Shard(0), Shard(0)],
    "z": [Shard(1), Replicate()],
}


def save_2d(r: Rank, path: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    db.save(dstate(mesh, MESH_2D), path)


def test_two_dim_mesh_to_one_dim_and_to_sharded_tensor_templates(pool, tmp_path):
    """FSDP x TP style 2-D placements on 4 ranks; replicas write once; 1-D and plain loads."""
    path = str(tmp_path / "ck")
    pool.run(save_2d, 4, path, default_group=True)
    with open(os.path.join(path, "dcpbridge.json")) as f:
        doc = json.load(f)
    ranks = {k: sorted(c["rank"] for c in v["chunks"]) for k, v in doc["tensors"].items()}
    assert ranks["model.b"] == [0, 1]  # dp replica 0 of each tp shard
    assert ranks["model.w"] == [0, 1, 2, 3]
    assert ranks["model.z"] == [0, 2]  # Shard(1) over dp, written by tp coordinate 0
    assert ranks["model.u"] == [0, 1, 2, 3]  # Shard(0) twice: 4 row blocks
    assert pool.run(load_1d, 2, path, LOAD_1D) == [["b", "u", "w", "z"]] * 2
    # dcpbridge ShardedTensor templates (Megatron style), one process
    tmpl = {
        k: db.ShardedTensor.from_rank_offsets(f"model.{k}", torch.zeros(SHAPES[k])) for k in SHAPES
    }
    out = db.load(tmpl, path)
    assert all(torch.equal(out[k], full(k)) for k in SHAPES)


def test_megatron_style_checkpoint_loads_into_dtensors(pool, tmp_path):
    path = str(tmp_path / "ck")
    sd = {k: db.ShardedTensor.from_rank_offsets(f"model.{k}", full(k)) for k in SHAPES}
    sd["step"] = 7
    db.save(sd, path)
    assert pool.run(load_1d, 3, path, LOAD_1D) == [["b", "u", "w", "z"]] * 3


def save_partial(r: Rank, path: str) -> str:
    mesh = mesh_of(r)
    sd = {"ok": distribute_tensor(full("w"), mesh, [Shard(0)])}
    sd["grad"] = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    with pytest.raises(db.CheckpointError) as e:
        db.save(sd, path, process_group=r.group)
    return str(e.value)


def test_partial_placement_refused_on_every_rank(pool, tmp_path):
    path = str(tmp_path / "ck")
    errors = pool.run(save_partial, 2, path)
    assert errors[0] == errors[1] and "'grad'" in errors[0] and "Partial" in errors[0]
    assert not os.path.exists(path) or not os.listdir(path)


# -- plain DCP with dcpbridge's planners and storage ---------------------------------------------


def dcp_save(r: Rank, path: str, ours: bool) -> None:
    planner = db.ShardedSavePlanner() if ours else None
    writer = db.FsspecCheckpointWriter(path)
    dcp.save(
        dstate(mesh_of(r), SAVE_1D), storage_writer=writer, planner=planner, process_group=r.group
    )


def dcp_load(r: Rank, path: str, ours: bool) -> list[str]:
    mesh = mesh_of(r)
    sd = {
        "model": {
            k: distribute_tensor(torch.zeros(SHAPES[k]), mesh, p) for k, p in LOAD_1D.items()
        },
        "step": 0,
    }
    planner = db.ShardedLoadPlanner() if ours else None
    dcp.load(
        sd, storage_reader=db.FsspecCheckpointReader(path), planner=planner, process_group=r.group
    )
    assert sd["step"] == 7
    for k, v in sd["model"].items():
        assert torch.equal(v.full_tensor(), full(k)), k
    return sorted(sd["model"])


@pytest.mark.parametrize(("save_ours", "load_ours"), [(True, True), (True, False), (False, True)])
def test_plain_dcp_with_dtensors_across_planner_pairs(pool, tmp_path, save_ours, load_ours):
    path = str(tmp_path / "ck")
    pool.run(dcp_save, 2, path, save_ours)
    assert pool.run(dcp_load, 3, path, load_ours) == [["b", "u", "w", "z"]] * 3


# -- refusals: nothing sharded is ever pickled ----------------------------------------------------


class MyTensor(torch.Tensor):
    """A tensor subclass dcpbridge does not know."""


class Sharding:
    """Some other library's sharding metadata."""

    def __init__(self) -> None:
        self.global_shape, self.global_offset, self.local = (4,), (0,), torch.ones(2)


def refuse_on_save(r: Rank, path: str, which: str) -> str:
    mesh = mesh_of(r)
    dt = distribute_tensor(full("w"), mesh, [Shard(0)])
    bad = {
        "subclass": torch.ones(3).as_subclass(MyTensor),
        "metadata": Sharding(),
        "tuple_of_dtensor": (dt, 1),
        "object_holding_dtensor": db.ShardedObject("obj", {"t": dt}, (1,), (0,)),
    }[which]
    with pytest.raises(db.SerializationError) as e:
        db.save({"fine": torch.ones(2), "cfg": {"bad": bad}}, path, process_group=r.group)
    return str(e.value)


@pytest.mark.parametrize(
    ("which", "named"),
    [
        ("subclass", "'cfg.bad'"),
        ("metadata", "'cfg.bad'"),
        ("tuple_of_dtensor", "'cfg.bad'"),
        ("object_holding_dtensor", "'obj/shard_0_1'"),
    ],
)
def test_sharded_values_are_refused_not_pickled(pool, tmp_path, which, named):
    path = str(tmp_path / "ck")
    errors = pool.run(refuse_on_save, 2, path, which)
    assert errors[0] == errors[1] and named in errors[0]
    assert not os.path.exists(path) or not os.listdir(path)


# -- torch.distributed._shard ShardedTensor -------------------------------------------------------


def torch_sharded(r: Rank, key: str, dim: int, fill: bool) -> torch.Tensor:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as TShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards

    shape = SHAPES[key]
    n = shape[dim] // r.size
    offsets = [0] * len(shape)
    offsets[dim] = r.rank * n
    sizes = list(shape)
    sizes[dim] = n
    value = full(key)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()
    local = value if fill else torch.zeros(sizes)
    md = ShardMetadata(offsets, sizes, f"rank:{r.rank}/cpu")
    return init_from_local_shards([TShard(local, md)], list(shape), process_group=r.group)


def save_torch_sharded(r: Rank, path: str) -> None:
    db.save({"w": torch_sharded(r, "w", 0, True)}, path, process_group=r.group)


def load_torch_sharded(r: Rank, path: str) -> bool:
    st = torch_sharded(r, "w", 1, False)
    out = db.load({"w": st}, path, process_group=r.group)
    assert out["w"] is st
    shard = st.local_shards()[0]
    o = shard.metadata.shard_offsets
    s = shard.metadata.shard_sizes
    expected = full("w")[o[0] : o[0] + s[0], o[1] : o[1] + s[1]]
    return torch.equal(shard.tensor, expected)


def test_torch_sharded_tensor_row_to_column_and_plain(pool, tmp_path):
    path = str(tmp_path / "ck")
    pool.run(save_torch_sharded, 2, path)
    assert pool.run(load_torch_sharded, 2, path) == [True, True]
    out = db.load({"w": torch.zeros(SHAPES["w"])}, path)
    assert torch.equal(out["w"], full("w"))


# -- fully parallel and async saves of DTensors ---------------------------------------------------


def save_replicated_fully_parallel(r: Rank, path: str, use_async: bool) -> None:
    """Data-parallel replicas (Replicate on the mesh): each tensor written once, spread."""
    state = dstate(mesh_of(r), {k: [Replicate()] for k in SHAPES})
    if use_async:
        handle = db.async_save(state, path, process_group=r.group, fully_parallel=True)
        for v in state["model"].values():
            v.to_local().add_(1)  # training goes on: the staged copy is what gets written
        handle.result(timeout=60)
    else:
        db.save(state, path, process_group=r.group, fully_parallel=True)


@pytest.mark.parametrize("use_async", [False, True])
def test_replicated_dtensors_fully_parallel_and_async(pool, tmp_path, use_async):
    path = str(tmp_path / "ck")
    pool.run(save_replicated_fully_parallel, 2, path, use_async)
    with open(os.path.join(path, "dcpbridge.json")) as f:
        doc = json.load(f)
    writers = {k: [c["rank"] for c in v["chunks"]] for k, v in doc["tensors"].items()}
    assert all(len(w) == 1 for w in writers.values())  # exactly once
    assert {w[0] for w in writers.values()} == {0, 1}  # spread over both replicas
    out = db.load({"model": {k: torch.zeros(s) for k, s in SHAPES.items()}}, path)
    assert all(torch.equal(out["model"][k], full(k)) for k in SHAPES)


def save_colliding_stages(r: Rank, path: str, fully_parallel: bool) -> str:
    """Two pipeline stages whose tensor-parallel DTensors share a key but not their values:
    each stage's ranks are main replicas of their boxes, so the save cannot pick one."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage = mesh.get_coordinate()[0]
    w = distribute_tensor(full("w") + 100 * stage, mesh["tp"], [Shard(0)], src_data_rank=None)
    with pytest.raises(db.ShardingValidationError) as e:
        db.save({"w": w}, path, fully_parallel=fully_parallel)
    return str(e.value)


@pytest.mark.parametrize("fully_parallel", [False, True])
def test_two_main_replicas_of_one_box_refused(pool, tmp_path, fully_parallel):
    """With fully_parallel, one stage's values were written and the other's silently lost."""
    path = str(tmp_path / "ck")
    errors = pool.run(save_colliding_stages, 4, path, fully_parallel, default_group=True)
    assert len(set(errors)) == 1 and "'w'" in errors[0] and "replica" in errors[0]
    assert not os.path.exists(path) or not os.listdir(path)


def save_tp_under_ddp(r: Rank, path: str) -> list[str]:
    """Tensor parallelism under DDP: each data-parallel replica holds its DTensors on its own
    tp mesh, so every replica looks like the main one. With fully_parallel the copies are
    checked equal at every save and written once; a copy that diverged fails the save."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_coordinate()[0]

    def state(scale: float, drift: float = 0.0) -> dict:
        w = full("w") * scale + drift * dp
        return {"w": distribute_tensor(w, mesh["tp"], [Shard(0)], src_data_rank=None)}

    db.save(state(1.0), path + "/1", fully_parallel=True)
    db.save(state(2.0), path + "/2", fully_parallel=True)  # the cached plan: checked again
    with pytest.raises(db.ShardingValidationError) as e:
        db.save(state(3.0, drift=1.0), path + "/3", fully_parallel=True)
    return [str(e.value)]


def test_tensor_parallel_under_ddp_saves_its_equal_copies_once(pool, tmp_path):
    path = str(tmp_path)
    errors = pool.run(save_tp_under_ddp, 4, path, default_group=True)
    assert len({e[0] for e in errors}) == 1 and "with different values" in errors[0][0]
    assert "'w' at offset (0, 0)" in errors[0][0] and "'w' at offset" in errors[0][0]
    for step, scale in (("1", 1.0), ("2", 2.0)):
        doc = json.loads((tmp_path / step / "dcpbridge.json").read_bytes())
        assert len(doc["tensors"]["w"]["chunks"]) == 2  # each tp box once, not once per copy
        out = db.load({"w": torch.zeros(SHAPES["w"])}, str(tmp_path / step))
        assert torch.equal(out["w"], full("w") * scale)
    assert not (tmp_path / "3").exists() or not os.listdir(tmp_path / "3")


# -- Megatron-Core's own objects, recognised by their fields ----------------------------------------


def megatron_objects(r: Rank, path: str) -> None:
    """In a pool worker: importing megatron.core registers safe globals process-wide."""
    tmp_path = Path(path)
    from megatron.core.dist_checkpointing import mapping as mm

    w, b = full("w"), full("b")

    def build(key, data, replica_id, flattened_range=None):
        return {
            "top": mm.ShardedTensor.from_rank_offsets(
                f"{key}.top", data[:3], replica_id=replica_id
            ),
            "bot": mm.ShardedTensor.from_rank_offsets(
                f"{key}.bot", data[3:], replica_id=replica_id
            ),
        }

    def state(wd, bd, obj):
        return {
            "w": mm.ShardedTensor.from_rank_offsets("w", wd, (0, 0, 1)),
            "f": mm.ShardedTensorFactory(
                "fac", bd.reshape(8, 1)[:6], build, lambda d: torch.cat([d["top"], d["bot"]])
            ),
            "o": mm.ShardedObject("rng", obj, (1,), (0,)),
            "np": mm.LocalNonpersistentObject("kept"),
            "it": 5,
        }

    db.save(state(w, b, {"seed": 1}), tmp_path, process_group=r.group)
    with open(os.path.join(tmp_path, "dcpbridge.json")) as f:
        doc = json.load(f)
    assert set(doc["tensors"]) == {"w", "fac.top", "fac.bot"}  # stored as tensors, not pickled
    assert set(doc["objects"]) == {"rng/shard_0_1", "it"}
    out = db.load(state(torch.zeros(6, 8), torch.zeros(8), None), tmp_path, process_group=r.group)
    assert torch.equal(out["w"], w) and torch.equal(out["f"], b.reshape(8, 1)[:6])
    assert out["o"] == {"seed": 1} and out["np"] == "kept" and out["it"] == 5
    flat = mm.ShardedTensor.from_rank_offsets("flat", torch.zeros(4))
    flat.flattened_range = slice(0, 2)
    with pytest.raises(db.CheckpointError, match=r"'flat'.*flattened_range"):
        db.save({"x": flat}, tmp_path / "flat", process_group=r.group)


@pytest.mark.interop
def test_megatron_cores_own_objects_save_and_load(pool, tmp_path):
    pool.run(megatron_objects, 1, str(tmp_path))


# -- CUDA ---------------------------------------------------------------------------------------


def cuda_dtensors(r: Rank, path: str) -> bool:
    torch.cuda.set_device(0)
    mesh = DeviceMesh.from_group(r.group or dist.group.WORLD, "cpu")
    state = {k: distribute_tensor(full(k), mesh, [Shard(0)]) for k in SHAPES}
    state = {
        k: DTensor.from_local(
            v.to_local().cuda(), mesh, v.placements, shape=v.shape, stride=v.stride()
        )
        for k, v in state.items()
    }
    db.save(state, path, process_group=r.group)
    tmpl = {
        k: DTensor.from_local(
            torch.zeros_like(v.to_local()), mesh, [Shard(0)], shape=v.shape, stride=v.stride()
        )
        for k, v in state.items()
    }
    db.load(tmpl, path, process_group=r.group)
    return all(torch.equal(tmpl[k].to_local(), state[k].to_local()) for k in SHAPES)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dtensors_save_and_load(pool, tmp_path):
    assert pool.run(cuda_dtensors, 1, str(tmp_path / "ck")) == [True]


# -- FSDP2 on top of tensor parallelism: strided sharding ---------------------------------------


def fsdp_over_tp(seed: int) -> torch.nn.Module:
    """FSDP2 over TP on a (dp, tp) mesh: colwise gives strided rows; rowwise with one input
    column leaves tp rank 1 no column, where FSDP2 reports its empty shard as (0, 0)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Linear(1, 3))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def fsdp_over_tp_full(seed: int) -> dict[str, torch.Tensor]:
    """The global values ``fsdp_over_tp(seed)`` starts from (full_tensor hangs on empty shards)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Linear(1, 3))
    return {k: v.detach() for k, v in model.state_dict().items()}


def local_box(full_value: torch.Tensor, dt: DTensor) -> torch.Tensor:
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return full_value[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def save_fsdp_over_tp(r: Rank, path: str) -> list[str]:
    model = fsdp_over_tp(0)
    placements = [type(p).__name__ for p in model[0].weight.placements]
    db.save({"model": model.state_dict()}, path)
    loaded = fsdp_over_tp(1)  # other values; filled in place, strided shards included
    db.load({"model": loaded.state_dict()}, path)
    full = fsdp_over_tp_full(0)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v.to_local().reshape(-1), local_box(full[k], v).reshape(-1)), k
    return placements


def test_fsdp2_over_tensor_parallel_strided_and_empty_shards(pool, tmp_path):
    path = str(tmp_path / "ck")
    results = pool.run(save_fsdp_over_tp, 4, path, default_group=True)
    assert results[0] == ["_StridedShard", "Shard"]
    full = fsdp_over_tp_full(0)
    out = db.load({"model": {k: torch.zeros_like(v) for k, v in full.items()}}, path)
    assert all(torch.equal(out["model"][k], v) for k, v in full.items())


def strided_not_one_block(r: Rank, path: str, save: bool) -> str:
    """``_StridedShard(0, split_factor=2)`` alone gives rank 0 rows [0, 1, 3, 4] of 6: no box
    holds them (torch reports rows 0-3), so a load filled them with rows 0-3."""
    from torch.distributed.tensor.placement_types import _StridedShard

    dt = distribute_tensor(
        full("w").clone() if save else torch.zeros(SHAPES["w"]),
        mesh_of(r),
        [_StridedShard(0, split_factor=2)],
        src_data_rank=None,
    )
    call = db.save if save else db.load
    with pytest.raises(db.SerializationError) as e:
        call({"w": dt}, path + "-again" if save else path, process_group=r.group)
    assert save or not dt.to_local().any()  # the template is left as it was
    return str(e.value)


@pytest.mark.parametrize("save", [False, True])
def test_strided_shards_of_several_blocks_refused_not_misplaced(pool, tmp_path, save):
    path = str(tmp_path / "ck")
    db.save({"w": full("w")}, path)
    errors = pool.run(strided_not_one_block, 2, path, save)
    assert errors[0] == errors[1] and "'w'" in errors[0] and "not one block" in errors[0]
    assert not os.path.exists(path + "-again") or not os.listdir(path + "-again")


# -- torch's own DCP writer, and torch ShardedTensor <-> DTensor --------------------------------


def save_with_torch_writer(r: Rank, path: str) -> None:
    dcp.save(
        dstate(mesh_of(r), SAVE_1D),
        storage_writer=dcp.FileSystemWriter(path),
        process_group=r.group,
    )


def load_dtensors_pickled_metadata(r: Rank, path: str) -> list[str]:
    """torch's pickled ``.metadata`` is read without ``allow_pickle`` (DCP's classes only)."""
    mesh = mesh_of(r)
    template = {
        "model": {k: distribute_tensor(torch.zeros(SHAPES[k]), mesh, p) for k, p in LOAD_1D.items()}
    }
    out = db.load(template, path, process_group=r.group)
    assert "step" not in out  # plain DCP records no common state: only what was asked
    return [k for k, v in out["model"].items() if torch.equal(v.full_tensor(), full(k))]


def test_torch_filesystem_writer_checkpoint_loads_into_dtensors(pool, tmp_path):
    path = str(tmp_path / "ck")
    pool.run(save_with_torch_writer, 2, path)
    assert pool.run(load_dtensors_pickled_metadata, 3, path) == [["w", "b", "u", "z"]] * 3


def load_torch_sharded_as_dtensor(r: Rank, path: str) -> bool:
    dt = distribute_tensor(torch.zeros(SHAPES["w"]), mesh_of(r), [Shard(1)])
    db.load({"w": dt}, path, process_group=r.group)
    return torch.equal(dt.full_tensor(), full("w"))


def test_torch_sharded_tensor_checkpoint_loads_into_dtensors(pool, tmp_path):
    path = str(tmp_path / "ck")
    pool.run(save_torch_sharded, 2, path)
    assert pool.run(load_torch_sharded_as_dtensor, 3, path) == [True] * 3


# -- bad input to save: refused on every rank, nothing written ------------------------------------


def save_bad_input(r: Rank, path: str, case: str) -> str:
    w = db.ShardedTensor.from_rank_offsets(
        "w", full("w")[3 * r.rank : 3 * r.rank + 3].clone(), (0, r.rank, 2)
    )
    sd: dict = {"w": w}
    if case == "reshaped data" and r.rank == 1:
        w.data = w.data.reshape(8, 3)  # same element count, another shape
    elif case == "dtype" and r.rank == 1:
        w.data = w.data.double()
    elif case == "NUL in key":
        sd["bad\x00key"] = torch.ones(1)
    elif case == "empty key":
        sd[""] = torch.ones(1)
    elif case == "duplicate chunk" and r.rank == 0:
        sd["again"] = db.ShardedTensor.from_rank_offsets("w", w.data.clone(), (0, 0, 2))
    with pytest.raises(db.CheckpointError) as e:
        db.save(sd, path, process_group=r.group)
    return str(e.value)


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("reshaped data", "'w': data is torch.float32 of shape (8, 3), declared"),
        ("dtype", "'w': data is torch.float64"),
        ("NUL in key", "NUL or control characters"),
        ("empty key", "non-empty string"),
        ("duplicate chunk", "'w': this rank saves the chunk at [0, 0] twice"),
    ],
)
def test_bad_input_refused_on_every_rank_nothing_written(pool, tmp_path, case, named):
    path = str(tmp_path / "ck")
    errors = pool.run(save_bad_input, 2, path, case)
    assert all(named in e for e in errors), errors
    assert not os.path.exists(path) or not os.listdir(path)


# -- load templates whose local tensor cannot hold the stored values -------------------------------


def load_into_overlapping_local(r: Rank, path: str) -> str:
    """Rank r's rows of ``w`` as a (3, 8) ``as_strided`` view of strides (1, 1): its elements
    meet, so the stored rows landed over each other (wrong values, no error)."""
    memory = torch.zeros(10)
    local = memory.as_strided((3, 8), (1, 1))
    dt = DTensor.from_local(
        local, mesh_of(r), [Shard(0)], run_check=False, shape=(6, 8), stride=(8, 1)
    )
    with pytest.raises(db.InvalidRequestError) as e:
        db.load({"w": dt}, path, process_group=r.group)
    assert not memory.any()  # nothing was read into it
    return str(e.value)


def test_dtensor_whose_local_elements_overlap_refused(pool, tmp_path):
    path = str(tmp_path / "ck")
    db.save({"w": full("w")}, path)
    errors = pool.run(load_into_overlapping_local, 2, path)
    assert all("'w'" in e and "sharing memory" in e for e in errors), errors


# -- a process whose rank changes (in-process restart) -------------------------------------------


def save_before_and_after_reranking(r: Rank, path: str, port: int) -> list[Any]:
    """Saves on a 1-D mesh, then the job restarts in process (a new default group, ranks
    reversed, as in-process restarts reassign them) and saves its new mesh, equal to the old
    one as torch compares meshes: the box of this process's old rank was reused."""
    from datetime import timedelta

    value = torch.arange(32.0).reshape(8, 4)
    mesh = init_device_mesh("cpu", (r.size,))
    db.save({"w": distribute_tensor(value, mesh, [Shard(0)], src_data_rank=None)}, path + "/a")
    dist.destroy_process_group()
    new_rank = r.size - 1 - r.rank
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=new_rank,
        world_size=r.size,
        timeout=timedelta(seconds=60),
    )
    again = init_device_mesh("cpu", (r.size,))
    assert again == mesh and tuple(again.get_coordinate()) == (new_rank,)
    w = distribute_tensor(value, again, [Shard(0)], src_data_rank=None)
    db.save({"w": w}, path + "/b")
    template = distribute_tensor(torch.zeros(8, 4), again, [Shard(0)], src_data_rank=None)
    db.load({"w": template}, path + "/a")
    return [new_rank, torch.equal(template.to_local(), w.to_local())]


def test_rank_reassigned_in_process_saves_and_loads_its_new_box(pool, tmp_path):
    from tests.support.s3_server import free_port

    path = str(tmp_path / "ck")
    try:
        ranks = pool.run(
            save_before_and_after_reranking, pool.size, path, free_port(), default_group=True
        )
    finally:
        pool.kill()  # its ranks' groups are gone: the next test starts a fresh pool
    value = torch.arange(32.0).reshape(8, 4)
    for name in ("a", "b"):  # b held the rows of each process's old rank: reversed, silently
        assert torch.equal(db.load({"w": torch.zeros(8, 4)}, f"{path}/{name}")["w"], value)
    assert ranks == [[pool.size - 1 - r, True] for r in range(pool.size)]  # loaded its new box


# -- DTensors whose placements do not fit their mesh or shape ---------------------------------------


def malformed_dtensor(r: Rank, path: str, case: str, save: bool) -> str:
    """``DTensor.from_local(..., run_check=False)`` takes any placements; those torch cannot
    place raised a bare IndexError (no key, not a CheckpointError) from torch's box maths."""
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = {
        "dim beyond the tensor": [Shard(2)],
        "strided dim beyond the tensor": [_StridedShard(3, split_factor=2)],
        "more placements than mesh dims": [Shard(0), Shard(1)],
    }[case]
    local = full("w")[3 * r.rank : 3 * r.rank + 3].clone() if save else torch.zeros(3, 8)
    dt = DTensor.from_local(
        local, mesh_of(r), placements, run_check=False, shape=(6, 8), stride=(8, 1)
    )
    call = db.save if save else db.load
    with pytest.raises(db.SerializationError) as e:
        call({"w": dt}, path + "-again" if save else path, process_group=r.group)
    assert save or not local.any()
    return str(e.value)


@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize(
    "case",
    ["dim beyond the tensor", "strided dim beyond the tensor", "more placements than mesh dims"],
)
def test_placements_that_do_not_fit_refused_naming_the_key(pool, tmp_path, case, save):
    path = str(tmp_path / "ck")
    db.save({"w": full("w")}, path)
    errors = pool.run(malformed_dtensor, 2, path, case, save)
    assert errors[0] == errors[1] and "'w'" in errors[0] and "placements" in errors[0], errors
    assert not os.path.exists(path + "-again") or not os.listdir(path + "-again")


# -- tensors whose memory was freed (storage resized to 0 bytes, as FSDP frees parameters) -----------


def freed_memory(r: Rank, path: str, kind: str, save: bool) -> str:
    """The tensor keeps its shape, its storage holds 0 bytes: reading or filling it at its
    address crashed the rank (SIGSEGV) instead of raising."""
    local = full("w")[3 * r.rank : 3 * r.rank + 3].clone() if save else torch.zeros(3, 8)
    local.untyped_storage().resize_(0)
    if kind == "dtensor":
        value: torch.Tensor = DTensor.from_local(
            local, mesh_of(r), [Shard(0)], run_check=False, shape=(6, 8), stride=(8, 1)
        )
    else:
        value = local
    call = db.save if save else db.load
    with pytest.raises(db.SerializationError) as e:
        call({"w": value}, path + "-again" if save else path, process_group=r.group)
    return str(e.value)


@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("kind", ["dtensor", "plain"])
def test_tensor_with_freed_storage_refused_not_crashing(pool, tmp_path, kind, save):
    path = str(tmp_path / "ck")
    db.save({"w": full("w")}, path)
    errors = pool.run(freed_memory, 2, path, kind, save)
    assert all("'w'" in e and "storage holds 0 bytes" in e for e in errors), errors
    assert not os.path.exists(path + "-again") or not os.listdir(path + "-again")


def save_freed_sharded_tensor(r: Rank, path: str, use_async: bool) -> str:
    """A Megatron-style ShardedTensor whose data's storage is freed after a first save: the
    async save (its plan cached) crashed the rank staging it, the sync one raised a bare
    RuntimeError from the writer."""
    data = full("w")[3 * r.rank : 3 * r.rank + 3].clone()
    sd = {"w": db.ShardedTensor.from_rank_offsets("w", data, (0, r.rank, r.size))}
    db.save(sd, path + "/1", process_group=r.group)
    data.untyped_storage().resize_(0)

    def again() -> None:
        if use_async:
            db.async_save(sd, path + "/2", process_group=r.group).result(timeout=60)
        else:
            db.save(sd, path + "/2", process_group=r.group)

    with pytest.raises(db.SerializationError) as e:
        again()
    return str(e.value)


@pytest.mark.parametrize("use_async", [False, True])
def test_sharded_tensor_with_freed_storage_refused_not_crashing(pool, tmp_path, use_async):
    path = str(tmp_path / "ck")
    errors = pool.run(save_freed_sharded_tensor, 2, path, use_async)
    assert all("'w'" in e and "storage holds 0 bytes" in e for e in errors), errors
    assert not os.path.exists(path + "/2") or not os.listdir(path + "/2")


def load_into_freed_sharded_tensor(r: Rank, path: str) -> str:
    """A ShardedTensor template whose data's storage was freed: filling a small one crashed
    the rank (SIGSEGV), a large one raised a StorageError blaming the data file."""
    data = torch.zeros(3, 8)
    data.untyped_storage().resize_(0)
    sd = {"w": db.ShardedTensor.from_rank_offsets("w", data, (0, r.rank, r.size))}
    with pytest.raises(db.SerializationError) as e:
        db.load(sd, path, process_group=r.group)
    return str(e.value)


def test_sharded_tensor_template_with_freed_storage_refused(pool, tmp_path):
    path = str(tmp_path / "ck")
    db.save({"w": db.ShardedTensor.from_rank_offsets("w", full("w"))}, path)
    errors = pool.run(load_into_freed_sharded_tensor, 2, path)
    assert all("'w'" in e and "storage holds 0 bytes" in e for e in errors), errors
