"""CUDA paths: GPU-resident shards, pinned staging, side-stream copies (also started from the
background staging thread, after an event marking the call), loads into GPU (needs a GPU)."""

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


def _load_on_cpu(state: dict, path) -> dict:
    """``path`` loaded into CPU templates shaped like ``state``'s shards."""
    return db.load(
        {
            k: db.ShardedTensor.from_box(
                k, torch.zeros_like(v.data.cpu()), v.global_shape, v.global_offset
            )
            for k, v in state.items()
        },
        str(path),
    )


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
    out = _load_on_cpu(state, tmp_path)
    assert torch.equal(out["w"], (_gpu_state(5.0)["w"].data).cpu())


def test_background_staging_of_gpu_tensors_copies_the_state_at_the_call(tmp_path):
    state = _gpu_state(5.0)
    for _ in range(50):  # queued before the call, maybe not run yet: the copy must include it
        state["w"].data.add_(1)
    want = {k: v.data.cpu() for k, v in state.items()}  # (the .cpu() waits for those kernels)
    for _ in range(50):
        state["w"].data.sub_(1)
    for _ in range(50):
        state["w"].data.add_(1)
    handle = db.async_save(state, str(tmp_path), background_staging=True, verify_staging=True)
    handle.wait_staged(120)  # the copies are queued; the caller's stream waits for them
    for sh in state.values():
        sh.data.mul_(0)  # queued at once: runs after the copies on the GPU
    handle.result(timeout=120)
    out = db.load(
        {
            k: db.ShardedTensor.from_box(k, torch.zeros_like(v), v.shape, (0,) * v.dim())
            for k, v in want.items()
        },
        str(tmp_path),
    )
    for k, v in want.items():
        assert torch.equal(out[k], v), k


def test_async_save_of_gpu_tensors_through_the_writer_process(tmp_path):
    from dcpbridge.storage.write import shared

    state = _gpu_state(7.0)
    handle = db.async_save(state, str(tmp_path), writer="process", background_staging=True)
    handle.wait_staged(120)
    for sh in state.values():
        sh.data.add_(1)  # queued after the copies on the GPU
    handle.result(timeout=120)
    segments = list(shared._by_address.values())
    assert segments and all(s.tensor.is_pinned() for s in segments)  # page-locked for CUDA
    out = _load_on_cpu(state, tmp_path)
    for k, v in _gpu_state(7.0).items():
        assert torch.equal(out[k], v.data.cpu()), k


def test_a_deferred_stream_wait_holds_the_caller_only_at_hold_streams(tmp_path):
    state = _gpu_state(9.0)
    handle = db.async_save(state, str(tmp_path), background_staging=True, defer_stream_wait=True)
    handle.wait_staged(120)
    assert len(handle._copies) == 1  # one event for the one device, not yet waited for
    handle.hold_streams()  # the caller's later kernels run after the copies
    for sh in state.values():
        sh.data.mul_(0)
    handle.result(timeout=120)
    out = _load_on_cpu(state, tmp_path)
    for k, v in _gpu_state(9.0).items():
        assert torch.equal(out[k], v.data.cpu()), k


def test_the_manager_holds_a_gpu_optimizer_step_until_staged(tmp_path):
    w = torch.nn.Parameter(torch.randn(2048, 1024, device="cuda"))
    opt = torch.optim.Adam([w], lr=0.1)
    w.grad = torch.ones_like(w)
    opt.step()
    mgr = db.CheckpointManager(
        str(tmp_path),
        every=1,
        async_save=True,
        optimizers=[opt],
        background_staging=True,
        verify_staging=True,
    )

    def state() -> dict:
        m = opt.state[w]["exp_avg"]
        return {
            "w": db.ShardedTensor.from_box("w", w.detach(), tuple(w.shape), (0, 0)),
            "m": db.ShardedTensor.from_box("m", m, tuple(m.shape), (0, 0)),
        }

    want = {"w": w.detach().cpu(), "m": opt.state[w]["exp_avg"].cpu()}
    mgr.save(1, state())
    opt.step()  # the hook waits until the copies are queued ahead of this step's kernels
    w.data.zero_()
    mgr.close()
    out = mgr.load(
        {
            k: db.ShardedTensor.from_box(k, torch.zeros_like(v), tuple(v.shape), (0, 0))
            for k, v in want.items()
        }
    )
    for k, v in want.items():
        assert torch.equal(out[k], v), k


def _mixed_gpu_state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(7)
    return {
        "big": torch.randn(1536, 1024, generator=g, device="cuda"),  # 6 MiB: spans slabs
        "bf16": torch.randn(3000, 700, generator=g, device="cuda").to(torch.bfloat16),
        "transposed": torch.randn(512, 300, generator=g, device="cuda").t(),
        **{f"small{i}": torch.randn(33, generator=g, device="cuda") for i in range(200)},
        "empty": torch.empty(0, 5, device="cuda"),
    }


def _boxes(tensors: dict[str, torch.Tensor]) -> dict[str, db.ShardedTensor]:
    return {
        k: db.ShardedTensor.from_box(k, t, tuple(t.shape), (0,) * t.ndim)
        for k, t in tensors.items()
    }


def _stored_items(path) -> dict:
    from dcpbridge.storage import FsspecCheckpointReader

    return FsspecCheckpointReader(str(path)).read_metadata().storage_data.items


@pytest.mark.parametrize("slab_bytes", [1 << 20, 32 << 20])
def test_sync_save_from_gpu_through_slabs_matches_a_cpu_save(tmp_path, monkeypatch, slab_bytes):
    from dcpbridge.storage.backends import device_copy

    monkeypatch.setattr(device_copy, "SLAB_BYTES", slab_bytes)
    monkeypatch.setattr(device_copy, "SLABS", 2)
    state = _mixed_gpu_state()
    db.save(_boxes(state), str(tmp_path / "gpu"))
    db.save(_boxes({k: v.cpu() for k, v in state.items()}), str(tmp_path / "cpu"))
    gpu, cpu = _stored_items(tmp_path / "gpu"), _stored_items(tmp_path / "cpu")
    assert gpu.keys() == cpu.keys()
    for key in gpu:  # digests computed slice by slice equal the whole-item digests
        assert gpu[key].checksums == cpu[key].checksums, key
    out = db.load(_boxes({k: torch.zeros_like(v) for k, v in state.items()}), str(tmp_path / "gpu"))
    for k, v in state.items():
        assert out[k].is_cuda and torch.equal(out[k], v), k


def test_narrow_loads_into_gpu_tensors_go_through_pinned_buffers(tmp_path):
    full = torch.arange(4096 * 64, dtype=torch.float32).reshape(4096, 64)
    db.save({"w": db.ShardedTensor.from_box("w", full, (4096, 64), (0, 0))}, str(tmp_path))
    halves = []
    for col in (0, 32):  # split on dim 1: every row is a strided piece
        dest = torch.zeros(4096, 32, device="cuda")
        out = db.load(
            {"w": db.ShardedTensor.from_box("w", dest, (4096, 64), (0, col))}, str(tmp_path)
        )
        halves.append(out["w"])
    assert torch.equal(torch.cat(halves, 1).cpu(), full)


def test_a_corrupt_item_is_refused_when_loading_into_gpu(tmp_path):
    state = _mixed_gpu_state()
    db.save(_boxes(state), str(tmp_path))
    item = _stored_items(tmp_path)[("big", (0, 0))]
    with open(tmp_path / item.file, "r+b") as f:
        f.seek(item.offset + 12345)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(db.CorruptCheckpointError, match="big"):
        db.load(_boxes({k: torch.zeros_like(v) for k, v in state.items()}), str(tmp_path))


def _fp_load_into_gpu(r, path: str) -> int:
    """A fully-parallel load into CUDA templates over gloo: boxes travel through host buffers."""
    from tests.engine.test_fully_parallel import _model

    tmpl = {
        k: db.ShardedTensor.from_box(
            k, torch.zeros_like(t, device="cuda"), tuple(t.shape), (0,) * t.ndim, replica_id=r.rank
        )
        for k, t in _model().items()
    }
    out = db.load(tmpl, path, process_group=r.group, fully_parallel=True)
    for k, t in _model().items():
        assert out[k].is_cuda and torch.equal(out[k].cpu(), t), k
    return len(out)


def test_fully_parallel_load_into_gpu_tensors_over_gloo(pool, tmp_path):
    from tests.engine.test_fully_parallel import _save_model_and_vec

    path = str(tmp_path / "ck")
    pool.run(_save_model_and_vec, 4, path)
    assert pool.run(_fp_load_into_gpu, 4, path) == [38] * 4


LOCAL_SHAPE = (64, 48)


def _local_weights(step: int, device: str) -> torch.Tensor:
    return torch.arange(64 * 48, dtype=torch.float32, device=device).reshape(LOCAL_SHAPE) + step


def _local_manager(r, root: str, local: str) -> db.CheckpointManager:
    return db.CheckpointManager(
        root,
        every=4,
        local_dir=local,
        local_every=1,
        replicas=1,
        ranks_per_node=2,
        async_save=True,
        process_group=r.group,
    )


def _local_save_from(r, root: str, local: str, device: str) -> None:
    """Six steps of GPU state: persistent step 4, local steps (with copies) up to 6."""
    mgr = _local_manager(r, root, local)
    for step in range(1, 7):
        w = _local_weights(step, device).chunk(r.size)[r.rank].clone()
        b = torch.full((32,), step, dtype=torch.bfloat16, device=device).chunk(r.size)[r.rank]
        mgr.save(
            step,
            {
                "w": db.ShardedTensor.from_rank_offsets("w", w, (0, r.rank, r.size)),
                "b": db.ShardedTensor.from_rank_offsets("b", b.clone(), (0, r.rank, r.size)),
                "step": step,
            },
        )
    mgr.close()


def _local_restore_into(r, root: str, local: str, device: str, axis: int) -> int:
    """A restart on ``r.size`` ranks split on ``axis``, into templates on ``device``."""
    mgr = _local_manager(r, root, local)
    w = torch.zeros(LOCAL_SHAPE, device=device).chunk(r.size, dim=axis)[r.rank].clone()
    b = torch.zeros(32 // r.size, dtype=torch.bfloat16, device=device)
    out = mgr.load(
        {
            "w": db.ShardedTensor.from_rank_offsets("w", w, (axis, r.rank, r.size)),
            "b": db.ShardedTensor.from_rank_offsets("b", b, (0, r.rank, r.size)),
            "step": 0,
        }
    )
    mgr.close()
    step = out["step"]
    want = _local_weights(step, "cpu").chunk(r.size, dim=axis)[r.rank]
    assert out["w"].device.type == device and torch.equal(out["w"].cpu(), want), r.rank
    assert torch.equal(out["b"].cpu(), torch.full((32 // r.size,), step, dtype=torch.bfloat16))
    return step


def test_the_local_tier_saves_gpu_state_and_restores_it_into_gpu_templates(pool, tmp_path):
    import shutil

    root, local = str(tmp_path / "persistent"), str(tmp_path / "node{node}")
    pool.run(_local_save_from, 4, root, local, "cuda", timeout=180)
    shutil.rmtree(tmp_path / "node1")  # node 1 died: its parts come from node 0's copies
    # step 6 exists only in the local tier (the persistent tier's newest is 4)
    assert pool.run(_local_restore_into, 4, root, local, "cuda", 0, timeout=180) == [6] * 4
    assert pool.run(_local_restore_into, 2, root, local, "cuda", 1, timeout=180) == [6] * 2
