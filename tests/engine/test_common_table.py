"""The common-state table in ``planner_data`` is checked before a load rebuilds the nesting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import dcpbridge as db
from dcpbridge.engine.common_table import check_common_table
from dcpbridge.storage.format.document import sign_document

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STATE: dict[str, Any] = {
    "w": db.ShardedTensor.from_box("w", torch.arange(4.0), (4,), (0,)),
    "opt": {"groups": [{"lr": 1}, {"lr": 2, "t": torch.ones(2)}], "none": {}, "betas": (0.9,)},
    "x.y": {"z": 1},
    "step": 3,
}
COMMON = {
    "opt": {"groups": [{"lr": 1}, {"lr": 2, "t": torch.ones(2)}], "none": {}, "betas": (0.9,)},
    "x.y": {"z": 1},
    "step": 3,
}


@pytest.fixture
def saved(tmp_path) -> Path:
    db.save(STATE, str(tmp_path / "ck"))
    return tmp_path / "ck"


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and torch.equal(a, b)
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_tables_saves_write_are_accepted(saved):
    table = json.loads((saved / "dcpbridge.json").read_bytes())["planner_data"]["common"]
    assert table["keys"]["opt.groups.1.t"] == ["opt", "groups", 1, "t"]
    assert table["keys"]["x.y.z"] == ["x.y", "z"] and table["empty"] == [["opt", "none"]]
    assert check_common_table(table) is table
    assert _same(db.load_common_state_dict(str(saved)), COMMON)


HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    # a load used to extend a list to this index: 2**31 items (16 GiB) before failing
    ("huge list index", {"keys": {"a.2147483648": ["a", 2**31]}}, r"list index in \[0, 1\)"),
    ("empty path", {"keys": {"a": []}}, "is not a non-empty list"),  # was IndexError
    ("negative index", {"keys": {"a.-1": ["a", -1]}}, "neither a string nor a list index"),
    ("bool index", {"keys": {"a.True": ["a", True]}}, "neither a string nor a list index"),
    ("float item", {"keys": {"1.5": [1.5]}}, "neither a string nor a list index"),
    ("path of another key", {"keys": {"step": ["cfg", "lr"]}}, "is not the key's path"),
    ("path not a list", {"keys": {"step": "step"}}, "is not a non-empty list"),
    ("dict and list at once", {"keys": {"a.x": ["a", "x"], "a.0": ["a", 0]}}, "the wrong way"),
    ("value holding entries", {"keys": {"a": ["a"], "a.x": ["a", "x"]}}, "holds a value and"),
    ("empty dict holding a value", {"keys": {"a.x": ["a", "x"]}, "empty": [["a"]]}, "holds a"),
    ("empty dict twice", {"keys": {}, "empty": [["a"], ["a"]]}, "recorded twice"),
    ("empty not a list", {"keys": {}, "empty": 5}, "'empty' a list"),  # was TypeError
    ("keys not a mapping", {"keys": [["a"]]}, "'keys' must be a JSON object"),
]


@pytest.mark.parametrize(("table", "needle"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_tables_are_refused(table, needle):
    with pytest.raises(db.CorruptCheckpointError, match=needle):
        check_common_table(table)


def test_a_load_refuses_a_resigned_hostile_table_before_rebuilding(saved):
    doc = json.loads((saved / "dcpbridge.json").read_bytes())
    doc["planner_data"]["common"]["keys"]["step"] = ["step", 2**31]
    (saved / "dcpbridge.json").write_bytes(sign_document(doc))
    needle = r"planner_data\.common: path \['step', 2147483648\] of key 'step'"
    with pytest.raises(db.CorruptCheckpointError, match=needle):
        db.load({"w": db.ShardedTensor.from_box("w", torch.zeros(4), (4,), (0,))}, str(saved))
    with pytest.raises(db.CorruptCheckpointError, match=needle):
        db.load_common_state_dict(str(saved))


def test_plain_dcp_planner_data_may_map_a_key_named_common(tmp_path):
    """DCP's key-to-path map names a state dict's key 'common' with a list: not a table."""
    db.save({"common": 1, "w": torch.ones(2)}, str(tmp_path))
    doc = json.loads((tmp_path / "dcpbridge.json").read_bytes())
    doc["planner_data"]["common"] = ["common"]  # what plain dcp.save with our planner records
    (tmp_path / "dcpbridge.json").write_bytes(sign_document(doc))
    assert torch.equal(db.load({"w": torch.zeros(2)}, str(tmp_path))["w"], torch.ones(2))


def test_a_listed_common_key_without_a_stored_entry_is_a_corrupt_checkpoint(saved):
    """A damaged document listing a request's key as common state, with no entry for it: the
    request was never counted missing, and the load returned without it."""
    doc = json.loads((saved / "dcpbridge.json").read_bytes())
    del doc["tensors"]["w"]
    doc["planner_data"]["common"]["keys"]["w"] = ["w"]
    (saved / "dcpbridge.json").write_bytes(sign_document(doc))
    needle = r"planner_data\.common: lists common keys the checkpoint stores no entry for: 'w'"
    with pytest.raises(db.CorruptCheckpointError, match=needle):
        db.load({"w": db.ShardedTensor.from_box("w", torch.zeros(4), (4,), (0,))}, str(saved))
