"""dcpbridge checkpoints are DCP checkpoints: DCP's keys, tensors as tensor entries, both ways."""

from __future__ import annotations

import io
import json
import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import dcpbridge as db
from dcpbridge.planners.walk import iter_leaves
from dcpbridge.storage.read.delivery import byte_view


def nested() -> dict:
    return {
        "cfg": {"betas": (0.9, 0.95), "names": ["a", "b"], "empty": []},
        "mixed": [torch.arange(3.0), 7, {"deep": torch.ones(2, 2)}],
        "blob": io.BytesIO(b"opaque"),
        "raw": b"bytes",
        "n": 3,
    }


def test_keys_are_dcps_flattened_keys():
    sd = nested()
    ours = [leaf.path for leaf in iter_leaves(sd)]
    theirs, _ = flatten_state_dict(sd)
    assert ours == list(theirs)
    assert "cfg.betas" in ours and "mixed.2.deep" in ours and "cfg.betas.0" not in ours


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()  # state exists (the template needs it), with other values
    msd, osd = get_state_dict(model, opt)
    return model, opt, {"model": msd, "optim": osd}


def assert_resumed(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    ref_model, ref_opt = trained()
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), n
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.8, 0.9)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        mine, ref = opt.state[p], ref_opt.state[q]
        assert set(mine) == set(ref)
        assert all(torch.equal(mine[k], ref[k]) for k in ref)


@pytest.mark.parametrize(("save_ours", "load_ours"), [(False, True), (True, False), (True, True)])
def test_get_state_dict_round_trip_across_planner_pairs(tmp_path, save_ours, load_ours):
    """nn.Linear + AdamW in one process: either planner pair writes, either reads, in place."""
    model, opt = trained()
    msd, osd = get_state_dict(model, opt)
    dcp.save(
        {"model": msd, "optim": osd},
        storage_writer=db.FsspecCheckpointWriter(tmp_path),
        planner=db.ShardedSavePlanner() if save_ours else None,
        no_dist=True,
    )
    with open(os.path.join(tmp_path, "dcpbridge.json")) as f:
        stored = json.load(f)
    assert "model.weight" in stored["tensors"] and "optim.param_groups.0.betas" in stored["objects"]
    assert "optim.state.weight.exp_avg" in stored["tensors"]
    model2, opt2, sd = fresh()
    weight = sd["model"]["weight"]
    dcp.load(
        sd,
        storage_reader=db.FsspecCheckpointReader(tmp_path),
        planner=db.ShardedLoadPlanner() if load_ours else None,
        no_dist=True,
    )
    assert sd["model"]["weight"] is weight  # filled in place
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert_resumed(model2, opt2)


def test_db_load_fills_a_plain_dcp_checkpoint_template(tmp_path):
    """The template's tensors are requests: filled in place, never a silent empty result."""
    model, opt = trained()
    msd, osd = get_state_dict(model, opt)
    dcp.save(
        {"model": msd, "optim": osd},
        storage_writer=db.FsspecCheckpointWriter(tmp_path),
        no_dist=True,
    )
    model2, opt2, sd = fresh()
    out = db.load(sd, tmp_path)
    assert out["model"]["weight"] is sd["model"]["weight"]
    assert out["optim"]["param_groups"][0]["lr"] == 0.01
    set_state_dict(model2, opt2, model_state_dict=out["model"], optim_state_dict=out["optim"])
    assert_resumed(model2, opt2)
    sd["model"]["extra"] = torch.zeros(2)
    with pytest.raises(db.MissingKeysError, match=r"model\.extra"):
        db.load(sd, tmp_path)


def test_db_save_is_read_by_plain_dcp_key_for_key(tmp_path):
    """db.save stores tensors as tensor entries and values one entry per key."""
    model, opt = trained()
    msd, osd = get_state_dict(model, opt)
    db.save({"model": msd, "optim": osd, **nested()}, tmp_path)
    with open(os.path.join(tmp_path, "dcpbridge.json")) as f:
        doc = json.load(f)
    assert "__common__" not in doc["objects"]
    assert {"model.weight", "model.bias", "mixed.0", "mixed.2.deep"} <= set(doc["tensors"])
    assert {"cfg.betas", "cfg.names", "blob", "raw", "n"} <= set(doc["objects"])
    model2, opt2, sd = fresh()
    sd.update(nested())
    sd["blob"], sd["raw"], sd["n"], sd["cfg"]["betas"] = io.BytesIO(), b"", 0, (0, 0)
    dcp.load(sd, storage_reader=db.FsspecCheckpointReader(tmp_path), no_dist=True)
    assert sd["blob"].getvalue() == b"opaque" and sd["raw"] == b"bytes" and sd["n"] == 3
    assert sd["cfg"]["betas"] == (0.9, 0.95)
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert_resumed(model2, opt2)
    # Megatron's meaning too: load returns the whole common state, whatever the template asks
    common = db.load_common_state_dict(tmp_path)
    assert common["cfg"] == {"betas": (0.9, 0.95), "names": ["a", "b"], "empty": []}
    assert common["blob"].getvalue() == b"opaque" and torch.equal(
        common["mixed"][0], torch.arange(3.0)
    )


@pytest.mark.parametrize("ours", [True, False])
def test_bytes_values_through_dcbridge_planners_and_dcps(tmp_path, ours):
    """An io.BytesIO saved by either planner loads with dcpbridge's safe (no-pickle) loader."""
    planner = db.ShardedSavePlanner() if ours else None
    dcp.save(
        {"blob": io.BytesIO(b"\x00\x01"), "b": b"xy"},
        storage_writer=db.FsspecCheckpointWriter(tmp_path),
        planner=planner,
        no_dist=True,
    )
    sd = {"blob": io.BytesIO(), "b": b""}
    dcp.load(
        sd,
        storage_reader=db.FsspecCheckpointReader(tmp_path),
        planner=db.ShardedLoadPlanner(),
        no_dist=True,
    )
    assert sd["blob"].getvalue() == b"\x00\x01" and sd["b"] == b"xy"


def test_older_per_item_keys_still_load(tmp_path):
    """dcpbridge < 0.2 stored tuples and lists item by item (``cfg.betas.0``): still read."""
    old = {
        "cfg": {"betas": {"0": 0.9, "1": 0.95}, "groups": {"0": {"0": 1, "1": 2}, "1": {"0": 3}}}
    }
    dcp.save(
        old,
        storage_writer=db.FsspecCheckpointWriter(tmp_path),
        planner=db.ShardedSavePlanner(),
        no_dist=True,
    )
    sd = {"cfg": {"betas": (0.0, 0.0), "groups": [[0, 0], [0]]}}
    dcp.load(
        sd,
        storage_reader=db.FsspecCheckpointReader(tmp_path),
        planner=db.ShardedLoadPlanner(),
        no_dist=True,
    )
    assert sd["cfg"]["betas"] == (0.9, 0.95) and sd["cfg"]["groups"] == [[1, 2], [3]]


def test_partial_loads_and_missing_keys(tmp_path):
    dcp.save({"a": torch.ones(2)}, storage_writer=db.FsspecCheckpointWriter(tmp_path), no_dist=True)
    sd = {"a": torch.zeros(2), "b": torch.zeros(2)}
    with pytest.raises(CheckpointException, match=r"MissingKeysError.*'b'"):  # DCP wraps it
        dcp.load(
            sd,
            storage_reader=db.FsspecCheckpointReader(tmp_path),
            planner=db.ShardedLoadPlanner(),
            no_dist=True,
        )
    dcp.load(
        sd,
        storage_reader=db.FsspecCheckpointReader(tmp_path),
        planner=DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )
    assert torch.equal(sd["a"], torch.ones(2)) and torch.equal(sd["b"], torch.zeros(2))


class Subclass(torch.Tensor):
    """A tensor subclass whose ``data_ptr`` the reader must not trust."""


def test_reader_writes_through_raw_pointers_only_into_plain_tensors():
    plain = torch.zeros(4)
    assert byte_view(plain) is not None
    assert byte_view(torch.nn.Parameter(torch.zeros(4))) is not None
    assert byte_view(torch.zeros(4).as_subclass(Subclass)) is None
    assert byte_view(torch.zeros(4, 2).t()) is None  # not contiguous
    assert byte_view(torch.zeros(4, device="meta")) is None


def _save_older_common_blob(path, blob: dict) -> None:
    """A checkpoint as dcpbridge < 0.2 wrote it: the common state as one ``__common__``
    object, beside the ShardedTensor ``w`` = arange(4)."""
    from dcpbridge.engine.bridge import BridgeSavePlanner

    w = db.ShardedTensor.from_rank_offsets("w", torch.arange(4.0))
    planner = BridgeSavePlanner([w], {"__common__": blob}, {})
    dcp.save({}, storage_writer=db.FsspecCheckpointWriter(path), planner=planner, no_dist=True)


def test_older_common_blob_still_loads(tmp_path):
    """Checkpoints of dcpbridge < 0.2 kept the common state as one ``__common__`` object."""
    _save_older_common_blob(tmp_path, {"iteration": 3, "rng": torch.arange(2), "cfg": {"lr": 0.1}})
    rng = torch.zeros(2, dtype=torch.int64)
    tmpl = {
        "w": db.ShardedTensor.from_rank_offsets("w", torch.zeros(4)),
        "rng": rng,
        "iteration": 0,
    }
    out = db.load(tmpl, tmp_path)
    assert torch.equal(out["w"], torch.arange(4.0)) and out["iteration"] == 3
    assert out["rng"] is rng and torch.equal(rng, torch.arange(2))  # filled from the blob
    assert out["cfg"] == {"lr": 0.1}
    assert db.load_common_state_dict(tmp_path)["cfg"] == {"lr": 0.1}


def _fully_parallel_from_older_blob(r, path: str) -> list:
    tmpl = {
        "w": db.ShardedTensor.from_rank_offsets("w", torch.zeros(4), replica_id=r.rank),
        "rng": torch.zeros(2, dtype=torch.int64),
        "big": torch.zeros(64),
    }
    out = db.load(tmpl, path, process_group=r.group, fully_parallel=True)
    return [out["w"].tolist(), out["rng"].tolist(), out["big"].tolist(), out["iteration"]]


def test_a_fully_parallel_load_fills_every_rank_s_plain_tensors_from_an_older_blob(pool, tmp_path):
    """The plain tensors a rank received from the one that read them held that rank's
    template zeros: the blob filled them only after the hand-over (one zeroed per rank)."""
    _save_older_common_blob(
        tmp_path, {"iteration": 3, "rng": torch.arange(2), "big": torch.arange(64.0)}
    )
    want = [[0.0, 1.0, 2.0, 3.0], [0, 1], list(range(64)), 3]
    assert pool.run(_fully_parallel_from_older_blob, 2, str(tmp_path)) == [want] * 2


class _Unpicklable:
    """A value whose serialization fails while DCP's own planner writes it."""

    def __reduce__(self) -> Any:
        raise RuntimeError("refuses to pickle")


def test_plain_dcp_save_failing_in_write_data_leaves_no_data_files(tmp_path):
    """DCP's planner serializes objects inside write_data; plain dcp.save calls no abort, so the
    writer must remove the data files it opened, leaving the previous checkpoint as it was."""
    path = str(tmp_path)
    dcp.save({"w": torch.ones(3)}, storage_writer=db.FsspecCheckpointWriter(path), no_dist=True)
    before = sorted(os.listdir(path))
    state = {"w": torch.zeros(3), "big": torch.zeros(1 << 18), "bad": _Unpicklable()}
    with pytest.raises(CheckpointException, match="refuses to pickle"):
        dcp.save(state, storage_writer=db.FsspecCheckpointWriter(path), no_dist=True)
    assert sorted(os.listdir(path)) == before
    assert torch.equal(db.load({"w": torch.zeros(3)}, path)["w"], torch.ones(3))


def _plain_dcp_save_failing_to_commit(r, path: str) -> str:
    """Two plain ``dcp.save``s over dcpbridge's writer; the coordinator's commit of the second
    fails (a storage fault while publishing its commit file); what each rank raised."""
    import torch.distributed as dist

    import dcpbridge.storage.write.writer as W

    def state(value: float) -> dict:
        return {f"w{r.rank}": torch.full((1 << 16,), value), "b": torch.full((4,), value)}

    dcp.save(state(1.0), storage_writer=db.FsspecCheckpointWriter(path), process_group=r.group)
    dist.barrier(group=r.group)
    original = W.publish

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full while publishing")

    W.publish = fail if r.rank == 0 else original
    try:
        writer = db.FsspecCheckpointWriter(path)
        dcp.save(state(2.0), storage_writer=writer, process_group=r.group)
    except CheckpointException as e:
        return str(e)
    finally:
        W.publish = original
    return "saved"


@pytest.mark.timeout(120)
def test_plain_dcp_save_whose_commit_fails_leaves_no_rank_s_data_files(pool, tmp_path):
    """DCP calls no abort step: when the coordinator's ``finish`` (the commit) failed, every
    rank raised but the data files each rank had written for the failed save stayed. The
    coordinator's writer now removes every rank's files of that save (all writes are done
    by then); the previous checkpoint is left as it was."""
    path = str(tmp_path / "ck")
    os.makedirs(path)
    errors = pool.run(_plain_dcp_save_failing_to_commit, 2, path, timeout=90)
    assert all("disk full while publishing" in e for e in errors), errors
    doc = json.loads((tmp_path / "ck" / "dcpbridge.json").read_text())
    assert sorted(os.listdir(path)) == sorted(["dcpbridge.json", *doc["files"]])
    out = db.load({"w1": torch.zeros(1 << 16), "b": torch.zeros(4)}, path)
    assert torch.equal(out["w1"], torch.full((1 << 16,), 1.0))


def _plain_dcp_save_failing_on_rank_1(r, path: str) -> dict:
    """Plain ``dcp.save``s over dcpbridge's writer: the first commits; rank 1's write of the
    second fails (DCP then skips ``finish``: no writer learns of it on rank 0); the third
    commits. The names in the folder after the second and third, and what each raised."""
    import torch.distributed as dist

    import dcpbridge.storage.write.writer as W

    def state(value: float) -> dict:
        return {f"w{r.rank}": torch.full((1 << 16,), value), "b": torch.full((4,), value)}

    out: dict = {}
    dcp.save(state(1.0), storage_writer=db.FsspecCheckpointWriter(path), process_group=r.group)
    dist.barrier(group=r.group)
    out["first"] = sorted(os.listdir(path))
    original = W.FsspecCheckpointWriter._write_file

    def fail(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError("disk full while writing")

    if r.rank == 1:
        W.FsspecCheckpointWriter._write_file = fail  # type: ignore[method-assign]
    try:
        writer = db.FsspecCheckpointWriter(path)
        dcp.save(state(2.0), storage_writer=writer, process_group=r.group)
    except CheckpointException as e:
        out["error"] = str(e)
    finally:
        W.FsspecCheckpointWriter._write_file = original  # type: ignore[method-assign]
    dist.barrier(group=r.group)
    out["after_failure"] = sorted(os.listdir(path))
    dist.barrier(group=r.group)
    dcp.save(state(3.0), storage_writer=db.FsspecCheckpointWriter(path), process_group=r.group)
    dist.barrier(group=r.group)
    out["after_next"] = sorted(os.listdir(path))
    return out


@pytest.mark.timeout(120)
def test_a_failed_write_s_other_data_files_go_with_the_next_plain_dcp_save(pool, tmp_path):
    """DCP skips ``finish`` when one rank's ``write_data`` fails and calls no abort step: the
    other ranks' data files of that save stayed for good (a later save there left them, as
    possibly another save's). The coordinator counts the saves whose ``finish`` never
    started; the next save it coordinates there removes their files (every write of such a
    save had returned before it raised), never a committed checkpoint's."""
    path = str(tmp_path / "ck")
    os.makedirs(path)
    out = pool.run(_plain_dcp_save_failing_on_rank_1, 2, path, timeout=90)
    assert all("disk full while writing" in o["error"] for o in out), out
    left = [n for n in out[0]["after_failure"] if n not in out[0]["first"]]
    assert left and all(n.startswith("__0_") for n in left), out[0]  # rank 0's, uncommitted
    doc = json.loads((tmp_path / "ck" / "dcpbridge.json").read_text())
    assert sorted(os.listdir(path)) == sorted(["dcpbridge.json", *doc["files"]])
    assert out[0]["after_next"] == out[1]["after_next"] == sorted(os.listdir(path))
    assert not set(left) & set(out[0]["after_next"])
    out3 = db.load({"w0": torch.zeros(1 << 16), "w1": torch.zeros(1 << 16)}, path)
    assert torch.equal(out3["w0"], torch.full((1 << 16,), 3.0))
    assert torch.equal(out3["w1"], torch.full((1 << 16,), 3.0))


def test_a_save_whose_files_a_later_save_removed_does_not_commit(tmp_path):
    """A save here whose ``finish`` had not started when a later save here began its write
    (a failed save, to the later one) lost its data files to it: its ``finish`` refuses to
    commit (``ConcurrentSaveError``) instead of naming missing files; the later one stays."""
    path = str(tmp_path)
    early = {"w": torch.full((64,), 1.0)}
    planner, writer = db.ShardedSavePlanner(), db.FsspecCheckpointWriter(path)
    planner.set_up_planner(early, writer.storage_meta(), True)
    writer.set_up_storage_writer(True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([local])
    plan = planner.finish_plan(writer.prepare_global_plan(plans)[0])
    results = writer.write_data(plan, planner).wait()
    assert len(os.listdir(path)) == 1  # its data file
    later = {"w": torch.full((64,), 2.0)}
    dcp.save(later, storage_writer=db.FsspecCheckpointWriter(path), no_dist=True)
    with pytest.raises(db.ConcurrentSaveError, match="removed its data files"):
        writer.finish(metadata, [results])
    doc = json.loads((tmp_path / "dcpbridge.json").read_text())
    assert sorted(os.listdir(path)) == sorted(["dcpbridge.json", *doc["files"]])
    assert torch.equal(db.load({"w": torch.zeros(64)}, path)["w"], later["w"])
