"""PyTorch's own DCP checkpoint scenarios, run with torch's and dcpbridge's planners, either way round.

Every scenario saves with one planner pair and loads with the same or the other pair (the
cross-planner matrix), always over dcpbridge's ``FsspecCheckpointWriter``/``Reader``, on gloo.
"""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dcpbridge as db
from tests.support.dist_pool import Rank

# (save planners, load planners): each pair alone, and each one reading the other's checkpoint.
PAIRS = [
    pytest.param("torch", "torch", id="torch"),
    pytest.param("dcpbridge", "dcpbridge", id="dcpbridge"),
    pytest.param("torch", "dcpbridge", id="torch-to-dcpbridge"),
    pytest.param("dcpbridge", "torch", id="dcpbridge-to-torch"),
]
planner_pairs = pytest.mark.parametrize(("save_with", "load_with"), PAIRS)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is .*assuming:UserWarning")


def save_planner(kind: str) -> Any:
    """A fresh save planner of ``kind`` ("torch" or "dcpbridge")."""
    return DefaultSavePlanner() if kind == "torch" else db.ShardedSavePlanner()


def load_planner(kind: str) -> Any:
    """A fresh load planner of ``kind`` ("torch" or "dcpbridge")."""
    return DefaultLoadPlanner() if kind == "torch" else db.ShardedLoadPlanner()


def save(state: dict, path: str, kind: str, group: Any = None, **kw: Any) -> None:
    """``dcp.save`` through dcpbridge's writer with the planner of ``kind``."""
    writer = db.FsspecCheckpointWriter(path)
    dcp.save(state, storage_writer=writer, planner=save_planner(kind), process_group=group, **kw)


def load(state: dict, path: str, kind: str, group: Any = None, **kw: Any) -> None:
    """``dcp.load`` through dcpbridge's reader with the planner of ``kind``."""
    reader = db.FsspecCheckpointReader(path)
    dcp.load(state, storage_reader=reader, planner=load_planner(kind), process_group=group, **kw)


def stored(path: str) -> dict[str, str]:
    """Every stored key of a checkpoint and whether it is a tensor or bytes."""
    md = db.FsspecCheckpointReader(path).read_metadata()
    return {
        k: "tensor" if hasattr(v, "chunks") else "bytes" for k, v in md.state_dict_metadata.items()
    }


def value(shape: tuple[int, ...], salt: int = 0) -> torch.Tensor:
    """A tensor whose every element differs (so misplaced bytes show), offset by ``salt``."""
    n = math.prod(shape)
    return (torch.arange(n, dtype=torch.float32).reshape(shape) + 1 + 1000 * salt) / 8


def box(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


def world_kw(n: int) -> dict[str, Any]:
    """pool.run keywords: 4 ranks run in the default group (2-D meshes need it)."""
    return {"default_group": n == 4}


# -- plain tensors and objects on the file system ------------------------------------------------


def plain_state(salt: int) -> dict[str, Any]:
    v = value((4, 5), salt)
    return {
        "w": v,
        "wt": value((5, 6), salt).t(),  # not contiguous, saved and filled as a view
        "nested": {"b": value((7,), salt), "pair": [value((2, 2), salt), value((3,), salt)]},
        "i64": torch.arange(6, dtype=torch.int64) * (salt + 1),
        "bf16": v.to(torch.bfloat16),
        "f64": v.double() / 3,
        "c64": torch.complex(v, -v),
        "i8": (v * 8).to(torch.int8),
        "flags": (v * 8).to(torch.int64) % 3 == salt,
        "scalar": torch.tensor(3.5 + salt),
        "empty": torch.zeros(0, 3),
        "epoch": 3 + salt,
        "cfg": {"name": f"run{salt}", "betas": (0.9, 0.95)},
    }


PLAIN_TENSORS = ["w", "wt", "nested.b", "nested.pair.0", "nested.pair.1", "i64", "bf16", "f64"]
PLAIN_TENSORS += ["c64", "i8", "flags", "scalar", "empty"]
PLAIN_KEYS = {k: "tensor" for k in PLAIN_TENSORS} | {
    "epoch": "bytes",
    "cfg.name": "bytes",
    "cfg.betas": "bytes",
}


def at(sd: dict[str, Any], key: str) -> Any:
    """The value at DCP key ``key`` of ``sd`` (dict keys and list indices joined by dots)."""
    node: Any = sd
    for part in key.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def save_plain(r: Rank, path: str, kind: str) -> None:
    save(plain_state(0), path, kind, r.group)


def load_plain(r: Rank, path: str, kind: str) -> bool:
    """Tensors are filled in place, objects replaced; every value equals what was saved."""
    sd = plain_state(1)
    before = {k: at(sd, k) for k in PLAIN_TENSORS}
    load(sd, path, kind, r.group)
    want = plain_state(0)
    for k in PLAIN_TENSORS:
        got, exp = at(sd, k), at(want, k)
        assert got is before[k], k
        assert got.dtype == exp.dtype and got.shape == exp.shape and torch.equal(got, exp), k
    assert not sd["wt"].is_contiguous()
    assert sd["epoch"] == 3 and sd["cfg"] == {"name": "run0", "betas": (0.9, 0.95)}
    return True


@planner_pairs
def test_plain_tensors_and_objects(pool, tmp_path, save_with, load_with):
    """Plain tensors (several dtypes, nested, in lists) and objects, 2 ranks to 2 and 1."""
    path = str(tmp_path / "ck")
    pool.run(save_plain, 2, path, save_with)
    assert stored(path) == PLAIN_KEYS
    assert pool.run(load_plain, 2, path, load_with) == [True, True]
    assert pool.run(load_plain, 1, path, load_with) == [True]


# -- Stateful objects holding bytes and io.BytesIO -------------------------------------------------


class TrainState(Stateful):
    """Training progress as DCP's e2e test keeps it: a step, losses in a BytesIO, raw bytes."""

    def __init__(self, step: int = 0, losses: list[float] | None = None, tag: bytes = b"") -> None:
        self.step, self.losses, self.tag = step, list(losses or []), tag
        self.loaded = False

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.losses, buf)
        buf.seek(0)
        return {"step": torch.tensor(self.step), "losses": buf, "tag": self.tag}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"].item())
        buf = state_dict["losses"]
        buf.seek(0)
        self.losses = torch.load(buf)
        self.tag = state_dict["tag"]
        self.loaded = True


class Blob(Stateful):
    """A Stateful whose whole state is one ``io.BytesIO``."""

    def __init__(self, data: bytes = b"") -> None:
        self.data = data

    def state_dict(self) -> dict[str, Any]:
        return {"blob": io.BytesIO(self.data)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.data = state_dict["blob"].getvalue()


class RecordingDict(dict):
    """A state dict that records whether DCP assigned any of its top-level entries."""

    assigned = False

    def __setitem__(self, key: Any, item: Any) -> None:
        self.assigned = True
        super().__setitem__(key, item)


BLOB = bytes(range(256)) * 3


def save_stateful(r: Rank, path: str, kind: str) -> None:
    sd = RecordingDict(
        train=TrainState(5, [2.5, 1.25, 0.625], b"\x00\xffckpt"),
        blob=Blob(BLOB),
        extra={"t": value((3, 3)), "ints": [1, 2, 3, 4]},
    )
    save(sd, path, kind, r.group)


def load_stateful(r: Rank, path: str, kind: str) -> bool:
    """Stateful values are loaded through load_state_dict and stay; others are replaced."""
    train, blob = TrainState(), Blob(b"old")
    sd = RecordingDict(train=train, blob=blob)
    load(sd, path, kind, r.group)
    assert not sd.assigned and sd["train"] is train and sd["blob"] is blob
    assert train.loaded and (train.step, train.losses, train.tag) == (
        5,
        [2.5, 1.25, 0.625],
        b"\x00\xffckpt",
    )
    assert blob.data == BLOB
    plain = RecordingDict(extra={"t": torch.zeros(3, 3), "ints": []})
    plain.assigned = False
    load(plain, path, kind, r.group)
    assert plain.assigned and plain["extra"]["ints"] == [1, 2, 3, 4]
    assert torch.equal(plain["extra"]["t"], value((3, 3)))
    return True


@planner_pairs
def test_stateful_bytes_and_bytesio(pool, tmp_path, save_with, load_with):
    """Stateful values with bytes and io.BytesIO; stateful and non-stateful loads, 2 ranks."""
    path = str(tmp_path / "ck")
    pool.run(save_stateful, 2, path, save_with)
    assert stored(path) == {
        "train.step": "tensor",
        "train.losses": "bytes",
        "train.tag": "bytes",
        "blob.blob": "bytes",
        "extra.t": "tensor",
        "extra.ints": "bytes",
    }
    assert pool.run(load_stateful, 2, path, load_with) == [True, True]


# -- torch.distributed._shard ShardedTensor ------------------------------------------------------

ST_SHAPE = (6, 8)
# Plans: per rank, the boxes (offsets, sizes) of its local shards.
ROWS = [[((0, 0), (3, 8))], [((3, 0), (3, 8))]]
ROWS_SWAPPED = [ROWS[1], ROWS[0]]
ROWS_UNEVEN = [[((0, 0), (1, 8))], [((1, 0), (5, 8))]]
COLS = [[((0, 2 * i), (6, 2))] for i in range(4)]
BLOCKS = [  # two shards per rank, a checkerboard of 3 x 4 blocks
    [((0, 0), (3, 4)), ((3, 4), (3, 4))],
    [((0, 4), (3, 4)), ((3, 0), (3, 4))],
]


def torch_st(r: Rank, plan: list, fill: bool) -> Any:
    """A torch ShardedTensor of ST_SHAPE; rank i holds ``plan[i]`` (the value, or zeros)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as TorchShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards

    shards = []
    for offsets, sizes in plan[r.rank]:
        local = box(value(ST_SHAPE), offsets, sizes).clone() if fill else torch.zeros(sizes)
        md = ShardMetadata(list(offsets), list(sizes), f"rank:{r.rank}/cpu")
        shards.append(TorchShard(local, md))
    return init_from_local_shards(shards, list(ST_SHAPE), process_group=r.group)


def save_st(r: Rank, path: str, kind: str, plan: list) -> None:
    save({"st": torch_st(r, plan, True), "step": 4}, path, kind, r.group)


def load_st(r: Rank, path: str, kind: str, plan: list) -> bool:
    st = torch_st(r, plan, False)
    sd = {"st": st, "step": 0}
    load(sd, path, kind, r.group)
    assert sd["st"] is st and sd["step"] == 4
    shards = st.local_shards()
    assert len(shards) == len(plan[r.rank])
    return all(
        torch.equal(
            s.tensor, box(value(ST_SHAPE), s.metadata.shard_offsets, s.metadata.shard_sizes)
        )
        for s in shards
    )


@planner_pairs
def test_torch_sharded_tensor_plans(pool, tmp_path, save_with, load_with):
    """Same plan, swapped, uneven and multi-shard plans, row-wise to column-wise, to plain."""
    path = str(tmp_path / "ck")
    pool.run(save_st, 2, path, save_with, ROWS)
    assert stored(path) == {"st": "tensor", "step": "bytes"}
    assert pool.run(load_st, 2, path, load_with, ROWS) == [True, True]
    assert pool.run(load_st, 2, path, load_with, ROWS_SWAPPED) == [True, True]
    assert pool.run(load_st, 2, path, load_with, ROWS_UNEVEN) == [True, True]
    assert pool.run(load_st, 2, path, load_with, BLOCKS) == [True, True]
    assert pool.run(load_st, 4, path, load_with, COLS, **world_kw(4)) == [True] * 4
    sd = {"st": torch.zeros(ST_SHAPE), "step": 0}
    load(sd, path, load_with)  # one process, no process group
    assert torch.equal(sd["st"], value(ST_SHAPE)) and sd["step"] == 4


@planner_pairs
def test_torch_sharded_tensor_two_shards_per_rank(pool, tmp_path, save_with, load_with):
    """A checkerboard plan (two local shards per rank) saved, then loaded by rows and whole."""
    path = str(tmp_path / "ck")
    pool.run(save_st, 2, path, save_with, BLOCKS)
    md = db.FsspecCheckpointReader(path).read_metadata().state_dict_metadata["st"]
    assert sorted(tuple(c.offsets) for c in md.chunks) == [(0, 0), (0, 4), (3, 0), (3, 4)]
    assert pool.run(load_st, 2, path, load_with, ROWS) == [True, True]
    sd = {"st": torch.zeros(ST_SHAPE), "step": 0}
    load(sd, path, load_with)
    assert torch.equal(sd["st"], value(ST_SHAPE)) and sd["step"] == 4


@planner_pairs
def test_plain_tensor_to_torch_sharded_tensor(pool, tmp_path, save_with, load_with):
    """A plain tensor saved by one process loads into column-wise ShardedTensors on 4 ranks."""
    path = str(tmp_path / "ck")
    save({"st": value(ST_SHAPE), "step": 4}, path, save_with)
    assert stored(path) == {"st": "tensor", "step": "bytes"}
    assert pool.run(load_st, 4, path, load_with, COLS, **world_kw(4)) == [True] * 4


# -- DTensor resharding: placements and meshes ---------------------------------------------------

# w divides evenly, u does not, e is so small that 4-way splits leave ranks empty.
DT_SHAPES = {"w": (8, 4), "u": (5, 3), "e": (3, 2)}


def dt_value(key: str) -> torch.Tensor:
    return value(DT_SHAPES[key], sorted(DT_SHAPES).index(key))


def mesh_for(r: Rank, dims: tuple[int, ...]) -> DeviceMesh:
    """A 1-D mesh over the test's ranks, or a 2-D mesh over all 4."""
    if len(dims) == 2:
        return init_device_mesh("cpu", dims)
    return DeviceMesh.from_group(r.group or dist.group.WORLD, "cpu")


def save_dt(r: Rank, path: str, kind: str, dims: tuple[int, ...], placements: dict) -> None:
    mesh = mesh_for(r, dims)
    model = {k: distribute_tensor(dt_value(k), mesh, p) for k, p in placements.items()}
    save({"model": model, "step": 9}, path, kind, r.group)


def load_dt(r: Rank, path: str, kind: str, dims: tuple[int, ...], placements: dict) -> list:
    """Fills zeroed DTensors in place; returns, per key, the local shard's shape."""
    mesh = mesh_for(r, dims)
    model = {
        k: distribute_tensor(torch.zeros(DT_SHAPES[k]), mesh, p) for k, p in placements.items()
    }
    before = dict(model)
    sd = {"model": model, "step": 0}
    load(sd, path, kind, r.group)
    assert sd["step"] == 9
    shapes = []
    for k in sorted(model):
        assert model[k] is before[k] and model[k].placements == tuple(placements[k])
        assert torch.equal(model[k].full_tensor(), dt_value(k)), k
        shapes.append(tuple(model[k].to_local().shape))
    return shapes


S0, S1, R = Shard(0), Shard(1), Replicate()
DT_KEYS = {"model.e": "tensor", "model.u": "tensor", "model.w": "tensor", "step": "bytes"}


@planner_pairs
def test_dtensor_reshard_from_1d(pool, tmp_path, save_with, load_with):
    """1-D Shard/Replicate on 2 ranks to other 1-D placements on 4 (empty shards) and 2-D."""
    path = str(tmp_path / "ck")
    pool.run(save_dt, 2, path, save_with, (2,), {"w": [S0], "u": [R], "e": [S1]})
    assert stored(path) == DT_KEYS
    shapes = pool.run(
        load_dt, 4, path, load_with, (4,), {"w": [S1], "u": [S0], "e": [S0]}, **world_kw(4)
    )
    # sorted keys e, u, w: e has 3 rows over 4 ranks, u 5 rows
    assert shapes == [[(1, 2), (2, 3), (8, 1)]] * 2 + [[(1, 2), (1, 3), (8, 1)]] + [
        [(0, 2), (0, 3), (8, 1)]
    ]
    twod = {"w": [S0, S1], "u": [R, S0], "e": [S1, S1]}
    assert pool.run(load_dt, 4, path, load_with, (2, 2), twod, **world_kw(4))[3] == [
        (3, 0),
        (2, 3),
        (4, 2),
    ]
    assert pool.run(load_dt, 2, path, load_with, (2,), {"w": [R], "u": [S1], "e": [R]})[1] == [
        (3, 2),
        (5, 1),
        (8, 4),
    ]


@planner_pairs
def test_dtensor_reshard_from_2d(pool, tmp_path, save_with, load_with):
    """2-D (2, 2) placements, with empty shards, to other 2-D placements, to 1-D and to 1 rank."""
    path = str(tmp_path / "ck")
    saved = {"w": [S0, S1], "u": [S0, S0], "e": [S0, S0]}  # e: rank 3 is empty
    pool.run(save_dt, 4, path, save_with, (2, 2), saved, **world_kw(4))
    assert stored(path) == DT_KEYS
    other = {"w": [R, S0], "u": [S1, R], "e": [S1, R]}
    assert pool.run(load_dt, 4, path, load_with, (2, 2), other, **world_kw(4))[3] == [
        (3, 1),
        (5, 1),
        (4, 4),
    ]
    assert pool.run(load_dt, 2, path, load_with, (2,), {"w": [S1], "u": [R], "e": [S0]})[1] == [
        (1, 2),
        (5, 3),
        (8, 2),
    ]
    assert pool.run(load_dt, 1, path, load_with, (1,), {"w": [S0], "u": [S0], "e": [R]}) == [
        [(3, 2), (5, 3), (8, 4)]
    ]


# -- models and optimizers: get_state_dict / set_state_dict ---------------------------------------

LR = 0.01


class Net(nn.Module):
    """Two linear layers, small enough for 4-way shards of every parameter."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def build(layout: str, r: Rank | None, seed: int, lr: float) -> tuple[nn.Module, Any]:
    """A Net in ``layout`` (plain, fsdp, hsdp, tp or fsdp_tp) and Adam with two param groups."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = Net(seed)
    tp_plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    if layout == "fsdp":
        mesh = mesh_for(r, (r.size,))
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "hsdp":  # replicate over the first mesh dimension, shard over the second
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard")))
    elif layout == "tp":
        parallelize_module(model, mesh_for(r, (r.size,)), tp_plan)
    elif layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan)
        fully_shard(model, mesh=mesh["dp"])
    groups = [
        {"params": list(model.fc1.parameters())},
        {"params": list(model.fc2.parameters()), "lr": 2 * lr, "weight_decay": 0.125},
    ]
    return model, torch.optim.Adam(groups, lr=lr)


def train(model: nn.Module, optim: Any, steps: int) -> None:
    """Steps on the same inputs on every rank."""
    for i in range(steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(100 + i))
        x = x.to(next(model.parameters()).device)
        model(x).square().sum().backward()
        optim.step()
        optim.zero_grad()


class App(Stateful):
    """Model and optimizer behind DCP's state_dict helpers, the usual training-loop wrapper."""

    def __init__(self, model: nn.Module, optim: Any) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optim,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


def snapshot(model: nn.Module, optim: Any) -> dict[str, Any]:
    """Full (gathered) parameters and optimizer state by name, lr and step per parameter."""
    names = {p: n for n, p in model.named_parameters()}
    out: dict[str, Any] = {}

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)

    for n, p in model.named_parameters():
        out[f"param.{n}"] = full(p)
    for p, st in optim.state.items():
        for k in sorted(st):
            out[f"state.{names[p]}.{k}"] = full(st[k])
    out["lr"] = [g["lr"] for g in optim.param_groups]
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k
    return True


def train_and_save(r: Rank, path: str, kind: str, layout: str) -> dict[str, Any]:
    model, optim = build(layout, r, seed=0, lr=LR)
    train(model, optim, 2)
    app, progress = App(model, optim), TrainState(2, [1.5, 0.75], b"e2e")
    save({"app": app, "progress": progress}, path, kind, r.group)
    return snapshot(model, optim)


def load_into(r: Rank, path: str, kind: str, layout: str) -> dict[str, Any]:
    """A differently initialised model and optimizer (lr 0.5, no state) loaded in place."""
    model, optim = build(layout, r, seed=1, lr=0.5)
    params = [p for _, p in model.named_parameters()]
    progress = TrainState()
    load({"app": App(model, optim), "progress": progress}, path, kind, r.group)
    assert [p for _, p in model.named_parameters()] == params
    assert (progress.step, progress.losses, progress.tag) == (2, [1.5, 0.75], b"e2e")
    return snapshot(model, optim)


MODEL_KEYS = {f"app.model.fc{i}.{w}" for i in (1, 2) for w in ("weight", "bias")}
OPTIM_KEYS = {
    f"app.optim.state.fc{i}.{w}.{s}"
    for i in (1, 2)
    for w in ("weight", "bias")
    for s in ("step", "exp_avg", "exp_avg_sq")
}


def check_e2e_keys(path: str) -> None:
    keys = stored(path)
    tensors = {k for k, v in keys.items() if v == "tensor"}
    assert tensors == MODEL_KEYS | OPTIM_KEYS | {"progress.step"}
    assert {
        "app.optim.param_groups.0.lr",
        "app.optim.param_groups.1.lr",
        "app.optim.param_groups.1.weight_decay",
        "progress.losses",
        "progress.tag",
    } <= set(keys)
    assert all(
        k.startswith(("app.optim.param_groups.", "progress.")) for k in keys.keys() - tensors
    )


E2E = [
    pytest.param("fsdp", 2, "fsdp", 4, id="fsdp2-2-to-fsdp2-4"),
    pytest.param("fsdp", 2, "plain", 1, id="fsdp2-2-to-plain-1"),
    pytest.param("hsdp", 4, "fsdp", 2, id="hsdp-2x2-to-fsdp2-2"),
    pytest.param("tp", 2, "tp", 4, id="tp-2-to-tp-4"),
    pytest.param("plain", 1, "tp", 2, id="plain-1-to-tp-2"),
    pytest.param("fsdp", 2, "hsdp", 4, id="fsdp2-2-to-hsdp-2x2"),
    pytest.param("fsdp_tp", 4, "tp", 2, id="fsdp2xtp-2x2-to-tp-2"),
    pytest.param("tp", 2, "fsdp_tp", 4, id="tp-2-to-fsdp2xtp-2x2"),
]


@planner_pairs
@pytest.mark.parametrize(("src", "n_src", "dst", "n_dst"), E2E)
def test_model_and_optimizer(pool, tmp_path, save_with, load_with, src, n_src, dst, n_dst):
    """Trained model + Adam state through get/set_state_dict, resharded; lr and step restored."""
    path = str(tmp_path / "ck")
    saved = pool.run(train_and_save, n_src, path, save_with, src, **world_kw(n_src))
    check_e2e_keys(path)
    loaded = pool.run(load_into, n_dst, path, load_with, dst, **world_kw(n_dst))
    assert saved[0]["lr"] == [LR, 2 * LR] and saved[0]["state.fc1.weight.step"] == 2
    assert all(same(saved[0], got) for got in loaded)


def load_model_only(r: Rank, path: str, kind: str) -> dict[str, torch.Tensor]:
    """Only the model of a model + optimizer checkpoint, into FSDP2 on this many ranks."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    model, _ = build("fsdp", r, seed=1, lr=0.5)
    msd = get_model_state_dict(model)
    load({"app": {"model": msd}}, path, kind, r.group)
    set_model_state_dict(model, msd)
    return {
        k: v for k, v in snapshot(model, torch.optim.SGD(model.parameters())).items() if k != "lr"
    }


@planner_pairs
def test_model_only_from_model_and_optimizer_checkpoint(pool, tmp_path, save_with, load_with):
    """A partial load (model, no optimizer) from an FSDP2 checkpoint on 2 ranks, on 4."""
    path = str(tmp_path / "ck")
    saved = pool.run(train_and_save, 2, path, save_with, "fsdp")[0]
    params = {k: v for k, v in saved.items() if k.startswith("param.")}
    loaded = pool.run(load_model_only, 4, path, load_with, **world_kw(4))
    assert all(same(params, got) for got in loaded)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_and_optimizer_to_cpu_and_back(tmp_path):
    """CUDA model + Adam state saved without a process group, loaded on CPU and on CUDA."""
    for save_with, load_with in [(s.values[0], s.values[1]) for s in PAIRS]:
        path = str(tmp_path / f"{save_with}-{load_with}")
        model, optim = build("plain", None, seed=0, lr=LR)
        model.cuda()
        optim = torch.optim.Adam(model.parameters(), lr=LR)
        train(model, optim, 2)
        save({"app": App(model, optim)}, path, save_with)
        for device in ("cpu", "cuda"):
            other = Net(seed=1).to(device)
            other_optim = torch.optim.Adam(other.parameters(), lr=0.5)
            load({"app": App(other, other_optim)}, path, load_with)
            assert next(other.parameters()).device.type == device
            assert same(snapshot(model, optim), snapshot(other, other_optim))


# -- no process group ----------------------------------------------------------------------------


def test_no_dist_end_to_end(tmp_path):
    """One process without a process group: save, load in place, training continues bit-exact."""
    for save_with, load_with in [(s.values[0], s.values[1]) for s in PAIRS]:
        path = str(tmp_path / f"{save_with}-{load_with}")
        model, optim = build("plain", None, seed=0, lr=LR)
        train(model, optim, 2)
        save({"app": App(model, optim)}, path, save_with, no_dist=True)
        check_keys = {k for k, v in stored(path).items() if v == "tensor"}
        assert check_keys == MODEL_KEYS | OPTIM_KEYS
        other, other_optim = build("plain", None, seed=1, lr=0.5)
        load({"app": App(other, other_optim)}, path, load_with)
        assert same(snapshot(model, optim), snapshot(other, other_optim))
        train(model, optim, 1)
        train(other, other_optim, 1)
        assert same(snapshot(model, optim), snapshot(other, other_optim))


def save_no_dist(r: Rank, path: str, kind: str) -> None:
    if r.rank == 0:  # the others take no part: no collective may run
        save(plain_state(0), path, kind, no_dist=True)


@planner_pairs
def test_no_dist_inside_a_process_group(pool, tmp_path, save_with, load_with):
    """``no_dist=True`` on one rank of a running group; loaded by 2 ranks."""
    path = str(tmp_path / "ck")
    pool.run(save_no_dist, 2, path, save_with)
    assert stored(path) == PLAIN_KEYS
    assert pool.run(load_plain, 2, path, load_with) == [True, True]


# -- partial loads -------------------------------------------------------------------------------


def save_for_keys(r: Rank, path: str, kind: str) -> None:
    mesh = mesh_for(r, (r.size,))
    state = {
        "model": {"w": distribute_tensor(dt_value("u"), mesh, [S0]), "layers": [value((2,), 1)]},
        "optim": {"param_groups": [{"lr": 0.5, "betas": (0.9, 0.99)}]},
        "step": 11,
    }
    save(state, path, kind, r.group)


@pytest.mark.parametrize("save_with", ["torch", "dcpbridge"])
def test_load_without_a_template(pool, tmp_path, save_with):
    """DCP's template-free load (``_load_state_dict_from_keys``, as ``dcp_to_torch_save``
    uses) rebuilds the nested state of either pair's checkpoint, whole or by key."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    path = str(tmp_path / "ck")
    pool.run(save_for_keys, 2, path, save_with)
    out = _load_state_dict_from_keys(storage_reader=db.FsspecCheckpointReader(path))
    assert sorted(out) == ["model", "optim", "step"] and out["step"] == 11
    assert out["optim"] == {"param_groups": [{"lr": 0.5, "betas": (0.9, 0.99)}]}
    assert torch.equal(out["model"]["w"], dt_value("u"))
    assert [t.tolist() for t in out["model"]["layers"]] == [value((2,), 1).tolist()]
    only = _load_state_dict_from_keys("model", storage_reader=db.FsspecCheckpointReader(path))
    assert list(only) == ["model"] and torch.equal(only["model"]["w"], dt_value("u"))


def save_partial(r: Rank, path: str, kind: str) -> None:
    save({"a": value((4, 2)), "b": value((3,), 1), "note": "x"}, path, kind, r.group)


def load_partial(r: Rank, path: str) -> tuple[list[str], list[str]]:
    """DCP's allow_partial_load and dcpbridge's return_all read the same subset."""
    sd = {"a": torch.zeros(4, 2), "absent": torch.zeros(2)}
    reader = db.FsspecCheckpointReader(path)
    dcp.load(
        sd,
        storage_reader=reader,
        planner=DefaultLoadPlanner(allow_partial_load=True),
        process_group=r.group,
    )
    assert torch.equal(sd["a"], value((4, 2))) and torch.equal(sd["absent"], torch.zeros(2))
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: absent"):
        load({"absent": torch.zeros(2)}, path, "torch", r.group)
    sd = {"a": torch.zeros(4, 2), "absent": torch.zeros(2)}
    planner = db.ShardedLoadPlanner(strict="return_all")
    reader = db.FsspecCheckpointReader(path)
    dcp.load(sd, storage_reader=reader, planner=planner, process_group=r.group)
    assert torch.equal(sd["a"], value((4, 2))) and torch.equal(sd["absent"], torch.zeros(2))
    return planner.missing_keys, planner.unexpected_keys


@pytest.mark.parametrize("save_with", ["torch", "dcpbridge"])
def test_partial_load(pool, tmp_path, save_with):
    """Loading a subset plus an absent key from either pair's checkpoint, 2 ranks."""
    path = str(tmp_path / "ck")
    pool.run(save_partial, 2, path, save_with)
    assert stored(path) == {"a": "tensor", "b": "tensor", "note": "bytes"}
    assert pool.run(load_partial, 2, path) == [(["absent"], ["b", "note"])] * 2
