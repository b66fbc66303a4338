"""DCP's pickled ``.metadata``, read without running code.

Checkpoints written by torch's own ``dcp.save`` load with ``db.load`` by default (no
``allow_pickle``); hostile ``.metadata`` files are refused before anything in them runs or
is allocated: a ``__reduce__`` payload, an unknown class, absurd sizes and lengths, deep
nesting, file names outside the checkpoint.
"""

from __future__ import annotations

import fractions
import os
import pickle
import resource
import struct
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import dcpbridge as db
from dcpbridge.formats.dcp_pickle import allow_list, loads_dcp_metadata
from dcpbridge.formats.unpickler import Malformed, Refused, restricted_loads
from tests.e2e.test_dtensor import SAVE_1D, dstate, full, mesh_of, torch_sharded
from tests.support.dist_pool import Rank
from tests.tools.test_cli import in_process

DCP = "torch.distributed.checkpoint.metadata"


def _dcp_save(state: dict, path: str) -> None:
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def _metadata(path: str) -> Metadata:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # the test's own file: what torch wrote


def _write_metadata(path: str, value: object, protocol: int = 4) -> None:
    raw = value if isinstance(value, bytes) else pickle.dumps(value, protocol=protocol)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(raw)


@pytest.fixture
def plain_dcp(tmp_path) -> str:
    """torch's ``dcp.save`` of plain tensors of four dtypes and non-tensor values."""
    path = str(tmp_path / "plain")
    state = {
        "a": torch.randn(3, 4),
        "b": torch.arange(5, dtype=torch.int64),
        "s": torch.tensor(3.0),
        "h": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "x": 5,
        "y": {"q": [1, 2]},
        "z": b"raw",
    }
    _dcp_save(state, path)
    return path


# -- real checkpoints of torch's dcp.save -----------------------------------------------------


def test_plain_tensors_and_bytes_load_without_allow_pickle(plain_dcp, capsys):
    want = _metadata(plain_dcp)
    got = dcp.FileSystemReader(plain_dcp).read_metadata()
    assert want.state_dict_metadata == got.state_dict_metadata
    template = {
        "a": torch.zeros(3, 4),
        "b": torch.zeros(5, dtype=torch.int64),
        "s": torch.zeros(()),
        "h": torch.zeros(2, 3, dtype=torch.bfloat16),
        "x": 0,
        "y": {"q": None},
        "z": None,
    }
    out = db.load(template, plain_dcp)
    saved = {k: torch.zeros_like(v) for k, v in template.items() if torch.is_tensor(v)}
    dcp.load(saved, checkpoint_id=plain_dcp, no_dist=True)  # torch's own reader, for reference
    assert all(torch.equal(out[k], saved[k]) for k in saved)
    assert out["x"] == 5 and out["y"] == {"q": [1, 2]} and out["z"] == b"raw"
    stored = db.load_tensors_metadata(plain_dcp)
    assert {k: (v.global_shape, v.dtype) for k, v in stored.items()} == {
        "a": ((3, 4), torch.float32),
        "b": ((5,), torch.int64),
        "s": ((), torch.float32),
        "h": ((2, 3), torch.bfloat16),
    }
    code, printed, err = in_process(capsys, "inspect", plain_dcp)
    assert code == 0 and "dcp version 1.0.0, complete" in printed, err
    code, printed, err = in_process(capsys, "validate", plain_dcp)
    assert code == 0, printed + err


def test_get_state_dict_model_and_optimizer_load_without_allow_pickle(tmp_path):
    path = str(tmp_path / "gsd")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    _dcp_save({"model": msd, "optim": osd}, path)

    model2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    model2(torch.randn(2, 4)).sum().backward()
    opt2.step()  # state to be overwritten
    msd2, osd2 = get_state_dict(model2, opt2)
    out = db.load({"model": msd2, "optim": osd2}, path)
    set_state_dict(model2, opt2, model_state_dict=out["model"], optim_state_dict=out["optim"])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    for p, q in zip(model.parameters(), model2.parameters()):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][name], opt2.state[q][name]), name
    assert opt2.param_groups[0]["lr"] == 0.1


def torch_save_dtensor_and_sharded(r: Rank, path: str) -> None:
    """torch's own ``dcp.save`` of DTensors (on 3 ranks: ``u`` split 2/2/1, ``z`` 1/1/0, an
    empty shard) and a torch ShardedTensor."""
    state = {**dstate(mesh_of(r), SAVE_1D), "st": torch_sharded(r, "w", 0, True)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), process_group=r.group)


def test_dtensor_and_torch_sharded_tensor_checkpoints_load_without_allow_pickle(pool, tmp_path):
    path = str(tmp_path / "dist")
    pool.run(torch_save_dtensor_and_sharded, 3, path)
    z = _metadata(path).state_dict_metadata["model.z"]
    assert [tuple(c.sizes) for c in z.chunks] == [(1, 4), (1, 4), (0, 4)]
    template = {
        "model": {k: torch.zeros(full(k).shape) for k in SAVE_1D},
        "st": torch.zeros(full("w").shape),
        "step": 0,
    }
    out = db.load(template, path)
    assert all(torch.equal(out["model"][k], full(k)) for k in SAVE_1D)
    assert torch.equal(out["st"], full("w")) and out["step"] == 7


def test_every_pickle_protocol_and_older_field_sets_read_alike(plain_dcp):
    """Protocols 2-5; metadata without the fields older torch lacked (``version``,
    ``storage_meta``, ``transform_descriptors``) or with Megatron's ``mcore_data``."""
    md = _metadata(plain_dcp)
    for protocol in (2, 3, 4, 5):
        got = loads_dcp_metadata(pickle.dumps(md, protocol=protocol), "x")
        assert got.state_dict_metadata == md.state_dict_metadata, protocol
        assert got.storage_data == md.storage_data and got.planner_data == md.planner_data
        assert got.storage_meta.checkpoint_id == str(md.storage_meta.checkpoint_id)  # no Path
    del md.version, md.storage_meta
    for info in md.storage_data.values():
        info.__dict__.pop("transform_descriptors", None)
    md.mcore_data = {"a": {"nd_reformulated_orig_global_shape": (3, 4)}}
    _write_metadata(plain_dcp, md)
    out = db.load({"a": torch.zeros(3, 4), "x": 0}, plain_dcp)
    assert out["x"] == 5


def test_copyreg_reconstructors_build_allowed_classes_only():
    """Protocol 1 rebuilds objects through ``copyreg._reconstructor``; ``__newobj__`` by
    REDUCE: both make allowed classes without calling them, and nothing else."""
    chunk = ChunkStorageMetadata(torch.Size([1, 2]), torch.Size([3, 4]))
    assert restricted_loads(pickle.dumps(chunk, protocol=1), allow_list()) == chunk
    for protocol in (2, 4):  # dcpbridge's chunk views pickle as ``builtins.list(items)``
        raw = pickle.dumps(_AsList([chunk, chunk]), protocol=protocol)
        assert restricted_loads(raw, allow_list()) == [chunk, chunk]
    newobj = _glob("copyreg", "__newobj__") + _glob(DCP, "ChunkStorageMetadata") + b"\x85R}b."
    assert type(restricted_loads(b"\x80\x02" + newobj, allow_list())) is ChunkStorageMetadata
    with pytest.raises(Refused, match=r"a call of .*Metadata"):  # calling a class runs __init__
        restricted_loads(_glob(DCP, "Metadata") + b")R.", allow_list())
    with pytest.raises(Refused, match="constructor arguments"):
        restricted_loads(_glob(DCP, "Metadata") + b"K\x01\x85\x81.", allow_list())
    state_not_none = b"K\x01"
    recon = _glob("copyreg", "_reconstructor") + b"(" + _glob(DCP, "Metadata")
    with pytest.raises(Refused, match="_reconstructor"):
        restricted_loads(
            recon + _glob("builtins", "object") + state_not_none + b"tR.", allow_list()
        )


class _AsList:
    """Pickles as ``list(items)``, as ``dcpbridge.storage.format.table.ChunkList`` does."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __reduce__(self):
        return (list, (self.items,))


# -- hostile metadata -------------------------------------------------------------------------


def _glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


class Exploit:
    """Runs a shell command when unpickled with ``pickle``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_reduce_payload_is_refused_and_never_runs(plain_dcp, tmp_path, capsys):
    marker = tmp_path / "pwned"
    md = _metadata(plain_dcp)
    md.planner_data = {"a": ("a",), "payload": Exploit(str(marker))}
    _write_metadata(plain_dcp, md)
    readers = [
        lambda: db.load({"a": torch.zeros(3, 4)}, plain_dcp),
        lambda: db.load_tensors_metadata(plain_dcp),
        lambda: db.open_source(plain_dcp),
    ]
    for read in readers:
        with pytest.raises(db.PickleRefusedError) as info:
            read()
        message = str(info.value)
        assert f"{os.system.__module__}.system" in message and "allow_pickle=True" in message
        assert "/.metadata" in message
    code, _, err = in_process(capsys, "inspect", plain_dcp)
    assert code == 1 and "--allow-pickle" in err and "system" in err
    _write_metadata(plain_dcp, Exploit(str(marker)))  # the payload as the whole file
    with pytest.raises(db.PickleRefusedError):
        db.load_tensors_metadata(plain_dcp)
    assert not marker.exists()


def test_an_unknown_class_is_refused_naming_it_unless_allowed(plain_dcp):
    md = _metadata(plain_dcp)
    md.planner_data = {"a": ("a",), "ratio": fractions.Fraction(1, 3)}
    _write_metadata(plain_dcp, md)
    with pytest.raises(db.PickleRefusedError, match=r"fractions\.Fraction.*allow_pickle=True"):
        db.load({"a": torch.zeros(3, 4)}, plain_dcp)
    out = db.load({"a": torch.zeros(3, 4)}, plain_dcp, allow_pickle=True)  # the opt-in
    assert out["a"].shape == (3, 4)
    md.planner_data, md.evil = None, 1  # a field DCP's Metadata does not have
    _write_metadata(plain_dcp, md)
    with pytest.raises(db.PickleRefusedError, match="unknown field 'evil'"):
        db.load_tensors_metadata(plain_dcp)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("huge_size", "needs .* bytes, .* are stored"),
        ("uncovered", "its chunks hold 12 elements"),
        ("overlapping", r"'a': chunks \[0:2, 0:4\] and \[1:2, 0:4\] overlap"),
        ("outside", "lies outside"),
        ("too_many_dims", "more than 64 dimensions"),
        ("escaping_file", "refusing file name '../../etc/passwd'"),
        ("long_file", "which has only .* bytes"),
        ("missing_file", "data file __9_0.distcp is missing"),
        ("chunks_type", "chunks are not a list"),
        ("dtype", "dtype is not a"),
    ],
)
def test_inconsistent_metadata_is_refused_before_any_read(plain_dcp, change, message):
    md = _metadata(plain_dcp)
    a: TensorStorageMetadata = md.state_dict_metadata["a"]
    (info,) = (v for k, v in md.storage_data.items() if k.fqn == "a")
    if change == "huge_size":
        a.size = torch.Size([1 << 40, 1 << 20])
        a.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), a.size)]
        md.storage_data = {
            (MetadataIndex("a", [0, 0]) if k.fqn == "a" else k): v
            for k, v in md.storage_data.items()
        }
    elif change == "uncovered":
        a.size = torch.Size([1 << 30, 4])
    elif change == "overlapping":  # 12 elements, inside, but row 1 twice and row 2 never
        a.chunks = [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 4])),
            ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([1, 4])),
        ]
        md.storage_data[MetadataIndex("a", [0, 0])] = info
        md.storage_data[MetadataIndex("a", [1, 0])] = info
    elif change == "outside":
        a.chunks[0].sizes = torch.Size([4, 4])
    elif change == "too_many_dims":
        a.size = torch.Size([1] * 65)
    elif change == "escaping_file":
        info.relative_path = "../../etc/passwd"
    elif change == "long_file":
        info.length = 1 << 40
    elif change == "missing_file":
        info.relative_path = "__9_0.distcp"
    elif change == "chunks_type":
        a.chunks = tuple(a.chunks)
    elif change == "dtype":
        a.properties.dtype = "float32"
    _write_metadata(plain_dcp, md)
    with pytest.raises(db.CorruptCheckpointError, match=message) as caught:
        db.load({"a": torch.zeros(3, 4)}, plain_dcp)
    assert "/.metadata" in str(caught.value)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "b",
            r"holds a torch.int64 tensor of shape \(5,\) where its metadata names a "
            r"torch.float32 chunk of \(3, 4\)",
        ),
        ("h", r"holds a torch.bfloat16 tensor of shape \(2, 3\)"),
    ],
)
def test_a_stored_chunk_of_another_dtype_or_shape_is_refused(plain_dcp, source, message):
    """The blob a chunk's storage entry points at must be that chunk: another tensor's was
    cut to the request (a RuntimeError past its end) or cast into the template."""
    md = _metadata(plain_dcp)
    (key,) = (k for k in md.storage_data if k.fqn == "a")
    (other,) = (v for k, v in md.storage_data.items() if k.fqn == source)
    md.storage_data[key] = other
    _write_metadata(plain_dcp, md)
    with pytest.raises(db.CorruptCheckpointError, match=message) as caught:
        db.load({"a": torch.zeros(3, 4)}, plain_dcp)
    assert "'a' in __0_0.distcp" in str(caught.value)


def _growth_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize(
    "tail",
    [
        b"B\xff\xff\xff\xff" + b"x" * 16,  # BINBYTES: 4 GiB announced, 16 bytes there
        b"\x8e" + struct.pack("<Q", 1 << 62),  # BINBYTES8
        b"\x96" + struct.pack("<Q", 1 << 62),  # BYTEARRAY8
        b"\x8d" + struct.pack("<Q", 1 << 62),  # BINUNICODE8
        b"\x95" + struct.pack("<Q", 1 << 62),  # FRAME
        b"\x8b" + struct.pack("<i", 1 << 30),  # LONG4
    ],
)
def test_announced_lengths_allocate_nothing(tail):
    before, started = _growth_mb(), time.monotonic()
    with pytest.raises(Malformed):
        restricted_loads(b"\x80\x04" + tail, allow_list())
    assert _growth_mb() - before < 64 and time.monotonic() - started < 5


def test_memo_indexes_allocate_nothing():
    """``pickle`` sizes its memo by the index a LONG_BINPUT names (2**32 entries here)."""
    before = _growth_mb()
    assert restricted_loads(b"\x80\x04]r\xff\xff\xff\xff0j\xff\xff\xff\xff.", {}) == []
    assert _growth_mb() - before < 64


def test_deep_nesting_is_refused_without_recursion(plain_dcp):
    md = _metadata(plain_dcp)
    md.planner_data = "NEST"
    raw = pickle.dumps(md, protocol=2)
    deep = b"]" * 200_000 + b"a" * 199_999  # a list in a list ... 200,000 deep
    raw = raw.replace(b"X\x04\x00\x00\x00NEST", deep, 1)
    _write_metadata(plain_dcp, raw)
    with pytest.raises(db.CorruptCheckpointError, match="planner_data is nested deeper than 32"):
        db.load_tensors_metadata(plain_dcp)
    key = b"\x80\x04}" + b")" + b"\x85" * 100_000 + b"Ns."  # a dict key nested 100,000 deep
    with pytest.raises(Malformed, match="not flat"):  # hashing it would recurse in C
        restricted_loads(key, {})


@pytest.mark.parametrize(
    ("raw", "what"),
    [
        (b"\x80\x04X\x01\x00\x00\x00a\x94Q.", "BINPERSID"),
        (b"\x80\x04\x82\x01.", "EXT1"),
        (b"(i__main__\nX\n.", "INST"),
        (b"\x80\x04\x8f.", "EMPTY_SET"),
        (b"\x80\x05\x97.", "NEXT_BUFFER"),
        (b"I1\n.", "protocol 0/1"),
        (_glob("builtins", "eval") + b"X\x01\x00\x00\x001\x85R.", "builtins.eval"),
        (_glob("torch", "load") + b").", "torch.load"),
        (_glob("torch.serialization", "_get_layout") + b"X\x02\x00\x00\x00os\x85R.", None),
    ],
)
def test_opcodes_and_globals_outside_the_allow_list_are_refused(raw, what):
    if what is None:  # an allowed factory checks its argument
        with pytest.raises(Malformed, match="unknown torch layout"):
            restricted_loads(raw, allow_list())
        return
    with pytest.raises(Refused, match=what):
        restricted_loads(raw, allow_list())


def test_the_allow_list_is_dcps_classes_and_nothing_more():
    names = sorted(f"{module}.{name}" for module, name in allow_list())
    assert [n for n in names if not isinstance(_entry(n), torch.dtype)] == [
        "builtins.list",
        "collections.OrderedDict",
        "pathlib.PosixPath",
        "pathlib.PurePosixPath",
        "pathlib.PureWindowsPath",
        "pathlib.WindowsPath",
        "torch.Size",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.distributed.checkpoint.filesystem._StoragePrefix",
        "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata.Metadata",
        "torch.distributed.checkpoint.metadata.MetadataIndex",
        "torch.distributed.checkpoint.metadata.StorageMeta",
        "torch.distributed.checkpoint.metadata.TensorProperties",
        "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.planner.BytesIOWriteData",
        "torch.distributed.checkpoint.planner.SavePlan",
        "torch.distributed.checkpoint.planner.TensorWriteData",
        "torch.distributed.checkpoint.planner.WriteItem",
        "torch.distributed.checkpoint.planner.WriteItemType",
        "torch.serialization._get_layout",
    ]


def _entry(name: str) -> object:
    module, _, attr = name.rpartition(".")
    entry = allow_list()[(module, attr)]
    return getattr(entry, "value", entry)
