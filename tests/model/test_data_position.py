"""GlobalBatchSampler and PerRankState in one process: the order does not depend on the DP
size, the position jumps without replay, hostile saved state is refused, the load checks."""

from __future__ import annotations

import json
import random
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import dcpbridge as db
from dcpbridge.model.data_position import epoch_seed
from dcpbridge.model.per_rank import check_per_rank
from dcpbridge.storage.format.document import sign_document

pytestmark = pytest.mark.timeout(120)

N, GBS = 100, 12  # 96 samples per epoch: 8 global batches, 4 samples dropped


def sampler(rank: int = 0, size: int = 1, **kw) -> db.GlobalBatchSampler:
    return db.GlobalBatchSampler(N, GBS, rank, size, seed=kw.pop("seed", 3), **kw)


def global_batches(size: int, steps: int) -> list[list[int]]:
    """``steps`` global batches as ``size`` DP ranks draw them, concatenated in rank order."""
    ranks = [sampler(r, size) for r in range(size)]
    out = []
    while len(out) < steps:
        iters = [iter(s) for s in ranks]
        for parts in zip(*iters):
            out.append([i for p in parts for i in p])
            for s in ranks:
                s.mark_consumed()
            if len(out) == steps:
                break
    return out


def test_global_batches_do_not_depend_on_the_dp_size():
    one = global_batches(1, 20)
    for size in (2, 3, 4, 6, 12):
        assert global_batches(size, 20) == one
    epoch0 = [i for b in one[:8] for i in b]
    assert len(set(epoch0)) == 96 and set(epoch0) <= set(range(N))  # no duplicate
    assert epoch0 == sampler().permutation(0)[:96].tolist()  # the permutation's prefix
    epoch1 = [i for b in one[8:16] for i in b]
    assert len(set(epoch1)) == 96 and epoch1 != epoch0  # the next epoch: another permutation
    assert epoch1 == sampler().permutation(1)[:96].tolist()


def test_epoch_seeds_are_mixed():
    seeds = {epoch_seed(s, e) for s in range(50) for e in range(50)}
    assert len(seeds) == 2500 and all(0 <= x < 1 << 63 for x in seeds)


def test_resume_jumps_to_the_position_in_a_dataloader_with_workers():
    s = sampler()
    loader = DataLoader(range(N), batch_sampler=s, num_workers=2, prefetch_factor=2)
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(3)]
    for _ in seen:
        s.mark_consumed()
    assert s._drawn > s.consumed_samples  # the workers were fed ahead of training
    state = s.state_dict()
    del it
    assert state["consumed_samples"] == 36 and state["sample_in_epoch"] == 36
    t = sampler(0, 4)
    t.load_state_dict(state)
    assert len(t) == 5
    parts = [sampler(r, 4) for r in range(4)]
    for p in parts:
        p.load_state_dict(state)
    nxt = [i for p in parts for i in next(iter(p))]
    assert nxt == global_batches(1, 4)[3]
    assert seen == global_batches(1, 3)


def test_mark_consumed_refuses_more_than_was_drawn():
    s = sampler()
    with pytest.raises(db.InvalidArgumentError, match="past what this sampler yielded"):
        s.mark_consumed()
    it = iter(s)
    next(it)
    s.mark_consumed()
    with pytest.raises(db.InvalidArgumentError):
        s.mark_consumed()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("epoch", -1, "epoch"),
        ("epoch", True, "epoch"),
        ("seed", 1.5, "seed"),
        ("consumed_samples", 1 << 70, "consumed_samples"),
        ("consumed_samples", 13, "multiples"),
        ("sample_in_epoch", 96, "past the epoch"),
        ("sample_in_epoch", 48, "less than"),
        ("global_batch_size", 0, "global_batch_size"),
        ("num_samples", "100", "num_samples"),
        ("dataset_id", 5, "dataset_id"),
        ("version", 2, "version"),
        ("extra", 1, "fields"),
    ],
)
def test_hostile_saved_positions_are_refused(field, value, match):
    state = sampler().state_dict()
    state["consumed_samples"] = 24
    state["sample_in_epoch"] = 24
    state[field] = value
    with pytest.raises(db.DataStateError, match=match):
        sampler().load_state_dict(state)


def test_not_a_mapping_is_refused():
    with pytest.raises(db.DataStateError, match="mapping"):
        sampler().load_state_dict([1, 2])


def _saved(tmp_path, **kw) -> str:
    s = sampler(**kw)
    it = iter(s)
    for _ in range(2):
        next(it)
        s.mark_consumed()
    path = str(tmp_path / "ckpt")
    db.save({"data": s, "step": 2}, path)
    return path


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"dataset_id": "other"}, "dataset"),
        ({"seed": 4}, "seed"),
        ({"gbs": 24}, "global_batch_size"),
    ],
)
def test_a_checkpoint_of_other_data_seed_or_batch_raises_unless_allowed(tmp_path, kw, name):
    path = _saved(tmp_path, dataset_id="ids")
    kw = {"dataset_id": "ids", **kw}
    gbs = kw.pop("gbs", GBS)
    s = db.GlobalBatchSampler(N, gbs, 0, 1, seed=kw.pop("seed", 3), **kw)
    with pytest.raises(db.DataStateError, match=f"state 'data'.*allow_changed=\\('{name}',\\)"):
        db.load({"data": s}, path)
    assert s.consumed_samples == 0
    allowed = db.GlobalBatchSampler(
        N, gbs, 0, 1, seed=s.seed, dataset_id=s.dataset_id, allow_changed=(name,)
    )
    out = db.load({"data": allowed}, path)
    assert out["data"] is allowed and allowed.consumed_samples == 24 and out["step"] == 2


def test_a_batch_change_must_land_on_a_multiple(tmp_path):
    path = _saved(tmp_path)  # 24 consumed
    s = db.GlobalBatchSampler(N, 36, 0, 1, seed=3, allow_changed=("global_batch_size",))
    with pytest.raises(db.DataStateError, match="not a multiple of the new global_batch_size"):
        db.load({"data": s}, path)


def test_a_tampered_position_in_a_checkpoint_is_refused(tmp_path):
    state = sampler().state_dict()
    state["consumed_samples"] = -12
    path = str(tmp_path / "bad")
    db.save({"data": state}, path)
    with pytest.raises(db.DataStateError, match=r"state 'data'.*consumed_samples") as err:
        db.load({"data": sampler()}, path)
    assert isinstance(err.value.__cause__, db.DataStateError)


def test_rng_state_round_trips(tmp_path):
    rng = db.RNGState()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    path = str(tmp_path / "rng")
    db.save({"rng": db.PerRankState("rng", rng, 0, 1)}, path)
    expect = (random.random(), np.random.rand(), torch.rand(2).tolist())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    db.load({"rng": db.PerRankState("rng", db.RNGState(), 0, 1)}, path)
    assert (random.random(), np.random.rand(), torch.rand(2).tolist()) == expect


def test_rng_state_refuses_garbage():
    with pytest.raises(db.DataStateError, match="RNG state"):
        db.RNGState().load_state_dict({"python": 1, "numpy": 2, "torch": 3, "cuda": []})
    with pytest.raises(db.DataStateError, match="keys"):
        db.RNGState().load_state_dict({"python": 1})


@pytest.mark.parametrize("value", [(1 << 32) + 5, -1])
def test_an_rng_state_whose_numpy_key_leaves_32_bits_is_refused(value):
    """NumPy's key words are uint32, stored as int64: one outside [0, 2**32) was cut to its
    low 32 bits and restored as another state than the stored one, silently."""
    stored = db.RNGState().state_dict()
    name, key, *rest = stored["numpy"]
    key = key.clone()
    key[3] = value
    stored["numpy"] = (name, key, *rest)
    np.random.seed(6)
    before = np.random.get_state()
    with pytest.raises(db.DataStateError, match=r"numpy key .*outside \[0, 2\*\*32\)"):
        db.RNGState().load_state_dict(stored)
    after = np.random.get_state()
    assert np.array_equal(after[1], before[1]) and after[2:] == before[2:]


@pytest.mark.parametrize("value", [(1 << 32) + 5, (1 << 64) - 1, -1])
def test_an_rng_state_whose_python_words_leave_32_bits_is_refused(value):
    """``random.setstate`` keeps the low 32 bits of each word of Mersenne Twister's state: a
    stored word of 2**32 or more restored another state than the stored one, silently."""
    stored = db.RNGState().state_dict()
    version, words, gauss = stored["python"]
    stored["python"] = (version, (*words[:3], value, *words[4:]), gauss)
    random.seed(6)
    before = random.getstate()
    with pytest.raises(db.DataStateError, match=r"python state .*outside \[0, 2\*\*32\)"):
        db.RNGState().load_state_dict(stored)
    assert random.getstate() == before


def _numpy_state(stored: dict, *, key: torch.Tensor | None = None, **fields: object) -> None:
    name, old_key, pos, has_gauss, gauss = stored["numpy"]
    fields = {"pos": pos, "has_gauss": has_gauss, "gauss": gauss} | fields
    stored["numpy"] = (name, old_key if key is None else key, *fields.values())


def _python_position(stored: dict, pos: int) -> None:
    version, words, gauss = stored["python"]
    stored["python"] = (version, (*words[:-1], pos), gauss)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda s: _numpy_state(s, pos=10**6), "numpy position"),  # read past the key: SIGSEGV
        (lambda s: _numpy_state(s, pos=-1), "numpy position"),  # read before the key
        (lambda s: _numpy_state(s, pos=1 << 70), "numpy position"),  # was a bare OverflowError
        (lambda s: _numpy_state(s, key=torch.zeros(5, dtype=torch.int64)), "624 words"),
        (lambda s: _numpy_state(s, has_gauss=1 << 70), "too large"),  # bare OverflowError
        (lambda s: _python_position(s, 1 << 70), "too large"),  # bare OverflowError
    ],
    ids=[
        "numpy-pos-past",
        "numpy-pos-negative",
        "numpy-pos-huge",
        "numpy-key-short",
        "numpy-gauss-huge",
        "python-pos-huge",
    ],
)
def test_an_rng_state_with_positions_out_of_range_is_refused(edit, needle):
    """NumPy's legacy generator took a stored position outside its 624 words as it was, and
    its next draw read memory outside the key (a crash at 10**6); numbers too large for C and
    a short key raised bare OverflowError / IndexError. Each is a ``DataStateError`` now,
    before any generator changed."""
    stored = db.RNGState().state_dict()
    edit(stored)
    random.seed(6)
    np.random.seed(6)
    before = (random.getstate(), np.random.get_state())
    with pytest.raises(db.DataStateError, match=needle) as err:
        db.RNGState().load_state_dict(stored)
    assert isinstance(err.value.__cause__, (ValueError, OverflowError, IndexError))
    after = (random.getstate(), np.random.get_state())
    assert after[0] == before[0] and np.array_equal(after[1][1], before[1][1])
    assert after[1][2:] == before[1][2:]


def test_an_rng_state_that_fails_midway_changes_no_generator():
    """A stored torch state torch refuses (after Python's and NumPy's were set) puts every
    generator back: NumPy's stayed changed."""
    stored = db.RNGState().state_dict()
    stored["torch"] = torch.zeros(7, dtype=torch.uint8)  # the right type, not a state
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    before = db.RNGState().state_dict()
    random.seed(8)  # what the stored state holds differs from ``before``
    np.random.seed(8)
    stored["python"], stored["numpy"] = random.getstate(), db.RNGState().state_dict()["numpy"]
    random.setstate(before["python"])
    np.random.set_state((before["numpy"][0], before["numpy"][1].numpy(), *before["numpy"][2:]))
    with pytest.raises(db.DataStateError, match="RNG state cannot be restored"):
        db.RNGState().load_state_dict(stored)
    after = db.RNGState().state_dict()
    assert after["python"] == before["python"]
    assert (
        torch.equal(after["numpy"][1], before["numpy"][1])
        and after["numpy"][2:] == before["numpy"][2:]
    )
    assert torch.equal(after["torch"], before["torch"])


def test_per_rank_decisions_from_stored_keys():
    state = db.PerRankState("loader", None, 0, 2)
    cells = ["loader/shard_0_2", "loader/shard_1_2", "loader.samples/shard_0_2"]
    assert check_per_rank({"l": state}, cells, "raise") == []
    with pytest.raises(db.DataLayoutError, match=r"holds no state of rank\(s\) 1"):
        check_per_rank({"l": state}, cells[:1], "drop")
    with pytest.raises(db.DataLayoutError, match="not in the checkpoint"):
        check_per_rank({"l": state}, [], "raise")
    grown = db.PerRankState("loader", None, 0, 4)
    with pytest.raises(db.DataLayoutError, match="saved by 2 ranks and cannot follow"):
        check_per_rank({"l": grown}, cells, "raise")
    (dropped,) = check_per_rank({"l": grown}, cells, "drop")
    assert (dropped.saved_size, dropped.counted) == (2, ())  # one count cell missing
    with pytest.raises(db.InvalidArgumentError, match="reshard_data_state"):
        check_per_rank({"l": grown}, cells, "keep")


def test_a_plain_value_per_rank_state_comes_back(tmp_path):
    path = str(tmp_path / "buf")
    db.save({"buf": db.PerRankState("buf", [1, 2, 3], 0, 1, samples=lambda: 3)}, path)
    back = db.PerRankState("buf", [], 0, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = db.load({"buf": back}, path)
    assert out["buf"] is back and back.value == [1, 2, 3]


def test_dropping_counts_the_samples_every_saved_rank_held(tmp_path):
    path = str(tmp_path / "two")
    cells = {
        f"r{r}": db.PerRankState("loader", [r], r, 2, samples=lambda r=r: 5 + r) for r in (0, 1)
    }
    db.save({**cells, "step": 3}, path)  # one process holding both ranks' cells
    with pytest.raises(db.DataLayoutError, match="saved by 2 ranks and cannot follow this job's 1"):
        db.load({"loader": db.PerRankState("loader", [], 0, 1)}, path)
    fresh = db.PerRankState("loader", [], 0, 1)
    with pytest.warns(db.DataStateDroppedWarning, match="the 11 samples they held"):
        out = db.load({"loader": fresh}, path, reshard_data_state="drop")
    assert out["loader"] is fresh and fresh.value == [] and out["step"] == 3


def _grid_resized(path: str, key: str, size: int) -> None:
    """Re-sign ``path``'s commit file with ShardedObject ``key``'s one-cell grid (and its
    sample count's) named a grid of ``size`` cells, as a damaged or hostile document would."""
    meta = f"{path}/dcpbridge.json"
    with open(meta) as f:
        raw = f.read()
    for name in (key, key + ".samples"):
        raw = raw.replace(f'"{name}/shard_0_1"', f'"{name}/shard_0_{size}"')
    doc = json.loads(raw)
    for info in doc["planner_data"]["objects"].values():
        info["global_shape"] = [size]
    with open(meta, "wb") as f:
        f.write(sign_document(doc))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["raise", "drop"])
def test_a_stored_grid_of_a_trillion_ranks_is_refused_at_once(tmp_path, mode):
    """A per-rank state's grid size comes from the checkpoint's object names: one cell named
    ``key/shard_0_1000000000000`` made the layout check build a set of 10**12 ranks (memory
    without bound, the load never returned). Now the missing ranks are found from the cells
    present: DataLayoutError naming the state, the first missing ranks and their count."""
    size = 10**12
    cells = [f"loader/shard_0_{size}", f"loader.samples/shard_0_{size}"]
    state = db.PerRankState("loader", None, 0, 1)
    with pytest.raises(db.DataLayoutError, match=r"holds no state of rank\(s\) 1, 2, ") as e:
        check_per_rank({"l": state}, cells, mode)
    assert f"{size - 1} of {size} ranks" in str(e.value)
    path = str(tmp_path / "ck")
    db.save({"loader": db.PerRankState("loader", [7], 0, 1, samples=lambda: 1)}, path)
    _grid_resized(path, "loader", size)
    back = db.PerRankState("loader", [], 0, 1)
    with pytest.raises(db.DataLayoutError, match="per-rank state 'loader'"):
        db.load({"loader": back}, path, reshard_data_state=mode)
    assert back.value == []


def _python_gauss(stored: dict, gauss: object) -> None:
    version, words, _ = stored["python"]
    stored["python"] = (version, words, gauss)


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: _python_gauss(s, "abc"),  # random.gauss() then raised a bare TypeError
        lambda s: _python_gauss(s, float("nan")),  # drawn as the next normal sample
        lambda s: _python_gauss(s, 10**400),  # drawn as the next normal sample
        lambda s: _python_gauss(s, [1.0]),
        lambda s: _numpy_state(s, has_gauss=1, gauss=float("nan")),
        lambda s: _numpy_state(s, has_gauss=1, gauss=float("-inf")),
    ],
    ids=["python-text", "python-nan", "python-huge", "python-list", "numpy-nan", "numpy-inf"],
)
def test_an_rng_state_with_a_cached_gaussian_no_generator_makes_is_refused(tmp_path, edit):
    """Python's and NumPy's generators keep the second normal sample of a pair; a stored one
    that no generator makes (text, a list, NaN, infinity, 10**400) was set as it was: the next
    ``random.gauss()`` raised a bare TypeError or returned it, ``np.random.standard_normal()``
    returned NaN. Now DataStateError names it, through a real checkpoint, and no generator
    changes."""
    stored = db.RNGState().state_dict()
    edit(stored)
    path = str(tmp_path / "rng")
    db.save({"rng": db.PerRankState("rng", stored, 0, 1)}, path)
    random.seed(6)
    np.random.seed(6)
    before = (random.getstate(), np.random.get_state())
    with pytest.raises(db.DataStateError, match=r"state 'rng'.*cached gaussian") as err:
        db.load({"rng": db.PerRankState("rng", db.RNGState(), 0, 1)}, path)
    assert isinstance(err.value.__cause__, db.DataStateError)
    after = (random.getstate(), np.random.get_state())
    assert after[0] == before[0] and np.array_equal(after[1][1], before[1][1])
    assert after[1][2:] == before[1][2:]


def _torch_cached_normal(stored: dict, *, double: bool) -> None:
    """Set the cached normal sample in a stored CPU generator state to NaN (torch's layout:
    normal_x, normal_y, normal_rho and normal_is_valid at bytes 5016-5044, then the float
    sample and its flag at 5048 and 5052)."""
    raw = bytearray(stored["torch"].numpy().tobytes())
    if double:
        raw[5024:5032] = np.float64(np.nan).tobytes()  # normal_y: the cached double
        raw[5040:5044] = np.int32(1).tobytes()
    else:
        raw[5048:5052] = np.float32(np.nan).tobytes()
        raw[5052] = 1
    stored["torch"] = torch.frombuffer(raw, dtype=torch.uint8).clone()


@pytest.mark.parametrize("double", [False, True], ids=["float", "double"])
def test_an_rng_state_with_a_nan_torch_normal_sample_is_refused(tmp_path, double):
    """torch's CPU generator state caches a normal sample too; torch takes a NaN there, and
    the next ``torch.randn`` (float) or ``normal_`` (float64) started with NaN. Now DataStateError names it, through a real
    checkpoint, and torch's generator is unchanged."""
    assert db.RNGState().state_dict()["torch"].numel() == 5056  # the layout edited here
    stored = db.RNGState().state_dict()
    _torch_cached_normal(stored, double=double)
    path = str(tmp_path / "rng")
    db.save({"rng": db.PerRankState("rng", stored, 0, 1)}, path)
    torch.manual_seed(6)
    before = torch.get_rng_state()
    with pytest.raises(db.DataStateError, match=r"state 'rng'.*torch cached normal sample"):
        db.load({"rng": db.PerRankState("rng", db.RNGState(), 0, 1)}, path)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.randn(4).isfinite().all()


@pytest.mark.parametrize("order", ["data-first", "rng-first"])
def test_a_refused_rng_state_leaves_the_data_position_unchanged(tmp_path, order):
    """Top-level Statefuls were loaded one by one: a checkpoint whose RNG cell is refused
    (here a NaN cached gaussian) raised only after the sampler before it had jumped to the
    checkpoint's position, so the job's live state was half the checkpoint's. Now every
    dcpbridge Stateful's state is checked before any of them changes."""
    saved = sampler()
    for _ in zip(range(3), iter(saved)):
        saved.mark_consumed()
    rng = db.RNGState().state_dict()
    _numpy_state(rng, has_gauss=1, gauss=float("nan"))
    cells = {"data": saved, "rng": db.PerRankState("rng", rng, 0, 1)}
    path = str(tmp_path / "ck")
    db.save(dict(sorted(cells.items(), reverse=order == "rng-first")), path)
    fresh = sampler()
    template = {"data": fresh, "rng": db.PerRankState("rng", db.RNGState(), 0, 1)}
    template = dict(sorted(template.items(), reverse=order == "rng-first"))
    with pytest.raises(db.DataStateError, match=r"state 'rng'.*cached gaussian"):
        db.load(template, path)
    assert fresh.consumed_samples == 0 and fresh.state_dict() == sampler().state_dict()
