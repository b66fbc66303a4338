"""Column-split resharding: 2 ranks save split on dim 0, N ranks load split on dim 1.

Each stored row is cut into N pieces, one per loading rank. Contenders, same run: dcpbridge
(its read plan joins a file's ranges where the storage's cost model says reading the bytes
between them is cheaper than another request, up to 2x the bytes needed), dcpbridge with
exact ranges only (one request per row piece: the plan before the cost model), and plain
DCP (whole stored chunks). Loads run cold (page cache dropped, where the machine allows it)
and warm; bytes read (from /proc/self/io) are summed over the ranks and divided by the bytes
the ranks need. Cases: (d) 2 -> 2 ranks, Shard(0) -> Shard(1); (e) TP 2 -> 4 on dim 1.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dcpbridge as db
from benchmarks.common import drop_page_cache, fresh_dir, rchar, table
from benchmarks.launch import run

IMPLS = ("dcpbridge", "dcpbridge-exact", "dcp")


def _full(i: int, rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(i))


@contextmanager
def _exact_ranges():
    """dcpbridge as it read before the cost model: every range a request of its own."""
    from dcpbridge.storage.backends.costs import ReadCosts
    from dcpbridge.storage.backends.store import LocalStorage

    before = LocalStorage.read_costs
    LocalStorage.read_costs = lambda self: ReadCosts(0.0, 1.0)  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalStorage.read_costs = before  # type: ignore[method-assign]


def _save(rank: int, world: int, root: str, count: int, rows: int, cols: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    local = {f"w{i}": _full(i, rows, cols).chunk(world)[rank].clone() for i in range(count)}
    db.save(
        {k: db.ShardedTensor.from_rank_offsets(k, t, (0, rank, world)) for k, t in local.items()},
        os.path.join(root, "dcpbridge"),
    )
    dt = {k: DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for k, t in local.items()}
    dcp.save(dt, storage_writer=dcp.FileSystemWriter(os.path.join(root, "dcp")))


def _load(
    rank: int, world: int, root: str, count: int, rows: int, cols: int, repeats: int
) -> dict[tuple[str, str], list[tuple[float, int]]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    want = {f"w{i}": _full(i, rows, cols).chunk(world, dim=1)[rank] for i in range(count)}
    out: dict[tuple[str, str], list[tuple[float, int]]] = {}
    kinds = ("cold", "warm")
    for r in range(repeats):
        order = IMPLS[r % 3 :] + IMPLS[: r % 3]  # rotated: no contender always runs first
        for kind in kinds:
            for impl in order:
                local = {k: torch.zeros_like(v) for k, v in want.items()}
                if impl == "dcp":
                    state: Any = {
                        k: DTensor.from_local(t, mesh, [Shard(1)], run_check=False)
                        for k, t in local.items()
                    }
                else:
                    state = {
                        k: db.ShardedTensor.from_rank_offsets(k, t, (1, rank, world))
                        for k, t in local.items()
                    }
                if kind == "cold" and rank == 0:
                    drop_page_cache()
                elif kind == "warm":  # this contender's own files in the cache
                    _run(impl, state, root)
                dist.barrier()
                before, t0 = rchar(), time.perf_counter()
                _run(impl, state, root)
                nread = rchar() - before
                dist.barrier()
                out.setdefault((impl, kind), []).append((time.perf_counter() - t0, nread))
                assert all(torch.equal(local[k], want[k]) for k in want), (impl, kind)
    return out


def _run(impl: str, state: dict[str, Any], root: str) -> None:
    if impl == "dcp":
        dcp.load(state, storage_reader=dcp.FileSystemReader(os.path.join(root, "dcp")))
    elif impl == "dcpbridge":
        db.load(state, os.path.join(root, "dcpbridge"))
    else:
        with _exact_ranges():
            db.load(state, os.path.join(root, "dcpbridge"))


def column_case(
    label: str, root: str, loaders: int, count: int, rows: int, cols: int, repeats: int
) -> list[str]:
    root = fresh_dir(os.path.join(root, f"columns-{label}"))
    run(_save, 2, root, count, rows, cols)
    per_rank = run(_load, loaders, root, count, rows, cols, repeats)
    needed = count * rows * cols * 4  # every element is needed by exactly one rank
    med: dict[tuple[str, str], float] = {}
    amp: dict[tuple[str, str], float] = {}
    for key in per_rank[0]:
        med[key] = statistics.median(t for t, _ in per_rank[0][key])
        amp[key] = (
            statistics.median(sum(r[key][i][1] for r in per_rank) for i in range(repeats)) / needed
        )
    kinds = [k for k in ("cold", "warm") if ("dcp", k) in med]
    table(
        f"({label}) column split: 2 ranks Shard(0) -> {loaders} ranks Shard(1), "
        f"{count} x {rows}x{cols} float32 = {needed / 2**20:.0f} MiB",
        [
            (impl, *(f"{med[(impl, k)]:.3f}s read {amp[(impl, k)]:.2f}x" for k in kinds))
            for impl in IMPLS
        ],
        ("impl", *(f"{k} load (bytes read / needed)" for k in kinds)),
    )
    return [
        f"({label}) column split 2 -> {loaders} {k}: dcpbridge "
        f"{med[('dcp', k)] / med[('dcpbridge', k)]:.2f}x DCP load speed, "
        f"{med[('dcpbridge-exact', k)] / med[('dcpbridge', k)]:.2f}x exact ranges; "
        f"bytes read/needed {amp[('dcpbridge', k)]:.2f} (DCP {amp[('dcp', k)]:.2f})"
        for k in kinds
    ]


def main(root: str, repeats: int, quick: bool) -> list[str]:
    count, rows, cols = (2, 2048, 4096) if quick else (8, 4096, 4096)  # 64 MiB / 512 MiB
    summary = column_case("d", root, 2, count, rows, cols, repeats)
    summary += column_case("e", root, 4, count, rows, cols, repeats)
    return summary
