"""The local tier behind the training loop, on real gloo ranks (nodes: ``{node}`` directories
of 2 ranks each): staging in the background (a watched optimizer waits for it), writes and
copies on the tier's thread, persistent steps uploaded from the local step's files, and
restores that receive only the checksum tiles a rank needs from its peers.
"""

from __future__ import annotations

import os
import shutil

import torch

import dcpbridge as db
from dcpbridge.engine import local_persist
from dcpbridge.engine import save as save_mod
from dcpbridge.errors import CheckpointError
from tests.e2e.test_local_tier import STEPS, _capture, manager, node_dir, piece, restore, state
from tests.support.dist_pool import Rank


class Halve(torch.optim.Optimizer):
    """Step ``n`` sets every parameter to ``p * 0.5 + n``, as ``test_local_tier.weights``."""

    def __init__(self, params) -> None:
        super().__init__(params, {})
        self.n = 0

    @torch.no_grad()
    def step(self, closure=None) -> None:
        self.n += 1
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(0.5).add_(self.n)


def loop(r: Rank, root: str, local: str, kwargs: dict, fail: dict | None = None) -> dict:
    """Steps 1..STEPS behind the loop, then one more optimizer step (which must wait for the
    last local step's staging); ``fail``: {"write"|"upload": (rank, step)} raised there."""
    from tests.e2e.test_local_tier import weights

    calls: list[tuple[int, str]] = []
    log = _capture()
    write, upload = save_mod.write_planned, local_persist._upload_file

    def failing_write(group, cache, planned, url, opts, *rest, **kw):
        if (group.rank, f"step_{fail['write'][1]:08d}") == (fail["write"][0], url[-13:]):
            planned.error = OSError("disk gone")  # raised inside the write's first step
        return write(group, cache, planned, url, opts, *rest, **kw)

    def failing_upload(local, source, store, target):
        if r.rank == fail["upload"][0]:
            raise OSError("bucket gone")
        return upload(local, source, store, target)

    if fail and "write" in fail:
        save_mod.write_planned = failing_write
    if fail and "upload" in fail:
        local_persist._upload_file = failing_upload
    w = torch.nn.Parameter(piece(weights(0), r.rank, r.size, 0))
    opt = Halve([w])
    options = dict(async_save=True, background_staging=True, optimizers=[opt])
    options.update(kwargs)
    mgr = manager(r, root, local, on_commit=lambda s, t, u: calls.append((s, t)), **options)
    raised = None
    try:
        for step in range(1, STEPS + 1):
            opt.step()
            assert torch.equal(w.detach(), piece(weights(step), r.rank, r.size, 0))
            mgr.save(step, state(w.detach(), r.rank, r.size, step))
        opt.step()  # w moves to step STEPS + 1 only once step STEPS is staged
        try:
            mgr.wait()
        except CheckpointError as e:
            raised = f"{type(e).__name__}: {e}"
        mgr.close()
    finally:
        save_mod.write_planned, local_persist._upload_file = write, upload
        import logging

        logging.getLogger("dcpbridge").removeHandler(log)
    return {"calls": sorted(calls), "log": log.lines, "raised": raised, "waited": mgr._guard.waited}


EXPECTED = sorted([*((s, "local") for s in range(1, STEPS + 1)), (4, "persistent")])


def _loop(pool, tmp_path, kwargs=None, fail=None) -> tuple[str, str, list[dict]]:
    root, local = str(tmp_path / "persistent"), str(tmp_path / "node{node}")
    out = pool.run(loop, 4, root, local, kwargs or {}, fail, timeout=120)
    return root, local, out


def test_staged_behind_the_loop_restores_the_step_as_it_was_saved(pool, tmp_path):
    root, local, out = _loop(pool, tmp_path)
    assert out[0]["calls"] == EXPECTED
    assert [o["raised"] for o in out] == [None] * 4
    assert sorted(os.listdir(node_dir(tmp_path, 1))) == ["step_00000006"]
    shutil.rmtree(node_dir(tmp_path, 1))
    back = pool.run(restore, 4, root, local, 0, 2, timeout=120)
    assert [b["step"] for b in back] == [STEPS] * 4  # the bytes of step 6, not of step 7
    shutil.rmtree(node_dir(tmp_path, 0))  # the persistent step, staged beside local step 4
    back = pool.run(restore, 4, root, local, 0, 2, timeout=120)
    assert [b["step"] for b in back] == [4] * 4


def test_a_failed_background_write_never_reaches_the_loop(pool, tmp_path):
    root, local, out = _loop(pool, tmp_path, fail={"write": (1, STEPS)})
    assert [o["raised"] for o in out] == [None] * 4
    for o in out:
        assert any(f"local step {STEPS} not committed" in x and "disk gone" in x for x in o["log"])
    assert (STEPS, "local") not in out[0]["calls"] and (STEPS - 1, "local") in out[0]["calls"]
    back = pool.run(restore, 4, root, local, 0, 2, timeout=120)
    assert [b["step"] for b in back] == [STEPS - 1] * 4


def test_persist_behind_uploads_the_local_step(pool, tmp_path):
    root, local, out = _loop(pool, tmp_path, {"persist_behind": True})
    assert out[0]["calls"] == EXPECTED
    assert sorted(os.listdir(root)) == ["step_00000004"]
    assert "manager.json" in os.listdir(os.path.join(root, "step_00000004"))
    for node in (0, 1):
        shutil.rmtree(node_dir(tmp_path, node))
    back = pool.run(restore, 4, root, local, 1, 2, timeout=120)  # another split too
    assert [b["step"] for b in back] == [4] * 4


def test_a_failed_upload_raises_on_every_rank_and_keeps_the_local_step(pool, tmp_path):
    kwargs = {"persist_behind": True, "every": STEPS}
    root, local, out = _loop(pool, tmp_path, kwargs, fail={"upload": (2, STEPS)})
    raised = [o["raised"] for o in out]
    assert all(x is not None and "bucket gone" in x and "rank 2" in x for x in raised), raised
    assert (STEPS, "persistent") not in out[0]["calls"]
    assert not os.path.exists(os.path.join(root, f"step_{STEPS:08d}"))  # nothing left behind
    back = pool.run(restore, 4, root, local, 0, 2, timeout=120)
    assert [b["step"] for b in back] == [STEPS] * 4  # from the local tier


WIDE = (512, 4096)  # rows of 16 KiB: 4 chunks of 2 MiB, checksum tiles of 64 rows x 512 cols


def wide_save(r: Rank, root: str, local: str) -> None:
    g = torch.Generator().manual_seed(3)
    full = torch.randn(WIDE, generator=g)
    mgr = manager(r, root, local, every=1000)
    w = full.chunk(r.size, dim=0)[r.rank].clone()
    mgr.save(1, {"w": db.ShardedTensor.from_rank_offsets("w", w, (0, r.rank, r.size))})
    mgr.close()


def wide_restore(r: Rank, root: str, local: str) -> dict:
    import logging

    g = torch.Generator().manual_seed(3)
    full = torch.randn(WIDE, generator=g)
    log = _capture()
    mgr = manager(r, root, local, every=1000)
    part = torch.zeros(WIDE).chunk(r.size, dim=1)[r.rank].clone()
    out = mgr.load({"w": db.ShardedTensor.from_rank_offsets("w", part, (1, r.rank, r.size))})
    assert torch.equal(out["w"], full.chunk(r.size, dim=1)[r.rank])
    mgr.close()
    logging.getLogger("dcpbridge").removeHandler(log)
    return {"log": log.lines}


def test_a_restore_receives_only_the_tiles_it_needs(pool, tmp_path):
    root, local = str(tmp_path / "persistent"), str(tmp_path / "node{node}")
    pool.run(wide_save, 4, root, local, timeout=120)
    shutil.rmtree(node_dir(tmp_path, 1))  # node 0 holds every chunk now: 2 of its own, 2 copies
    back = pool.run(wide_restore, 4, root, local, timeout=120)
    quarter = WIDE[0] * WIDE[1] * 4 // 4  # a quarter of the columns of every chunk
    for rank in (2, 3):  # node 1's ranks receive all they need, and only that
        line = next(x for x in back[rank]["log"] if "received" in x)
        assert f"rank {rank} received {quarter} bytes from peers" in line, line
