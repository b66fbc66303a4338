"""Unusual state through plain DCP and dcpbridge, either way: what plain DCP stores, dcpbridge
stores and returns; what neither can take is refused with a CheckpointError naming the key."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

import dcpbridge as db
from tests.support.dist_pool import Rank

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is .*assuming:UserWarning")

Pair = namedtuple("Pair", "first second")


def empties(fill: bool) -> dict:
    """1-D tensors next to empty tensors of more dimensions than any written chunk."""
    return {
        "a": torch.arange(3.0) if fill else torch.zeros(3),
        "e": torch.zeros(3, 0),
        "d": {"z": torch.zeros(2, 0, 4, dtype=torch.int8)},
    }


def check_empties(out: dict) -> None:
    assert torch.equal(out["a"], torch.arange(3.0))
    assert out["e"].shape == (3, 0) and out["d"]["z"].shape == (2, 0, 4)
    assert out["d"]["z"].dtype == torch.int8


def test_empty_tensors_wider_than_every_chunk_through_dcp_save(tmp_path):
    """dcp.save with dcpbridge's planner: the coordinator's array check failed (ValueError)."""
    dcp.save(
        empties(True),
        storage_writer=db.FsspecCheckpointWriter(tmp_path),
        planner=db.ShardedSavePlanner(),
        no_dist=True,
    )
    md = db.FsspecCheckpointReader(tmp_path).read_metadata().state_dict_metadata
    assert tuple(md["e"].size) == (3, 0) and tuple(md["d.z"].size) == (2, 0, 4)
    plain = empties(False)
    dcp.load(plain, storage_reader=db.FsspecCheckpointReader(tmp_path), no_dist=True)
    check_empties(plain)
    check_empties(db.load(empties(False), tmp_path))


def save_and_load_empties(r: Rank, path: str) -> bool:
    db.save(empties(True), path, process_group=r.group)
    check_empties(db.load(empties(False), path, process_group=r.group))
    return True


def test_empty_tensors_wider_than_every_chunk_on_two_ranks(pool, tmp_path):
    assert pool.run(save_and_load_empties, 2, str(tmp_path / "ck")) == [True, True]


def test_namedtuples_in_template_and_checkpoint(tmp_path):
    """Namedtuples (tuples: one pickled value each, as in DCP) come back as namedtuples, also
    where the template holds one; rebuilding them raised TypeError."""
    w = torch.arange(4.0)
    state = {
        "n": Pair(1, "x"),
        "l": [Pair(2, None), torch.ones(2)],
        "t": Pair(torch.arange(2.0), 3),  # a plain tensor inside: pickled whole, as DCP does
        "sharded": Pair(db.ShardedTensor.from_rank_offsets("w", w), 5),
    }
    db.save(state, tmp_path)
    template = {
        "n": Pair(0, ""),
        "l": [Pair(0, 0), torch.zeros(2)],
        "t": Pair(torch.zeros(2), 0),
        "sharded": Pair(db.ShardedTensor.from_rank_offsets("w", torch.zeros(4)), 0),
    }
    out = db.load(template, tmp_path, allow_pickle=True)
    assert out["n"] == Pair(1, "x") and type(out["n"]) is Pair
    assert out["l"][0] == Pair(2, None) and torch.equal(out["l"][1], torch.ones(2))
    assert type(out["t"]) is Pair and torch.equal(out["t"].first, torch.arange(2.0))
    assert type(out["sharded"]) is Pair and out["sharded"].second == 5
    assert torch.equal(out["sharded"].first, w)
    with pytest.raises(db.PickleRefusedError, match="Pair"):
        db.load(template, tmp_path)  # a class of the user's: only when allowed


def test_template_of_overlapping_memory_refused_naming_the_key(tmp_path):
    """An expanded view cannot receive data: plain DCP fails too; dcpbridge names the key."""
    db.save({"w": torch.arange(4.0)}, tmp_path)
    with pytest.raises(db.InvalidRequestError, match=r"'w'.*sharing memory"):
        db.load({"w": torch.zeros(1).expand(4)}, tmp_path)
    with pytest.raises(CheckpointException, match=r"InvalidRequestError"):
        dcp.load(
            {"w": torch.zeros(1).expand(4)},
            storage_reader=db.FsspecCheckpointReader(tmp_path),
            planner=db.ShardedLoadPlanner(),
            no_dist=True,
        )
    stride_view = {"w": torch.zeros(8)[::2]}  # strided, not overlapping: filled in place
    out = db.load(stride_view, tmp_path)
    assert out["w"] is stride_view["w"] and torch.equal(out["w"], torch.arange(4.0))


def test_template_whose_elements_overlap_without_a_zero_stride_refused(tmp_path):
    """An ``as_strided`` view whose elements meet (strides (1, 1)) took the stored rows over
    each other: [[0, 3, 6], [3, 6, 9], ...] instead of the stored values, silently."""
    full = torch.arange(12.0).reshape(4, 3)
    db.save({"w": full}, tmp_path)
    memory = torch.zeros(6)
    with pytest.raises(db.InvalidRequestError, match=r"'w'.*sharing memory"):
        db.load({"w": memory.as_strided((4, 3), (1, 1))}, tmp_path)
    assert not memory.any()  # nothing was read into it
    # interleaved but disjoint (offsets 2i + 3j of a (3, 3) view): filled in place
    interleaved = {"w": torch.full((11,), -1.0).as_strided((3, 3), (2, 3))}
    db.save({"w": full[:3]}, tmp_path / "rows")
    out = db.load(interleaved, tmp_path / "rows")
    assert out["w"] is interleaved["w"] and torch.equal(out["w"], full[:3])


@pytest.mark.parametrize("writer", ["dcp", "dcpbridge"])
def test_tensor_stored_where_the_template_holds_a_value(tmp_path, writer):
    """SGD's momentum buffer is None before the first step: db.load returns the stored tensor
    for plain DCP checkpoints as for its own (it was silently left out of the result)."""
    state = {"optim": {"state": {"w": {"momentum_buffer": torch.arange(3.0)}}}, "step": 4}
    if writer == "dcp":
        dcp.save(state, storage_writer=db.FsspecCheckpointWriter(tmp_path), no_dist=True)
    else:
        db.save(state, tmp_path)
    template = {"optim": {"state": {"w": {"momentum_buffer": None}}}, "step": 0}
    out = db.load(template, tmp_path)
    assert torch.equal(out["optim"]["state"]["w"]["momentum_buffer"], torch.arange(3.0))
    assert out["step"] == 4


def value_for_tensor(r: Rank, path: str) -> list[str]:
    """Template tensors whose key the checkpoint holds as a value: a DTensor or a sharded
    tensor raises, a plain tensor comes back as the stored value."""
    mesh = DeviceMesh.from_group(r.group or dist.group.WORLD, "cpu")
    errors = []
    sharded = db.ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, r.rank, r.size))
    for tensor in (distribute_tensor(torch.zeros(4), mesh, [Shard(0)]), sharded):
        with pytest.raises(db.ShapeMismatchError) as e:
            db.load({"w": tensor, "t": torch.zeros(2)}, path, process_group=r.group)
        errors.append(str(e.value))
    out = db.load({"w": torch.zeros(4), "t": torch.zeros(2)}, path, process_group=r.group)
    assert out["w"] == 5 and torch.equal(out["t"], torch.arange(2.0))
    return errors


def test_value_stored_where_the_template_holds_a_tensor(pool, tmp_path):
    """The request was silently dropped from the result (the key is common state, so not
    counted missing), the template left unfilled: a sharded one raises naming the key, on
    every rank; a plain one comes back as stored, as a plain tensor of another form does."""
    path = str(tmp_path / "ck")
    db.save({"w": 5, "t": torch.arange(2.0)}, path)
    errors = pool.run(value_for_tensor, 2, path)
    assert errors[0] == errors[1] and all("'w': stored as a value" in e for e in errors[0])
    with pytest.raises(CheckpointException, match=r"ShapeMismatchError.*'w': stored as a value"):
        dcp.load(
            {"w": torch.zeros(4)},
            storage_reader=db.FsspecCheckpointReader(path),
            planner=db.ShardedLoadPlanner(strict="ignore_all"),
            no_dist=True,
        )


def save_nested(r: Rank, path: str) -> None:
    mesh = DeviceMesh.from_group(r.group or dist.group.WORLD, "cpu")
    state = {
        "model": {"w": distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])},
        "mc": {"fc": db.ShardedTensor.from_rank_offsets("dec.fc", torch.ones(2), (0, r.rank, 2))},
        "optim": {"param_groups": [{"lr": 0.5}], "bias": torch.arange(2.0)},
        "step": 3,
    }
    db.save(state, path, process_group=r.group)


def test_torch_template_free_loads_rebuild_db_save_nesting(pool, tmp_path):
    """db.save records DCP's key-to-path map, so torch's template-free loader rebuilds the
    nested state (it returned flat dotted keys) and loads by key (it raised TypeError)."""
    path = str(tmp_path / "ck")
    pool.run(save_nested, 2, path)
    out = _load_state_dict_from_keys(storage_reader=db.FsspecCheckpointReader(path))
    assert sorted(out) == ["dec.fc", "model", "optim", "step"] and out["step"] == 3
    assert torch.equal(out["model"]["w"], torch.arange(6.0).reshape(3, 2))
    assert torch.equal(out["dec.fc"], torch.ones(4))  # Megatron keys stay as they are
    assert out["optim"]["param_groups"] == [{"lr": 0.5}]
    assert torch.equal(out["optim"]["bias"], torch.arange(2.0))
    only = _load_state_dict_from_keys("model", storage_reader=db.FsspecCheckpointReader(path))
    assert list(only) == ["model"] and list(only["model"]) == ["w"]


class App:
    """A model and its optimizer behind torch's Stateful protocol (torchtitan's pattern)."""

    def __init__(self, seed: int) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        self._get, self._set = get_state_dict, set_state_dict
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(3, 2)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=0.1 * (seed + 1))
        self.model(torch.randn(4, 3)).sum().backward()
        self.optim.step()

    def state_dict(self) -> dict:
        msd, osd = self._get(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state_dict: dict) -> None:
        self._set(self.model, self.optim, model_state_dict=state_dict["model"],
                  optim_state_dict=state_dict["optim"])  # fmt: skip


@pytest.mark.parametrize("writer", ["dcp", "dcpbridge"])
def test_stateful_values_go_through_their_state_dicts(tmp_path, writer):
    """As in DCP: db.save stored the Stateful object itself as a pickle, and db.load returned
    nothing for it from a plain DCP checkpoint, silently leaving the app unloaded."""
    saved = App(0)
    if writer == "dcp":
        dcp.save({"app": saved, "step": 2}, storage_writer=db.FsspecCheckpointWriter(tmp_path))
    else:
        db.save({"app": saved, "step": 2}, tmp_path)
    md = db.FsspecCheckpointReader(tmp_path).read_metadata().state_dict_metadata
    assert {"app.model.weight", "app.optim.state.weight.exp_avg", "step"} <= set(md)
    app = App(1)
    out = db.load({"app": app, "step": 0}, tmp_path)
    assert out["app"] is app and out["step"] == 2
    assert torch.equal(app.model.weight, saved.model.weight)
    assert app.optim.param_groups[0]["lr"] == 0.1
    ref = saved.optim.state[saved.model.weight]["exp_avg"]
    assert torch.equal(app.optim.state[app.model.weight]["exp_avg"], ref)


def test_empty_tensor_of_freed_storage_saves_and_loads(tmp_path):
    """An empty view of a storage freed since (resized to 0 bytes) holds nothing to read or
    fill: it is stored and loaded like any empty tensor, not refused as freed memory."""
    memory = torch.zeros(10)
    empty = memory[3:3]
    memory.untyped_storage().resize_(0)
    db.save({"e": empty, "w": torch.arange(3.0)}, tmp_path)
    template = {"e": empty, "w": torch.zeros(3)}
    out = db.load(template, tmp_path)
    assert out["e"].shape == (0,) and torch.equal(out["w"], torch.arange(3.0))
