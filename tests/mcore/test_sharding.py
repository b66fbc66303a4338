"""Rank 0 reads a full state dict, broadcasts each tensor once, every rank keeps its shard."""

from __future__ import annotations

import json
import struct

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dcpbridge as db
from dcpbridge.formats.layout import even_pieces
from dcpbridge.mcore.sharding import TensorInfo, _device_for, plan_broadcasts
from tests.support import layouts as L
from tests.support.collective_counts import count_collectives
from tests.support.dist_pool import Rank

# -- planning (pure) ---------------------------------------------------------------------------


def test_plan_follows_rank0_order_and_reports_keys():
    header = {
        "b": TensorInfo((4,), torch.float32),
        "a": TensorInfo((2, 3), torch.float32),
        "junk": TensorInfo((1,), torch.float32),
        "extra": {"v": 1},
    }
    needs = [{"a": (2, 3), "extra": None, "gone": (5,)}, {"b": (4,), "a": (2, 3)}]
    plan = plan_broadcasts(needs, header)
    assert plan.order == ["b", "a"]
    assert plan.unexpected == ["junk"]
    assert plan.missing == {0: ["gone"], 1: []}
    assert plan.errors == []


def test_plan_names_shape_and_kind_mismatches():
    header = {"a": TensorInfo((2, 3), torch.float32), "o": 7}
    needs = [{"a": (2, 3), "o": (1,)}, {"a": (3, 2), "o": (1,)}, {"a": (3, 2), "o": None}]
    plan = plan_broadcasts(needs, header)
    assert plan.errors == [
        "'o': ranks [0, 1] expect a tensor of shape (1,), rank 0's state dict holds a int",
        "'a': ranks [1, 2] expect global shape (3, 2), rank 0's tensor has shape (2, 3)",
    ]


def test_device_map():
    dm = {"": "cpu", "decoder": "meta:0", "decoder.layers.1": 3}
    assert _device_for("embed.weight", dm) == torch.device("cpu")
    assert _device_for("decoder.layers.1.w", dm) == torch.device("cuda", 3)
    assert _device_for("decoder.layers.10.w", dm) == torch.device("meta", 0)
    assert _device_for("x", None) == torch.device("cpu")
    assert _device_for("x", 1) == torch.device("cuda", 1)
    with pytest.raises(db.InvalidArgumentError, match="'disk'"):
        _device_for("x", {"x": "disk"})


def test_wrong_rank_raises_invalid_argument():
    with pytest.raises(db.InvalidArgumentError, match="ranks other than 0"):
        db.shard_broadcasted_state_dict({}, {})


# -- full tensors and their expected shards ----------------------------------------------------

FULL = {
    "w": ((7, 5), torch.float32),  # uneven rows over 2 and 4
    "emb": ((6, 9), torch.bfloat16),
    "b": ((4,), torch.float32),
    "mask": ((3, 2), torch.bool),
    "scale": ((), torch.float64),
    "ids": ((5,), torch.int64),
}


def full(key: str) -> torch.Tensor:
    shape, dtype = FULL[key]
    if dtype == torch.bool:
        return L.full(key, shape, torch.int64) % 2 == 0
    return L.full(key, shape, dtype)


def expected_local(t: torch.Tensor, mesh_shape, coord, placements) -> torch.Tensor:
    """DTensor's layout written out: mesh dims in order, each Shard(d) = torch.chunk along d."""
    for n, c, p in zip(mesh_shape, coord, placements):
        if isinstance(p, Shard):
            chunks = torch.chunk(t, n, dim=p.dim)
            t = chunks[c] if c < len(chunks) else t.narrow(p.dim, 0, 0)
    return t


def meta_dtensor(key: str, mesh: DeviceMesh, placements) -> DTensor:
    shape, dtype = FULL[key]
    return distribute_tensor(
        torch.empty(shape, dtype=dtype, device="meta"), mesh, placements, src_data_rank=None
    )


def rank0_state() -> dict:
    sd = {k: full(k) for k in FULL}
    sd["junk"] = torch.ones(3)
    sd["meta_info"] = {"version": 3}
    return sd


def _only_own_memory(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _run_distribute(r: Rank, meta: dict) -> tuple[dict, db.DistributedKeys, int]:
    out: dict = {}
    with count_collectives() as calls:
        if r.rank == 0:
            keys = db.broadcast_and_shard_state_dict(
                rank0_state(), meta, out, process_group=r.group
            )
        else:
            keys = db.shard_broadcasted_state_dict(meta, out, process_group=r.group)
    return out, keys, calls["broadcast_tensor"]


DT_CASES = {"w": [Shard(0)], "emb": [Shard(1)], "b": [Replicate()], "mask": [Shard(0)]}


def dtensors_1d(r: Rank) -> None:
    mesh = DeviceMesh.from_group(r.group, "cpu")
    meta = {k: meta_dtensor(k, mesh, p) for k, p in DT_CASES.items()}
    meta["scale"] = torch.empty((), dtype=torch.float64, device="meta")  # plain: replicated
    meta["meta_info"] = None  # non-tensor: rank 0's value
    meta["absent"] = torch.empty(2, device="meta")
    out, keys, broadcasts = _run_distribute(r, meta)
    assert broadcasts == 5, "each needed tensor travels exactly once"
    assert keys == (["absent"], ["ids", "junk"])
    assert set(out) == {*DT_CASES, "scale", "meta_info"}
    for k, placements in DT_CASES.items():
        got = out[k]
        assert isinstance(got, DTensor) and got.placements == tuple(placements), k
        want = expected_local(full(k), (r.size,), (r.rank,), placements)
        local = got.to_local()
        assert local.dtype == want.dtype and torch.equal(local, want), k
        assert local.device.type == "cpu" and got.shape == full(k).shape
        if local.numel() < full(k).numel():
            assert _only_own_memory(local), f"{k} keeps the full tensor alive"
    assert torch.equal(out["scale"], full("scale"))
    assert out["meta_info"] == {"version": 3}


def test_dtensors_two_ranks(pool):
    pool.run(dtensors_1d, 2)


def dtensors_2d_and_sharded_tensors(r: Rank) -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    coord = mesh.get_coordinate()
    cases = {
        "w": [Shard(0), Shard(1)],
        "emb": [Replicate(), Shard(0)],
        "ids": [Shard(0), Replicate()],
    }
    meta: dict = {k: meta_dtensor(k, mesh, p) for k, p in cases.items()}
    # ShardedTensors on meta, matched by their key: two boxes of "w" per rank, a prepended axis
    rows = even_pieces(7, 8)[2 * r.rank : 2 * r.rank + 2]
    meta["st"] = [
        db.ShardedTensor.from_box("w", torch.empty(n, 5, device="meta"), (7, 5), (o, 0))
        for o, n in rows
    ]
    meta["layer"] = db.ShardedTensor.from_rank_offsets(
        "emb",
        torch.empty(9, dtype=torch.bfloat16, device="meta"),
        (0, r.rank, 6),
        prepend_axis_num=1,
    )
    out, keys, broadcasts = _run_distribute(r, meta)
    assert broadcasts == 3, "w, emb, ids once each, though w has three users per rank"
    assert keys == ([], ["b", "mask", "scale", "junk", "meta_info"])
    for k, placements in cases.items():
        want = expected_local(full(k), (2, 2), coord, placements)
        assert torch.equal(out[k].to_local(), want), k
    for sh, (o, n) in zip(out["st"], rows):
        assert isinstance(sh, db.ShardedTensor) and sh.key == "w"
        assert sh.global_offset == (o, 0) and torch.equal(sh.data, full("w")[o : o + n])
        assert _only_own_memory(sh.data)
    layer = out["layer"]
    assert layer.prepend_axis_num == 1 and torch.equal(layer.data, full("emb")[r.rank])


def test_dtensor_mesh_2d_and_sharded_tensors_four_ranks(pool):
    pool.run(dtensors_2d_and_sharded_tensors, 4, default_group=True)


def shape_mismatch(r: Rank) -> str:
    meta = {"w": torch.empty(7, 5 + r.rank, device="meta"), "b": torch.empty(4, device="meta")}
    with pytest.raises(db.ShapeMismatchError) as e:
        _run_distribute(r, meta)
    return str(e.value)


def test_shape_mismatch_raises_on_every_rank(pool):
    messages = pool.run(shape_mismatch, 2)
    assert messages[0] == messages[1]
    assert (
        "'w': rank 1 expects global shape (7, 6), rank 0's tensor has shape (7, 5)" in (messages[0])
    )


# -- rank-0 file reading and DistModule --------------------------------------------------------

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64", torch.bool: "BOOL"}


def write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors layout written by hand (the library's writer needs numpy)."""
    header, blobs, offset = {}, [], 0
    for k, t in tensors.items():
        raw = bytes(t.contiguous().reshape(-1).view(torch.uint8))
        header[k] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


class Toy(nn.Module):
    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.proj = nn.Linear(5, 7, bias=True, device=device)
        self.emb = nn.Embedding(6, 9, device=device, dtype=torch.bfloat16)
        self.register_buffer("mask", torch.zeros(3, 2, dtype=torch.bool, device=device))


def toy_full() -> dict[str, torch.Tensor]:
    return {
        "proj.weight": full("w"),
        "proj.bias": L.full("bias", (7,), torch.float32),
        "emb.weight": full("emb"),
        "mask": full("mask"),
    }


TOY_PLACEMENTS = {"proj.weight": [Shard(0)], "proj.bias": [Shard(0)], "emb.weight": [Shard(1)]}


def sharded_toy(mesh: DeviceMesh, device: str) -> Toy:
    model = Toy(device)
    for name, placements in TOY_PLACEMENTS.items():
        mod_name, attr = name.rsplit(".", 1)
        mod = model.get_submodule(mod_name)
        param = getattr(mod, attr)
        setattr(
            mod,
            attr,
            nn.Parameter(distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)),
        )
    return model


def dist_module_load(r: Rank, ckpt: str, assign: bool) -> None:
    mesh = DeviceMesh.from_group(r.group, "cpu")
    model = db.DistModule(sharded_toy(mesh, "meta" if assign else "cpu"), process_group=r.group)
    sd = db.load_state_dict(ckpt, process_group=r.group)
    assert (len(sd) == 4) if r.rank == 0 else sd == {}
    result = model.load_state_dict(sd, assign=assign)
    assert result.missing_keys == [] and result.unexpected_keys == []
    want = toy_full()
    for name, placements in TOY_PLACEMENTS.items():
        got = model.get_parameter(name)
        assert isinstance(got, DTensor), name
        local = expected_local(want[name], (r.size,), (r.rank,), placements)
        assert torch.equal(got.to_local(), local), name
    assert torch.equal(model.mask, want["mask"])
    # attribute access and forward go to the wrapped module
    assert model.proj is model.module.proj and set(model.state_dict()) == set(want)


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_dist_module_two_and_four_ranks(pool, tmp_path, fmt):
    ckpt = str(tmp_path / f"full.{fmt}")
    if fmt == "pt":
        torch.save(toy_full(), ckpt)
    else:
        write_safetensors(ckpt, toy_full())
    for n in (2, 4):
        pool.run(dist_module_load, n, ckpt, False)
    pool.run(dist_module_load, 4, ckpt, True)


def dist_module_strict(r: Rank, ckpt: str) -> tuple[str, list, list]:
    model = db.DistModule(Toy(), process_group=r.group)
    sd = db.load_state_dict(ckpt, process_group=r.group)
    with pytest.raises(db.KeyMismatchError) as e:  # still nn.Module's RuntimeError
        model.load_state_dict(sd)
    assert isinstance(e.value, RuntimeError)
    result = model.load_state_dict(sd, strict=False)
    assert torch.equal(model.proj.weight, toy_full()["proj.weight"])
    return str(e.value), result.missing_keys, result.unexpected_keys


def test_dist_module_strict_keys(pool, tmp_path):
    ckpt = str(tmp_path / "full.pt")
    sd = toy_full()
    del sd["emb.weight"]
    sd["stale"] = torch.zeros(2)
    torch.save(sd, ckpt)
    results = pool.run(dist_module_strict, 2, ckpt)
    assert results[0] == results[1]
    message, missing, unexpected = results[0]
    assert missing == ["emb.weight"] and unexpected == ["stale"]
    assert "Unexpected key(s) in state_dict: 'stale'" in message
    assert "Missing key(s) in state_dict: 'emb.weight'" in message


def read_missing_file(r: Rank, path: str) -> str:
    with pytest.raises(FileNotFoundError) as e:
        db.load_state_dict(path, process_group=r.group)
    return str(e.value)


def test_read_failure_raises_on_every_rank(pool, tmp_path):
    path = str(tmp_path / "nope.pt")
    messages = pool.run(read_missing_file, 2, path)
    assert all(path in m for m in messages)


def test_plain_process_reads_index_of_shards(tmp_path):
    """No process group: the single process is rank 0; an index json gathers its shard files."""
    sd = toy_full()
    torch.save({k: sd[k] for k in ("proj.weight", "proj.bias")}, tmp_path / "a.bin")
    write_safetensors(str(tmp_path / "b.safetensors"), {k: sd[k] for k in ("emb.weight", "mask")})
    weight_map = {"proj.weight": "a.bin", "proj.bias": "a.bin", "emb.weight": "b.safetensors"}
    weight_map["mask"] = "b.safetensors"
    (tmp_path / "m.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert not dist.is_initialized()
    got = db.load_state_dict(tmp_path / "m.index.json")
    assert list(got) == list(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    model = db.DistModule(Toy())
    model.load_state_dict(got)
    assert torch.equal(model.emb.weight, sd["emb.weight"])


def factory_on_rank1(r: Rank) -> str:
    meta: dict = {"w": torch.empty(7, 5, device="meta")}
    if r.rank == 1:
        meta["f"] = db.ShardedTensorFactory("f", torch.zeros(2), lambda *a: {}, lambda x: x)
    with pytest.raises(db.InvalidRequestError) as e:
        _run_distribute(r, meta)
    return str(e.value)


def test_template_error_on_one_rank_raises_on_every_rank(pool):
    messages = pool.run(factory_on_rank1, 2)
    assert messages[0] == messages[1]
    assert "rank 1" in messages[0] and "'f': a ShardedTensorFactory cannot be cut" in messages[0]


def test_load_state_dict_accepts_a_checkpoint_directory(tmp_path):
    """A dcpbridge checkpoint directory and a Hugging Face style safetensors directory read
    like a file: every tensor whole, by key."""
    sd = toy_full()
    db.save(
        {k: db.ShardedTensor.from_box(k, v, tuple(v.shape), (0,) * v.dim()) for k, v in sd.items()},
        str(tmp_path / "ck"),
    )
    got = db.load_state_dict(tmp_path / "ck")
    assert sorted(got) == sorted(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    (tmp_path / "hf").mkdir()
    write_safetensors(str(tmp_path / "hf" / "model.safetensors"), sd)
    got = db.load_state_dict(str(tmp_path / "hf"))
    assert sorted(got) == sorted(sd) and all(torch.equal(got[k], sd[k]) for k in sd)


def test_index_of_shards_is_checked_before_its_files_are_read(tmp_path):
    """An index (hostile input) names plain files of its folder, and each key comes from the
    file it names: names outside the folder, a key its file lacks and a key the index places
    in another file than the one read last were all taken as they came."""
    (tmp_path / "ck").mkdir()
    outside = torch.full((3,), 9.0)
    torch.save({"w": outside}, tmp_path / "outside.bin")
    for name in ("../outside.bin", str(tmp_path / "outside.bin"), "", "m.index.json"):
        (tmp_path / "ck" / "m.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
        with pytest.raises(db.CorruptCheckpointError, match=r"m\.index\.json") as e:
            db.load_state_dict(tmp_path / "ck" / "m.index.json")
        assert "plain file names" in str(e.value), name

    torch.save({"w": torch.ones(3), "x": torch.zeros(2)}, tmp_path / "ck" / "a.bin")
    torch.save({"w": torch.full((3,), 2.0)}, tmp_path / "ck" / "b.bin")
    index = {"weight_map": {"w": "a.bin", "x": "a.bin", "y": "b.bin"}}
    (tmp_path / "ck" / "m.index.json").write_text(json.dumps(index))
    with pytest.raises(db.CorruptCheckpointError, match=r"places 'y' in b\.bin, which lacks it"):
        db.load_state_dict(tmp_path / "ck" / "m.index.json")
    del index["weight_map"]["y"]
    index["weight_map"]["z"] = "b.bin"
    torch.save({"w": torch.full((3,), 2.0), "z": torch.ones(1)}, tmp_path / "ck" / "b.bin")
    (tmp_path / "ck" / "m.index.json").write_text(json.dumps(index))
    got = db.load_state_dict(tmp_path / "ck" / "m.index.json")
    assert sorted(got) == ["w", "x", "z"]
    assert torch.equal(got["w"], torch.ones(3)), "w is a.bin's, as the index says"


class _Note:
    """A class safe (weights_only) loading refuses."""


def test_index_shards_read_with_allow_pickle(tmp_path):
    """``allow_pickle=True`` reaches torch.save files, alone or named by an index (they were
    read weights_only regardless, so a trusted file holding an object was refused)."""
    torch.save({"w": torch.ones(2), "note": _Note()}, tmp_path / "a.bin")
    (tmp_path / "m.index.json").write_text(json.dumps({"weight_map": {"w": "a.bin"}}))
    with pytest.raises(db.PickleRefusedError, match=r"a\.bin: holds objects"):  # the shard named
        db.load_state_dict(tmp_path / "m.index.json")
    for trusted in (tmp_path / "m.index.json", tmp_path / "a.bin"):
        got = db.load_state_dict(trusted, allow_pickle=True)
        assert torch.equal(got["w"], torch.ones(2)) and isinstance(got["note"], _Note)


C = torch.tensor([1 + 2j, -3 + 0.5j, 4 - 1j, 0.25 + 8j], dtype=torch.complex64)
N = torch.tensor([1.5, -2.0, 0.0, 7.25])


def views_from_a_torch_file(r: Rank, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0 reads a torch.save file whose tensors are a conjugate and a negative view
    (torch.save keeps both bits); each rank keeps its half of each."""
    sd = db.load_state_dict(path, process_group=r.group)
    meta = {
        k: db.ShardedTensor.from_rank_offsets(k, torch.empty(2, dtype=t.dtype), (0, r.rank, 2))
        for k, t in (("c", C), ("n", N))
    }
    out: dict = {}
    if r.rank == 0:
        assert sd["c"].is_conj() and sd["n"].is_neg()
        db.broadcast_and_shard_state_dict(sd, meta, out, process_group=r.group)
    else:
        db.shard_broadcasted_state_dict(meta, out, process_group=r.group)
    return out["c"].data, out["n"].data


def test_conjugate_and_negative_views_are_broadcast_as_the_values_they_show(pool, tmp_path):
    """A conjugate or negative view's memory holds other values than it shows: rank 0 raised
    torch's ``RuntimeError`` (``view`` to bytes is not supported for them) while the other
    ranks waited in the broadcast. Every rank now gets the shown values of its half."""
    path = str(tmp_path / "views.pt")
    torch.save({"c": C.clone().conj(), "n": N.clone()._neg_view()}, path)
    for rank, (c, n) in enumerate(pool.run(views_from_a_torch_file, 2, path)):
        assert torch.equal(c, C.conj()[2 * rank : 2 * rank + 2])
        assert torch.equal(n, -N[2 * rank : 2 * rank + 2])


def _share(r: Rank, state: dict, meta: dict) -> db.DistributedKeys:
    """Rank 0 broadcasts ``state``; every rank keeps its shards of ``meta``'s tensors."""
    if r.rank == 0:
        return db.broadcast_and_shard_state_dict(state, meta, {}, process_group=r.group)
    return db.shard_broadcasted_state_dict(meta, {}, process_group=r.group)


def broadcast_kind(r: Rank, kind: str) -> str:
    """Rank 0 holds ``s`` as a tensor with no dense bytes to broadcast."""
    meta = {"s": db.ShardedTensor.from_rank_offsets("s", torch.empty(2), (0, r.rank, 2))}
    t = torch.tensor([1.0, 0.0, 2.0, 0.0])
    bad = {
        "sparse": t.to_sparse,
        "quantized": lambda: torch.quantize_per_tensor(t, 0.1, 0, torch.qint8),
        "meta": lambda: t.to("meta"),
    }[kind]()
    with pytest.raises(db.SerializationError) as e:
        _share(r, {"s": bad}, meta)
    return str(e.value)


@pytest.mark.parametrize("kind", ["sparse", "quantized", "meta"])
def test_a_tensor_without_dense_bytes_is_refused_on_every_rank(pool, kind):
    """Rank 0 failed in the broadcast (a sparse or meta tensor's bytes; a quantized one's
    garbage on the others, as ``CollectiveError``) while the other ranks waited in it until
    the process group's timeout. It is refused by key on every rank before any broadcast."""
    messages = pool.run(broadcast_kind, 2, kind)
    assert messages[0] == messages[1] and "'s': rank 0's state dict holds a" in messages[0]
    assert "no dense data to broadcast" in messages[0]
