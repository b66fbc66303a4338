"""User-caused failures raise a clear exception on every rank, and never commit a checkpoint."""

from __future__ import annotations

import os

import pytest
import torch

import dcpbridge as db
from tests.support import layouts as L
from tests.support.dist_pool import Rank


def _expect(fn, exc_type: type[BaseException]) -> str:
    """Run ``fn``; return the message of the expected exception (the test fails otherwise)."""
    try:
        fn()
    except exc_type as e:
        return str(e)
    raise AssertionError(f"expected {exc_type.__name__}")


def save_bad(r: Rank, path: str, case: str) -> str:
    w = L.full("w")
    if case == "overlap":  # rows [0:8] and [4:12]: both main replicas write [4:8]
        start = 0 if r.rank == 0 else 4
        sh = db.ShardedTensor.from_box("w", w[start : start + 8].clone(), (12, 8), (start, 0))
    elif case == "gap":  # rows [0:4] and [6:12]: nobody writes [4:6]
        start, size = [(0, 4), (6, 6)][r.rank]
        sh = db.ShardedTensor.from_box("w", w[start : start + size].clone(), (12, 8), (start, 0))
    elif case == "shape":  # ranks disagree on the global shape
        cols = 8 if r.rank == 0 else 16
        sh = db.ShardedTensor.from_rank_offsets("w", torch.zeros(6, cols), (0, r.rank, 2))
    elif case == "dtype":
        dtype = torch.float32 if r.rank == 0 else torch.float16
        sh = db.ShardedTensor.from_rank_offsets("w", torch.zeros(6, 8, dtype=dtype), (0, r.rank, 2))
    else:
        raise ValueError(case)
    return _expect(
        lambda: db.save({"w": sh}, path, process_group=r.group), db.ShardingValidationError
    )


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("overlap", ["'w'", "overlap", "rank 0 [0:8, 0:8]", "rank 1 [4:12, 0:8]", "[4:8, 0:8]"]),
        ("gap", ["'w'", "[4:6, 0:8]", "not written by any rank", "80 of 96"]),
        ("shape", ["'w'", "disagree", "(12, 8)", "(12, 16)", "ranks [0]", "ranks [1]"]),
        ("dtype", ["'w'", "disagree", "float32", "float16"]),
    ],
)
def test_invalid_sharding_raises_everywhere_and_commits_nothing(pool, tmp_path, case, needles):
    path = str(tmp_path / case)
    messages = pool.run(save_bad, 2, path, case)
    assert messages[0] == messages[1], "every rank sees the same report"
    for needle in needles:
        assert needle in messages[0], (needle, messages[0])
    assert not os.path.exists(os.path.join(path, "dcpbridge.json"))
    assert not [f for f in os.listdir(path) if f.endswith(".bin")] if os.path.exists(path) else True


def load_missing(r: Rank, path: str) -> str:
    tmpl = {"w": L.template("w", L.boxes("rows2", "w", r.rank)[0])}
    if r.rank == 1:
        tmpl["extra"] = db.ShardedTensor.from_box("not.saved", torch.zeros(2), (2,), (0,))
    return _expect(lambda: db.load(tmpl, path, process_group=r.group), db.MissingKeysError)


def load_strict(r: Rank, path: str, strict: str):
    keys = ["w"] if r.rank == 0 else ["w", "vec"]  # 'w_bf16' and 'idx' requested by no rank
    tmpl = {k: L.template(k, L.boxes("rows2", k, r.rank)[0]) for k in keys}
    if r.rank == 0:
        tmpl["ghost"] = db.ShardedObject("ghost", None, (1,), (0,))
    if strict == "raise_all":
        return _expect(
            lambda: db.load(tmpl, path, process_group=r.group, strict=strict),
            db.CheckpointError,
        )
    out, missing, unexpected = db.load(tmpl, path, process_group=r.group, strict=strict)
    assert "ghost" not in out and torch.equal(
        out["w"], L.expected("w", L.boxes("rows2", "w", r.rank)[0])
    )
    return missing, unexpected


def test_missing_unexpected_and_strict_modes(pool, tmp_path):
    from tests.e2e.test_reshard import save_layout

    path = str(tmp_path / "ck")
    pool.run(save_layout, 2, "rows2", path)
    a, b = pool.run(load_missing, 2, path)
    assert a == b
    assert "rank 1" in a and "'not.saved'" in a
    # return_all (Megatron's shape): (state, stored-not-requested keys of all ranks,
    # requested-not-stored keys of this rank); objects named by key, not storage name
    (m0, u0), (m1, u1) = pool.run(load_strict, 2, path, "return_all")
    assert m0 == m1 == {"idx", "w_bf16"}
    assert u0 == {"ghost"} and u1 == set()
    # raise_all: one error on every rank, before any read, with both sets
    errs = pool.run(load_strict, 2, path, "raise_all")
    assert errs[0] == errs[1]
    assert (
        "1 key(s) requested but not in the checkpoint" in errs[0] and "'ghost' (rank 0)" in errs[0]
    )
    assert "2 key(s) in the checkpoint but not requested" in errs[0] and "'w_bf16'" in errs[0]


def load_unexpected_only(r: Rank, path: str) -> str:
    tmpl = {"w": L.template("w", L.boxes("rows2", "w", r.rank)[0])}
    return _expect(
        lambda: db.load(tmpl, path, process_group=r.group, strict="raise_all"),
        db.UnexpectedKeysError,
    )


def test_unexpected_keys_raise_in_strict_mode(pool, tmp_path):
    from tests.e2e.test_reshard import save_layout

    path = str(tmp_path / "ck")
    pool.run(save_layout, 2, "rows2", path)
    a, b = pool.run(load_unexpected_only, 2, path)
    assert a == b
    assert "'idx'" in a and "'vec'" in a and "'w_bf16'" in a and "'w'" not in a.split(":", 1)[1]


def load_any(r: Rank, path: str, exc_name: str) -> str:
    tmpl = {"w": L.template("w", L.boxes("rows2", "w", r.rank)[0])}
    return _expect(lambda: db.load(tmpl, path, process_group=r.group), getattr(db, exc_name))


def save_failing_object(r: Rank, path: str) -> str:
    """Rank 1's object cannot be pickled: the plan fails on every rank, nothing is written."""
    sd = {"w": L.shard("w", L.boxes("rows2", "w", r.rank)[0])}
    if r.rank == 1:
        sd["bad"] = db.ShardedObject("bad", lambda: 0, (1,), (0,))
    return _expect(lambda: db.save(sd, path, process_group=r.group), Exception)


def test_not_a_checkpoint_and_incomplete_checkpoint(pool, tmp_path):
    msgs = pool.run(load_any, 2, str(tmp_path / "nowhere"), "NotACheckpointError")
    assert msgs[0] == msgs[1] and "no such checkpoint directory" in msgs[0]
    (tmp_path / "empty").mkdir()
    msgs = pool.run(load_any, 2, str(tmp_path / "empty"), "NotACheckpointError")
    assert "dcpbridge.json is missing" in msgs[0]

    path = str(tmp_path / "broken")
    errs = pool.run(save_failing_object, 2, path)
    assert errs[0] == errs[1] and "rank 1" in errs[0] and "bad" in errs[0]
    assert not os.path.exists(path) or os.listdir(path) == []  # refused while planning
    # a process killed while saving leaves data without a commit file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "__0_0.0123456789abcdef.bin"), "wb") as f:
        f.write(b"\0" * 64)
    msgs = pool.run(load_any, 2, path, "IncompleteCheckpointError")
    assert msgs[0] == msgs[1] and "incomplete checkpoint" in msgs[0]
    with pytest.raises(db.IncompleteCheckpointError):
        db.load_tensors_metadata(path)


def test_failed_resave_keeps_previous_checkpoint(pool, tmp_path):
    """A save that fails into an existing checkpoint leaves the old one intact and loadable."""
    from tests.e2e.test_reshard import load_layout, save_layout

    path = str(tmp_path / "ck")
    pool.run(save_layout, 2, "rows2", path)
    before = sorted(os.listdir(path))
    pool.run(save_failing_object, 2, path)
    pool.run(load_layout, 2, "cols2", path)
    pool.run(save_layout, 2, "rows2", path)  # a successful re-save removes everything stale
    after = sorted(os.listdir(path))
    assert len(after) == len(before) and set(after).isdisjoint(set(before) - {"dcpbridge.json"})


def load_wrong_shape(r: Rank, path: str) -> str:
    tmpl = {"w": db.ShardedTensor.from_rank_offsets("w", torch.zeros(6, 9), (0, r.rank, 2))}
    return _expect(lambda: db.load(tmpl, path, process_group=r.group), db.ShapeMismatchError)


def load_wrong_dtype(r: Rank, path: str) -> str:
    tmpl = {
        "w": db.ShardedTensor.from_rank_offsets(
            "w", torch.zeros(6, 8, dtype=torch.float64), (0, r.rank, 2)
        )
    }
    return _expect(lambda: db.load(tmpl, path, process_group=r.group), db.DTypeMismatchError)


def test_shape_and_dtype_mismatch_on_load(pool, tmp_path):
    from tests.e2e.test_reshard import save_layout

    path = str(tmp_path / "ck")
    pool.run(save_layout, 2, "rows2", path)
    msgs = pool.run(load_wrong_shape, 2, path)
    assert msgs[0] == msgs[1] and "(12, 8)" in msgs[0] and "(12, 9)" in msgs[0]
    msgs = pool.run(load_wrong_dtype, 2, path)
    assert "float32" in msgs[0] and "float64" in msgs[0]
    # an explicit cast is allowed on request
    out = db.load(
        {
            "w": db.ShardedTensor.from_box(
                "w", torch.zeros(12, 8, dtype=torch.float64), (12, 8), (0, 0)
            )
        },
        path,
        allow_dtype_cast=True,
    )
    assert torch.equal(out["w"], L.full("w").double())
