"""Background staging: an async save that returns before its copy is made, guarded by the
optimizer's step, checked by ``verify_staging``, failing on every rank, never communicating.

Staging is held back by a gate (``gated_stage``) so that every claim about order is proven
by events, never by timing.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator

import pytest
import torch

import dcpbridge as db
from dcpbridge.engine.manager import SIDECAR
from tests.support.collective_counts import record_collectives
from tests.support.dist_pool import Rank

pytestmark = pytest.mark.timeout(180)


@contextlib.contextmanager
def gated_stage(*, hold: str = "before") -> Iterator[tuple[threading.Event, threading.Event]]:
    """Within the block, staging waits for ``gate`` ``hold`` ("before"/"after") it copies the
    tensors; ``copied`` is set once the copy is made. This process only."""
    from dcpbridge.engine import save as api

    real, gate, copied = api.stage, threading.Event(), threading.Event()

    def gated(*args, **kwargs):
        if hold == "before":
            assert gate.wait(60), "the test never opened the gate"
        out = real(*args, **kwargs)
        copied.set()
        if hold == "after":
            assert gate.wait(60), "the test never opened the gate"
        return out

    api.stage = gated
    try:
        yield gate, copied
    finally:
        api.stage = real
        gate.set()


def _sharded(key: str, t: torch.Tensor, r: Rank) -> db.ShardedTensor:
    return db.ShardedTensor.from_rank_offsets(key, t, (0, r.rank, r.size))


def _load(r: Rank, path: str, like: dict[str, torch.Tensor]) -> dict:
    tmpl = {k: _sharded(k, torch.zeros_like(v), r) for k, v in like.items()}
    return db.load(tmpl, path, process_group=r.group)


def returns_before_staging(r: Rank, root: str) -> tuple[bool, bool]:
    big = torch.randn(16 << 20, generator=torch.Generator().manual_seed(r.rank))  # 64 MiB
    want = big.clone()
    with gated_stage() as (gate, done):
        handle = db.async_save(
            {"big": _sharded("big", big, r)}, root, process_group=r.group, background_staging=True
        )
        returned_early = not handle.staged and not done.is_set() and not handle.done()
        gate.set()
        handle.wait_staged(60)
        staged = handle.staged and done.is_set()
    big.zero_()  # staged: training may change the state now
    handle.result(60)
    assert torch.equal(_load(r, root, {"big": big})["big"], want)
    return returned_early, staged


def test_async_save_returns_before_staging_finishes(pool, tmp_path):
    assert pool.run(returns_before_staging, 2, str(tmp_path), timeout=120) == [(True, True)] * 2


def _model(r: Rank) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    g = torch.Generator().manual_seed(10 + r.rank)
    w = torch.nn.Parameter(torch.randn(64, 32, generator=g))
    opt = torch.optim.Adam([w], lr=0.1)
    return w, opt


def _train_step(w: torch.nn.Parameter, opt: torch.optim.Optimizer) -> None:
    w.grad = torch.ones_like(w)
    opt.step()


def _train_state(r: Rank, w: torch.nn.Parameter, opt: torch.optim.Optimizer, step: int) -> dict:
    return {
        "w": _sharded("w", w.detach(), r),
        "exp_avg": _sharded("exp_avg", opt.state[w]["exp_avg"], r),
        "step": step,
    }


def guarded_loop(r: Rank, root: str, verify: bool) -> tuple[bool, float]:
    w, opt = _model(r)
    mgr = db.CheckpointManager(
        root,
        every=1,
        async_save=True,
        process_group=r.group,
        optimizers=[opt],
        background_staging=True,
        verify_staging=verify,
    )
    seen: list[bool] = []
    _train_step(w, opt)  # Adam's state exists
    with gated_stage() as (gate, done):
        opt.register_step_pre_hook(lambda *a: seen.append(done.is_set()))  # after the manager's
        mgr.save(1, _train_state(r, w, opt, 1))
        assert mgr.saving  # held at the gate
        want = {"w": w.detach().clone(), "exp_avg": opt.state[w]["exp_avg"].clone()}
        opener = threading.Timer(0.2, gate.set)  # staging resumes while step() waits for it
        opener.start()
        _train_step(w, opt)  # the manager's hook holds this step until the copy is made
        w.data.mul_(0)  # the loop goes on mutating
        opener.join()
    mgr.wait()
    assert not mgr.saving
    mgr.close()
    out = _load(r, mgr.step_url(1), want)
    for key, value in want.items():
        assert torch.equal(out[key], value), key
    return seen == [True], mgr._guard.waited


@pytest.mark.parametrize("verify", [False, True])
def test_the_optimizer_step_waits_for_staging_and_the_save_holds_the_call_state(
    pool, tmp_path, verify
):
    results = pool.run(guarded_loop, 2, str(tmp_path / "run"), verify, timeout=120)
    assert all(ordered and waited > 0 for ordered, waited in results), results


def early_mutation(r: Rank, root: str, hold: str) -> tuple[str, bool]:
    t = torch.arange(4096, dtype=torch.float32) + 10_000 * r.rank
    other = torch.ones(128) * r.rank
    state = {"t": _sharded("t", t, r), "other": _sharded("other", other, r)}
    with gated_stage(hold=hold) as (gate, copied):
        handle = db.async_save(
            state, root, process_group=r.group, background_staging=True, verify_staging=True
        )
        if r.rank == 1:
            if hold == "before":
                t.add_(1)  # before the copy: the version counter tells
            else:
                assert copied.wait(60)
                t.numpy()[7] += 1  # after the copy, unseen by autograd: the checksum tells
        gate.set()
        handle.wait_staged(60)  # returns: nothing reads the tensors any more
    with pytest.raises(db.StagingMutationError) as info:
        handle.result(60)
    return str(info.value), os.path.exists(os.path.join(root, "dcpbridge.json"))


@pytest.mark.parametrize("hold", ["before", "after"])
def test_verify_staging_catches_a_loop_that_mutates_before_staging_is_done(pool, tmp_path, hold):
    (a, c0), (b, c1) = pool.run(early_mutation, 2, str(tmp_path / "ck"), hold, timeout=120)
    assert a == b and "rank 1" in a and "'t' (offset (4096,))" in a and "'other'" not in a
    assert ("modified in place" if hold == "before" else "differs from its staged copy") in a
    assert not c0 and not c1  # never committed


@pytest.mark.parametrize("background", [False, True])
def test_verify_staging_passes_an_unchanged_conjugate_view(tmp_path, background):
    """A plain tensor's conjugate view (staged resolved, as the save writes it) is not a
    mutation; a ShardedTensor over one is refused by name, as ``save`` refuses it."""
    x = torch.randn(6, 5, dtype=torch.complex64, generator=torch.Generator().manual_seed(3))
    live = x.conj()
    handle = db.async_save(
        {"c": live}, str(tmp_path), background_staging=background, verify_staging=True
    )
    handle.result(60)  # it failed: StagingError, the live view could not be hashed
    tmpl = {"c": db.ShardedTensor.from_box("c", torch.zeros(6, 5, dtype=x.dtype), (6, 5), (0, 0))}
    assert torch.equal(db.load(tmpl, str(tmp_path))["c"], x.conj().resolve_conj())
    state = {"c": db.ShardedTensor.from_box("c", live, (6, 5), (0, 0))}
    handle = db.async_save(
        state, str(tmp_path / "st"), background_staging=background, verify_staging=True
    )
    with pytest.raises(db.SerializationError, match=r"^ShardedTensor 'c': data is a conjugate"):
        handle.result(60)
    assert not (tmp_path / "st").exists()


def failing_staging(r: Rank, root: str) -> tuple[str, str, bool]:
    from dcpbridge.engine import save as api

    w, opt = _model(r)
    _train_step(w, opt)
    mgr = db.CheckpointManager(
        root, every=1, process_group=r.group, optimizers=[opt], background_staging=True
    )
    real = api.stage

    def no_memory(*args, **kwargs):
        raise RuntimeError("no host memory left for staging")

    if r.rank == 1:
        api.stage = no_memory
    try:
        handle = db.async_save(
            {"w": _sharded("w", w.detach(), r)},
            os.path.join(root, "direct"),
            process_group=r.group,
            background_staging=True,
        )
        handle.wait_staged(60)  # never raises: the failure is every rank's, at result()
        with pytest.raises(db.StagingError) as direct:
            handle.result(60)
        mgr.save(1, _train_state(r, w, opt, 1))
        _train_step(w, opt)  # does not hang on the failed staging
    finally:
        api.stage = real
    with pytest.raises(db.StagingError) as managed:
        mgr.save(2, _train_state(r, w, opt, 2))  # raises step 1's failure, saves nothing
    assert mgr.save(3, _train_state(r, w, opt, 3))  # the next save works again
    mgr.close()
    return str(direct.value), str(managed.value), mgr.all_steps() == [3]


def test_a_staging_failure_raises_on_every_rank_at_the_next_wait(pool, tmp_path):
    (a1, a2, ok0), (b1, b2, ok1) = pool.run(failing_staging, 2, str(tmp_path), timeout=120)
    assert a1 == b1 and a2 == b2 and ok0 and ok1
    for text in (a1, a2):
        assert "rank 1" in text and "no host memory left for staging" in text


def staging_collectives(r: Rank, root: str) -> list[tuple[str, str, str]]:
    t = torch.randn(1 << 20)
    with record_collectives() as calls, gated_stage() as (gate, done):
        handle = db.async_save(
            {"t": _sharded("t", t, r)}, root, process_group=r.group, background_staging=True
        )
        in_call = list(calls)
        gate.set()
        handle.result(60)
    assert done.is_set() and in_call
    return calls


def test_background_staging_never_communicates(pool, tmp_path):
    for calls in pool.run(staging_collectives, 2, str(tmp_path), timeout=120):
        threads = {(thread, group) for _, thread, group in calls}
        # the call's decisions on the caller's group; the write on its own store-backed group
        assert threads == {("MainThread", "Group"), ("dcpb-async-save", "StoreGroup")}, calls


def test_the_manager_refuses_background_staging_without_an_optimizer(tmp_path):
    mgr = db.CheckpointManager(
        str(tmp_path),
        every=1,
        async_save=True,
        background_staging=True,
        keep_best=1,
        best_metric="loss",
    )
    state = {"w": db.ShardedTensor.from_box("w", torch.ones(4), (4,), (0,))}
    with pytest.raises(db.InvalidArgumentError, match="optimizers=\\[opt\\]"):
        mgr.save(1, state, metrics={"loss": 1.0})
    w = torch.nn.Parameter(torch.ones(4))
    mgr.watch(torch.optim.SGD([w], lr=1.0))
    with pytest.raises(db.InvalidArgumentError, match="keep_best ranks checkpoints by 'loss'"):
        mgr.save(1, state)  # still raised in the call, the sidecar's writing is behind
    assert mgr.save(
        1, {"w": db.ShardedTensor.from_box("w", w.detach(), (4,), (0,))}, metrics={"loss": 2.0}
    )
    mgr.close()
    assert mgr.all_steps() == [1]
    sidecar = json.loads((tmp_path / "step_00000001" / SIDECAR).read_text())
    assert sidecar == {"metrics": {"loss": 2.0}, "step": 1}
    with pytest.raises(db.InvalidArgumentError):
        mgr.watch(object())  # type: ignore[arg-type]


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_async_save_of_data_without_values_names_its_key_and_offset(tmp_path, background, kind):
    """A ShardedTensor whose data is meta or sparse fails staging with a ``StagingError``
    naming its key and offset, as the synchronous save names the key (it named the URL only,
    with torch's message), and nothing is committed."""
    bad = torch.empty(4, device="meta") if kind == "meta" else torch.ones(4).to_sparse()
    state = {
        "w0": db.ShardedTensor.from_box("w", torch.ones(4), (8,), (0,)),
        "w1": db.ShardedTensor.from_box("w", bad, (8,), (4,)),
    }
    handle = db.async_save(state, str(tmp_path / "ck"), background_staging=background)
    with pytest.raises(db.StagingError) as info:
        handle.result(60)
    layout = "meta" if kind == "meta" else "torch.sparse_coo"
    assert f"'w' (offset (4,)): {layout} data cannot be saved" in str(info.value)
    assert not os.path.exists(tmp_path / "ck" / "dcpbridge.json")
