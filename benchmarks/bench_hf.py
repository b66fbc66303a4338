"""Hugging Face safetensors from and into 2 ranks: ``db.save_hf`` vs DCP's
``HuggingFaceStorageWriter`` (its documented distributed path: per-rank shards, then
consolidation into whole-tensor files), and ``db.load`` vs ``HuggingFaceStorageReader`` of the
same files into DTensor templates split on dim 0 and on dim 1.

A 1 GiB bf16 model (128 MiB with --quick), 16 tensors, 4 output files. Saves start after
``os.sync()``; loads are warm (the files were just written or read). Every load is checked
against the reference values.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dcpbridge as db
from benchmarks.common import fresh_dir, gbps, table
from benchmarks.launch import run

warnings.filterwarnings("ignore")
TENSORS, FILES = 16, 4


def _full(i: int, rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(rows, cols, generator=g).to(torch.bfloat16)


def _state(rank: int, world: int, rows: int, cols: int, dim: int, fill: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for i in range(TENSORS):
        if fill:
            local = _full(i, rows, cols).chunk(world, dim=dim)[rank].contiguous()
        else:
            shape = (rows // world, cols) if dim == 0 else (rows, cols // world)
            local = torch.zeros(shape, dtype=torch.bfloat16)
        out[f"layers.{i:02d}.weight"] = DTensor.from_local(
            local, mesh, [Shard(dim)], run_check=False
        )
    return out


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _progress(rank: int, what: str, results: dict[str, list[float]]) -> None:
    if rank == 0:
        print(f"  ... {what}: {results[what][-1]:.3f}s", flush=True)


def _ranks(rank: int, world: int, root: str, rows: int, cols: int, repeats: int) -> dict:
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    state = _state(rank, world, rows, cols, 0, True)
    per_file = TENSORS // FILES
    mapping = {k: i // per_file + 1 for i, k in enumerate(sorted(state))}
    shard_bytes = per_file * rows * cols * 2
    paths = {"dcpbridge": os.path.join(root, "bridge"), "dcp": os.path.join(root, "dcp")}

    def save_bridge() -> None:
        db.save_hf(state, paths["dcpbridge"], max_shard_bytes=shard_bytes)

    def save_dcp() -> None:
        writer = HuggingFaceStorageWriter(
            paths["dcp"],
            fqn_to_index_mapping=mapping,
            save_distributed=True,
            enable_consolidation=True,
            thread_count=2,
            thread_count_consolidation=2,
        )
        dcp.save(state, storage_writer=writer)

    results: dict[str, list[float]] = {}
    for i in range(repeats):
        order = [("dcpbridge", save_bridge), ("dcp", save_dcp)]
        for name, fn in order[i % 2 :] + order[: i % 2]:
            if rank == 0:
                fresh_dir(paths[name])
                os.sync()
            results.setdefault(f"save {name}", []).append(_timed(fn))
            _progress(rank, f"save {name}", results)
    for dim in (0, 1):
        want = _state(rank, world, rows, cols, dim, True)
        for i in range(repeats):
            order = ["dcpbridge", "dcp"]
            for name in order[i % 2 :] + order[: i % 2]:
                src = paths["dcp"] if i % 2 else paths["dcpbridge"]  # both read both outputs
                template = _state(rank, world, rows, cols, dim, False)
                if name == "dcpbridge":
                    seconds = _timed(lambda t=template, s=src: db.load(t, s))
                else:
                    reader = HuggingFaceStorageReader(src)
                    seconds = _timed(lambda t=template, r=reader: dcp.load(t, storage_reader=r))
                assert all(torch.equal(template[k].to_local(), want[k].to_local()) for k in want), (
                    name,
                    dim,
                    src,
                )
                results.setdefault(f"load dim{dim} {name}", []).append(seconds)
                _progress(rank, f"load dim{dim} {name}", results)
    return {k: statistics.median(v) for k, v in results.items()}


def main(root: str, repeats: int, quick: bool) -> list[str]:
    rows, cols = (1024, 4096) if quick else (4096, 8192)  # x 16 bf16: 128 MiB or 1 GiB
    root = fresh_dir(os.path.join(root, "hf"))
    med = run(_ranks, 2, root, rows, cols, repeats, timeout=3600)[0]
    nbytes = TENSORS * rows * cols * 2
    rows_out = [(k, f"{v:.3f}s", gbps(nbytes, v)) for k, v in med.items()]
    table(
        f"hf: {nbytes >> 20} MiB bf16 ({TENSORS} tensors, {FILES} files), 2 ranks, DTensor "
        f"Shard(0) saved; loads into Shard(0) and Shard(1), warm; medians of {repeats}",
        rows_out,
        ("what", "seconds", "rate"),
    )
    summary = [f"(hf) save_hf: {med['save dcp'] / med['save dcpbridge']:.2f}x DCP's HF writer"]
    for dim in (0, 1):
        ratio = med[f"load dim{dim} dcp"] / med[f"load dim{dim} dcpbridge"]
        summary.append(
            f"(hf) load from safetensors into Shard({dim}): {ratio:.2f}x DCP's HF reader"
        )
    return summary
