"""Train at TP=2, save model + optimizer, resume at TP=4 and TP=1: bit-identical to no stop.

The toy model is built so each value is computed the same way whatever the TP degree:
column-parallel layers whose dot products are explicit sequential loops (no BLAS blocking),
full activations all-gathered, the input gradient summed over all rows in a fixed order
after an all-gather, and every local size a multiple of 32 floats so elementwise kernels
(optimizer updates included) take the same vectorized path at TP 1, 2 and 4.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import dcpbridge as db
from tests.support.dist_pool import Rank

D, LAYERS, K = 128, 2, 3  # width, layers, steps before the checkpoint


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class TPModel(nn.Module):
    """``LAYERS`` column-parallel softsign layers (rows split over TP) and a replicated gain."""

    def __init__(self, tp: int, tp_rank: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.tp, self.tp_rank, self.group = tp, tp_rank, group
        rows = slice(tp_rank * D // tp, (tp_rank + 1) * D // tp)
        self.w = nn.ParameterList(_randn(10 + i, D, D)[rows] * 0.2 for i in range(LAYERS))
        self.b = nn.ParameterList(_randn(20 + i, D)[rows] * 0.1 for i in range(LAYERS))
        self.gain = nn.Parameter(1 + 0.1 * _randn(30, D))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Concatenate the TP ranks' row blocks (dim 0)."""
        if self.tp == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts)

    @torch.no_grad()
    def loss_and_grads(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Forward and hand-written backward; sets ``.grad`` of every parameter."""
        hs, zs = [x], []
        for w, b in zip(self.w, self.b):
            z = b.clone()
            for k in range(D):
                z = z + w[:, k] * hs[-1][k]
            zs.append(z)
            hs.append(self.gather(z / (1 + z.abs())))
        r = self.gain * hs[-1] - target
        self.gain.grad = 2 * r * hs[-1]
        dh = 2 * r * self.gain
        for layer in reversed(range(LAYERS)):
            w, z = self.w[layer], zs[layer]
            denom = 1 + z.abs()
            dz = dh[self.tp_rank * z.numel() : (self.tp_rank + 1) * z.numel()] / (denom * denom)
            w.grad = dz[:, None] * hs[layer][None, :]
            self.b[layer].grad = dz.clone()
            contrib = self.gather(w * dz[:, None])
            dh = contrib[0].clone()
            for j in range(1, D):
                dh = dh + contrib[j]
        return (r * r).sum()

    def sharded_state_dict(self) -> dict:
        """Weights/biases share one key each, with a prepended layer axis; the gain is
        replicated over TP and saved through a factory as two halves."""
        sd: dict = {}
        tp = (1, self.tp_rank, self.tp)
        for i in range(LAYERS):
            for name, param in (("weight", self.w[i]), ("bias", self.b[i])):
                sd[f"layers.{i}.{name}"] = db.ShardedTensor.from_rank_offsets(
                    f"layers.{name}", param, (0, i, LAYERS), tp, prepend_axis_num=1
                )
        sd["head.gain"] = db.ShardedTensorFactory(
            "head.gain", self.gain, _halves, _join, replica_id=self.tp_rank
        )
        return sd

    def full_params(self) -> dict[str, torch.Tensor]:
        out = {"gain": self.gain.detach().clone()}
        for i in range(LAYERS):
            out[f"w{i}"] = self.gather(self.w[i].detach())
            out[f"b{i}"] = self.gather(self.b[i].detach())
        return out


def _halves(key: str, data: torch.Tensor, replica_id) -> dict:
    return {
        part: db.ShardedTensor.from_rank_offsets(f"{key}.{part}", half, replica_id=replica_id)
        for part, half in zip(("first", "second"), data.chunk(2))
    }


def _join(loaded: dict) -> torch.Tensor:
    return torch.cat([loaded["first"], loaded["second"]])


def make_optimizer(kind: str, model: TPModel) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = db.OptimizerConfig(optimizer=kind, lr=1e-2, weight_decay=1e-2, adam_beta2=0.99)
    overrides = {
        db.ParamKey(name="b.*"): {"weight_decay": 0.0},
        db.ParamKey(name="gain", label="head"): {"lr": 3e-3},
    }
    return db.get_optimizer(model, config, overrides)


def train(
    r: Rank,
    kind: str,
    start: int,
    stop: int,
    load_from: str | None,
    save_to: str | None,
    load_optimizer: bool = True,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Steps ``start..stop-1`` at TP = ``r.size``, optionally resumed from / saved to a checkpoint."""
    model = TPModel(r.size, r.rank, r.group)
    optimizer = make_optimizer(kind, model)
    if load_from is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # whatever was there must come from the checkpoint
        db.init_optimizer_state(optimizer)
        model_sd = model.sharded_state_dict()
        template = {
            "model": model_sd,
            "optimizer": db.optimizer_sharded_state_dict(optimizer, model_sd),
        }
        loaded = db.load(template, load_from, process_group=r.group)  # fills Parameters
        with torch.no_grad():
            model.gain.copy_(loaded["model"]["head.gain"])
        assert loaded["iteration"] == start
        if load_optimizer:
            db.load_optimizer_state(optimizer, loaded["optimizer"])
        else:
            optimizer = make_optimizer(kind, model)
    losses = []
    for step in range(start, stop):
        optimizer.zero_grad()
        loss = model.loss_and_grads(_randn(100 + step, D), _randn(200 + step, D))
        optimizer.step()
        losses.append(loss.item())
    if save_to is not None:
        model_sd = model.sharded_state_dict()
        state = {
            "model": model_sd,
            "optimizer": db.optimizer_sharded_state_dict(optimizer, model_sd),
            "iteration": stop,
        }
        db.save(state, save_to, process_group=r.group)
    return losses, model.full_params()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _check_resume(pool, tmp_path, kind: str) -> None:
    path = str(tmp_path / kind)
    reference, ref_params = pool.run(train, 2, kind, 0, K + 1, None, None)[0]
    first, _ = pool.run(train, 2, kind, 0, K, None, path)[0]
    assert first == reference[:K]
    resumed = {
        4: pool.run(train, 4, kind, K, K + 1, path, None)[0],
        1: train(Rank(0, 1, None), kind, K, K + 1, path, None),
    }
    for tp, (losses, params) in resumed.items():
        assert losses == reference[K:], (tp, losses, reference[K:])
        assert _same(params, ref_params), f"TP={tp}: parameters differ from the uninterrupted run"
    assert not _same(params, pool.run(train, 2, kind, K, K + 1, path, None, False)[0][1]), (
        "a resume without the optimizer state must differ, or this test proves nothing"
    )


def test_adam_with_param_groups_resumes_bit_exact_across_tp(pool, tmp_path):
    _check_resume(pool, tmp_path, "adam")


def test_sgd_momentum_resumes_bit_exact_across_tp(pool, tmp_path):
    _check_resume(pool, tmp_path, "sgd")
