"""Cross-framework resume: Megatron-style TP jobs and FSDP2 jobs resume each other's checkpoints.

One 4-layer MLP (fc1 column-parallel, fc2 row-parallel with a replicated bias under TP; every
parameter split along dim 0 under FSDP2) trained with AdamW on synthetic full gradients. Each
job sets ``.grad`` of its local shards from the same full gradients, and every rank also runs a
reference on full tensors. Every local numel is a multiple of 32 floats and torch runs on one
thread, so AdamW's elementwise kernels take the same vectorized path in every layout and a
resumed run can be compared bit for bit with one that never left its layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

import dcpbridge as db
from tests.support.dist_pool import Rank

L, D, H, K = 4, 192, 384, 3  # layers, width, hidden, steps before the checkpoint
NAMES = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
SHAPES = {"fc1.weight": (H, D), "fc1.bias": (H,), "fc2.weight": (D, H), "fc2.bias": (D,)}
TP_AXIS = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None}  # None: replicated
STACKED = {n: f"decoder.layers.mlp.linear_{n}" for n in NAMES}  # Megatron-Core's stacked keys
KEY_MAP = db.KeyMap({f"layers.{{i}}.mlp.{n}": STACKED[n] for n in NAMES})
STATE = ("exp_avg", "exp_avg_sq")


def fqn(layer: int, name: str) -> str:
    return f"layers.{layer}.mlp.{name}"


def _randn(seed: int, shape: tuple[int, ...], scale: float) -> torch.Tensor:
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def init_value(layer: int, name: str) -> torch.Tensor:
    return _randn(100 * layer + NAMES.index(name), SHAPES[name], 0.05)


def full_grad(step: int, layer: int, name: str) -> torch.Tensor:
    return _randn(10_000 + 1000 * step + 100 * layer + NAMES.index(name), SHAPES[name], 1.0)


def make_adamw(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """Two groups, matched across jobs by position: weights decay, biases do not."""
    weights = [p for n, p in named if n.endswith("weight")]
    biases = [p for n, p in named if n.endswith("bias")]
    groups = [{"params": weights}, {"params": biases, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reference() -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Full-tensor AdamW: (params and optimizer state after K steps, params after K + 1)."""
    params = {fqn(i, n): nn.Parameter(init_value(i, n)) for i in range(L) for n in NAMES}
    opt = make_adamw(list(params.items()))
    snapshot: dict[str, dict[str, torch.Tensor]] = {}
    for step in range(K + 1):
        if step == K:
            snapshot = {
                k: {"param": p.detach().clone()} | {s: opt.state[p][s].clone() for s in STATE}
                for k, p in params.items()
            }
        for k, p in params.items():
            i, n = int(k.split(".")[1]), k.split(".", 3)[3]
            p.grad = full_grad(step, i, n)
        opt.step()
    return snapshot, {k: p.detach().clone() for k, p in params.items()}


# -- Megatron-style tensor parallelism: dcpbridge ShardedTensors over plain Parameters ---------


def tp_slice(full: torch.Tensor, name: str, tp: int, rank: int) -> torch.Tensor:
    axis = TP_AXIS[name]
    return full if axis is None else full.chunk(tp, dim=axis)[rank]


class TPModel:
    """Each rank's TP slices as plain Parameters, keyed by FQN."""

    def __init__(self, tp: int, rank: int) -> None:
        self.tp, self.rank = tp, rank
        self.params = {
            fqn(i, n): nn.Parameter(tp_slice(init_value(i, n), n, tp, rank).clone())
            for i in range(L)
            for n in NAMES
        }

    def sharded_state_dict(self, stacked: bool) -> dict:
        """Per-layer keys (= the FSDP2 FQNs), or Megatron-Core's stacked keys with a layer axis."""
        sd = {}
        for k, p in self.params.items():
            i, n = int(k.split(".")[1]), k.split(".", 3)[3]
            axis = TP_AXIS[n]
            p_axes = 1 if stacked else 0
            tp = () if axis is None else ((axis + p_axes, self.rank, self.tp),)
            replica = self.rank if axis is None else 0
            if stacked:
                sd[k] = db.ShardedTensor.from_rank_offsets(
                    STACKED[n], p, (0, i, L), *tp, replica_id=replica, prepend_axis_num=1
                )
            else:
                sd[k] = db.ShardedTensor.from_rank_offsets(k, p, *tp, replica_id=replica)
        return sd

    def set_grads(self, step: int) -> None:
        for k, p in self.params.items():
            i, n = int(k.split(".")[1]), k.split(".", 3)[3]
            p.grad = tp_slice(full_grad(step, i, n), n, self.tp, self.rank)

    def local_of(self, k: str, full: torch.Tensor) -> torch.Tensor:
        return tp_slice(full, k.split(".", 3)[3], self.tp, self.rank)


# -- FSDP2 ------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, H), nn.Linear(H, D)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(L))


def fsdp_net(r: Rank) -> tuple[Net, DeviceMesh]:
    mesh = DeviceMesh.from_group(r.group or dist.group.WORLD, "cpu")
    net = Net()
    with torch.no_grad():
        for k, p in net.named_parameters():
            p.copy_(init_value(int(k.split(".")[1]), k.split(".", 3)[3]))
    fully_shard(net, mesh=mesh)
    return net, mesh


def dlocal(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's piece of ``full`` placed like ``like`` (no communication)."""
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def fsdp_set_grads(net: Net, step: int) -> None:
    for k, p in net.named_parameters():
        g = full_grad(step, int(k.split(".")[1]), k.split(".", 3)[3])
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)


# -- the jobs ---------------------------------------------------------------------------------

Local = tuple[str, int] | None  # (local_dir, ranks_per_node): through the manager's local tier


def _manager(r: Rank, path: str, local: tuple[str, int]) -> db.CheckpointManager:
    """A manager whose persistent tier never saves at step K: only its local tier holds K."""
    local_dir, ranks_per_node = local
    return db.CheckpointManager(
        path,
        every=1000,
        local_dir=local_dir,
        ranks_per_node=ranks_per_node,
        process_group=r.group,
        async_save=False,
    )


def _save(r: Rank, state: dict, path: str, local: Local) -> None:
    """``db.save``, or a local step K only."""
    if local is None:
        db.save(state, path, process_group=r.group)
        return
    with _manager(r, path, local) as mgr:
        assert mgr.save(K, state)


def _load(r: Rank, template: dict, path: str, local: Local) -> dict:
    """``db.load``, or the manager's restore of local step K."""
    if local is None:
        return db.load(template, path, process_group=r.group)
    with _manager(r, path, local) as mgr:
        assert mgr.latest_step() == K
        return mgr.load(template)


def tp_train_and_save(r: Rank, path: str, stacked: bool, local: Local = None) -> None:
    """K AdamW steps at TP = ``r.size``, saved with dcpbridge's Megatron-style helpers."""
    with one_thread():
        model = TPModel(r.size, r.rank)
        opt = make_adamw(list(model.params.items()))
        for step in range(K):
            model.set_grads(step)
            opt.step()
        model_sd = model.sharded_state_dict(stacked)
        state = {"model": model_sd, "optimizer": db.optimizer_sharded_state_dict(opt, model_sd)}
        _save(r, {**state, "iteration": K}, path, local)


def fsdp_train_and_save(r: Rank, path: str, local: Local = None) -> None:
    """K AdamW steps under FSDP2, saved through ``to_model_space``."""
    with one_thread():
        net, _ = fsdp_net(r)
        opt = make_adamw(list(net.named_parameters()))
        for step in range(K):
            fsdp_set_grads(net, step)
            opt.step()
        model_sd, optim_sd = get_state_dict(net, opt)
        state = {**model_sd, "optimizer": db.to_model_space(optim_sd), "iteration": K}
        _save(r, state, path, local)


def _compare(
    local: dict[str, dict[str, torch.Tensor]], expected: dict[str, dict[str, torch.Tensor]]
) -> list[str]:
    """Names of the (key, entry) pairs that are not bit-identical."""
    return [
        f"{k}:{e}"
        for k in expected
        for e in expected[k]
        if not torch.equal(local[k][e], expected[k][e])
    ]


def _fresh_step_differs(
    params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], ref
) -> bool:
    """The control: the same step from fresh optimizer state must not match the reference."""
    copies = {k: nn.Parameter(p.detach().clone()) for k, p in params.items()}
    opt = make_adamw(list(copies.items()))
    for k, p in copies.items():
        p.grad = grads[k]
    opt.step()
    return any(not torch.equal(p.detach(), ref[k]) for k, p in copies.items())


def fsdp_resume(r: Rank, path: str, stacked: bool, local: Local = None) -> dict:
    """Load a TP checkpoint into FSDP2 (``set_state_dict``), check it, take one more step."""
    with one_thread():
        snapshot, after = reference()
        net, _ = fsdp_net(r)
        with torch.no_grad():
            for p in net.parameters():
                p.zero_()  # whatever was there must come from the checkpoint
        opt = make_adamw(list(net.named_parameters()))
        model_sd, optim_sd = get_state_dict(net, opt)  # initializes the optimizer's state
        template = {**model_sd, "optimizer": db.to_model_space(optim_sd)}
        if stacked:
            template = KEY_MAP.apply(template, stored=db.load_tensors_metadata(path))
        loaded = _load(r, template, path, local)
        set_state_dict(
            net,
            opt,
            model_state_dict=model_sd,
            optim_state_dict=db.from_model_space(loaded["optimizer"]),
        )
        params = dict(net.named_parameters())
        local = {
            k: {"param": p.to_local().clone()}
            | {s: opt.state[p][s].to_local().clone() for s in STATE}
            for k, p in params.items()
        }
        expected = {
            k: {e: dlocal(v, params[k]) for e, v in entries.items()}
            for k, entries in snapshot.items()
        }
        steps = sorted({float(opt.state[p]["step"]) for p in params.values()})
        grads = {
            k: dlocal(full_grad(K, int(k.split(".")[1]), k.split(".", 3)[3]), p)
            for k, p in params.items()
        }
        before = {k: p.to_local().clone() for k, p in params.items()}
        ref_after = {k: dlocal(after[k], p) for k, p in params.items()}
        fsdp_set_grads(net, K)
        opt.step()
        return {
            "loaded_mismatch": _compare(local, expected),
            "compared": sum(len(v) for v in expected.values()),
            "steps": steps,
            "iteration": loaded["iteration"],
            "after_mismatch": [
                k for k, p in params.items() if not torch.equal(p.to_local(), ref_after[k])
            ],
            "fresh_differs": _fresh_step_differs(before, grads, ref_after),
        }


def tp_resume(r: Rank, path: str, stacked: bool, local: Local = None) -> dict:
    """Load an FSDP2 checkpoint at TP = ``r.size`` with dcpbridge's helpers; one more step."""
    with one_thread():
        snapshot, after = reference()
        model = TPModel(r.size, r.rank)
        with torch.no_grad():
            for p in model.params.values():
                p.zero_()
        opt = make_adamw(list(model.params.items()))
        db.init_optimizer_state(opt)
        model_sd = model.sharded_state_dict(stacked)
        template = {"model": model_sd, "optimizer": db.optimizer_sharded_state_dict(opt, model_sd)}
        if stacked:
            template = KEY_MAP.inverse().apply(template)
        loaded = _load(r, template, path, local)
        db.load_optimizer_state(opt, loaded["optimizer"])
        params = model.params
        local = {
            k: {"param": p.detach().clone()} | {s: opt.state[p][s].clone() for s in STATE}
            for k, p in params.items()
        }
        expected = {
            k: {e: model.local_of(k, v) for e, v in entries.items()}
            for k, entries in snapshot.items()
        }
        steps = sorted({float(opt.state[p]["step"]) for p in params.values()})
        before = {k: p.detach().clone() for k, p in params.items()}
        model.set_grads(K)
        grads = {k: p.grad for k, p in params.items()}
        opt.step()
        ref_after = {k: model.local_of(k, v) for k, v in after.items()}
        return {
            "loaded_mismatch": _compare(local, expected),
            "compared": sum(len(v) for v in expected.values()),
            "steps": steps,
            "iteration": loaded["iteration"],
            "after_mismatch": [
                k for k, p in params.items() if not torch.equal(p.detach(), ref_after[k])
            ],
            "fresh_differs": _fresh_step_differs(before, grads, ref_after),
        }


def _check(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        assert res["loaded_mismatch"] == [], (rank, res["loaded_mismatch"])
        assert res["compared"] == L * len(NAMES) * 3  # params, exp_avg, exp_avg_sq
        assert res["steps"] == [float(K)] and res["iteration"] == K
        assert res["after_mismatch"] == [], (rank, res["after_mismatch"])
        assert res["fresh_differs"], "a resume without the optimizer state must differ"


@pytest.mark.parametrize("stacked", [False, True], ids=["same_keys", "stacked_key_map"])
def test_tp2_checkpoint_resumes_under_fsdp2_on_3_ranks(pool, tmp_path, stacked):
    path = str(tmp_path / "tp2")
    pool.run(tp_train_and_save, 2, path, stacked, timeout=120)
    stored = db.load_tensors_metadata(path)
    key = STACKED["fc1.weight"] if stacked else fqn(3, "fc1.weight")
    assert stored[key].global_shape == ((L, H, D) if stacked else (H, D))
    assert stored[f"optimizer.state.exp_avg_sq.{key}"].global_shape == stored[key].global_shape
    _check(pool.run(fsdp_resume, 3, path, stacked, timeout=120))


@pytest.mark.parametrize("stacked", [False, True], ids=["same_keys", "stacked_key_map"])
def test_fsdp2_checkpoint_resumes_at_tp4(pool, tmp_path, stacked):
    path = str(tmp_path / "fsdp2")
    pool.run(fsdp_train_and_save, 2, path, timeout=120)
    stored = db.load_tensors_metadata(path)
    assert set(stored) == {
        *(fqn(i, n) for i in range(L) for n in NAMES),
        *(f"optimizer.state.{s}.{fqn(i, n)}" for s in STATE for i in range(L) for n in NAMES),
        "optimizer.shared_state.step",  # once, not per parameter
    }
    _check(pool.run(tp_resume, 4, path, stacked, timeout=120))


# -- one process: what the key map reads, plain tensors, optimizer.state_dict() ---------------


def test_key_map_reads_only_the_requested_layer_of_a_stacked_tensor(tmp_path):
    path = str(tmp_path / "stacked")
    layers = [init_value(i, "fc1.weight") for i in range(L)]
    sd = {
        f"l{i}": db.ShardedTensor.from_rank_offsets(
            STACKED["fc1.weight"], w, (0, i, L), prepend_axis_num=1
        )
        for i, w in enumerate(layers)
    }
    db.save(sd, path)
    want = db.ShardedTensor.from_rank_offsets(fqn(2, "fc1.weight"), torch.zeros(H, D))
    mapped = KEY_MAP.apply({"w": want}, stored=db.load_tensors_metadata(path))
    box = mapped["w"]
    assert (box.key, box.global_shape, box.global_offset) == (
        STACKED["fc1.weight"],
        (L, H, D),
        (2, 0, 0),
    )
    assert box.prepend_axis_num == 1 and box.data is want.data
    reader = db.FsspecCheckpointReader(path, verify_checksums=False)
    dcp.load(mapped, storage_reader=reader, planner=db.ShardedLoadPlanner())
    assert torch.equal(want.data, layers[2])
    assert reader.bytes_read == H * D * 4  # that layer's bytes, nothing else of the stacked tensor
    # a plain tensor per layer, through dcpbridge.load; the template's own object comes back
    plain = {fqn(i, "fc1.weight"): torch.zeros(H, D) for i in (0, 3)}
    out = db.load(KEY_MAP.apply(plain), path)
    assert all(out[k] is plain[k] for k in plain)
    assert torch.equal(plain[fqn(0, "fc1.weight")], layers[0])
    assert torch.equal(plain[fqn(3, "fc1.weight")], layers[3])
    # without ``stored`` the layer count is the template's: layer 1 alone says 2 layers
    with pytest.raises(db.ShapeMismatchError, match=r"\(4, 384, 192\), requested \(2, 384, 192\)"):
        db.load(KEY_MAP.apply({fqn(1, "fc1.weight"): torch.zeros(H, D)}), path)


def test_per_layer_checkpoint_loads_into_stacked_templates(tmp_path):
    path = str(tmp_path / "per_layer")
    layers = [init_value(i, "fc2.weight") for i in range(L)]
    db.save({fqn(i, "fc2.weight"): w for i, w in enumerate(layers)}, path)
    back = KEY_MAP.inverse()
    whole = torch.zeros(L, D, H)  # a plain stacked tensor: its first axis spans the keys
    out = db.load(back.apply({STACKED["fc2.weight"]: whole}), path)
    assert out[STACKED["fc2.weight"]] is whole and torch.equal(whole, torch.stack(layers))
    # Megatron-style: one ShardedTensor per layer with a prepended axis, and one covering 1..2
    per_layer = db.ShardedTensor.from_rank_offsets(
        STACKED["fc2.weight"], torch.zeros(D, H), (0, 3, L), prepend_axis_num=1
    )
    middle = db.ShardedTensor.from_box(
        STACKED["fc2.weight"], torch.zeros(2, D, H), (L, D, H), (1, 0, 0)
    )
    out = db.load(back.apply({"a": per_layer, "b": middle, "step": 0}), path)
    assert torch.equal(out["a"], layers[3]) and out["a"] is per_layer.data
    assert torch.equal(out["b"], torch.stack(layers[1:3])) and out["b"] is middle.data


def test_key_map_rules():
    km = db.KeyMap([("h.{n}.attn.w", "layers.{n}.self_attn.w"), ("emb", "embedding.word")])
    assert km.map_key("h.7.attn.w") == "layers.7.self_attn.w"
    assert (
        km.map_key("optimizer.state.exp_avg.h.7.attn.w")
        == "optimizer.state.exp_avg.layers.7.self_attn.w"
    )
    assert km.map_key("emb") == "embedding.word" and km.map_key("h.x.attn.w") is None
    assert km.inverse().map_key("layers.2.self_attn.w") == "h.2.attn.w"
    assert KEY_MAP.map_key(fqn(3, "fc1.bias")) == STACKED["fc1.bias"]
    kept = torch.ones(2)
    out = km.apply({"other": kept, "n": 1, "emb": torch.zeros(3)})
    assert (
        out["other"] is kept and out["n"] == 1 and isinstance(out["emb"], db.ShardedTensorFactory)
    )
    with pytest.raises(ValueError, match="one stacked axis"):
        db.KeyMap({"a.{i}.{j}": "b"})
    with pytest.raises(ValueError, match="repeats"):
        db.KeyMap({"a.{i}.{i}": "b.{i}"})


def test_key_map_refuses_a_stored_stack_that_is_no_stack(tmp_path):
    """A checkpoint whose stacked key holds a 0-dim tensor (another program's, or damaged)
    made ``KeyMap.apply(..., stored=load_tensors_metadata(dir))`` raise a bare IndexError
    reading its layer count; now ShapeMismatchError names the key."""
    path = str(tmp_path / "ck")
    db.save({"stack.w": torch.tensor(1.0)}, path)
    km = db.KeyMap({"layers.{i}.w": "stack.w"})
    template = {"layers": {"0": {"w": torch.zeros(3)}}}
    with pytest.raises(db.ShapeMismatchError, match=r"'stack\.w'.*0-dim"):
        km.apply(template, stored=db.load_tensors_metadata(path))
    with pytest.raises(db.ShapeMismatchError, match=r"'stack\.w'.*0-dim"):
        km.apply(template, stored={"stack.w": ()})


def _named_net_and_adamw() -> tuple[Net, torch.optim.Optimizer]:
    net = Net()
    with torch.no_grad():
        for k, p in net.named_parameters():
            p.copy_(init_value(int(k.split(".")[1]), k.split(".", 3)[3]))
    named = list(net.named_parameters())
    groups = [
        {"params": [(n, p) for n, p in named if n.endswith("weight")]},
        {"params": [(n, p) for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]
    return net, torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _step(net: Net, opt: torch.optim.Optimizer, step: int) -> None:
    for k, p in net.named_parameters():
        p.grad = full_grad(step, int(k.split(".")[1]), k.split(".", 3)[3])
    opt.step()


def test_plain_optimizer_state_dict_round_trips_through_model_space(tmp_path):
    """``optimizer.state_dict()`` (ids + param_names) saved and loaded in one process."""
    path = str(tmp_path / "plain")
    with one_thread():
        net, opt = _named_net_and_adamw()
        for step in range(K):
            _step(net, opt, step)
        db.save({**net.state_dict(), "optimizer": db.to_model_space(opt.state_dict())}, path)
        stored = db.load_tensors_metadata(path)
        assert f"optimizer.state.exp_avg.{fqn(2, 'fc2.bias')}" in stored
        net2, opt2 = _named_net_and_adamw()
        db.init_optimizer_state(opt2)
        template = {**net2.state_dict(), "optimizer": db.to_model_space(opt2.state_dict())}
        loaded = db.load(template, path)
        opt2.load_state_dict(db.from_model_space(loaded["optimizer"]))
        a, b = opt.state_dict(), opt2.state_dict()
        assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
        for pid, entry in a["state"].items():
            assert entry.keys() == b["state"][pid].keys()
            assert all(torch.equal(v, b["state"][pid][s]) for s, v in entry.items())
            assert b["state"][pid]["step"].dtype == torch.float32
        _step(net, opt, K)
        _step(net2, opt2, K)
        assert all(torch.equal(p, q) for p, q in zip(net.parameters(), net2.parameters()))
    unnamed = torch.optim.AdamW(Net().parameters())
    with pytest.raises(db.OptimizerStateError, match="param_names"):
        db.to_model_space(unnamed.state_dict())
