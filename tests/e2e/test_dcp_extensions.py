"""DCP's extension points with dcpbridge: async executors and stagers, no_dist, stream
extensions (ZStandard) and the HuggingFace safetensors writer, all with torch's own components."""

from __future__ import annotations

import contextlib
import io
import json
import math
import multiprocessing
import os
import pickle
import subprocess
import sys
import zlib
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import zstandard
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._extension import (
    ExtensionRegistry,
    StreamTransformExtension,
    ZStandard,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dcpbridge as db
from dcpbridge.tools.dcp_transforms import decode, descriptors_of
from dcpbridge.tools.formats import open_checkpoint
from tests.support.dist_pool import Rank

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
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        stop_checkpoint_process()
        config["daemon"] = daemon


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
