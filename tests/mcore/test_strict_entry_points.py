"""Every entry point that takes ``strict`` behaves as ``load`` (Megatron's meaning), checked
against Megatron-Core's own ``to_state_dict`` and validation where they run, and every
key-mismatch error names every key up to the stated limit."""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcpbridge as db
from dcpbridge.planners.errors import KEY_LIST_LIMIT
from dcpbridge.planners.strict import STRICT_VALUES, decide, parse_strict
from tests.support import megatron_cpu as M
from tests.support.dist_pool import Rank

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TASD = db.TensorAwareStateDict
NON_RAISING = ("return_all", "return_unexpected", "log_all", "log_unexpected", "ignore_all")


# -- one state, in Megatron's types or dcpbridge's ------------------------------------------------


def _kept(r: Rank, types: Any) -> dict[str, Any]:
    """What rank ``r`` of 4 keeps: its rows of w, a replicated bias, its cell of object ObjB."""
    return {
        "w": types.ShardedTensor.from_rank_offsets(
            "w", torch.full((2, 3), r.rank * 1.0), (0, r.rank, 4)
        ),
        "bias": types.ShardedTensor.from_rank_offsets("bias", torch.ones(5), replica_id=r.rank),
        "objs": types.ShardedObject("ObjB", {"rank": r.rank}, (4,), (r.rank,)),
        "iteration": 7,
    }


def _request(r: Rank, types: Any, extra: bool) -> dict[str, Any]:
    """Rank ``r``'s template: w only (bias and ObjB are kept but requested by no rank); with
    ``extra``, rank 2 also asks for a tensor and an object nobody kept."""
    sd: dict[str, Any] = {
        "w": types.ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, r.rank, 4))
    }
    if extra and r.rank == 2:
        sd["ghost"] = types.ShardedTensor.from_rank_offsets("ghost", torch.zeros(2))
        sd["objc"] = types.ShardedObject("ObjC", None, (4,), (r.rank,))
    return sd


def _outcome(fn: Any, raises: tuple[type[BaseException], ...]) -> Any:
    try:
        out = fn()
    except raises as e:
        return "raise", str(e)
    return "ok", out


def megatron_vs_ours(r: Rank, extra: bool) -> dict[str, Any]:
    """Each policy's outcome from Megatron's real ``MCoreTensorAwareStateDict.to_state_dict``
    (or, where that trips its own assertion on a requested key nobody kept, from the
    validation it runs first) and from dcpbridge's, on the same kept state and request."""
    mdc = M.mcore()
    from megatron.core.dist_checkpointing import validation as V
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import (
        MCoreTensorAwareStateDict,
    )
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    sharded, _ = extract_sharded_base(_kept(r, mdc))  # what its from_state_dict keeps
    theirs_state = MCoreTensorAwareStateDict(common={"iteration": 7}, sharded_state_dict=sharded)
    ours_state, _ = TASD.from_state_dict(_kept(r, db), algo="atomic", parallelization_group=r.group)
    stored = {sh.key: sh.without_data() for sh in nested_values(sharded)}

    def theirs(strict: Any) -> Any:
        if extra and strict.value in NON_RAISING:  # its to_state_dict would assert: validate
            part, _ = extract_sharded_base(_request(r, mdc, extra))
            local, everyone = V.determine_global_metadata(part)
            _, missing, unexpected = V.validate_integrity_and_strict_load(
                part, strict, False, local, everyone, stored
            )
            return missing, unexpected
        _, missing, unexpected = theirs_state.to_state_dict(
            _request(r, mdc, extra),
            algo="atomic",
            validate_access_integrity=False,
            strict=strict,
            return_mismatch_keys=True,
        )
        return missing, unexpected

    def ours(strict: Any) -> Any:
        result, missing, unexpected = ours_state.to_state_dict(
            _request(r, db, extra),
            algo="atomic",
            validate_access_integrity=False,
            parallelization_group=r.group,
            strict=strict,
            return_mismatch_keys=True,
        )
        assert torch.equal(result["w"], torch.full((2, 3), r.rank * 1.0))
        assert "ghost" not in result and "objc" not in result and result["iteration"] == 7
        return missing, unexpected

    # Megatron's restore fails an assertion on a requested key nobody kept under the one
    # policy that skips its check (assume_ok_unexpected): a raise all the same
    raises = (mdc.core.CheckpointingException, AssertionError)
    out: dict[str, Any] = {}
    for policy in STRICT_VALUES[1:]:  # Megatron's eight
        strict = V.StrictHandling(policy)
        out[policy] = (
            _outcome(functools.partial(theirs, strict), raises),
            _outcome(functools.partial(ours, strict), (db.CheckpointError,)),
        )
    return out


@pytest.mark.interop
@pytest.mark.parametrize("extra", [False, True], ids=["stored_not_requested", "both_kinds"])
def test_to_state_dict_strict_matches_megatron(pool, extra):
    results = pool.run(megatron_vs_ours, 4, extra, default_group=True, timeout=120)
    for rank, per_policy in enumerate(results):
        for policy, ((theirs, t_value), (ours, o_value)) in per_policy.items():
            assert theirs == ours, (rank, policy, t_value, o_value)  # raises where Megatron does
            if ours == "ok":  # (missing, unexpected): Megatron's order, meaning and naming
                assert o_value == t_value, (rank, policy)
    ours_return_all = [per_policy["return_all"][1][1] for per_policy in results]
    unexpected = {"ghost", "ObjC"} if extra else set()
    assert ours_return_all == [
        ({"bias", "ObjB"}, unexpected if rank == 2 else set()) for rank in range(4)
    ]
    raise_all = {per_policy["raise_all"][1][1] for per_policy in results}
    assert len(raise_all) == 1  # every rank raises the same error
    text = raise_all.pop()
    assert "in the state each rank kept itself" in text and "'ObjB'" in text and "'bias'" in text
    assert ("'ghost' (rank 2)" in text and "'ObjC' (rank 2)" in text) == extra
    assert "shard_" not in text


def tasd_raise_all(r: Rank) -> tuple[str, str]:
    state, _ = TASD.from_state_dict(_kept(r, db), parallelization_group=r.group)
    template = _request(r, db, extra=True)
    with pytest.raises(db.KeyMismatchError) as e:  # one error, both kinds
        state.to_state_dict(template, parallelization_group=r.group, strict="RAISE_ALL")
    assert isinstance(e.value, db.MissingKeysError) and isinstance(e.value, db.UnexpectedKeysError)
    return type(e.value).__name__, str(e.value)


def test_to_state_dict_raise_all_names_both_kinds_on_every_rank(pool):
    results = pool.run(tasd_raise_all, 4)
    assert len(set(results)) == 1
    text = results[0][1]
    assert "2 key(s) requested but not in the state kept by the group" in text
    assert "'ObjC' (rank 2)" in text and "'ghost' (rank 2)" in text
    assert "2 key(s) in the state kept by the group but not requested by any rank" in text
    assert "'ObjB'" in text and "'bias'" in text and "shard_" not in text


def tasd_logs_and_ignores(r: Rank) -> list[Any]:
    state, _ = TASD.from_state_dict(_kept(r, db), parallelization_group=r.group)
    out = []
    for policy in ("log_all", "ignore_all", "return_unexpected"):
        got = state.to_state_dict(
            _request(r, db, True), parallelization_group=r.group, strict=policy
        )
        result = got[0] if isinstance(got, tuple) else got
        assert torch.equal(result["w"], torch.full((2, 3), r.rank * 1.0))
        assert "ghost" not in result and "objc" not in result  # skipped
        out.append(got[1:] if isinstance(got, tuple) else None)
    plain = state.to_state_dict(
        _request(r, db, False),
        parallelization_group=r.group,
        strict="return_all",
        return_mismatch_keys=False,
    )
    assert isinstance(plain, dict)  # Megatron's return_mismatch_keys=False: the state only
    return out


def test_to_state_dict_non_raising_policies(pool):
    results = pool.run(tasd_logs_and_ignores, 4)
    for rank, (log_all, ignore_all, return_unexpected) in enumerate(results):
        assert log_all is None and ignore_all is None
        assert return_unexpected == (set(), {"ghost", "ObjC"} if rank == 2 else set())


# -- the DCP planner: strict for plain dcp.load ---------------------------------------------------


@pytest.fixture
def saved(tmp_path) -> str:
    path = str(tmp_path / "ck")
    db.save(
        {
            "w": db.ShardedTensor.from_box("w", torch.ones(4), (4,), (0,)),
            "obj": db.ShardedObject("ObjB", {"x": 1}, (1,), (0,)),  # stored as ObjB/shard_0_1
        },
        path,
    )
    return path


def _dcp_load(path: str, sd: dict[str, Any], strict: Any) -> db.ShardedLoadPlanner:
    planner = db.ShardedLoadPlanner(strict=strict)
    reader = db.FsspecCheckpointReader(path)
    dcp.load(sd, storage_reader=reader, planner=planner, no_dist=True)
    return planner


def test_sharded_load_planner_takes_megatron_policies(saved):
    from megatron.core.dist_checkpointing.validation import StrictHandling as MegatronStrict

    sd = {"w": torch.zeros(4), "ghost": torch.zeros(2)}
    planner = _dcp_load(saved, sd, MegatronStrict.RETURN_ALL)
    assert torch.equal(sd["w"], torch.ones(4))
    assert planner.requested_not_stored == {"ghost"}  # Megatron's unexpected
    assert planner.stored_not_requested == {"ObjB"}  # Megatron's missing: named by its key
    assert (planner.missing_keys, planner.unexpected_keys) == (["ghost"], ["ObjB"])
    for policy in ("raise_all", db.StrictHandling.RAISE_ALL):
        with pytest.raises(CheckpointException) as e:  # DCP wraps the planner's error
            _dcp_load(saved, {"w": torch.zeros(4), "ghost": torch.zeros(2)}, policy)
        assert "KeyMismatchError" in str(e.value)
        assert "'ghost'" in str(e.value) and "'ObjB'" in str(e.value)
    planner = _dcp_load(saved, {"w": torch.zeros(4), "ghost": torch.zeros(2)}, "ignore_all")
    assert planner.requested_not_stored == {"ghost"} and planner.stored_not_requested == set()


# -- every key named, up to the limit -------------------------------------------------------------


def test_mismatch_messages_name_every_key_up_to_the_limit():
    assert KEY_LIST_LIMIT >= 50
    many = [f"k{i:03d}" for i in range(KEY_LIST_LIMIT + 20)]
    text = str(decide(parse_strict("raise_all"), many[:60], many[60:]).error)
    assert all(f"'{k}'" in text for k in many)  # 60 + 60 keys: under the limit in each list
    text = str(decide(parse_strict("raise_missing"), many, ()).error)
    assert all(f"'{k}'" in text for k in many[:KEY_LIST_LIMIT])
    assert f"'{many[KEY_LIST_LIMIT]}'" not in text and text.endswith(", and 20 more")


def test_planner_and_tasd_errors_name_every_key(saved):
    sd = {"w": torch.zeros(4), **{f"absent{i:02d}": torch.zeros(1) for i in range(60)}}
    with pytest.raises(CheckpointException) as e:
        _dcp_load(saved, sd, "raise_missing")
    assert "60 key(s) requested but not in the checkpoint" in str(e.value)
    assert all(f"'absent{i:02d}'" in str(e.value) for i in range(60))
    state, _ = TASD.from_state_dict(
        {"w": db.ShardedTensor.from_box("w", torch.ones(4), (4,), (0,))}
    )
    template = {
        f"t{i:02d}": db.ShardedTensor.from_box(f"t{i:02d}", torch.zeros(1), (1,), (0,))
        for i in range(60)
    }
    with pytest.raises(db.MissingKeysError) as e:
        state.to_state_dict(template, algo="atomic", validate_access_integrity=False)
    assert all(f"'t{i:02d}' (rank 0)" in str(e.value) for i in range(60))


def test_log_policies_warn_with_every_key(saved, caplog):
    with caplog.at_level(logging.WARNING, logger="dcpbridge"):
        out = db.load(
            {"w": db.ShardedTensor.from_box("w", torch.zeros(4), (4,), (0,)), "g": torch.zeros(1)},
            saved,
            strict="log_all",
        )
    assert torch.equal(out["w"], torch.ones(4)) and "g" not in out
    text = caplog.text
    assert "'g'" in text and "'ObjB'" in text and "shard_" not in text
