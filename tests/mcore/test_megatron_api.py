"""Megatron-Core API behaviours: strict policies, metadata readers, the drop-in module."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from torch import nn

import dcpbridge as db
from dcpbridge import dist_checkpointing as dc
from dcpbridge.engine.strict import STRICT_VALUES, decide, parse_strict
from dcpbridge.storage import read_checkpoint_metadata, resolve
from tests.support import megatron_cpu as M
from tests.support.dist_pool import Rank

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MEGATRON_POLICIES = [v for v in STRICT_VALUES if v != "raise_missing"]
KEY_SETS = [(set(), set()), ({"u"}, set()), (set(), {"m"}), ({"u", "u2"}, {"m"})]


def _st(key: str, n: int = 4) -> db.ShardedTensor:
    return db.ShardedTensor.from_box(key, torch.arange(n, dtype=torch.float32), (n,), (0,))


def _template(key: str, n: int = 4) -> db.ShardedTensor:
    return db.ShardedTensor.from_box(key, torch.zeros(n), (n,), (0,))


@pytest.fixture
def ckpt(tmp_path) -> str:
    """One process: tensors 'a' and 'b.x', a 2-cell object grid 'rng', common 'iteration'."""
    path = str(tmp_path / "ck")
    sd = {
        "a": _st("a"),
        "b": _st("b.x", 6),
        "rng": [db.ShardedObject("rng", {"seed": i}, (2,), (i,)) for i in range(2)],
        "iteration": 7,
    }
    db.save(sd, path)
    return path


# --- strict: the pure decision against Megatron's own validation -------------------------


def _mdc():
    """megatron.core.dist_checkpointing, unpatched (this process must not touch torch.cuda)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing


def _megatron_validation(policy: str, unexpected: set[str], missing: set[str], caplog):
    """What Megatron's validation does for requested-not-stored ``unexpected`` and stored-not-
    requested ``missing``: ("raise", None) / ("log" or "ok", returned key sets or None)."""
    mdc = _mdc()
    from megatron.core.dist_checkpointing import validation as V

    def sts(keys):
        return {k: mdc.ShardedTensor.from_rank_offsets(k, torch.zeros(1)) for k in keys}

    requested = sts({"shared"} | unexpected)
    stored = sts({"shared"} | missing)
    local = [sh.without_data() for sh in requested.values()]
    strict = V.parse_strict_flag(policy)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=V.logger.name):
        try:
            _, got_missing, got_unexpected = V.validate_integrity_and_strict_load(
                requested, strict, False, local, [local], stored
            )
        except mdc.core.CheckpointingException:
            return "raise", None
    logged = "log" if caplog.records else "ok"
    if V.StrictHandling.requires_returning_mismatch_keys(strict):
        return logged, (got_missing, got_unexpected)
    return logged, None


@pytest.mark.parametrize("policy", MEGATRON_POLICIES)
@pytest.mark.parametrize(("unexpected", "missing"), KEY_SETS)
def test_strict_policies_match_megatron_validation(policy, unexpected, missing, caplog):
    outcome, returned = _megatron_validation(policy, unexpected, missing, caplog)
    verdict = decide(parse_strict(policy), unexpected, missing)
    if policy == "assume_ok_unexpected":
        # Megatron skips the check and its storage strategy fails later on unexpected keys;
        # dcpbridge raises the clear error up front, and only then.
        assert outcome == "ok"
        assert (verdict.error is not None) == bool(unexpected)
        assert verdict.warning is None and verdict.returned is None
        return
    assert (verdict.error is not None) == (outcome == "raise"), (policy, verdict)
    assert (verdict.warning is not None) == (outcome == "log"), (policy, verdict)
    assert verdict.returned == returned


def test_strict_error_texts_and_classes():
    both = decide(parse_strict("raise_all"), {0: ["ghost"], 1: ["ghost", "x"]}, ["m"]).error
    assert isinstance(both, db.KeyMismatchError)
    assert isinstance(both, db.MissingKeysError) and isinstance(both, db.UnexpectedKeysError)
    text = str(both)
    assert "2 key(s) requested but not in the checkpoint" in text
    assert "'ghost' (ranks [0, 1]), 'x' (rank 1)" in text
    assert "1 key(s) in the checkpoint but not requested by any rank" in text
    only_stored = decide(parse_strict("raise_all"), [], ["m"]).error
    assert type(only_stored) is db.UnexpectedKeysError
    only_requested = decide(parse_strict("raise_missing"), ["u"], ["m"]).error
    assert type(only_requested) is db.MissingKeysError and "'m'" not in str(only_requested)


def test_parse_strict_accepts_every_spelling():
    from megatron.core.dist_checkpointing.validation import StrictHandling as MegatronStrict

    for member in MegatronStrict:
        assert parse_strict(member).name == member.value
        assert parse_strict(member.name).name == member.value  # "RETURN_ALL"
        assert parse_strict(db.StrictHandling(member.value)).name == member.value
        assert dc.parse_strict_flag(member) is dc.StrictHandling(member.value)
    assert parse_strict(db.StrictMode.RAISE_MISSING).name == "raise_missing"
    assert dc.parse_strict_flag("raise_missing") is dc.StrictHandling.ASSUME_OK_UNEXPECTED
    assert dc.StrictHandling.requires_returning_mismatch_keys("return_unexpected")
    assert not dc.StrictHandling.requires_global_app_metadata(dc.StrictHandling.LOG_UNEXPECTED)
    for bad in (True, "strict", None):
        with pytest.raises(ValueError, match="strict must be one of"):
            parse_strict(bad)


def test_strict_policies_end_to_end(ckpt, caplog):
    def tmpl():
        return {
            "a": _template("a"),
            "ghost": _template("ghost"),
            "rng": dc.ShardedObject("rng", None, (2,), (1,)),
        }

    out, missing, unexpected = db.load(tmpl(), ckpt, strict="return_all")
    assert missing == {"b.x"} and unexpected == {"ghost"}  # 'rng' named by key, requested
    assert torch.equal(out["a"], torch.arange(4.0)) and out["rng"] == {"seed": 1}
    assert "ghost" not in out and out["iteration"] == 7
    out, missing, unexpected = db.load(tmpl(), ckpt, strict=dc.StrictHandling.RETURN_UNEXPECTED)
    assert missing == set() and unexpected == {"ghost"}
    assert set(db.load(tmpl(), ckpt, strict="ignore_all")) == {"a", "rng", "iteration"}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dcpbridge.engine.strict"):
        out = db.load(tmpl(), ckpt, strict="LOG_ALL")
    assert isinstance(out, dict) and "'ghost'" in caplog.text and "'b.x'" in caplog.text
    for policy in ("raise_missing", "assume_ok_unexpected", "raise_unexpected"):
        with pytest.raises(db.MissingKeysError, match="requested but not in the checkpoint"):
            db.load(tmpl(), ckpt, strict=policy)
    with pytest.raises(db.KeyMismatchError, match="in the checkpoint but not requested"):
        db.load(tmpl(), ckpt, strict="raise_all")
    # A cell of another grid is an error whatever the policy: the key is stored, not that cell.
    with pytest.raises(db.ShapeMismatchError, match=r"'rng/shard_0_3' is requested but not"):
        db.load({"o": db.ShardedObject("rng", None, (3,), (0,))}, ckpt, strict="ignore_all")


# --- metadata readers -----------------------------------------------------------------


def test_load_plain_tensors_idiom_and_sharded_metadata(ckpt):
    meta = db.load_tensors_metadata(ckpt)
    assert meta["a"].data.is_meta and meta["a"].axis_fragmentations == (1,)
    out = db.load(meta, ckpt)
    assert torch.equal(out["a"], torch.arange(4.0)) and not out["a"].is_meta
    assert torch.equal(out["b.x"], torch.arange(6.0))
    # Megatron's own metadata objects carry data=None: those load too.
    none_data = {k: v.without_data() for k, v in dc.load_tensors_metadata(ckpt).items()}
    assert torch.equal(db.load(none_data, ckpt)["b.x"], torch.arange(6.0))

    plain = dc.load_plain_tensors(ckpt)
    assert set(plain) == {"a", "b.x"} and torch.equal(plain["a"], torch.arange(4.0))

    sharded = dc.load_sharded_metadata(ckpt)
    assert set(sharded) == {"a", "b.x", "rng/shard_0_2", "rng/shard_1_2"}
    cell = sharded["rng/shard_1_2"]
    assert (cell.key, cell.global_shape, cell.global_offset, cell.data) == ("rng", (2,), (1,), None)
    # Megatron parses the same storage names into the same cells.
    from megatron.core.dist_checkpointing.mapping import ShardedObject as MegatronObject

    theirs = MegatronObject.empty_from_unique_key("rng/shard_1_2")
    assert (theirs.key, theirs.global_shape, theirs.global_offset) == ("rng", (2,), (1,))


def test_a_zero_dim_object_grid_is_named_by_its_key(tmp_path):
    """A ShardedObject of shape () is stored as 'o/shard__'; strict results and the sharded
    metadata name it like any other grid ('o', not its storage name; not left out)."""
    path = str(tmp_path / "zero_dim")
    db.save({"o": db.ShardedObject("o", {"v": 1}, (), ()), "a": _st("a")}, path)
    _, missing, unexpected = dc.load({"a": _template("a")}, path, strict="return_all")
    assert (missing, unexpected) == ({"o"}, set())
    cell = dc.load_sharded_metadata(path)["o/shard__"]
    assert (cell.key, cell.global_shape, cell.global_offset) == ("o", (), ())


def test_remove_sharded_tensors(ckpt):
    files_before = {f for f in os.listdir(ckpt) if f.endswith(".bin")}
    assert dc.remove_sharded_tensors(ckpt, "b.") is None
    assert set(db.load_tensors_metadata(ckpt)) == {"a"}
    assert torch.equal(db.load({"a": _template("a")}, ckpt)["a"], torch.arange(4.0))
    with pytest.raises(db.MissingKeysError, match=r"'b\.x'"):
        db.load({"b": _template("b.x", 6)}, ckpt)
    assert {f for f in os.listdir(ckpt) if f.endswith(".bin")} <= files_before
    with pytest.warns(UserWarning, match="nothing removed"):
        assert db.remove_sharded_tensors(ckpt, "nope") == []
    assert db.remove_sharded_tensors(ckpt, "rng/") == ["rng/shard_0_2", "rng/shard_1_2"]
    assert db.load_common_state_dict(ckpt)["iteration"] == 7


def _incremental_pair(tmp_path) -> tuple[str, str, torch.Tensor]:
    """Step 1 and step 2 saved beside it with ``reuse_from``: step 2 references step 1's
    file holding the unchanged ``base``."""
    first, second = str(tmp_path / "step_1"), str(tmp_path / "step_2")
    base = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    db.save({"base": base, "adapter": torch.zeros(4)}, first)
    db.save({"base": base, "adapter": torch.ones(4)}, second, reuse_from=first)
    assert any(
        f.startswith("../step_1/")
        for f in read_checkpoint_metadata(resolve(second)).storage_data.files
    )
    return first, second, base


def test_removing_keys_keeps_files_another_checkpoint_references(tmp_path):
    """A data file of step 1 that step 2 (an incremental save) references stays when step 1
    drops the keys it holds: deleting it broke step 2."""
    first, second, base = _incremental_pair(tmp_path)
    assert db.remove_sharded_tensors(first, "base") == ["base"]
    assert set(db.load_tensors_metadata(first)) == {"adapter"}
    out = db.load({"base": torch.zeros(64, 64), "adapter": torch.zeros(4)}, second)
    assert torch.equal(out["base"], base) and torch.equal(out["adapter"], torch.ones(4))


def test_removing_keys_of_an_incremental_checkpoint_leaves_the_referenced_one_alone(tmp_path):
    """Dropping a key whose bytes live in a referenced sibling neither raises after the commit
    (the reference is not a file of this checkpoint) nor deletes the sibling's file."""
    first, second, base = _incremental_pair(tmp_path)
    before = sorted(os.listdir(first))
    assert db.remove_sharded_tensors(second, "base") == ["base"]
    assert set(db.load_tensors_metadata(second)) == {"adapter"}
    assert sorted(os.listdir(first)) == before
    out = db.load({"base": torch.zeros(64, 64), "adapter": torch.zeros(4)}, first)
    assert torch.equal(out["base"], base) and torch.equal(out["adapter"], torch.zeros(4))


def test_removing_common_state_keys_keeps_the_checkpoint_loadable(tmp_path):
    """Common values and tensors a prefix matches leave the common-state table too (every
    load of the rewritten checkpoint raised MissingKeysError for them)."""
    path = str(tmp_path / "ck")
    db.save({"a": _st("a"), "opt": {"lr": 2, "t": torch.ones(2)}, "iteration": 7}, path)
    assert db.remove_sharded_tensors(path, "opt.") == ["opt.lr", "opt.t"]
    assert torch.equal(db.load({"a": _template("a")}, path)["a"], torch.arange(4.0))
    assert db.load_common_state_dict(path) == {"iteration": 7}
    planner_data = read_checkpoint_metadata(resolve(path)).planner_data
    assert not {"opt.lr", "opt.t"} & set(planner_data)  # DCP's path map forgets them too
    assert planner_data["a"] == ["a"]


# --- mapping: narrow, factories, flattened_range ----------------------------------------


@pytest.mark.parametrize(
    ("rank_offsets", "dim", "start", "length"), [((0, 1, 2), 0, 1, 2), ((1, 2, 4), 1, 0, 1)]
)
def test_narrow_matches_megatron(rank_offsets, dim, start, length):
    mdc = _mdc()
    data = torch.arange(12.0).reshape(4, 3)
    ours = db.ShardedTensor.from_rank_offsets("w", data, rank_offsets, prepend_axis_num=1)
    theirs = mdc.ShardedTensor.from_rank_offsets("w", data, rank_offsets, prepend_axis_num=1)
    [a] = ours.narrow(dim, start, length)
    [b] = theirs.narrow(dim, start, length)
    assert (a.global_shape, a.global_offset, a.local_shape) == (
        b.global_shape,
        b.global_offset,
        tuple(b.local_shape),
    )
    assert torch.equal(a.data, b.data)
    with pytest.raises(db.InvalidShardError, match=r"'v'.*regular grid"):
        db.ShardedTensor.from_box("v", torch.zeros(3), (7,), (2,)).narrow(0, 0, 1)


def test_apply_factories_in_place_with_megatron_build_fn():
    seen = []

    def build(key, data, replica_id, flattened_range):  # Megatron's signature
        seen.append(flattened_range)
        half = data.shape[0] // 2
        return {
            "lo": db.ShardedTensor.from_box(f"{key}.lo", data[:half], (half,), (0,)),
            "hi": db.ShardedTensor.from_box(f"{key}.hi", data[half:], (half,), (0,)),
        }

    def merge(d):
        return torch.cat([d["lo"], d["hi"]])

    sd = {"m": [dc.ShardedTensorFactory("w", torch.arange(4.0), build, merge)], "x": 1}
    factories = {"m": [sd["m"][0]]}
    assert dc.apply_factories(sd) is sd and seen == [None]
    assert sd["m"][0]["lo"].key == "w.lo" and sd["x"] == 1
    loaded = {"m": [{"lo": torch.ones(2), "hi": torch.zeros(2)}], "x": 1}
    assert dc.apply_factory_merges(loaded, factories) is loaded
    assert torch.equal(loaded["m"][0], torch.tensor([1.0, 1.0, 0.0, 0.0]))
    with pytest.raises(db.InvalidShardError, match=r"m: loaded list has 0 items"):
        dc.apply_factory_merges({"m": []}, factories)


def test_flattened_range_is_refused_naming_the_key(tmp_path):
    with pytest.raises(db.InvalidShardError, match=r"ShardedTensor 'w': flattened_range=slice"):
        db.ShardedTensor.from_rank_offsets("w", torch.zeros(4), flattened_range=slice(0, 2))
    sh = db.ShardedTensor.from_rank_offsets("w", torch.zeros(4), flattened_range=None)
    assert sh.flattened_range is None
    sh.flattened_range = slice(0, 2)  # set after construction: refused at save and at load
    with pytest.raises(db.InvalidShardError, match="'w': flattened_range"):
        dc.save({"w": sh}, str(tmp_path / "s"))
    db.save({"w": _st("w")}, str(tmp_path / "ok"))
    with pytest.raises(db.InvalidShardError, match="'w': flattened_range"):
        dc.load({"w": sh}, str(tmp_path / "ok"))
    fac = dc.ShardedTensorFactory("f", torch.zeros(2), lambda *a: {}, lambda d: d, 0, slice(0, 1))
    with pytest.raises(db.InvalidShardError, match="ShardedTensorFactory 'f': flattened_range"):
        dc.save({"f": fac}, str(tmp_path / "f"))


# --- the drop-in module -------------------------------------------------------------------


def test_drop_in_save_load_with_megatron_parameters(tmp_path):
    path = str(tmp_path / "d")
    assert not dc.check_is_distributed_checkpoint(path)
    sd = {"a": _st("a"), "it": 3}
    assert (
        dc.save(sd, path, None, None, True, False, lambda c: c, content_metadata={"v": 2}) is None
    )
    assert "content_metadata" not in sd  # the caller's dict is left alone
    assert dc.check_is_distributed_checkpoint(path)
    assert dc.load_content_metadata(path) == {"v": 2}
    assert dc.load_common_state_dict(path) == {"it": 3, "content_metadata": {"v": 2}}
    out = dc.load({"a": _template("a")}, path, None, None, True, dc.StrictHandling.RETURN_ALL)
    assert out[1:] == (set(), set()) and torch.equal(out[0]["a"], torch.arange(4.0))
    assert dc.load_content_metadata(preloaded_state_dict=out[0]) == {"v": 2}

    handle = dc.save({"a": _st("a")}, str(tmp_path / "async"), async_sharded_save=True)
    handle.result()
    assert torch.equal(dc.load_plain_tensors(str(tmp_path / "async"))["a"], torch.arange(4.0))

    tdist = str(tmp_path / "tdist")
    dc.save({"a": _st("a")}, tdist, dc.get_default_save_sharded_strategy("torch_dist"))
    assert os.path.exists(os.path.join(tdist, "metadata.json"))
    assert dc.get_default_load_sharded_strategy(tdist).backend == "torch_dist"
    assert set(dc.load_tensors_metadata(tdist, allow_pickle=True)) == {"a"}
    with pytest.raises(dc.CheckpointingException, match="rewrites dcpbridge checkpoints only"):
        dc.remove_sharded_tensors(tdist, "a")

    with pytest.raises(dc.CheckpointingException, match="backend 'zarr' is not supported"):
        dc.save(sd, str(tmp_path / "z"), ("zarr", 1))
    with pytest.raises(dc.CheckpointingException, match="common_strategy"):
        dc.save(sd, str(tmp_path / "c"), common_strategy=("torch", 1))
    with pytest.raises(dc.CheckpointingException, match="not supported"):
        dc.load({"a": _template("a")}, path, sharded_strategy=object())


@pytest.mark.parametrize(
    ("common", "sharded"),
    [
        ({"w": torch.ones(4)}, _st("w")),  # the ShardedTensor was dropped
        ({"w": 3}, _st("w")),  # loaded back as the value
        ({"a": {"b": 3}}, _st("a.b")),
        ({"o/shard_0_1": 5}, db.ShardedObject("o", {"v": 1}, (1,), (0,))),
    ],
    ids=["tensor", "value", "nested_value", "object"],
)
def test_torch_dist_refuses_shards_keyed_like_common_state(tmp_path, common, sharded):
    """As dcpbridge's own format does: one key cannot name both (a load returned the wrong
    one, or the save dropped the shard)."""
    path = str(tmp_path / "td")
    name = sharded.key if isinstance(sharded, db.ShardedTensor) else sharded.unique_key
    with pytest.raises(db.ShardingValidationError, match=rf"'{name}': .*common state"):
        dc.save({**common, "m": sharded}, path, ("torch_dist", 1))
    assert not os.path.exists(path) or os.listdir(path) == []


def test_torch_dist_keeps_an_object_keyed_like_a_common_tensor(tmp_path):
    path = str(tmp_path / "td")
    # a ShardedObject of that key is no clash (stored as 'w/shard_0_1'): it is kept
    sd = {"w": torch.ones(4), "o": db.ShardedObject("w", {"a": 1}, (1,), (0,))}
    dc.save(sd, path, dc.get_default_save_sharded_strategy("torch_dist"))
    out = dc.load({"w": torch.zeros(4), "o": db.ShardedObject("w", None, (1,), (0,))}, path)
    assert out["o"] == {"a": 1} and torch.equal(out["w"], torch.ones(4))


def test_torch_dist_common_state_wins_over_a_shard_of_the_same_key(tmp_path):
    """Megatron-Core writes a common-state value and a ShardedTensor under one key apart
    (common.pt, .metadata) and loads the value from common.pt: so does dcpbridge."""
    path, common = str(tmp_path / "td"), str(tmp_path / "common")
    sd = {"m": _st("w"), "x": _st("it"), "y": _st("a.b", 6), "q": _st("q")}
    dc.save(sd, path, ("torch_dist", 1))
    dc.save({"w": torch.ones(4), "it": 3, "a": {"b": "v"}}, common, ("torch_dist", 1))
    shutil.copy(os.path.join(common, "common.pt"), os.path.join(path, "common.pt"))
    template = {"w": torch.zeros(4), "it": 0, "a": {"b": ""}, "x": _template("it")}
    out = dc.load({**template, "y": _template("a.b", 6)}, path)
    assert type(out["it"]) is int and out["it"] == 3 and out["a"] == {"b": "v"}
    assert torch.equal(out["w"], torch.ones(4))
    assert torch.equal(out["x"], torch.arange(4.0)) and torch.equal(out["y"], torch.arange(6.0))
    out = dc.load({"m": _template("w")}, path)
    assert torch.equal(out["m"], torch.arange(4.0)) and torch.equal(out["w"], torch.ones(4))
    with pytest.raises(db.InvalidRequestError, match=r"'w': the load template asks for it both"):
        dc.load({**template, "m": _template("w")}, path)
    # a plain tensor the common state lacks still reads the stored tensor of its key
    assert torch.equal(dc.load({"q": torch.zeros(4)}, path)["q"], torch.arange(4.0))


@pytest.mark.parametrize("fmt", ["dcpbridge", "torch_dist"])
def test_common_tensors_in_another_form_come_back_as_stored(tmp_path, fmt):
    """README (Keys): a plain tensor stored in another dtype or shape, or stored as a value,
    comes back as stored (torch_dist cast it, or called it missing; both formats dropped the
    value)."""
    path = str(tmp_path / fmt)
    stored = torch.tensor([1.0000001, 2.5, 3.3], dtype=torch.float64)
    db.save({"t": stored, "u": torch.arange(6.0), "n": 3}, path, format=fmt)
    template = {"t": torch.zeros(3, dtype=torch.bfloat16), "u": torch.zeros(4), "n": torch.zeros(2)}
    out = dc.load(template, path)
    assert out["t"].dtype == torch.float64 and torch.equal(out["t"], stored)
    assert torch.equal(out["u"], torch.arange(6.0)) and out["n"] == 3
    assert not template["t"].any() and not template["u"].any()  # left as they were


def test_hostile_torch_dist_config_and_common_state_are_corrupt_checkpoints(tmp_path):
    """A metadata.json nested past the JSON parser's recursion limit, or a common.pt that is
    not a dict, raises CorruptCheckpointError (not RecursionError; no common state dropped)."""
    path = str(tmp_path / "td")
    dc.save({"a": _st("a"), "it": 3}, path, dc.get_default_save_sharded_strategy("torch_dist"))
    config = os.path.join(path, "metadata.json")
    with open(config) as f:
        good = f.read()
    with open(config, "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    with pytest.raises(db.CorruptCheckpointError, match=r"metadata\.json is not a Megatron-Core"):
        dc.load_common_state_dict(path)
    assert not dc.check_is_distributed_checkpoint(path)
    with open(config, "w") as f:
        f.write(good)
    torch.save([1, 2], os.path.join(path, "common.pt"))
    for read in (
        lambda: dc.load({"a": _template("a")}, path),
        lambda: dc.load_content_metadata(path),
    ):
        with pytest.raises(db.CorruptCheckpointError, match=r"common\.pt holds a list"):
            read()


def drop_in_ranks(r: Rank, path: str, strict: str):
    """2 ranks through the drop-in: rank 0 asks for 'ghost' too, nobody asks for 'b.x'."""
    from dcpbridge.dist_checkpointing.strategies import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    if strict == "save":
        sd = {
            "a": dc.ShardedTensor.from_rank_offsets(
                "a", torch.arange(2.0) + 2 * r.rank, (0, r.rank, 2)
            ),
            "b": dc.ShardedTensor.from_rank_offsets("b.x", torch.ones(3), replica_id=r.rank),
        }
        wrapper = FullyParallelSaveStrategyWrapper(None, r.group)
        dc.save(sd, path, wrapper, process_group=r.group)
        return None
    tmpl = {"a": dc.ShardedTensor.from_box("a", torch.zeros(4), (4,), (0,))}
    if r.rank == 0:
        tmpl["g"] = dc.ShardedTensor.from_box("ghost", torch.zeros(1), (1,), (0,))
    wrapper = FullyParallelLoadStrategyWrapper(None, r.group)
    try:
        out = dc.load(tmpl, path, wrapper, strict=strict, process_group=r.group)
    except db.CheckpointError as e:
        return type(e).__name__, str(e)
    state, missing, unexpected = out
    assert torch.equal(state["a"], torch.arange(4.0))
    return missing, unexpected


def test_drop_in_strict_across_ranks(pool, tmp_path):
    path = str(tmp_path / "ranks")
    pool.run(drop_in_ranks, 2, path, "save", timeout=60)
    (m0, u0), (m1, u1) = pool.run(drop_in_ranks, 2, path, "return_all", timeout=60)
    assert m0 == m1 == {"b.x"} and u0 == {"ghost"} and u1 == set()
    (m0, u0), (m1, u1) = pool.run(drop_in_ranks, 2, path, "return_unexpected", timeout=60)
    assert m0 == m1 == set() and u0 == {"ghost"} and u1 == set()
    errors = pool.run(drop_in_ranks, 2, path, "raise_unexpected", timeout=60)
    assert errors[0] == errors[1] and errors[0][0] == "MissingKeysError"
    assert "rank 0: 1 key(s) requested but not in the checkpoint" in errors[0][1]


# --- against real megatron-core ------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_ckpt(pool, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("mcore_api") / "iter_1")
    os.makedirs(path)
    pool.run(M.megatron_save, 4, path, default_group=True, timeout=120)
    return path


def _mismatched(r: Rank, state: dict, make_ghost) -> dict:
    """Drop the bias (stored, requested by no rank); rank 1 asks for a 'ghost' tensor."""
    state = {k: v for k, v in state.items() if k != "bias"}
    if r.rank == 1:
        state["ghost"] = make_ghost()
    return state


def megatron_return_all(r: Rank, path: str):
    mdc = M.mcore()
    state = _mismatched(
        r,
        M.megatron_state(r, mdc, with_data=False),
        lambda: mdc.ShardedTensor.from_rank_offsets("ghost", torch.zeros(2)),
    )
    _, missing, unexpected = mdc.load(state, path, strict=mdc.validation.StrictHandling.RETURN_ALL)
    return missing, unexpected


def drop_in_return_all(r: Rank, path: str):
    from megatron.core.dist_checkpointing.validation import StrictHandling as MegatronStrict

    fc1 = dc.ShardedTensor.from_rank_offsets(
        "decoder.fc1.weight", torch.zeros(4, 6), (0, r.rank, 4)
    )
    qkv = dc.ShardedTensor.from_rank_offsets(
        "decoder.layers.qkv", torch.zeros(8, 6), (0, r.rank, 4), prepend_axis_num=1
    )
    state = {
        "fc1": fc1,
        "layers": {"qkv": qkv},
        "rng": dc.ShardedObject("rng_state", None, (4,), (r.rank,)),
    }
    state = _mismatched(
        r, state, lambda: dc.ShardedTensor.from_box("ghost", torch.zeros(2), (2,), (0,))
    )
    out, missing, unexpected = dc.load(
        state, path, strict=MegatronStrict.RETURN_ALL, process_group=r.group, allow_pickle=True
    )
    assert torch.equal(out["fc1"], M.full("decoder.fc1.weight")[4 * r.rank : 4 * r.rank + 4])
    assert out["rng"] == {"seed": 1000 + r.rank} and "ghost" not in out
    return missing, unexpected


@pytest.mark.interop
def test_return_all_matches_megatron_on_its_checkpoint(pool, megatron_ckpt):
    theirs = pool.run(megatron_return_all, 4, megatron_ckpt, default_group=True, timeout=120)
    ours = pool.run(drop_in_return_all, 4, megatron_ckpt, default_group=True, timeout=120)
    assert theirs == ours
    assert ours[0] == ({"embedding.bias"}, set()) and ours[1] == ({"embedding.bias"}, {"ghost"})
    # Megatron's metadata readers and ours agree on its checkpoint.
    mdc = _mdc()
    their_meta = mdc.serialization.load_sharded_metadata(megatron_ckpt)
    our_meta = dc.load_sharded_metadata(megatron_ckpt, allow_pickle=True)
    assert set(their_meta) == set(our_meta)
    for k, v in their_meta.items():
        ours_v = our_meta[k]
        assert (ours_v.key, tuple(ours_v.global_shape)) == (v.key, tuple(v.global_shape)), k
    assert dc.check_is_distributed_checkpoint(megatron_ckpt)
    assert mdc.check_is_distributed_checkpoint(megatron_ckpt)


def drop_in_save_megatron_objects(r: Rank, path: str) -> None:
    mdc = M.mcore()
    dc.save(M.megatron_state(r, mdc), path)


@pytest.mark.interop
def test_drop_in_saves_megatron_objects(pool, tmp_path):
    path = str(tmp_path / "mobjs")
    os.makedirs(path)
    pool.run(drop_in_save_megatron_objects, 4, path, default_group=True, timeout=120)
    plain = dc.load_plain_tensors(path, allow_pickle=True)
    for key in M.SHAPES:
        assert torch.equal(plain[key], M.full(key)), key


def test_optimizer_helpers_take_megatron_core_sharded_tensors(tmp_path):
    """The drop-in's optimizer helpers map a model sharded state dict built with Megatron-Core's
    own ShardedTensor and ShardedTensorFactory (what Megatron's modules return) as Megatron's
    helpers do; they matched no parameter (OptimizerStateError), and a Megatron factory was
    rebuilt with a ``dtype`` field it lacks (TypeError)."""
    from megatron.core.dist_checkpointing import optimizer as megatron_optimizer
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def halves(key, data, replica_id, flattened_range):
        return [
            ShardedTensor.from_rank_offsets(f"{key}.{i}", h) for i, h in enumerate(data.chunk(2))
        ]

    def join(parts):
        with torch.no_grad():
            return torch.cat(parts)

    def model_sd(net: nn.Linear) -> dict:
        return {
            "w": ShardedTensorFactory("w", net.weight, halves, join),
            "b": ShardedTensor.from_rank_offsets("b", net.bias),
        }

    def optim_sd(net: nn.Linear, opt: torch.optim.Optimizer) -> dict:
        params = [net.weight, net.bias]
        id_map = dc.get_param_id_to_sharded_param_map(model_sd(net), params)
        assert (
            id_map.keys()
            == megatron_optimizer.get_param_id_to_sharded_param_map(model_sd(net), params).keys()
        )
        state = opt.state_dict()
        dc.optim_state_to_sharding_state(state, id_map)
        return state

    torch.manual_seed(0)
    src = nn.Linear(3, 4)
    opt = torch.optim.Adam(src.parameters(), lr=0.1)
    src(torch.randn(2, 3)).sum().backward()
    opt.step()
    dc.save({"optimizer": optim_sd(src, opt)}, str(tmp_path / "ck"))
    assert {"optimizer.state.exp_avg.w.0", "optimizer.state.exp_avg.b"} <= set(
        dc.load_tensors_metadata(str(tmp_path / "ck"))
    )
    dst = nn.Linear(3, 4)
    new = torch.optim.Adam(dst.parameters(), lr=0.5)
    db.init_optimizer_state(new)
    out = dc.load({"optimizer": optim_sd(dst, new)}, str(tmp_path / "ck"))
    db.load_optimizer_state(new, out["optimizer"])
    for p_src, p_dst in zip(src.parameters(), dst.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(new.state[p_dst][key], opt.state[p_src][key]), key


def test_load_takes_megatron_core_load_strategies(ckpt):
    """Megatron-Core's own load strategy (what its get_default_load_sharded_strategy returns),
    alone or in its fully-parallel wrapper, loads: it was refused as 'not supported'."""
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    for strategy in (
        TorchDistLoadShardedStrategy(),
        FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()),
    ):
        out = dc.load({"a": _template("a")}, ckpt, strategy)
        assert torch.equal(out["a"], torch.arange(4.0))
        assert set(dc.load_tensors_metadata(ckpt, strategy)) == {"a", "b.x"}
        assert "rng/shard_1_2" in dc.load_sharded_metadata(ckpt, strategy)
    with pytest.raises(dc.CheckpointingException, match="not supported"):
        dc.save({"a": _st("a")}, ckpt + "_again", TorchDistLoadShardedStrategy())


def test_torch_dist_common_state_keeps_its_dict_keys(tmp_path):
    """Megatron-Core's common.pt keeps the state dict's own keys: an optimizer's int param ids
    stayed ints ('0' beside the template's 0 made Megatron-Core's load return both, and
    torch's optimizer drop the step)."""
    path = str(tmp_path / "td")
    state = {
        "opt": {
            "state": {0: {"exp_avg": _st("opt.0.exp_avg"), "step": torch.tensor(5)}, 1: {}},
            "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.99)}],
        },
        "odd": {(1, 2): "tuple", True: [1, {2: "two"}], None: 3, 1.5: "float", "s": 4},
    }
    db.save(state, path, format="torch_dist")
    common = torch.load(os.path.join(path, "common.pt"), weights_only=True)
    assert common == {
        "opt": {
            "state": {0: {"step": torch.tensor(5)}, 1: {}},
            "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.99)}],
        },
        "odd": {(1, 2): "tuple", True: [1, {2: "two"}], None: 3, 1.5: "float", "s": 4},
    }
    assert [type(k) for k in common["opt"]["state"]] == [int, int]
    template = {"opt": {"state": {0: {"exp_avg": _template("opt.0.exp_avg"), "step": None}}}}
    out = db.load(template, path)
    assert torch.equal(out["opt"]["state"][0]["exp_avg"], torch.arange(4.0))
    assert out["opt"]["state"][0]["step"] == torch.tensor(5) and out["opt"]["state"][1] == {}
