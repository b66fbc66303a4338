"""Training position across a change of data-parallel size, on real gloo ranks with real
DataLoaders (2 worker processes each, prefetching): the global sample ids consumed over a
save / resume are exactly the permutation's prefix and each resumed step's global batch is
the uninterrupted run's; per-rank loader and RNG state resume exactly in the same layout and
refuse (or, opted in, drop with a count) in another; broken checkpoints raise on every rank."""

from __future__ import annotations

import gc
import random
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import dcpbridge as db
from tests.support.dist_pool import Rank, children_allowed

pytestmark = pytest.mark.timeout(300)

N, GBS, SEED, DATASET = 100, 12, 7, "ids-v1"  # 96 samples (8 global batches) per epoch
SAVE_EVERY, TOTAL = 5, 14  # saves at 5 (epoch 0) and 10 (epoch 1)


def _sampler(r: Rank, **kw) -> db.GlobalBatchSampler:
    opts = {"seed": SEED, "dataset_id": DATASET, **kw}
    return db.GlobalBatchSampler(N, GBS, r.rank, r.size, **opts)


def _train(r: Rank, sampler: db.GlobalBatchSampler, start: int, stop: int, save=None) -> list:
    """This rank's batches of steps ``start+1..stop`` as its DataLoader yielded them, each
    marked consumed after its step; one DataLoader iteration per epoch."""
    log, step = [], start
    # earlier tests of this pool rank leave managers and the gloo side groups they made in
    # reference cycles: collected here, not by the first collection inside a forked worker
    # (it segfaulted there, destroying a backend whose threads the child does not have)
    gc.collect()
    while step < stop:
        with children_allowed():
            batches = iter(
                DataLoader(range(N), batch_sampler=sampler, num_workers=2, prefetch_factor=2)
            )
        for batch in batches:
            log.append(batch.tolist())
            step += 1
            sampler.mark_consumed()
            if save is not None:
                save(step)
            if step == stop:
                break
    return log


def save_and_continue(r: Rank, root: str) -> dict:
    """The uninterrupted run: TOTAL steps, checkpointed every SAVE_EVERY by the manager."""
    sampler = _sampler(r)
    mgr = db.CheckpointManager(root, every=SAVE_EVERY, process_group=r.group)
    ahead = []

    def save(step: int) -> None:
        if mgr.save(step, {"data": sampler, "step": step}):
            ahead.append(sampler._drawn - sampler.consumed_samples)  # prefetched, not trained

    log = _train(r, sampler, 0, TOTAL, save)
    mgr.close()
    return {"log": log, "ahead": ahead, "steps": mgr.all_steps()}


def resume(r: Rank, root: str, step: int | None) -> dict:
    sampler = _sampler(r)
    mgr = db.CheckpointManager(root, process_group=r.group, async_save=False)
    out = mgr.load({"data": sampler}, step)
    assert out["data"] is sampler
    start = out["step"]
    log = _train(r, sampler, start, TOTAL)
    mgr.close()
    return {"start": start, "log": log, "consumed": sampler.consumed_samples}


def load_error(r: Rank, root: str, kw: dict) -> str:
    """The error message this rank gets resuming with another sampler configuration."""
    try:
        db.CheckpointManager(root, process_group=r.group).load({"data": _sampler(r, **kw)})
    except db.DataStateError as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("the load did not raise")


def _epochs_are_the_permutation(log: list[list[int]]) -> None:
    """Steps' ids, epoch by epoch, are exactly each epoch's permutation prefix."""
    per_epoch = N // GBS
    perm = db.GlobalBatchSampler(N, GBS, 0, 1, seed=SEED)
    for epoch in range(0, (len(log) + per_epoch - 1) // per_epoch):
        ids = [i for b in log[epoch * per_epoch : (epoch + 1) * per_epoch] for i in b]
        assert len(set(ids)) == len(ids), f"epoch {epoch}: duplicates"
        assert ids == perm.permutation(epoch)[: len(ids)].tolist(), f"epoch {epoch}: a gap"


def _global(logs: list[list[list[int]]]) -> list[list[int]]:
    """Each step's global batch: the ranks' batches of that step in rank order."""
    return [[i for part in parts for i in part] for parts in zip(*logs)]


def _check_resumed(ref: list, saved_at: int, got: list[dict]) -> None:
    resumed = _global([rank["log"] for rank in got])
    assert len(resumed) == TOTAL - saved_at
    assert resumed == ref[saved_at:]  # the same global batches, step by step
    assert all(rank["start"] == saved_at and rank["consumed"] == TOTAL * GBS for rank in got)
    _epochs_are_the_permutation(ref[:saved_at] + resumed)


def test_position_follows_dp_2_to_4_1_and_3(pool, tmp_path):
    root = str(tmp_path / "run")
    first = pool.run(save_and_continue, 2, root, timeout=120)
    ref = _global([rank["log"] for rank in first])
    assert len(ref) == TOTAL and all(len(b) == GBS for b in ref)
    assert first[0]["steps"] == [5, 10]
    assert min(first[0]["ahead"]) > 0  # the DataLoaders had drawn batches training never saw
    _epochs_are_the_permutation(ref)
    _check_resumed(ref, 5, pool.run(resume, 4, root, 5, timeout=120))
    _check_resumed(ref, 5, pool.run(resume, 1, root, 5, timeout=120))
    _check_resumed(ref, 10, pool.run(resume, 3, root, None, timeout=120))  # the newest

    for kw, what in (
        ({"dataset_id": "ids-v2"}, "dataset"),
        ({"seed": SEED + 1}, "seed"),
    ):
        errors = pool.run(load_error, 2, root, kw, timeout=60)
        assert all(f"allow_changed=('{what}',)" in e and "'data'" in e for e in errors), errors


def test_position_follows_dp_4_to_2(pool, tmp_path):
    root = str(tmp_path / "run")
    first = pool.run(save_and_continue, 4, root, timeout=120)
    ref = _global([rank["log"] for rank in first])
    _check_resumed(ref, 5, pool.run(resume, 2, root, 5, timeout=120))
    # the global order does not depend on the DP size: DP=1 from scratch draws the same
    assert pool.run(resume_from_scratch, 1, timeout=120)[0] == ref


def resume_from_scratch(r: Rank) -> list:
    return _train(r, _sampler(r), 0, TOTAL)


def test_a_global_batch_the_new_size_cannot_split_is_refused():
    with pytest.raises(db.InvalidArgumentError, match="not divisible by dp_size 5"):
        db.GlobalBatchSampler(N, GBS, 0, 5)


# -- per-rank state -----------------------------------------------------------------------------

SAVE_AT, STREAM_STEPS, BATCH = 3, 6, 4


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _state(r: Rank, loader: StatefulDataLoader, taken: list[int], position) -> dict:
    return {
        "loader": db.PerRankState("loader", loader, r.rank, r.size, samples=lambda: taken[0]),
        "rng": db.PerRankState("rng", db.RNGState(), r.rank, r.size),
        "data": position,
        "step": SAVE_AT,
    }


def _stream(r: Rank) -> StatefulDataLoader:
    """This rank's own stream: its own samples, shuffled by its own generator."""
    ids = list(range(1000 * r.rank, 1000 * r.rank + 40))
    g = torch.Generator().manual_seed(r.rank)
    gc.collect()  # before its workers fork (see ``_train``)
    return StatefulDataLoader(ids, batch_size=BATCH, shuffle=True, num_workers=2, generator=g)


def _draws(r: Rank, it, position: db.GlobalBatchSampler, steps: range) -> list:
    out = []
    for _ in steps:
        batch = next(it).tolist()
        next(iter(position))
        position.mark_consumed()
        out.append((batch, torch.rand(2).tolist(), float(np.random.rand()), random.random()))
    return out


def per_rank_run(r: Rank, path: str, faulty: bool = False) -> list:
    """The uninterrupted stream run, saving after SAVE_AT steps; ``faulty``: rank 1's loader
    cell is not written (a checkpoint missing one rank's data state)."""
    _seed_everything(100 + r.rank)
    loader, taken, position = _stream(r), [0], _sampler(r)
    state = _state(r, loader, taken, position)
    if faulty and r.rank == 1:
        state["loader"] = db.PerRankState("loader", loader, r.rank, r.size, replica_id=1)
    with children_allowed():
        it = iter(loader)
    log = _draws(r, it, position, range(SAVE_AT))
    taken[0] = SAVE_AT * BATCH
    db.save(state, path, process_group=r.group, validate_access_integrity=not faulty)
    return log + _draws(r, it, position, range(SAVE_AT, STREAM_STEPS))


def per_rank_resume(r: Rank, path: str, mode: str) -> dict:
    _seed_everything(999)  # restored state must win over this
    loader, position = _stream(r), _sampler(r)
    state = _state(r, loader, [0], position)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = db.load(state, path, process_group=r.group, reshard_data_state=mode)
    except db.CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    assert out["loader"] is state["loader"] and out["step"] == SAVE_AT
    dropped = [str(w.message) for w in caught if w.category is db.DataStateDroppedWarning]
    with children_allowed():
        it = iter(loader)
    log = _draws(r, it, position, range(SAVE_AT, STREAM_STEPS))
    return {"log": log, "warnings": dropped, "consumed": position.consumed_samples}


def test_per_rank_state_resumes_exactly_in_the_same_layout(pool, tmp_path):
    path = str(tmp_path / "ckpt")
    ref = pool.run(per_rank_run, 2, path, timeout=120)
    got = pool.run(per_rank_resume, 2, path, "raise", timeout=120)
    for rank in range(2):
        assert got[rank]["log"] == ref[rank][SAVE_AT:]  # loader batches and all RNG draws
        assert got[rank]["warnings"] == []
    assert ref[0][SAVE_AT][0] != ref[1][SAVE_AT][0]  # the streams are the ranks' own


def test_per_rank_state_refuses_another_layout_and_drops_when_asked(pool, tmp_path):
    path = str(tmp_path / "ckpt")
    ref = pool.run(per_rank_run, 2, path, timeout=120)
    for size in (4, 1):
        errors = [x["error"] for x in pool.run(per_rank_resume, size, path, "raise", timeout=60)]
        for e in errors:
            assert e.startswith("DataLayoutError")
            assert (
                f"'loader' (ShardedObject 'loader') was saved by 2 ranks and cannot follow this job's {size}"
                in e
            )
            assert "'rng'" in e and "reshard_data_state='drop'" in e
    got = pool.run(per_rank_resume, 3, path, "drop", timeout=120)
    for rank in got:
        loader_warning, rng_warning = rank["warnings"]
        assert (
            "'loader'" in loader_warning and "saved by 2 ranks and this job has 3" in loader_warning
        )
        assert f"the {2 * SAVE_AT * BATCH} samples they held" in loader_warning
        assert "'rng'" in rng_warning and "unknown number of samples" in rng_warning
        assert rank["consumed"] == STREAM_STEPS * GBS  # the global position followed
    fresh = [b for b, *_ in got[0]["log"]]
    assert fresh != [b for b, *_ in ref[0][SAVE_AT:]]  # rank 0's stream started over


def test_a_checkpoint_missing_one_ranks_state_raises_on_every_rank(pool, tmp_path):
    path = str(tmp_path / "ckpt")
    pool.run(per_rank_run, 2, path, True, timeout=120)
    for mode in ("raise", "drop"):
        errors = [x["error"] for x in pool.run(per_rank_resume, 2, path, mode, timeout=60)]
        for e in errors:
            assert e.startswith("DataLayoutError") and "'loader'" in e
            assert "saved by 2 ranks but holds no state of rank(s) 1" in e


def test_the_save_itself_refuses_a_missing_rank_when_validating(pool, tmp_path):
    errors = pool.run(_save_missing_rank, 2, str(tmp_path / "ckpt"), timeout=60)
    assert all(e.startswith("ShardingValidationError") and "loader" in e for e in errors), errors


def _save_missing_rank(r: Rank, path: str) -> str:
    """Rank 1 marks its cell a replica (not written): the save's validation refuses."""
    state = {"loader": db.PerRankState("loader", [r.rank], r.rank, r.size, replica_id=r.rank)}
    try:
        db.save(state, path, process_group=r.group)
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("the save did not raise")
