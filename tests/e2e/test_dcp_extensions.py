"""DCP's extension points with dcpbridge: async executors and stagers, no_dist, stream
extensions (ZStandard) and the HuggingFace safetensors writer, all with torch's own components."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import zstandard
from safetensors.torch import save_file
from torch.distributed.checkpoint import (
    FileSystemReader,
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint._extension import (
    ExtensionRegistry,
    StreamTransformExtension,
    ZStandard,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dcpbridge as db
from dcpbridge.formats.checkpoint import open_checkpoint
from dcpbridge.formats.dcp_transforms import decode, descriptors_of
from tests.support.dist_pool import Rank, children_allowed

pytestmark = pytest.mark.timeout(300)

SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "w": ((8, 6), torch.float32),
    "h": ((5, 3), torch.bfloat16),
    "b": ((7,), torch.int64),
    "z": ((1, 4), torch.float32),
}
# background staging on the CPU (DefaultStager's defaults need an accelerator)
THREAD_STAGING = StagingOptions(False, False, True, False)
# staging into shared memory, for the checkpoint process
SHARED_STAGING = StagingOptions(False, True, False, False)


def full(key: str) -> torch.Tensor:
    """The global value of ``key``: seeded by the key, so misplaced bytes show."""
    shape, dtype = SHAPES[key]
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


# -- async_save: both executors, stagers, and the planner/writer pickled to a process ---------


def sharded_state(r: Rank, w: torch.Tensor) -> dict:
    """Rank ``r``'s rows of ``w`` (8 x 6, split on dim 0), a plain tensor and objects."""
    rows = 8 // r.size
    return {
        "w": db.ShardedTensor.from_box("w", w, (8, 6), (r.rank * rows, 0)),
        "b": full("b"),
        "rng": db.ShardedObject("rng", {"rank": r.rank}, (r.size,), (r.rank,)),
        "step": 7,
    }


def my_rows(r: Rank) -> torch.Tensor:
    rows = 8 // r.size
    return full("w")[r.rank * rows : (r.rank + 1) * rows].clone()


@contextlib.contextmanager
def may_start_processes() -> Iterator[None]:
    """Let this pool worker (a daemonic process) start torch's checkpoint process, as a
    training process (not daemonic) may; it is stopped before the block ends."""
    with children_allowed():
        try:
            yield
        finally:
            stop_checkpoint_process()


def stop_checkpoint_process() -> None:
    """End the checkpoint process torch's PROCESS executor keeps per process (its __del__
    asks it to stop and joins it), so later tests in this pool worker start clean."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    proc, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
    del proc


def async_saves(r: Rank, root: str) -> str:
    """Every async combination into ``root/<name>``; returns the refusal of memory://."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # for the checkpoint process's store
    writer = db.FsspecCheckpointWriter()  # one writer and planner for every save: reused
    planner = db.ShardedSavePlanner()  # (and pickled to the checkpoint process after use)
    common = {"storage_writer": writer, "planner": planner, "process_group": r.group}
    with may_start_processes():
        for kind in (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS):
            state = sharded_state(r, my_rows(r))
            got = dcp.async_save(
                state, checkpoint_id=f"{root}/{kind.name}", async_checkpointer_type=kind, **common
            )
            assert isinstance(got, Future)
            got.result(timeout=120)

        # background staging: the save holds what was staged, whatever happens after
        live = my_rows(r)
        stager = DefaultStager(THREAD_STAGING)
        got = dcp.async_save(
            sharded_state(r, live), checkpoint_id=f"{root}/staged", async_stager=stager, **common
        )
        assert isinstance(got, AsyncSaveResponse)
        got.staging_completion.result(timeout=60)
        live.fill_(-1.0)
        got.upload_completion.result(timeout=60)
        stager.close()

        # shared-memory staging handed to the checkpoint process
        stager = DefaultStager(SHARED_STAGING)
        got = dcp.async_save(
            sharded_state(r, my_rows(r)),
            checkpoint_id=f"{root}/staged_process",
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
            **common,
        )
        got.result(timeout=120)
        stager.close()

        # memory:// lives in this process: the checkpoint process must refuse, not lose it
        lost = db.FsspecCheckpointWriter(f"memory://dcpext-{r.rank}/ck")
        with pytest.raises(CheckpointException) as refused:
            dcp.async_save(
                sharded_state(r, my_rows(r)),
                storage_writer=lost,
                planner=db.ShardedSavePlanner(),
                process_group=r.group,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            ).result(timeout=120)
        return str(refused.value)


def check_loads(path: str, world: int) -> None:
    """Load ``path`` in one process into another layout, by db.load and by plain dcp.load."""
    w = full("w")
    out = db.load(
        {
            "w": db.ShardedTensor.from_box("w", torch.zeros(3, 6), (8, 6), (2, 0)),
            "rng": db.ShardedObject("rng", None, (world,), (world - 1,)),
            "b": torch.zeros(7, dtype=torch.int64),
            "step": 0,
        },
        path,
    )
    assert torch.equal(out["w"], w[2:5]), path
    assert out["rng"] == {"rank": world - 1} and out["step"] == 7
    assert torch.equal(out["b"], full("b"))
    template = {"w": torch.zeros(8, 6), "b": torch.zeros(7, dtype=torch.int64), "step": 0}
    dcp.load(
        template,
        storage_reader=db.FsspecCheckpointReader(path),
        planner=db.ShardedLoadPlanner(),
        no_dist=True,
    )
    assert torch.equal(template["w"], w) and torch.equal(template["b"], full("b"))
    assert template["step"] == 7


def test_async_save_with_both_executors_and_stagers(pool, tmp_path):
    """THREAD and PROCESS executors, background and shared-memory staging, on 2 ranks."""
    root = str(tmp_path)
    refusals = pool.run(async_saves, 2, root, timeout=280)
    for name in ("THREAD", "PROCESS", "staged", "staged_process"):
        check_loads(f"{root}/{name}", 2)
    for text in refusals:
        assert "memory://dcpext-" in text and "lives in the memory of process" in text
        assert "InvalidArgumentError" in text


def test_writer_and_planner_pickle_without_their_io_or_last_state(tmp_path, memory_store):
    """What DCP's checkpoint process receives: locations and settings, no open I/O."""
    opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    for url, options in [
        (str(tmp_path / "ck"), None),
        ("memory://dcpext-pickle/ck", None),
        ("s3://bucket/run/ck", opts),  # its byte I/O (timeouts, transfers) recursed before
    ]:
        writer = db.FsspecCheckpointWriter(url, storage_options=options, thread_count=3)
        assert isinstance(writer, AsyncStager)  # it stages for dcp.async_save (values shown)
        back = pickle.loads(pickle.dumps(writer))
        assert back.location == writer.location and back.thread_count == 3
        assert back.location.fs.storage_options == writer.location.fs.storage_options
        assert type(back._store) is type(writer._store)
        reader = pickle.loads(pickle.dumps(db.FsspecCheckpointReader(url, storage_options=options)))
        assert reader.location == writer.location
    planner = db.ShardedSavePlanner(validate=False)
    big = torch.zeros(1 << 18)
    dcp.save(
        {"big": big},
        storage_writer=db.FsspecCheckpointWriter(str(tmp_path / "p")),
        planner=planner,
        no_dist=True,
    )
    blob = pickle.dumps(planner)
    assert len(blob) < 4096  # not the 1 MiB tensor of the save it planned
    assert pickle.loads(blob).validate is False


def test_no_dist_save_and_load_with_our_planners_and_storage(tmp_path, memory_store):
    """no_dist=True: dcp.save, both async paths and dcp.load, on disk and memory://."""
    w = full("w")
    for root in (str(tmp_path), "memory://dcpext-nodist"):
        state = {
            "w": db.ShardedTensor.from_box("w", w.clone(), (8, 6), (0, 0)),
            "b": full("b"),
            "rng": db.ShardedObject("rng", {"rank": 0}, (1,), (0,)),
            "step": 7,
        }
        dcp.save(
            state,
            storage_writer=db.FsspecCheckpointWriter(f"{root}/sync"),
            planner=db.ShardedSavePlanner(),
            no_dist=True,
        )
        dcp.async_save(
            state,
            storage_writer=db.FsspecCheckpointWriter(f"{root}/thread"),
            planner=db.ShardedSavePlanner(),
            no_dist=True,
        ).result(timeout=60)
        stager = DefaultStager(THREAD_STAGING)
        got = dcp.async_save(
            state,
            storage_writer=db.FsspecCheckpointWriter(f"{root}/staged"),
            planner=db.ShardedSavePlanner(),
            no_dist=True,
            async_stager=stager,
        )
        got.upload_completion.result(timeout=60)
        stager.close()
        for name in ("sync", "thread", "staged"):
            check_loads(f"{root}/{name}", 1)


def test_process_executor_without_a_process_group_fails_at_once(tmp_path):
    """torch's PROCESS executor needs a process group even with no_dist: it raises, nothing
    is written, nothing hangs."""
    path = str(tmp_path / "ck")
    with pytest.raises(ValueError, match="process group"):
        dcp.async_save(
            {"w": full("w")},
            storage_writer=db.FsspecCheckpointWriter(path),
            planner=db.ShardedSavePlanner(),
            no_dist=True,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
    assert not os.path.exists(os.path.join(path, "dcpbridge.json"))


# -- stream extensions: ZStandard, unknown extensions, a missing decoder ----------------------


class XorBytes(StreamTransformExtension):
    """A stream transform of our own (XOR 0x5A), unknown to torch's default registry."""

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> XorBytes:
        return XorBytes()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: io.IOBase) -> io.IOBase:
        return _Xor(output)

    def transform_from(self, input: io.IOBase) -> io.IOBase:
        return io.BytesIO(_xor(input.read()))


def _xor(data: bytes) -> bytes:
    return (torch.frombuffer(bytearray(data), dtype=torch.uint8) ^ 0x5A).numpy().tobytes()


class _Xor(io.RawIOBase):
    def __init__(self, output: io.IOBase) -> None:
        self.output = output

    def writable(self) -> bool:
        return True

    def write(self, b: bytes) -> int:
        data = bytes(b)
        self.output.write(_xor(data) if data else b"")
        return len(data)

    def close(self) -> None:
        self.output.close()
        super().close()


def plain_state() -> dict:
    """A nested state dict of several dtypes, a compressible tensor and objects."""
    return {
        "model": {"w": full("w"), "h": full("h"), "b": full("b"), "zeros": torch.zeros(256, 64)},
        "cfg": {"lr": 0.25, "betas": (0.9, 0.95)},
        "step": 11,
    }


def plain_template() -> dict:
    return {
        "model": {
            "w": db.ShardedTensor.from_box("model.w", torch.zeros(4, 3), (8, 6), (2, 3)),
            "h": torch.zeros(5, 3, dtype=torch.bfloat16),
            "b": torch.zeros(7, dtype=torch.int64),
            "zeros": torch.ones(256, 64),
        },
        "cfg": {"lr": 0.0, "betas": None},
        "step": 0,
    }


def check_plain(out: dict) -> None:
    want = plain_state()
    assert torch.equal(out["model"]["w"], want["model"]["w"][2:6, 3:6])
    for k in ("h", "b", "zeros"):
        assert torch.equal(out["model"][k], want["model"][k]), k
    assert out["cfg"] == want["cfg"] and out["step"] == 11


def test_zstd_checkpoint_loads_bit_exact(tmp_path):
    """dcp.save with ZStandard: db.load, a source and plain dcp.load through dcpbridge's
    DCP-file reader give the saved bytes; FsspecCheckpointReader says what the directory is."""
    path = str(tmp_path / "ck")
    dcp.save(
        plain_state(),
        storage_writer=dcp.FileSystemWriter(path, _extensions=[ZStandard()]),
        no_dist=True,
    )
    metadata = open_checkpoint(path, allow_pickle=True).reader().read_metadata()
    assert {tuple(i.transform_descriptors) for i in metadata.storage_data.values()} == {
        ("stream.zstd/1",)
    }
    raw_bytes = sum(t.numel() * t.element_size() for t in plain_state()["model"].values())
    stored = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    assert stored < raw_bytes / 2  # compressed indeed

    check_plain(db.load(plain_template(), path, allow_pickle=True))
    source = db.open_source(path, allow_pickle=True)
    assert torch.equal(source.read("model.w", (1, 2), (6, 3)), full("w")[1:7, 2:5])
    assert source.object("cfg.lr") == 0.25
    template = plain_template()
    dcp.load(
        template,
        storage_reader=open_checkpoint(path, allow_pickle=True).reader(),
        planner=db.ShardedLoadPlanner(),
        no_dist=True,
    )
    check_plain({**template, "model": {**template["model"], "w": template["model"]["w"].data}})
    with pytest.raises(CheckpointException, match=r"plain torch\.distributed\.checkpoint"):
        dcp.load(plain_template(), storage_reader=db.FsspecCheckpointReader(path), no_dist=True)


def test_unknown_extension_and_damaged_streams_raise(tmp_path):
    """An extension dcpbridge cannot undo is named; a damaged zstd stream is refused."""
    xor = str(tmp_path / "xor")
    dcp.save(
        plain_state(),
        storage_writer=dcp.FileSystemWriter(xor, _extensions=[XorBytes()]),
        no_dist=True,
    )
    registry = ExtensionRegistry()
    registry.register(XorBytes)  # torch reads it with the extension registered: it is valid
    template = {"model": {"w": torch.zeros(8, 6)}}
    dcp.load(
        template, storage_reader=FileSystemReader(xor, _extension_registry=registry), no_dist=True
    )
    assert torch.equal(template["model"]["w"], full("w"))
    with pytest.raises(db.UnsupportedExtensionError, match=r"'test\.xor/1'.*cannot decode"):
        db.load({"model": {"w": torch.zeros(8, 6)}}, xor, allow_pickle=True)
    with pytest.raises(db.UnsupportedExtensionError, match=r"test\.xor/1"):
        db.open_source(xor, allow_pickle=True).object("step")

    zst = str(tmp_path / "zst")
    dcp.save(
        plain_state(),
        storage_writer=dcp.FileSystemWriter(zst, _extensions=[ZStandard()]),
        no_dist=True,
    )
    metadata = open_checkpoint(zst, allow_pickle=True).reader().read_metadata()
    info = next(i for k, i in metadata.storage_data.items() if k.fqn == "model.w")
    with open(os.path.join(zst, info.relative_path), "r+b") as f:
        f.seek(info.offset)
        f.write(b"\0\0\0\0")  # the frame's magic number
    with pytest.raises(db.CorruptCheckpointError, match=r"'model\.w'.*stream\.zstd/1.*decode"):
        db.load({"model": {"w": torch.zeros(8, 6)}}, zst, allow_pickle=True)


def test_zstd_decoding_is_bounded_and_complete():
    """Cut-short or trailing streams and streams that decode past their bound are refused."""
    data = full("w").numpy().tobytes() * 4
    frame = zstandard.ZstdCompressor().compress(data)
    zstd = ["stream.zstd/1"]
    assert decode(frame, zstd, limit=len(data), what="x") == data
    with pytest.raises(db.CorruptCheckpointError, match="cut short"):
        decode(frame[:-7], zstd, limit=len(data), what="x")
    with pytest.raises(db.CorruptCheckpointError, match="stray bytes"):
        decode(frame + b"junk", zstd, limit=len(data), what="x")
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    assert len(bomb) < 4096
    with pytest.raises(db.CorruptCheckpointError, match="more than the 1048576 bytes"):
        decode(bomb, zstd, limit=1 << 20, what="x")
    with pytest.raises(db.UnsupportedExtensionError, match=r"stream\.zstd/2"):
        decode(frame, ["stream.zstd/2"], limit=len(data), what="x")

    class Info:
        transform_descriptors = "stream.zstd/1"  # a string, not a list

    with pytest.raises(db.CorruptCheckpointError, match="list of strings"):
        descriptors_of(Info(), "x")


def test_a_transformed_chunk_larger_than_its_stream_can_decode_to_is_refused(tmp_path):
    """A zstd block of at least 4 bytes decodes to at most 128 KiB; a ``.metadata`` naming a
    tensor far larger than its compressed chunk can decode to made a load into a plain
    template allocate it (torch's ``RuntimeError``: cannot allocate 1 PiB). It is refused as
    corrupt when the checkpoint is opened, naming the key, before anything is allocated."""
    path = tmp_path / "ck"
    dcp.save(
        {"w": torch.zeros(4, 4), "b": torch.ones(3)},
        storage_writer=dcp.FileSystemWriter(str(path), _extensions=[ZStandard()]),
        no_dist=True,
    )
    metadata = pickle.loads((path / ".metadata").read_bytes())
    md = metadata.state_dict_metadata["w"]
    md.size = md.chunks[0].sizes = torch.Size([1 << 24, 1 << 24])
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    match = r"'w': the chunk at \(0, 0\) needs 1125899906842624 bytes, its \d+ stored bytes"
    with pytest.raises(db.CorruptCheckpointError, match=match):
        db.load({"w": torch.zeros(4, 4)}, str(path))
    with pytest.raises(db.CorruptCheckpointError, match=match):
        db.open_source(str(path))


BLOCK_ZSTD = """
import sys
import threading
sys.modules["zstandard"] = None  # not installed, as far as this process can tell
sys.modules["pyzstd"] = None
import torch
import dcpbridge as db
try:
    db.load({"model": {"w": torch.zeros(8, 6)}}, sys.argv[1], allow_pickle=True)
except db.UnsupportedExtensionError as e:
    print("REFUSED", e)
"""


def test_missing_zstandard_names_the_extension_and_package(tmp_path):
    path = str(tmp_path / "ck")
    dcp.save(
        plain_state(),
        storage_writer=dcp.FileSystemWriter(path, _extensions=[ZStandard()]),
        no_dist=True,
    )
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_ZSTD, path], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED" in proc.stdout and "'stream.zstd/1'" in proc.stdout, proc.stdout
    assert "pip install zstandard" in proc.stdout


def mesh_of(r: Rank) -> DeviceMesh:
    return DeviceMesh.from_group(r.group or dist.group.WORLD, "cpu")


SAVE_PLACEMENTS = {"w": Shard(0), "h": Shard(1), "b": Replicate(), "z": Shard(0)}
LOAD_PLACEMENTS = {"w": Shard(1), "h": Shard(0), "b": Shard(0), "z": Replicate()}


def dtensor_state(r: Rank, placements: dict, fill: bool = True) -> dict:
    mesh = mesh_of(r)
    return {
        "model": {
            k: distribute_tensor(full(k) if fill else torch.zeros_like(full(k)), mesh, [p])
            for k, p in placements.items()
        }
    }


def check_dtensors(r: Rank, model: dict) -> list[str]:
    for k, v in model.items():
        assert isinstance(v, DTensor) and v.placements == (LOAD_PLACEMENTS[k],), k
        assert torch.equal(v.full_tensor(), full(k)), k
    return sorted(model)


def zstd_dtensor_save(r: Rank, path: str) -> None:
    state = {**dtensor_state(r, SAVE_PLACEMENTS), "step": 3}
    writer = dcp.FileSystemWriter(path, _extensions=[ZStandard()])
    dcp.save(state, storage_writer=writer, process_group=r.group)


def zstd_dtensor_load(r: Rank, path: str) -> list[str]:
    template = {**dtensor_state(r, LOAD_PLACEMENTS, fill=False), "step": 0}
    out = db.load(template, path, process_group=r.group, allow_pickle=True)
    assert out["step"] == 3
    return check_dtensors(r, out["model"])


def test_zstd_dtensor_checkpoint_of_two_ranks_loads_on_three(pool, tmp_path):
    path = str(tmp_path / "ck")
    pool.run(zstd_dtensor_save, 2, path, timeout=120)
    assert pool.run(zstd_dtensor_load, 3, path, timeout=120) == [["b", "h", "w", "z"]] * 3


# -- DCP's HuggingFace writer: sharded safetensors with DCP's offsets --------------------------


def hf_save(r: Rank, path: str, consolidate: bool) -> None:
    placements = SAVE_PLACEMENTS
    if consolidate:  # torch's consolidation takes floating point tensors only (torch.finfo)
        placements = {k: p for k, p in placements.items() if SHAPES[k][1].is_floating_point}
    writer = HuggingFaceStorageWriter(path, save_distributed=True, enable_consolidation=consolidate)
    dcp.save(dtensor_state(r, placements), storage_writer=writer, process_group=r.group)


def resharded_load(r: Rank, path: str) -> list[str]:
    template = dtensor_state(r, LOAD_PLACEMENTS, fill=False)
    return check_dtensors(r, db.load(template, path, process_group=r.group)["model"])


TP3 = {
    "world_size": 3,
    "rules": [
        {"match": "model.w", "split": {"axis": 1, "parts": 3}},
        {"match": "model.h", "split": {"axis": 0, "parts": 3}},
        {"match": "*", "replicate": True},
    ],
}


def check_hf_source(url: str, keys: str = "whbz") -> None:
    source = db.open_source(url)
    assert {k: v.shape for k, v in source.tensors.items()} == {
        f"model.{k}": SHAPES[k][0] for k in keys
    }
    assert source.tensors["model.h"].dtype == torch.bfloat16
    for key in keys:
        want = full(key)
        box = tuple(max(0, n - 1) for n in want.shape)
        got = source.read(f"model.{key}", (0,) * want.dim(), box)
        assert torch.equal(got, want[tuple(slice(0, n) for n in box)]), key
    source.close()


def test_hf_writer_output_of_two_ranks_loads_resharded(pool, tmp_path):
    """DTensors saved by DCP's HuggingFaceStorageWriter from 2 ranks (one file per rank, DCP's
    offsets in each) open as a source, reshard to 3 ranks and load as other placements."""
    sharded = str(tmp_path / "hf")
    pool.run(hf_save, 2, sharded, False, timeout=120)
    names = sorted(os.listdir(sharded))
    assert names == [f"shard-0000{i}-model-00001-of-00001.safetensors" for i in (1, 2)]
    check_hf_source(sharded)
    source = db.open_source(sharded)
    assert [len(source.tensors[f"model.{k}"].chunks) for k in "whbz"] == [2, 2, 1, 1]
    dst = str(tmp_path / "tp3")
    db.reshard(source, dst, db.parse_layout(TP3))
    assert pool.run(resharded_load, 3, dst, timeout=120) == [["b", "h", "w", "z"]] * 3
    whole = db.load_state_dict(sharded)  # every tensor, whole, in one process
    assert all(torch.equal(whole[f"model.{k}"], full(k)) for k in SHAPES)

    consolidated = str(tmp_path / "hf_full")
    pool.run(hf_save, 2, consolidated, True, timeout=120)
    assert "model.safetensors.index.json" in os.listdir(consolidated)
    check_hf_source(consolidated, "whz")  # the index and its whole tensors
    check_hf_source(os.path.join(consolidated, "sharded"), "whz")


def test_hf_writer_single_rank_with_index(tmp_path):
    """One process, two files by fqn_to_index_mapping, and the index torch writes."""
    path = str(tmp_path / "hf")
    state = {"model": {k: full(k) for k in SHAPES}}
    mapping = {"model.w": 1, "model.h": 2, "model.b": 2, "model.z": 1}
    writer = HuggingFaceStorageWriter(path, fqn_to_index_mapping=mapping)
    dcp.save(state, storage_writer=writer, no_dist=True)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        assert json.load(f)["weight_map"]["model.h"] == "model-00002-of-00002.safetensors"
    check_hf_source(path)
    dst = str(tmp_path / "ck")
    db.reshard(db.open_source(path), dst, db.parse_layout({"world_size": 1}))
    out = db.load({"model": {k: torch.zeros_like(full(k)) for k in SHAPES}}, dst)
    assert all(torch.equal(out["model"][k], full(k)) for k in SHAPES)


EMPTY_DTENSORS = {
    "rows": ((0, 3), Shard(0)),
    "cols": ((4, 0), Shard(0)),
    "rep": ((0,), Replicate()),
}


def empty_dtensors(r: Rank, fill: float) -> dict:
    """0-element DTensors next to a sharded one: every rank's local shard of them is empty."""
    mesh = mesh_of(r)
    state = {
        k: distribute_tensor(torch.zeros(s), mesh, [p]) for k, (s, p) in EMPTY_DTENSORS.items()
    }
    state["w"] = distribute_tensor(full("w") + fill, mesh, [Shard(0)])
    return {"model": state}


def hf_empty_dtensors(r: Rank, path: str) -> list[str]:
    """Saved through DCP's HF writer with dcpbridge's planner, loaded back with it."""
    writer = HuggingFaceStorageWriter(path, save_distributed=True)
    planner = db.ShardedSavePlanner()
    dcp.save(empty_dtensors(r, 0), storage_writer=writer, planner=planner, process_group=r.group)
    template = empty_dtensors(r, 1)
    reader = HuggingFaceStorageReader(path)
    dcp.load(
        template, storage_reader=reader, planner=db.ShardedLoadPlanner(), process_group=r.group
    )
    out = db.load(empty_dtensors(r, 2), path, process_group=r.group)
    for got in (template, out):
        assert torch.equal(got["model"]["w"].full_tensor(), full("w"))
        for k, (shape, _) in EMPTY_DTENSORS.items():
            assert got["model"][k].shape == shape, k
    return sorted(HuggingFaceStorageReader(path).read_metadata().state_dict_metadata)


def test_hf_writer_with_dcpbridge_planner_keeps_empty_dtensors(pool, tmp_path):
    """A 0-element DTensor planned by dcpbridge's planner is one whole empty chunk written by
    the mesh's first rank: in the HF output once, with its global shape, as DCP's planner does."""
    path = str(tmp_path / "hf")
    keys = ["model.cols", "model.rep", "model.rows", "model.w"]
    assert pool.run(hf_empty_dtensors, 2, path, timeout=120) == [keys] * 2


def empty_sharded(r: Rank, fill: float) -> dict:
    """0-element Megatron-style ShardedTensors: identical empty boxes on every rank (rows),
    empty boxes split by rows (cols), replicas (rep), a key one rank holds (late); next to a
    sharded tensor with data."""
    n, i = r.size, r.rank
    rows = 8 // n
    return {
        "model": {
            "rows": db.ShardedTensor.from_rank_offsets("rows", torch.zeros(0, 3), (0, i, n)),
            "cols": db.ShardedTensor.from_box("cols", torch.zeros(2, 0), (2 * n, 0), (2 * i, 0)),
            "rep": db.ShardedTensor.from_box(
                "rep", torch.zeros(0, dtype=torch.bfloat16), (0,), (0,), replica_id=i
            ),
            **(
                {"late": db.ShardedTensor.from_box("late", torch.zeros(0, 5), (0, 5), (0, 0))}
                if i == n - 1
                else {}
            ),
            "w": db.ShardedTensor.from_box(
                "w", full("w")[i * rows : (i + 1) * rows] + fill, (8, 6), (i * rows, 0)
            ),
        }
    }


def hf_empty_sharded(r: Rank, path: str) -> tuple[list[tuple[str, list[int]]], list[str]]:
    """Saved through DCP's HF writer with dcpbridge's planner: each file's keys and shapes as
    the safetensors package reads them, and the keys db.load filled."""
    from safetensors import safe_open

    writer = HuggingFaceStorageWriter(path, save_distributed=True)
    dcp.save(
        empty_sharded(r, 0),
        storage_writer=writer,
        planner=db.ShardedSavePlanner(),
        process_group=r.group,
    )
    stored = []
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                stored += [(k, list(f.get_slice(k).get_shape())) for k in f.keys()]  # noqa: SIM118 (a safe_open handle)
    template = empty_sharded(r, 1)
    out = db.load(template, path, process_group=r.group)["model"]
    rows = 8 // r.size
    assert torch.equal(out["w"], full("w")[r.rank * rows : (r.rank + 1) * rows])
    own = path + "-dcpbridge"  # dcpbridge's writer under dcp.save, and db.save
    dcp.save(
        empty_sharded(r, 0),
        storage_writer=db.FsspecCheckpointWriter(own),
        planner=db.ShardedSavePlanner(),
        process_group=r.group,
    )
    db.save(empty_sharded(r, 0), own + "-save", process_group=r.group)
    for url in (own, own + "-save"):
        got = db.load(empty_sharded(r, 1), url, process_group=r.group)["model"]
        assert sorted(got) == sorted(out) and torch.equal(got["w"], out["w"])
        assert db.load_tensors_metadata(url)["rows"].global_shape == (0, 3)
    return sorted(stored), sorted(out)


def test_hf_writer_with_dcpbridge_planner_keeps_empty_sharded_tensors(pool, tmp_path):
    """A ShardedTensor whose global tensor has no elements is one whole empty chunk, planned
    once (by the lowest rank holding it): in the HF output exactly once, with its global shape,
    wherever it is held, however many ranks hold (identical) empty boxes of it."""
    path = str(tmp_path / "hf")
    stored = [
        ("cols", [4, 0]),
        ("late", [0, 5]),
        ("rep", [0]),
        ("rows", [0, 3]),
        ("w", [4, 6]),
        ("w", [4, 6]),
    ]
    got = pool.run(hf_empty_sharded, 2, path, timeout=120)
    assert got == [
        (stored, ["cols", "rep", "rows", "w"]),
        (stored, ["cols", "late", "rep", "rows", "w"]),
    ]


@pytest.mark.parametrize("distributed", [False, True])
def test_hf_writer_with_dcpbridge_planner_keeps_empty_tensors(tmp_path, distributed):
    """DCP's HF writer writes only the planned items: a 0-element tensor planned by
    dcpbridge's planner must reach the safetensors file, key for key as DCP's planner does."""
    state = {"w": full("w"), "e": torch.zeros(0, 3), "z": torch.tensor(2.5)}
    path = str(tmp_path / "hf")
    writer = HuggingFaceStorageWriter(path, save_distributed=distributed)
    dcp.save({"model": state}, storage_writer=writer, planner=db.ShardedSavePlanner(), no_dist=True)
    stored = HuggingFaceStorageReader(path).read_metadata().state_dict_metadata
    assert sorted(stored) == ["model.e", "model.w", "model.z"]
    template = {"model": {k: torch.ones_like(v) for k, v in state.items()}}
    dcp.load(
        template,
        storage_reader=HuggingFaceStorageReader(path),
        planner=db.ShardedLoadPlanner(),
        no_dist=True,
    )
    out = db.load({"model": {k: torch.ones_like(v) for k, v in state.items()}}, path)
    for got in (template, out):
        for k, v in state.items():
            assert got["model"][k].shape == v.shape and torch.equal(got["model"][k], v), k


NON_TENSORS = [3, "run-1", io.BytesIO(b"raw")]


def hf_save_non_tensor(r: Rank, path: str, value: object) -> str:
    """dcp.save through DCP's HF writer with dcpbridge's planner: the error, every rank's."""
    state = {"model": {"w": full("w")}, "step": value}
    writer = HuggingFaceStorageWriter(path, save_distributed=True)
    with pytest.raises(CheckpointException) as e:
        dcp.save(
            state, storage_writer=writer, planner=db.ShardedSavePlanner(), process_group=r.group
        )
    return str(e.value)


@pytest.mark.parametrize("value", NON_TENSORS, ids=["int", "str", "bytesio"])
def test_hf_writer_with_dcpbridge_planner_refuses_non_tensor_values(pool, tmp_path, value):
    """DCP's HF writer stores tensors only: a non-tensor value (its bytes written where the
    safetensors header does not name them, a broken file) is refused by dcpbridge's planner by
    key on every rank, before any file is written."""
    path = str(tmp_path / "hf")
    one = str(tmp_path / "one")
    writer = HuggingFaceStorageWriter(one)
    with pytest.raises(CheckpointException) as e:
        dcp.save(
            {"model": {"w": full("w")}, "step": value},
            storage_writer=writer,
            planner=db.ShardedSavePlanner(),
            no_dist=True,
        )
    errors = [str(e.value), *pool.run(hf_save_non_tensor, 2, path, value, timeout=120)]
    for error in errors:
        assert "SerializationError" in error
        assert "'step': DCP's HuggingFaceStorageWriter stores tensors only" in error
    for folder in (one, path):
        assert not os.path.exists(folder) or os.listdir(folder) == []


def _hf_file(folder, name: str, tensors: dict, offsets: object) -> None:
    info = offsets if isinstance(offsets, str) else json.dumps(offsets)
    save_file(tensors, os.path.join(folder, name), metadata={"DCP_SHARDING_INFO": info})


@pytest.mark.parametrize(
    ("files", "error"),
    [
        ({"a": [0, 0], "b": [1, 0]}, r"chunks of tensor 'w' overlap: \[0:2, 0:4\] in a"),
        ({"a": [0, 0], "b": [3, 0]}, r"'w' .*shape \(5, 4\).* elements \[2:3, 0:4\] in no file"),
        ({"a": [0, 0], "b": [-1, 0]}, r"b\.safetensors: tensor 'w': saved_offsets must hold"),
        ({"a": [0, 0], "b": [True, 0]}, r"saved_offsets must hold integers"),
        ({"a": [0, 0], "b": [2]}, r"saved_offsets has 1 entries, the tensor 2 dims"),
        ({"a": [0, 0], "b": [2**62, 0]}, r"saved_offsets reach past 2\^62"),
        ({"a": [0, 0], "b": [2**70, 0]}, r"saved_offsets must hold integers in \[0, 2\^62\]"),
        ({"a": [0, 0], "b": [2**40, 2**40]}, r"'w' .*shape \(1099511627778, 1099511627780\)"),
        ({"a": [0, 0], "b": "{not json"}, r"b\.safetensors: DCP_SHARDING_INFO is not a JSON"),
        ({"a": [0, 0], "b": None}, r"tensor 'w' is in 2 places \(a\.safetensors, b\.safetensors\)"),
    ],
)
def test_hostile_dcp_offsets_are_refused(tmp_path, files, error):
    """DCP's offsets in safetensors metadata are checked before anything is sized by them."""
    w = torch.arange(8.0).reshape(2, 4)
    for name, offsets in files.items():
        if offsets is None:
            save_file({"w": w}, str(tmp_path / f"{name}.safetensors"))  # a plain file
        elif isinstance(offsets, str):
            _hf_file(tmp_path, f"{name}.safetensors", {"w": w}, offsets)
        else:
            _hf_file(tmp_path, f"{name}.safetensors", {"w": w}, {"w": {"saved_offsets": offsets}})
    with pytest.raises(db.CorruptCheckpointError, match=error):
        db.open_source(str(tmp_path))


def test_hf_metadata_and_index_must_name_what_the_files_hold(tmp_path):
    w = torch.arange(8.0).reshape(2, 4)
    _hf_file(tmp_path, "a.safetensors", {"w": w}, {"v": {"saved_offsets": [0, 0]}})
    with pytest.raises(db.CorruptCheckpointError, match="DCP_SHARDING_INFO gives it no offsets"):
        db.open_source(str(tmp_path))
    folder = tmp_path / "indexed"
    folder.mkdir()
    save_file({"w": w}, str(folder / "a.safetensors"))
    index = {"weight_map": {"w": "a.safetensors", "lost": "a.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(db.CorruptCheckpointError, match=r"places 'lost' in a\.safetensors"):
        db.open_source(str(folder))


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ({"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}, "unsupported dtype"),
        ({"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}, "shape must hold integers"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "byte range does not match"),
        ({"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 1 << 42]}, "past the end of"),
        ([1, 2], "header entry is not a JSON object"),
    ],
)
def test_hostile_safetensors_headers_are_refused(tmp_path, entry, error):
    """Header numbers are checked before anything is sized by them (the file holds 8 bytes)."""
    header = json.dumps({"w": entry}).encode()
    (tmp_path / "m.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(db.CorruptCheckpointError, match=error):
        db.open_source(str(tmp_path))


def test_hf_writer_refusal_reaches_a_planner_subclass_overriding_set_up(tmp_path):
    """A ShardedSavePlanner subclass whose ``set_up_planner`` calls the base's still sees
    DCP's HF writer: the non-tensor value is refused, nothing is written."""

    class Planner(db.ShardedSavePlanner):
        def set_up_planner(
            self, state_dict: object, storage_meta: object = None, is_coordinator: bool = False
        ) -> None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)  # type: ignore[arg-type]

    path = str(tmp_path / "hf")
    writer = HuggingFaceStorageWriter(path)
    state = {"model": {"w": full("w")}, "step": 3}
    with pytest.raises(CheckpointException, match="'step': DCP's HuggingFaceStorageWriter"):
        dcp.save(state, storage_writer=writer, planner=Planner(), no_dist=True)
    assert not os.path.exists(path) or os.listdir(path) == []


class _Point(NamedTuple):
    x: int
    y: torch.Tensor


class _GatedPlanner(db.ShardedSavePlanner):
    """Plans only once the test has changed the caller's values (the save runs behind)."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def create_local_plan(self) -> Any:
        self.gate.wait(30)
        return super().create_local_plan()


def test_async_save_stores_byte_streams_and_tuples_as_they_were_at_the_call(tmp_path):
    """Our writer stages for ``dcp.async_save``: a BytesIO the caller writes to afterwards,
    and a namedtuple or ``torch.Size`` (BlockingAsyncStager made them plain tuples), are
    stored as the call saw them, as torch's DefaultStager stored them."""
    path, gate = str(tmp_path / "ck"), threading.Event()
    stream = io.BytesIO(b"original")
    sd = {"b": stream, "p": _Point(1, torch.arange(3.0)), "s": torch.Size([2, 3])}
    writer = db.FsspecCheckpointWriter(path)
    fut = dcp.async_save(sd, storage_writer=writer, planner=_GatedPlanner(gate), no_dist=True)
    stream.seek(0)
    stream.write(b"CHANGED!")
    gate.set()
    fut.result()
    out: dict[str, Any] = {"b": io.BytesIO(), "p": None, "s": None}
    dcp.load(out, storage_reader=db.FsspecCheckpointReader(path), no_dist=True)
    assert out["b"].getvalue() == b"original"
    point, size = out["p"], out["s"]  # DCP's load planner unpickles them (its own choice)
    assert type(point) is _Point and point.x == 1 and torch.equal(point.y, torch.arange(3.0))
    assert type(size) is torch.Size and size == torch.Size([2, 3])


def scalar_dtensor_async_save(r: Rank, path: str) -> tuple[float, list[float]]:
    """``dcp.async_save`` of a 0-dim DTensor and a sharded one, both changed in place once the
    call returned (before the save behind it plans); what was stored, loaded back."""
    mesh, gate = mesh_of(r), threading.Event()
    step = distribute_tensor(torch.tensor(5.0), mesh, [Replicate()])
    w = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    fut = dcp.async_save(
        {"step": step, "w": w},
        storage_writer=db.FsspecCheckpointWriter(path),
        planner=_GatedPlanner(gate),
        process_group=r.group,
    )
    step.add_(1)
    w.add_(1)
    gate.set()
    fut.result()
    out = {
        "step": distribute_tensor(torch.tensor(0.0), mesh, [Replicate()]),
        "w": distribute_tensor(torch.zeros(4), mesh, [Shard(0)]),
    }
    dcp.load(out, storage_reader=db.FsspecCheckpointReader(path), process_group=r.group)
    return out["step"].to_local().item(), out["w"].full_tensor().tolist()


@pytest.mark.timeout(120)
def test_async_save_stores_a_scalar_dtensor_as_it_was_at_the_call(pool, tmp_path):
    """BlockingAsyncStager hands a 0-dim DTensor back itself, not a copy: an update after
    the call (an optimizer's step count) was stored instead. The writer's stage copies it."""
    got = pool.run(scalar_dtensor_async_save, 2, str(tmp_path / "ck"), timeout=100)
    assert got == [(5.0, [0.0, 1.0, 2.0, 3.0])] * 2


def test_async_save_stages_views_into_one_buffer_as_one_copy(tmp_path):
    """ShardedTensors over views into one flat buffer (a distributed optimizer's state): the
    writer's stage copied the whole buffer for each of them (BlockingAsyncStager deep-copies
    object leaves one by one), 40 MB of data staged as 1.6 GB; they share one copy now, and
    what is stored is the buffer as it was at the call."""
    buf = torch.arange(40 * 1000, dtype=torch.float32).reshape(40, 1000)
    original = buf.clone()
    sd = {f"p{i}": db.ShardedTensor.from_rank_offsets(f"p{i}", buf[i]) for i in range(40)}
    writer = db.FsspecCheckpointWriter(str(tmp_path / "ck"))
    staged = writer.stage(sd)
    storages = {v.data.untyped_storage().data_ptr() for v in staged.values()}
    assert len(storages) == 1
    assert staged["p0"].data.untyped_storage().nbytes() == buf.nbytes
    gate = threading.Event()
    fut = dcp.async_save(sd, storage_writer=writer, planner=_GatedPlanner(gate), no_dist=True)
    buf.add_(1)
    gate.set()
    fut.result()
    template = {
        f"p{i}": db.ShardedTensor.from_rank_offsets(f"p{i}", torch.zeros(1000)) for i in range(40)
    }
    out = db.load(template, str(tmp_path / "ck"))
    for i in range(40):
        assert torch.equal(out[f"p{i}"].data, original[i]), i
