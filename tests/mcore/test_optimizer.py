"""Optimizer state sharded like the model: mapping, metadata inheritance, shared step, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dcpbridge as db
from dcpbridge.model.mapping import LocalNonpersistentObject
from dcpbridge.model.state import apply_factories, extract, is_nonpersistent, is_sharded
from tests.support.dist_pool import Rank


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.scale = nn.Parameter(torch.arange(1.0, 5.0))


def _halves(key, data, replica_id):
    return {
        i: db.ShardedTensor.from_rank_offsets(f"{key}.{i}", h, replica_id=replica_id)
        for i, h in enumerate(data.chunk(2))
    }


def _join(parts):
    return torch.cat([parts[0], parts[1]])


def net_sharded(net: Net, params: dict | None = None, *, whole: bool = False) -> dict:
    """fc.weight is a box (rank 1 of 3 along dim 0, layer 2 of 5 prepended), the rest
    replicas; ``whole``: one process holding everything (main replicas)."""
    p = params if params is not None else dict(net.named_parameters())
    box = ((0, 0, 1), (1, 0, 1)) if whole else ((0, 2, 5), (1, 1, 3))
    return {
        "fc": {
            "weight": db.ShardedTensor.from_rank_offsets(
                "dec.fc.weight",
                p["fc.weight"],
                *box,
                replica_id=(0, 0, 0) if whole else (0, 1, 2),
                prepend_axis_num=1,
            ),
            "bias": db.ShardedTensor.from_rank_offsets(
                "dec.fc.bias", p["fc.bias"], replica_id=0 if whole else 3
            ),
        },
        "scale": db.ShardedTensorFactory(
            "dec.scale", p["scale"], _halves, _join, replica_id=0 if whole else 1
        ),
    }


def stepped_adam(net: Net, steps: int = 2, **kwargs) -> torch.optim.Adam:
    opt = torch.optim.Adam([net.scale, net.fc.weight, net.fc.bias], lr=0.1, **kwargs)
    for _ in range(steps):
        opt.zero_grad()
        net.fc(net.scale).square().sum().backward()
        opt.step()
    return opt


def test_param_maps_follow_optimizer_order():
    net = Net()
    order = [net.scale, net.fc.weight, net.fc.bias]
    assert db.get_optim_param_to_id_map(order) == {id(p): i for i, p in enumerate(order)}
    sd = net_sharded(net)
    mapping = db.get_param_id_to_sharded_param_map(sd, iter(order))
    assert mapping == {0: sd["scale"], 1: sd["fc"]["weight"], 2: sd["fc"]["bias"]}


def test_sharded_state_inherits_the_parameter_sharding():
    net = Net()
    sd = net_sharded(net)
    exp_avg = torch.ones(6, 4, dtype=torch.bfloat16)
    st = db.make_sharded_optimizer_tensor(sd["fc"]["weight"], exp_avg, "optimizer.state.exp_avg")
    model = sd["fc"]["weight"]
    assert st.key == "optimizer.state.exp_avg.dec.fc.weight" and st.data is exp_avg
    assert st.dtype == torch.bfloat16
    for attr in (
        "local_shape",
        "global_shape",
        "global_offset",
        "axis_fragmentations",
        "replica_id",
        "prepend_axis_num",
        "allow_shape_mismatch",
    ):
        assert getattr(st, attr) == getattr(model, attr), attr
    assert st.global_shape == (5, 18, 4) and st.global_offset == (2, 6, 0)
    fac = db.make_sharded_optimizer_tensor(sd["scale"], torch.zeros(4), "optimizer.state.m")
    assert isinstance(fac, db.ShardedTensorFactory) and fac.key == "optimizer.state.m.dec.scale"
    assert fac.build_fn is _halves and fac.merge_fn is _join and fac.replica_id == 1
    assert [sh.key for sh in fac.build().values()] == [
        "optimizer.state.m.dec.scale.0",
        "optimizer.state.m.dec.scale.1",
    ]
    with pytest.raises(db.OptimizerStateError, match=r"\(4, 6\) does not match .* \(6, 4\)"):
        db.make_sharded_optimizer_tensor(model, torch.zeros(4, 6), "optimizer.state.x")


def test_state_dict_layout_step_once_groups_common_params_local():
    net = Net()
    opt = stepped_adam(net)
    sd = db.optimizer_sharded_state_dict(opt, net_sharded(net))
    assert set(sd) == {"state", "param_groups", "shared_state", "local"}
    assert sd["state"][1]["exp_avg_sq"].key == "optimizer.state.exp_avg_sq.dec.fc.weight"
    assert sd["state"][1]["exp_avg"].data is opt.state[net.fc.weight]["exp_avg"]
    assert set(sd["state"][0]) == {"exp_avg", "exp_avg_sq"}, "step is not per parameter"
    step = sd["shared_state"]["step"]
    assert step.dtype == torch.float32 and step.item() == 2.0
    assert isinstance(sd["local"], LocalNonpersistentObject)
    assert sd["local"].obj["groups"] == [("#0", {"params": [0, 1, 2]})]
    # what save writes as common state: hyper-parameters, keyed by group identity
    _, rest = extract(apply_factories(sd), is_nonpersistent)
    _, common = extract(rest, is_sharded)
    assert common["param_groups"]["#0"]["lr"] == 0.1
    assert "params" not in common["param_groups"]["#0"]
    assert "state" not in common and "local" not in common


def test_disagreeing_step_is_an_error_naming_the_values():
    net = Net()
    opt = stepped_adam(net)
    opt.state[net.fc.bias]["step"] = torch.tensor(7.0)
    with pytest.raises(db.OptimizerStateError) as e:
        db.optimizer_sharded_state_dict(opt, net_sharded(net))
    message = str(e.value)
    assert "'step' differs" in message
    assert "2.0 for params [0, 1]" in message and "7.0 for params [2]" in message
    sd = db.optimizer_sharded_state_dict(opt, net_sharded(net), exclude_keys=("step",))
    assert "shared_state" not in sd and "step" not in sd["state"][2]


def test_plain_tensors_get_the_keep_vars_hint():
    net = Net()
    opt = stepped_adam(net)
    detached = net_sharded(net, net.state_dict())  # state_dict() without keep_vars=True
    with pytest.raises(db.OptimizerStateError, match=r"3 optimizer parameter.*keep_vars=True"):
        db.optimizer_sharded_state_dict(opt, detached)
    partial = net_sharded(net)
    del partial["scale"]
    with pytest.raises(db.OptimizerStateError) as e:
        db.optimizer_sharded_state_dict(opt, partial)
    assert "#0 (4,)" in str(e.value) and "keep_vars" not in str(e.value)


def test_round_trip_in_one_process(tmp_path):
    """Saved by an Adam under float64 default dtype (float64 step), restored into a float32 one."""
    torch.set_default_dtype(torch.float64)
    try:
        src = Net()
        opt = stepped_adam(src, steps=3)
    finally:
        torch.set_default_dtype(torch.float32)
    assert opt.state[src.scale]["step"].dtype == torch.float64
    db.save(
        {"optimizer": db.optimizer_sharded_state_dict(opt, net_sharded(src, whole=True))}, tmp_path
    )

    dst = Net().double()
    new = torch.optim.Adam([dst.scale, dst.fc.weight, dst.fc.bias], lr=0.5)
    template = {"optimizer": db.optimizer_sharded_state_dict(new, net_sharded(dst, whole=True))}
    with pytest.raises(db.OptimizerStateError, match="init_optimizer_state"):
        db.load_optimizer_state(new, db.load(template, tmp_path)["optimizer"])
    before = {n: p.detach().clone() for n, p in dst.named_parameters()}
    db.init_optimizer_state(new)
    assert all(torch.equal(p, before[n]) for n, p in dst.named_parameters())
    assert all(p.grad is None for p in dst.parameters())
    template = {"optimizer": db.optimizer_sharded_state_dict(new, net_sharded(dst, whole=True))}
    db.load_optimizer_state(new, db.load(template, tmp_path)["optimizer"])

    assert new.param_groups[0]["lr"] == 0.1, "hyper-parameters come from the checkpoint"
    steps = [new.state[p]["step"] for p in (dst.scale, dst.fc.weight, dst.fc.bias)]
    assert all(s.dtype == torch.float32 and s.item() == 3.0 for s in steps)
    assert len({s.data_ptr() for s in steps}) == 3, "each parameter owns its step"
    for p_src, p_dst in zip(
        (src.scale, src.fc.weight, src.fc.bias), (dst.scale, dst.fc.weight, dst.fc.bias)
    ):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(new.state[p_dst][key], opt.state[p_src][key]), key


def test_sgd_has_no_shared_state_and_excluded_keys_keep_current_values(tmp_path):
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net.fc(net.scale).sum().backward()
    opt.step()
    sd = db.optimizer_sharded_state_dict(
        opt, net_sharded(net, whole=True), exclude_keys=("momentum_buffer",)
    )
    assert "shared_state" not in sd and sd["state"] == {0: {}, 1: {}, 2: {}}
    db.save({"o": sd}, tmp_path)
    before = {k: v["momentum_buffer"].clone() for k, v in opt.state_dict()["state"].items()}
    template = {
        "o": db.optimizer_sharded_state_dict(
            opt, net_sharded(net, whole=True), exclude_keys=("momentum_buffer",)
        )
    }
    restored = db.restore_optim_state(db.load(template, tmp_path)["o"])
    assert all(torch.equal(restored["state"][k]["momentum_buffer"], before[k]) for k in before)


class ScaledLinear(nn.Module):
    """A Linear times a learnable 0-dim scale (as CLIP's ``logit_scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))


def test_model_space_keeps_moments_of_a_zero_dim_parameter_apart(tmp_path):
    """A 0-dim parameter's ``exp_avg`` is per-parameter state: it must not be stored once and
    then overwrite every other parameter's ``exp_avg`` on restore."""
    torch.manual_seed(0)
    src = ScaledLinear()
    opt = torch.optim.AdamW(src.named_parameters(), lr=0.1)
    (src.fc(torch.randn(2, 4)) * src.logit_scale).sum().backward()
    opt.step()
    db.save({**src.state_dict(), "optimizer": db.to_model_space(opt.state_dict())}, tmp_path)

    dst = ScaledLinear()
    new = torch.optim.AdamW(dst.named_parameters(), lr=0.5)
    db.init_optimizer_state(new)
    template = {**dst.state_dict(), "optimizer": db.to_model_space(new.state_dict())}
    new.load_state_dict(db.from_model_space(db.load(template, tmp_path)["optimizer"]))
    want, got = opt.state_dict()["state"], new.state_dict()["state"]
    assert want.keys() == got.keys()
    for pid, entry in want.items():
        for name, value in entry.items():
            assert got[pid][name].shape == value.shape, (pid, name)
            assert torch.equal(got[pid][name], value), (pid, name)


def test_model_space_refuses_two_parameters_of_one_name():
    """An optimizer over two modules' ``named_parameters()`` names two parameters "weight":
    their state landed under one model-space key, the first one's moments silently replaced
    by the second's (saved once, restored to both). Now that raises, naming the ids."""
    first, second = nn.Linear(3, 2), nn.Linear(3, 2)
    opt = torch.optim.AdamW([*first.named_parameters(), *second.named_parameters()])
    (first(torch.ones(1, 3)).sum() + 2 * second(torch.ones(1, 3)).sum()).backward()
    opt.step()
    with pytest.raises(db.OptimizerStateError) as raised:
        db.to_model_space(opt.state_dict())
    message = str(raised.value)
    assert "'weight' (state ids [0, 2])" in message and "'bias' (state ids [1, 3])" in message


def _tampered_load(tmp_path, tamper, kept=None, **adam):
    """An Adam state saved after ``tamper(saved)`` edits it, loaded (not restored yet) into a
    new Adam with hyper-parameters ``adam`` (lr 0.1 unless given) and per-parameter ``step``
    ``kept`` (None: its own); returns (the new optimizer, what the load returned)."""
    net = Net()
    saved = db.optimizer_sharded_state_dict(
        stepped_adam(net, steps=1), net_sharded(net, whole=True)
    )
    tamper(saved)
    db.save({"o": saved}, tmp_path)
    new = torch.optim.Adam([net.scale, net.fc.weight, net.fc.bias], **({"lr": 0.1} | adam))
    db.init_optimizer_state(new)
    for state in new.state.values():
        state["step"] = state["step"] if kept is None else kept
    template = {"o": db.optimizer_sharded_state_dict(new, net_sharded(net, whole=True))}
    return new, db.load(template, tmp_path)["o"]


def _step_to(stored):
    """A tamper setting the saved shared ``step`` to ``stored``."""
    return lambda saved: saved["shared_state"].update(step=stored)


@pytest.mark.parametrize(
    ("stored", "needles"),
    [
        (torch.arange(3.0), ["tensor([0., 1., 2.])", "torch.float32 tensor of shape ()"]),
        ("seven", ["'seven'", "torch.float32 tensor of shape ()"]),
        (2.5, ["2.5", "torch.int64 tensor of shape ()", "not a whole number"]),
    ],
    ids=["vector", "text", "fraction"],
)
def test_a_stored_step_the_optimizer_cannot_hold_is_an_optimizer_state_error(
    tmp_path, stored, needles
):
    """A checkpoint's shared ``step`` that does not fit this optimizer's (another program's
    state, a damaged one) raised torch's RuntimeError or TypeError out of restore, or was
    truncated (2.5 restored as 2 into an integer step). Now OptimizerStateError names it."""
    kept = torch.tensor(1) if isinstance(stored, float) else None  # steps kept as integers
    _, loaded = _tampered_load(tmp_path, _step_to(stored), kept)
    with pytest.raises(db.OptimizerStateError) as raised:
        db.restore_optim_state(loaded)
    message = str(raised.value)
    assert message.startswith("optimizer state 'step': the checkpoint's value "), message
    assert all(n in message for n in needles), message
    assert raised.value.__cause__ is not None


@pytest.mark.parametrize(
    ("kept", "stored"), [(1, float("inf")), (1.0, 10**400)], ids=["int-inf", "float-10e400"]
)
def test_a_stored_step_beyond_the_optimizers_number_is_an_optimizer_state_error(
    tmp_path, kept, stored
):
    """A stored step no Python int or float can hold (infinity for an optimizer counting
    steps as ints, 10**400 for one keeping a float) raised a bare OverflowError out of
    restore; now OptimizerStateError names it."""
    _, loaded = _tampered_load(tmp_path, _step_to(stored), kept)
    with pytest.raises(db.OptimizerStateError, match="optimizer state 'step'") as raised:
        db.restore_optim_state(loaded)
    assert isinstance(raised.value.__cause__, OverflowError)


def _columns(key, data, replica_id):
    """Two column halves: views of the parameter that are not contiguous."""
    return {
        i: db.ShardedTensor.from_rank_offsets(f"{key}.{i}", h, replica_id=replica_id)
        for i, h in enumerate(data.chunk(2, dim=1))
    }


@pytest.mark.parametrize("fmt", ["dcpbridge", "torch_dist"])
@pytest.mark.parametrize("build", [_halves, _columns], ids=["rows", "columns"])
def test_factories_of_parameters_load_with_the_optimizer(tmp_path, fmt, build):
    """A factory over an nn.Parameter (what optimizer_sharded_state_dict needs) loads: its
    views were filled in place with autograd on, so a merge_fn without no_grad raised
    torch's RuntimeError ('Output 0 of Split is a view ... modified inplace')."""
    src = Net()
    opt = stepped_adam(src, steps=2)

    def model_sd(net: Net) -> dict:
        sd = net_sharded(net, whole=True)
        join = (
            (lambda parts: torch.cat([parts[0], parts[1]], dim=1)) if build is _columns else _join
        )
        sd["fc"]["weight"] = db.ShardedTensorFactory("dec.fc.weight", net.fc.weight, build, join)
        return sd

    sd = model_sd(src)
    db.save(
        {"model": sd, "optimizer": db.optimizer_sharded_state_dict(opt, sd)}, tmp_path, format=fmt
    )
    dst = Net()
    new = torch.optim.Adam([dst.scale, dst.fc.weight, dst.fc.bias], lr=0.5)
    db.init_optimizer_state(new)
    sd = model_sd(dst)
    out = db.load({"model": sd, "optimizer": db.optimizer_sharded_state_dict(new, sd)}, tmp_path)
    db.load_optimizer_state(new, out["optimizer"])
    for p_src, p_dst in zip(
        (src.scale, src.fc.weight, src.fc.bias), (dst.scale, dst.fc.weight, dst.fc.bias)
    ):
        assert torch.equal(p_dst, p_src)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(new.state[p_dst][key], opt.state[p_src][key]), key
    assert torch.equal(out["model"]["fc"]["weight"], src.fc.weight)


def adafactor_tp(r: Rank, path: str, rows: int) -> str:
    """Each of 2 ranks holds ``rows`` rows of one weight under Adafactor, whose row_var and
    col_var are per-parameter but not shaped like the parameter."""
    p = nn.Parameter(torch.arange(rows * 3.0).reshape(rows, 3) + 12 * r.rank)
    opt = torch.optim.Adafactor([p], lr=0.1)
    p.grad = torch.full((rows, 3), 1.0 + r.rank)
    opt.step()
    model = {"w": db.ShardedTensor.from_rank_offsets("w", p, (0, r.rank, 2))}
    with pytest.raises(db.OptimizerStateError) as e:
        db.optimizer_sharded_state_dict(opt, model)
    return str(e.value)


@pytest.mark.parametrize("rows", [4, 1])
def test_state_not_shaped_like_its_parameter_is_refused(pool, tmp_path, rows):
    """Such state was stored once (rank 0's, as common state), so every other rank silently
    loaded rank 0's row_var and col_var; Megatron refuses it too (exclude_keys still works).
    With one row per rank, row_var (shape (1, 1)) has one element: it was stored once too,
    and rank 1 loaded rank 0's row_var. Only 0-dim tensors (and numbers) are stored once."""
    messages = pool.run(adafactor_tp, 2, str(tmp_path), rows, timeout=60)
    for message in messages:
        assert "'row_var'" in message
        assert "not shaped like its parameter" in message and "exclude_keys" in message


def test_a_stored_shared_entry_named_like_a_per_parameter_one_is_refused(tmp_path):
    """A checkpoint whose shared_state also holds ``exp_avg`` (damaged, or another program's)
    replaced every parameter's loaded exp_avg moment with that one number, silently (the
    optimizer then failed in its next step). Now OptimizerStateError names the entry, and
    the optimizer keeps its own state."""
    net = Net()
    opt = stepped_adam(net, steps=1)
    saved = db.optimizer_sharded_state_dict(opt, net_sharded(net, whole=True))
    saved["shared_state"]["exp_avg"] = 3.0
    db.save({"o": saved}, tmp_path)
    new = torch.optim.Adam([net.scale, net.fc.weight, net.fc.bias], lr=0.1)
    db.init_optimizer_state(new)
    before = {i: dict(s) for i, s in new.state_dict()["state"].items()}
    template = {"o": db.optimizer_sharded_state_dict(new, net_sharded(net, whole=True))}
    loaded = db.load(template, tmp_path)["o"]
    with pytest.raises(db.OptimizerStateError) as raised:
        db.load_optimizer_state(new, loaded)
    message = str(raised.value)
    assert "'exp_avg'" in message and "stored once" in message, message
    after = new.state_dict()["state"]
    for i, entry in before.items():
        assert all(torch.equal(after[i][k], v) for k, v in entry.items() if k != "exp_avg")
        assert isinstance(after[i]["exp_avg"], torch.Tensor)


@pytest.mark.parametrize(
    ("name", "stored"),
    [
        ("lr", "0.1"),
        ("lr", None),
        ("lr", True),
        ("lr", float("nan")),
        ("lr", 10**400),
        ("lr", {"x": 1}),
        ("betas", (0.9,)),
        ("betas", [0.9, "a"]),
        ("betas", 0.9),
        ("amsgrad", 0),
    ],
    ids=["text", "none", "bool", "nan", "10e400", "dict", "short", "text-in", "scalar", "int-flag"],
)
def test_a_stored_hyper_parameter_the_optimizer_cannot_use_is_refused(tmp_path, name, stored):
    """A checkpoint's param-group hyper-parameter of another kind than this optimizer's (text
    for lr, one beta, NaN, a number no float holds) went into the optimizer as it was: its
    next step raised a bare TypeError, ValueError or OverflowError, or trained on silently
    (NaN parameters, lr=True as 1.0). Now OptimizerStateError names the group and the entry,
    and the optimizer keeps its own hyper-parameters."""
    new, loaded = _tampered_load(
        tmp_path,
        lambda saved: saved["param_groups"]["#0"].update({name: stored}),
        lr=0.5,
        betas=(0.8, 0.9),
    )
    with pytest.raises(db.OptimizerStateError) as raised:
        db.load_optimizer_state(new, loaded)
    message = str(raised.value)
    assert f"param group '#0': hyper-parameter {name!r}" in message, message
    assert new.param_groups[0]["lr"] == 0.5 and new.param_groups[0]["betas"] == (0.8, 0.9)


def test_stored_hyper_parameters_of_a_compatible_kind_load(tmp_path):
    """What a checkpoint may hold for this optimizer's hyper-parameters: an int lr where it
    keeps a float, betas as a list, entries it does not know (an LR scheduler's initial_lr)."""
    new, loaded = _tampered_load(
        tmp_path,
        lambda saved: saved["param_groups"]["#0"].update(lr=1, betas=[0.5, 0.75], initial_lr=0.25),
        lr=0.5,
    )
    db.load_optimizer_state(new, loaded)
    group = new.param_groups[0]
    assert (group["lr"], list(group["betas"]), group["initial_lr"]) == (1, [0.5, 0.75], 0.25)


@pytest.mark.parametrize("stored", [[1, 2], 5], ids=["list", "number"])
def test_a_stored_shared_state_that_is_no_mapping_is_refused(tmp_path, stored):
    """A checkpoint's shared_state that is no mapping (damaged, or another program's), loaded
    by an optimizer that stores none (SGD), raised a bare AttributeError out of restore."""
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net.fc(net.scale).sum().backward()
    opt.step()
    saved = db.optimizer_sharded_state_dict(opt, net_sharded(net, whole=True))
    saved["shared_state"] = stored
    db.save({"o": saved}, tmp_path)
    template = {"o": db.optimizer_sharded_state_dict(opt, net_sharded(net, whole=True))}
    loaded = db.load(template, tmp_path)["o"]
    with pytest.raises(db.OptimizerStateError, match="shared_state is a"):
        db.restore_optim_state(loaded)


@pytest.mark.parametrize(
    "stored", [float("nan"), float("inf"), -3, 2.5, torch.tensor(-1.0)], ids=str
)
def test_a_stored_step_that_is_no_count_is_an_optimizer_state_error(tmp_path, stored):
    """A shared ``step`` is a count of steps taken; one that is none (NaN, infinity, negative,
    a fraction, from a damaged or foreign checkpoint) was restored as it was: Adam's next step
    made every parameter NaN, or raised a bare RuntimeError or ZeroDivisionError. Now
    OptimizerStateError names it, and the optimizer's state is untouched."""
    new, loaded = _tampered_load(tmp_path, _step_to(stored))
    with pytest.raises(db.OptimizerStateError) as raised:
        db.load_optimizer_state(new, loaded)
    message = str(raised.value)
    assert message.startswith("optimizer state 'step': the checkpoint's value "), message
    assert "a step count" in message, message
    assert all(s["step"].item() == 1.0 for s in new.state.values())


def _stepped_three() -> torch.optim.Adam:
    """An Adam over three parameters, one step taken (each with its own moments)."""
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(3)) for _ in range(3)]
    opt = torch.optim.Adam(ps, lr=0.1)
    for i, p in enumerate(ps):
        p.grad = torch.full((3,), float(i + 1))
    opt.step()
    return opt


@pytest.mark.parametrize(
    ("params", "needle"),
    [([0, 0, 1], "[0, 0, 1]"), ([0, 1, 7], "[0, 1, 7]"), ([2, 1, 0], "[2, 1, 0]")],
    ids=["duplicated", "out-of-range", "reordered"],
)
def test_a_top_level_optimizer_refuses_stored_param_ids_not_its_own(tmp_path, params, needle):
    """A torch optimizer at the top level of the state is loaded through its own
    ``load_state_dict``, which maps the stored ``params`` ids to its parameters by position:
    a checkpoint whose ids were duplicated or out of range gave parameter 1 parameter 0's
    moments, parameter 2 parameter 1's, and left parameter 0 without state, silently. Now
    OptimizerStateError names the state's key before the optimizer changes."""
    opt = _stepped_three()
    sd = opt.state_dict()
    sd["param_groups"][0]["params"] = params
    db.save({"opt": sd}, tmp_path)
    new = torch.optim.Adam([nn.Parameter(torch.zeros(3)) for _ in range(3)], lr=0.5)
    db.init_optimizer_state(new)
    before = {k: v.clone() for k, v in new.state_dict()["state"][0].items()}
    with pytest.raises(db.OptimizerStateError, match="state 'opt'") as raised:
        db.load({"opt": new}, tmp_path)
    assert needle in str(raised.value) and "[0, 1, 2]" in str(raised.value)
    assert all(isinstance(p, torch.Tensor) for p in new.state)
    assert new.param_groups[0]["lr"] == 0.5
    assert before.keys() == new.state_dict()["state"][0].keys()


def test_a_top_level_optimizer_round_trips(tmp_path):
    """The same optimizer at the top level, untampered, resumes exactly."""
    opt = _stepped_three()
    db.save({"opt": opt}, tmp_path)
    new = torch.optim.Adam([nn.Parameter(torch.zeros(3)) for _ in range(3)], lr=0.5)
    db.init_optimizer_state(new)
    db.load({"opt": new}, tmp_path)
    want, got = opt.state_dict(), new.state_dict()
    assert got["param_groups"][0]["lr"] == 0.1
    for i in range(3):
        assert all(torch.equal(got["state"][i][k], v) for k, v in want["state"][i].items())


@pytest.mark.parametrize(
    ("name", "stored"),
    [("lr", "0.1"), ("lr", float("nan")), ("betas", (0.9,)), ("amsgrad", 0)],
    ids=["text", "nan", "short", "int-flag"],
)
def test_a_top_level_optimizer_refuses_stored_hyper_parameters_it_cannot_use(
    tmp_path, name, stored
):
    """As for the sharded optimizer state: a top-level optimizer took the checkpoint's
    hyper-parameters as stored (its next step then raised a bare TypeError or ValueError, or
    trained on NaN). Now OptimizerStateError names the state, group and entry."""
    ps = [nn.Parameter(torch.randn(3)) for _ in range(2)]
    opt = torch.optim.Adam(ps, lr=0.1)
    for p in ps:
        p.grad = torch.ones(3)
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0][name] = stored
    db.save({"opt": sd}, tmp_path)
    new = torch.optim.Adam([nn.Parameter(torch.zeros(3)) for _ in range(2)], lr=0.5)
    db.init_optimizer_state(new)
    with pytest.raises(db.OptimizerStateError) as raised:
        db.load({"opt": new}, tmp_path)
    assert f"state 'opt': param group 0: hyper-parameter {name!r}" in str(raised.value)
    assert new.param_groups[0]["lr"] == 0.5 and new.param_groups[0]["betas"] == (0.9, 0.999)


def test_stored_param_names_never_reach_the_optimizer(tmp_path):
    """A param group's ``params`` and ``param_names`` name this rank's own parameters and are
    never saved; a checkpoint holding ``param_names`` anyway (damaged, or crafted) had them
    merged into an optimizer without names (its next to_model_space save would then name
    parameters wrongly, or refuse). Now the optimizer keeps its own."""
    net = Net()
    opt = stepped_adam(net, steps=1)
    saved = db.optimizer_sharded_state_dict(opt, net_sharded(net, whole=True))
    saved["param_groups"]["#0"].update(param_names=["fc.bias", "scale"], params=[5, 5])
    db.save({"o": saved}, tmp_path)
    new = torch.optim.Adam([net.scale, net.fc.weight, net.fc.bias], lr=0.5)
    db.init_optimizer_state(new)
    template = {"o": db.optimizer_sharded_state_dict(new, net_sharded(net, whole=True))}
    db.load_optimizer_state(new, db.load(template, tmp_path)["o"])
    group = new.param_groups[0]
    assert "param_names" not in group and group["lr"] == 0.1
    assert [id(p) for p in group["params"]] == [id(net.scale), id(net.fc.weight), id(net.fc.bias)]
