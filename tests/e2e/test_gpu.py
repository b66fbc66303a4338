"""CUDA paths: GPU-resident shards, pinned staging, side-stream copies (needs a GPU)."""

from __future__ import annotations

import pytest
import torch

import dcpbridge as db
from dcpbridge.engine.ownership import WriteOwners
from dcpbridge.engine.staging import StagingArea, stage

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _gpu_state(scale: float) -> dict:
    w = torch.arange(1 << 20, dtype=torch.float32, device="cuda").reshape(1024, 1024) * scale
    b = torch.ones(1024, dtype=torch.bfloat16, device="cuda") * scale
    return {
        "w": db.ShardedTensor.from_box("w", w, (1024, 1024), (0, 0)),
        "b": db.ShardedTensor.from_box("b", b, (1024,), (0,)),
    }


def test_gpu_shards_save_and_load_into_gpu_templates(tmp_path):
    db.save(_gpu_state(2.0), str(tmp_path))
    tmpl = _gpu_state(0.0)
    out = db.load(tmpl, str(tmp_path))
    assert out["w"].is_cuda and torch.equal(out["w"], _gpu_state(2.0)["w"].data)
    assert torch.equal(out["b"], _gpu_state(2.0)["b"].data)


def test_staging_uses_pinned_buffers_and_orders_the_training_stream():
    area = StagingArea(1)
    state = _gpu_state(3.0)
    staged, buffers = stage(list(state.values()), area, WriteOwners(coordinator=True))
    assert buffers.flat.is_pinned() and buffers.events
    # the training stream's next kernel mutates the source; it must wait for the copy
    state["w"].data.mul_(0)
    buffers.wait_ready()
    assert torch.equal(staged[0].data, (torch.arange(1 << 20).reshape(1024, 1024) * 3.0).float())


def test_async_save_of_gpu_tensors_is_unaffected_by_later_updates(tmp_path):
    state = _gpu_state(5.0)
    handle = db.async_save(state, str(tmp_path))
    for sh in state.values():
        sh.data.add_(1)  # training continues immediately
    handle.result(timeout=120)
    out = db.load(
        {
            k: db.ShardedTensor.from_box(
                k, torch.zeros_like(v.data.cpu()), v.global_shape, v.global_offset
            )
            for k, v in state.items()
        },
        str(tmp_path),
    )
    assert torch.equal(out["w"], (_gpu_state(5.0)["w"].data).cpu())
