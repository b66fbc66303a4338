"""Megatron-Core checkpoints on CPU with gloo, built at test time (no binary fixtures).

megatron-core's dist_checkpointing runs on CPU once ``torch.cuda.synchronize`` is a no-op and
``torch.cuda.current_device`` returns ``"cpu"``. It uses the default process group, so these
functions run on all pool ranks (``default_group=True``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from typing import Any

import torch

from tests.support import layouts as L
from tests.support.dist_pool import Rank

# The global tensors of the Megatron-side state: one TP-style weight, a layer-stacked weight
# whose leading axis is a prepended (pipeline) axis, and a bf16 vector.
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "decoder.fc1.weight": ((16, 6), torch.float32),
    "decoder.layers.qkv": ((4, 8, 6), torch.float32),
    "embedding.bias": ((10,), torch.bfloat16),
}
COMMON = {"iteration": 42, "args": argparse.Namespace(lr=0.5, tp=4), "note": "megatron"}


def full(key: str) -> torch.Tensor:
    shape, dtype = SHAPES[key]
    return L.full(key, shape, dtype)


def mcore() -> Any:
    """megatron.core.dist_checkpointing, patched to run on CPU."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing

    return dist_checkpointing


def megatron_state(r: Rank, mdc: Any, *, with_data: bool = True) -> dict[str, Any]:
    """Rank ``r`` of 4 holds: fc1 rows split 4 ways; layer ``r`` of qkv (prepended axis), its
    columns whole; the bias replicated (rank 0 main); one object of a 4-object grid."""
    ST, SO = mdc.ShardedTensor, mdc.ShardedObject
    fc1 = full("decoder.fc1.weight")[r.rank * 4 : (r.rank + 1) * 4].clone()
    qkv = full("decoder.layers.qkv")[r.rank].clone()
    bias = full("embedding.bias").clone()
    if not with_data:
        fc1, qkv, bias = torch.zeros_like(fc1), torch.zeros_like(qkv), torch.zeros_like(bias)
    return {
        "fc1": ST.from_rank_offsets("decoder.fc1.weight", fc1, (0, r.rank, 4)),
        "layers": {
            "qkv": ST.from_rank_offsets(
                "decoder.layers.qkv", qkv, (0, r.rank, 4), prepend_axis_num=1
            )
        },
        "bias": ST.from_rank_offsets("embedding.bias", bias, replica_id=r.rank),
        "rng": SO("rng_state", {"seed": 1000 + r.rank} if with_data else None, (4,), (r.rank,)),
        **({**COMMON} if with_data else {}),
    }


def megatron_save(r: Rank, path: str) -> None:
    mdc = mcore()
    # Megatron's writer starts helper processes, which daemonic pool workers may not have;
    # they are finished before save returns (its Manager at the worker's exit).
    mp.current_process()._config["daemon"] = False
    try:
        _forked_results_queue()
        mdc.save(megatron_state(r, mdc), path)
    finally:
        mp.current_process()._config["daemon"] = True


def _forked_results_queue() -> None:
    """Megatron's writer reports through a queue of a Manager it starts by spawn: a fresh
    interpreter that imports this rank's main module, torch with it (~4.5 CPU s a rank, a
    third of a 4-rank save). A Manager forked from the rank serves the same queue at once."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()


def megatron_load(r: Rank, path: str) -> dict[str, Any]:
    """Megatron loads its own 4-rank layout; returns what it got (tensors, objects, common)."""
    mdc = mcore()
    out = mdc.load(megatron_state(r, mdc, with_data=False), path)
    return {
        "fc1": out["fc1"],
        "qkv": out["layers"]["qkv"],
        "bias": out["bias"],
        "rng": out["rng"],
        "iteration": out.get("iteration"),
    }
