"""Param groups: ParamKey overrides, deterministic groups, matching by identity on load."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import dcpbridge as db
from tests.mcore.test_optimizer import Net, net_sharded


def test_param_key_identity_and_validation():
    assert db.ParamKey(name="*.bias").identity == "name=*.bias"
    assert db.ParamKey(name=["a*", "b"], attr="shared").identity == "name=a*|b;attr=shared"
    assert db.ParamKey(name="x", label="embeddings").identity == "embeddings"
    with pytest.raises(db.InvalidArgumentError, match="needs a name pattern"):
        db.ParamKey()
    with pytest.raises(db.InvalidArgumentError, match="needs a label"):
        db.ParamKey(predicate=lambda n, p: p.ndim == 1)
    with pytest.raises(db.InvalidArgumentError, match="default"):
        db.ParamKey(name="x", label="default")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"optimizer": "lamb"}, "optimizer must be one of"),
        ({"lr": -1.0}, "lr must be"),
        ({"lr": float("nan")}, "lr must be"),
        ({"lr": 1e-3, "min_lr": 1e-2}, "min_lr must be in"),
        ({"adam_beta2": 1.0}, "adam_beta2 must be in"),
        ({"adam_eps": 0.0}, "adam_eps must be > 0"),
        ({"weight_decay": -0.1}, "weight_decay must be"),
        ({"optimizer": "sgd", "sgd_nesterov": True}, "sgd_nesterov needs"),
    ],
)
def test_config_validation(kwargs, needle):
    with pytest.raises(db.InvalidArgumentError, match=needle):
        db.OptimizerConfig(**kwargs)


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.norm = nn.LayerNorm(4)
        self.frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
        self.embed.weight.is_embedding = True


OVERRIDES = {
    db.ParamKey(attr="is_embedding"): {"lr": 0.01},
    db.ParamKey(name=("*.bias", "norm.*")): {"weight_decay": 0.0},
    db.ParamKey(predicate=lambda n, p: p.ndim == 2, label="matrices"): {"lr": 0.5},
    db.ParamKey(name="nothing.matches"): {"lr": 0.2},
}


def test_groups_follow_override_order_first_match_wins():
    config = db.OptimizerConfig(lr=0.1, weight_decay=0.05, min_lr=0.001)
    groups = db.get_param_groups(Tower(), config, OVERRIDES)
    assert [g["group_key"] for g in groups] == [
        "default",
        "attr=is_embedding",
        "name=*.bias|norm.*",
        "matrices",
        "name=nothing.matches",
    ]
    assert [g["param_names"] for g in groups] == [
        [],
        ["embed.weight"],  # also 2-D: the first matching key wins
        ["blocks.0.bias", "blocks.1.bias", "norm.weight", "norm.bias"],
        ["blocks.0.weight", "blocks.1.weight"],
        [],  # empty groups stay, so every rank has the same groups
    ]
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [
        (0.1, 0.05),
        (0.01, 0.05),
        (0.1, 0.0),
        (0.5, 0.05),
        (0.2, 0.05),
    ]
    assert all(g["min_lr"] == 0.001 and g["betas"] == (0.9, 0.999) for g in groups)
    # the same model built twice (other ids, other dict/set orders) gives the same groups
    again = db.get_param_groups(Tower(), config, OVERRIDES)
    assert [g["param_names"] for g in again] == [g["param_names"] for g in groups]


def test_model_chunks_share_parameters_once():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight  # tied across chunks
    groups = db.get_param_groups([a, b], db.OptimizerConfig())
    assert groups[0]["param_names"] == ["chunk0.weight", "chunk0.bias", "chunk1.bias"]


def test_override_validation():
    key = db.ParamKey(name="x")
    with pytest.raises(db.InvalidArgumentError, match="unknown fields \\['learning_rate'\\]"):
        db.get_param_groups(Tower(), db.OptimizerConfig(), {key: {"learning_rate": 1.0}})
    with pytest.raises(db.InvalidArgumentError, match="one optimizer"):
        db.get_param_groups(Tower(), db.OptimizerConfig(), {key: {"optimizer": "sgd"}})
    with pytest.raises(db.InvalidArgumentError, match="min_lr must be"):
        db.get_param_groups(Tower(), db.OptimizerConfig(min_lr=0.5, lr=1.0), {key: {"lr": 0.1}})
    with pytest.raises(db.InvalidArgumentError, match="distinct"):
        db.get_param_groups(
            Tower(), db.OptimizerConfig(), {key: {}, db.ParamKey(name="y", label="name=x"): {}}
        )
    same_label = {
        db.ParamKey(predicate=lambda n, p: True, label="a"): {},
        db.ParamKey(predicate=lambda n, p: False, label="a"): {},
    }
    with pytest.raises(db.InvalidArgumentError, match="distinct"):
        db.get_param_groups(Tower(), db.OptimizerConfig(), same_label)
    sgd = db.OptimizerConfig(optimizer="sgd", lr=0.3, sgd_momentum=0.5)
    groups = db.get_param_groups(Tower(), db.OptimizerConfig(optimizer="sgd"), {key: sgd})
    assert groups[1]["momentum"] == 0.5 and groups[1]["lr"] == 0.3


def test_get_optimizer_builds_torch_optimizer_and_dumps_map(tmp_path):
    dump = tmp_path / "groups.json"
    opt = db.get_optimizer(
        Tower(), db.OptimizerConfig(optimizer="adamw", lr=0.1), OVERRIDES, dump_param_groups_to=dump
    )
    assert type(opt) is torch.optim.AdamW
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01, 0.1, 0.5, 0.2]
    mapping = json.loads(dump.read_text())
    assert mapping["embed.weight"] == "attr=is_embedding"
    assert mapping["blocks.1.weight"] == "matrices" and "frozen" not in mapping
    opt = db.get_optimizer(
        Tower(),
        db.OptimizerConfig(optimizer="sgd", sgd_momentum=0.9, sgd_nesterov=True),
        dump_param_groups_to=str(tmp_path / "r{rank}.json"),
    )
    assert opt.param_groups[0]["nesterov"] and (tmp_path / "r0.json").exists()


# -- matching saved groups to current groups by identity -----------------------------------------

BIAS, SCALE = db.ParamKey(name="fc.bias"), db.ParamKey(name="scale", label="scale")


def _optimizer(net: Net, overrides: dict) -> torch.optim.Optimizer:
    return db.get_optimizer(net, db.OptimizerConfig(lr=0.1), overrides)


def _save(path) -> Net:
    net = Net()
    opt = _optimizer(net, {BIAS: {"lr": 0.01}, SCALE: {"lr": 0.02, "adam_beta1": 0.5}})
    net.fc(net.scale).sum().backward()
    opt.step()
    db.save({"o": db.optimizer_sharded_state_dict(opt, net_sharded(net, whole=True))}, path)
    return net


def _load(path, overrides: dict) -> torch.optim.Optimizer:
    net = Net()
    opt = _optimizer(net, overrides)
    db.init_optimizer_state(opt)
    template = {"o": db.optimizer_sharded_state_dict(opt, net_sharded(net, whole=True))}
    db.load_optimizer_state(opt, db.load(template, path)["o"])
    return opt


def test_groups_are_matched_by_identity_not_position(tmp_path):
    _save(tmp_path)
    opt = _load(tmp_path, {SCALE: {"lr": 9.0}, BIAS: {"lr": 9.0}})  # other order, other lr
    by_key = {g["group_key"]: g for g in opt.param_groups}
    assert [g["group_key"] for g in opt.param_groups] == ["default", "scale", "name=fc.bias"]
    assert by_key["scale"]["lr"] == 0.02 and by_key["scale"]["betas"] == (0.5, 0.999)
    assert by_key["name=fc.bias"]["lr"] == 0.01 and by_key["default"]["lr"] == 0.1
    assert by_key["scale"]["param_names"] == ["scale"]
    assert all(s["step"].item() == 1.0 for s in opt.state.values())


def test_group_mismatch_names_the_groups(tmp_path):
    _save(tmp_path)
    extra = db.ParamKey(name="fc.weight", label="matrix")
    with pytest.raises(db.OptimizerStateError) as e:
        _load(tmp_path, {BIAS: {}, extra: {}})
    assert "no saved counterpart: ['matrix']" in str(e.value)
    assert "saved groups with no current counterpart: ['scale']" in str(e.value)
