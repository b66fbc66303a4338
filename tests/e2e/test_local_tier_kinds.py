"""The local tier holds every state kind: FSDP2 DTensors with AdamW state restore as
Megatron-style ShardedTensors at another TP, Megatron-style TP state with its optimizer
restores under FSDP2, both after a node's directory is wiped; ShardedObjects, a replicated
tensor and common state restore in another layout, given as a sharded state dict or as the
``TensorAwareStateDict`` Megatron hands a local checkpoint manager.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import dcpbridge as db
from tests.e2e.test_cross_framework import (
    K,
    _check,
    fsdp_resume,
    fsdp_train_and_save,
    tp_resume,
    tp_train_and_save,
)
from tests.support.dist_pool import Rank


def _dirs(tmp_path) -> tuple[str, str]:
    return str(tmp_path / "persistent"), str(tmp_path / "node{node}")


def _committed(tmp_path, nodes: int, step: int = K) -> None:
    for n in range(nodes):
        assert os.path.exists(tmp_path / f"node{n}" / f"step_{step:08d}" / "local.json")


def test_fsdp2_with_adamw_restores_at_tp2_from_the_copies(pool, tmp_path):
    root, local = _dirs(tmp_path)
    pool.run(fsdp_train_and_save, 4, root, (local, 2), timeout=180)  # 2 nodes of 2 ranks
    _committed(tmp_path, 2)
    assert not os.path.exists(root)  # local only: the restore cannot fall back
    shutil.rmtree(tmp_path / "node1")
    _check(pool.run(tp_resume, 2, root, False, (local, 1), timeout=180))


def test_megatron_tp4_with_adamw_restores_under_fsdp2_on_3_ranks(pool, tmp_path):
    root, local = _dirs(tmp_path)
    pool.run(tp_train_and_save, 4, root, False, (local, 2), timeout=180)
    _committed(tmp_path, 2)
    shutil.rmtree(tmp_path / "node0")  # node 2 of the new job is new and empty too
    _check(pool.run(fsdp_resume, 3, root, False, (local, 1), timeout=180))


ROWS, COLS = 8, 6


def _w() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).view(ROWS, COLS) * 0.25


def _b() -> torch.Tensor:
    return torch.linspace(-1, 1, COLS, dtype=torch.float64)


def save_megatron_state(r: Rank, root: str, local: str, tensor_aware: bool) -> None:
    """Rows of w per rank, a bias replicated on every rank (any member may keep it),
    one object per rank and common state; with ``tensor_aware``, handed over as a
    TensorAwareStateDict."""
    sd = {
        "w": db.ShardedTensor.from_rank_offsets(
            "w", _w().chunk(r.size)[r.rank].clone(), (0, r.rank, r.size)
        ),
        "b": db.ShardedTensor.from_rank_offsets("b", _b().clone(), replica_id=r.rank),
        "rng": db.ShardedObject("rng", {"seed": 10 + r.rank}, (r.size,), (r.rank,)),
        "iteration": 7,
    }
    if tensor_aware:
        sd, _ = db.TensorAwareStateDict.from_state_dict(sd, algo="fully_parallel")
    with db.CheckpointManager(
        root, every=1000, local_dir=local, ranks_per_node=2, process_group=r.group, async_save=False
    ) as mgr:
        mgr.save(7, sd)


def restore_megatron_state(r: Rank, root: str, local: str) -> None:
    """Columns of w on 2 ranks, each also asking for two of the 4 saved objects."""
    template = {
        "w": db.ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS // 2), (1, r.rank, 2)),
        "b": db.ShardedTensor.from_rank_offsets(
            "b", torch.zeros(COLS, dtype=torch.float64), replica_id=r.rank
        ),
        "rng": [
            db.ShardedObject("rng", None, (4,), (i,), replica_id=r.rank)
            for i in (r.rank, r.rank + 2)
        ],
    }
    with db.CheckpointManager(
        root, every=1000, local_dir=local, ranks_per_node=1, process_group=r.group, async_save=False
    ) as mgr:
        out = mgr.load(template)
    assert torch.equal(out["w"], _w().chunk(2, dim=1)[r.rank])
    assert torch.equal(out["b"], _b())
    assert out["rng"] == [{"seed": 10 + r.rank}, {"seed": 12 + r.rank}]
    assert out["iteration"] == 7


@pytest.mark.parametrize(
    "tensor_aware",
    [False, True],
    ids=["sharded_state_dict", "tensor_aware_state_dict"],
)
def test_megatron_objects_and_replicas_restore_in_another_layout(pool, tmp_path, tensor_aware):
    root, local = _dirs(tmp_path)
    pool.run(save_megatron_state, 4, root, local, tensor_aware, timeout=120)
    _committed(tmp_path, 2, step=7)
    shutil.rmtree(tmp_path / "node1")
    pool.run(restore_megatron_state, 2, root, local, timeout=120)
