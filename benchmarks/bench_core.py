"""dcpbridge save/load vs plain DCP vs raw write+fsync / read, and a 2 -> 4 rank reshard load.

(a) 64 tensors x 32 MiB, (b) 20,000 tensors x 16 KiB: one process, saves with os.sync() before each
timed run, loads cold (page cache dropped) when the machine allows it and warm. (c) 2 ranks save,
4 ranks load with the split on dim 0 and on dim 1: bytes read (from /proc/self/io) / bytes needed.

Every timed save and load of (a) and (b), dcpbridge's, plain DCP's and raw alike, starts right
after a full ``gc.collect()``: with 20,000 tensors alive a full collection costs ~0.14 s here and
otherwise fires at random inside whichever contender happens to allocate past the threshold.
Each contender is handed its input built before the clock starts: plain DCP a dict of tensors,
dcpbridge the sharded state dict (ShardedTensors) a training loop hands it.
"""

from __future__ import annotations

import gc
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dcpbridge as db
from benchmarks.common import (
    alternate,
    drop_page_cache,
    fresh_dir,
    gbps,
    proc_io,
    table,
    write_pieces,
)
from benchmarks.launch import run

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def _tensors(count: int, nbytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(nbytes // 4, generator=g) for i in range(count)}


def _sharded(tensors: dict[str, torch.Tensor]) -> dict[str, db.ShardedTensor]:
    return {k: db.ShardedTensor.from_box(k, t, tuple(t.shape), (0,)) for k, t in tensors.items()}


def _raw_save(tensors: dict[str, torch.Tensor], path: str) -> None:
    """One file, written in calls of at most 1 MiB, then one fsync."""
    with open(os.path.join(path, "raw.bin"), "wb", buffering=0) as f:
        for t in tensors.values():
            write_pieces(f, memoryview(t.numpy()).cast("B"))
        os.fsync(f.fileno())


def _raw_load(out: dict[str, torch.Tensor], path: str) -> None:
    with open(os.path.join(path, "raw.bin"), "rb", buffering=0) as f:
        for t in out.values():
            f.readinto(memoryview(t.numpy()).cast("B"))


def _dcp_save(tensors: dict[str, torch.Tensor], path: str) -> None:
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def _dcp_load(out: dict[str, torch.Tensor], path: str) -> None:
    dcp.load(out, storage_reader=dcp.FileSystemReader(path), no_dist=True)


def _bridge_save(state: dict[str, db.ShardedTensor], path: str) -> None:
    db.save(state, path)


def _bridge_load(state: dict[str, db.ShardedTensor], path: str) -> None:
    db.load(state, path)


def _plain(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return tensors


IMPLS = {
    "dcpbridge": (_bridge_save, _bridge_load),
    "dcp": (_dcp_save, _dcp_load),
    "raw": (_raw_save, _raw_load),
}
# What each contender is handed, built before its clock starts: plain DCP gets the tensors and
# dcpbridge the sharded state dict a training loop builds (Megatron's sharded_state_dict())
STATE = {"dcpbridge": _sharded, "dcp": _plain, "raw": _plain}


def save_load_case(label: str, count: int, nbytes: int, root: str, repeats: int) -> list[str]:
    tensors = _tensors(count, nbytes)
    total = count * nbytes
    dirs = {name: os.path.join(root, f"{label}-{name}") for name in IMPLS}

    def timed_save(name: str) -> float:
        path = fresh_dir(dirs[name])
        drop_page_cache()  # os.sync() (ext4's fsync flushes others' dirty pages) + a clean cache
        time.sleep(0.5)
        state = STATE[name](tensors)
        gc.collect()  # the same start for every contender (see the module docstring)
        t0 = time.perf_counter()
        IMPLS[name][0](state, path)
        return time.perf_counter() - t0

    def timed_load(name: str, cold: bool) -> float:
        # touched before the clock starts: a training job loads into memory it already uses,
        # and first-touch faults of fresh memory vary 3x run to run on these VMs
        out = {k: torch.empty_like(t).zero_() for k, t in tensors.items()}
        state = STATE[name](out)
        if cold:
            drop_page_cache()
        gc.collect()
        t0 = time.perf_counter()
        IMPLS[name][1](state, dirs[name])
        dt = time.perf_counter() - t0
        assert all(torch.equal(out[k], tensors[k]) for k in tensors), f"{name} loaded wrong data"
        return dt

    save = alternate({n: (lambda n=n: timed_save(n)) for n in IMPLS}, repeats)
    cold_ok = drop_page_cache()
    loads = {"warm": alternate({n: (lambda n=n: timed_load(n, False)) for n in IMPLS}, repeats)}
    if cold_ok:
        loads["cold"] = alternate({n: (lambda n=n: timed_load(n, True)) for n in IMPLS}, repeats)
    rows = [("save", *(f"{save[n]:.3f}s {gbps(total, save[n])}" for n in IMPLS))]
    rows += [
        (f"load ({kind})", *(f"{t[n]:.3f}s {gbps(total, t[n])}" for n in IMPLS))
        for kind, t in loads.items()
    ]
    table(
        f"({label}) {count} tensors x {nbytes >> 10} KiB = {total / 2**30:.2f} GiB",
        rows,
        ("", *IMPLS),
    )
    summary = [
        f"({label}) save: dcpbridge {save['dcp'] / save['dcpbridge']:.2f}x DCP speed, "
        f"{save['raw'] / save['dcpbridge']:.2f}x raw write+fsync speed"
    ]
    for kind, t in loads.items():
        summary.append(
            f"({label}) load {kind}: dcpbridge {t['dcp'] / t['dcpbridge']:.2f}x DCP speed, "
            f"{t['raw'] / t['dcpbridge']:.2f}x raw read speed"
        )
    return summary


# -- (c) reshard load: 2 ranks save, 4 ranks load --------------------------------------------

RESHARD_TENSORS, ROWS, COLS = 8, 2048, 4096  # 8 x 32 MiB float32


def _full(i: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(i))


def _reshard_save(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    local = {f"w{i}": _full(i).chunk(world)[rank].contiguous() for i in range(RESHARD_TENSORS)}
    db.save(
        {k: db.ShardedTensor.from_rank_offsets(k, t, (0, rank, world)) for k, t in local.items()},
        os.path.join(root, "dcpbridge"),
    )
    dtensors = {
        k: DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for k, t in local.items()
    }
    dcp.save(dtensors, storage_writer=dcp.FileSystemWriter(os.path.join(root, "dcp")))


def _reshard_load(rank: int, world: int, root: str, repeats: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    results: dict[tuple[str, int], list[tuple[float, tuple[int, int]]]] = {}
    expected = {
        d: {f"w{i}": _full(i).chunk(world, dim=d)[rank] for i in range(RESHARD_TENSORS)}
        for d in (0, 1)
    }
    for _ in range(repeats):
        for dim in (0, 1):
            for impl in ("dcpbridge", "dcpbridge-noverify", "dcp"):
                local = {k: torch.zeros_like(v) for k, v in expected[dim].items()}
                if impl.startswith("dcpbridge"):
                    state = {
                        k: db.ShardedTensor.from_rank_offsets(k, t, (dim, rank, world))
                        for k, t in local.items()
                    }
                else:
                    state = {
                        k: DTensor.from_local(t, mesh, [Shard(dim)], run_check=False)
                        for k, t in local.items()
                    }
                if rank == 0:
                    drop_page_cache()
                dist.barrier()
                before, t0 = proc_io(), time.perf_counter()
                if impl.startswith("dcpbridge"):
                    verify = impl == "dcpbridge"
                    db.load(state, os.path.join(root, "dcpbridge"), verify_checksums=verify)
                else:
                    dcp.load(state, storage_reader=dcp.FileSystemReader(os.path.join(root, "dcp")))
                dt, after = time.perf_counter() - t0, proc_io()
                nread = tuple(after[c] - before[c] for c in ("rchar", "read_bytes"))
                dist.barrier()
                seconds = time.perf_counter() - t0
                assert all(torch.equal(local[k], expected[dim][k]) for k in local), (impl, dim)
                results.setdefault((impl, dim), []).append((max(dt, 0.0) and seconds, nread))
    return results


def reshard_case(root: str, repeats: int) -> list[str]:
    root = fresh_dir(os.path.join(root, "reshard"))
    run(_reshard_save, 2, root)
    per_rank = run(_reshard_load, 4, root, repeats)
    needed = RESHARD_TENSORS * ROWS * COLS * 4  # every element is needed by exactly one rank
    rows, summary, med = [], [], {}
    for (impl, dim), _ in per_rank[0].items():
        times = sorted(per_rank[0][(impl, dim)][i][0] for i in range(repeats))
        syscalls, disk = (sum(r[(impl, dim)][0][1][c] for r in per_rank) for c in (0, 1))
        med[(impl, dim)] = times[len(times) // 2]
        rows.append(
            (
                impl,
                f"dim {dim}",
                f"{med[(impl, dim)]:.3f}s",
                f"{syscalls / needed:.3f}",
                f"{disk / needed:.3f}",
            )
        )
    table(
        f"(c) reshard load 2 -> 4 ranks, {RESHARD_TENSORS} x {ROWS}x{COLS} float32, cold cache "
        "(read(): bytes through read syscalls, which a mapped file's pages are not; storage: "
        "bytes fetched from the disk, mapped pages included, 0 where the page cache held them)",
        rows,
        ("impl", "target split", "seconds", "read() / needed", "storage / needed"),
    )
    for impl in ("dcpbridge", "dcpbridge-noverify"):
        for dim in (0, 1):
            row = next(r for r in rows if r[0] == impl and r[1] == f"dim {dim}")
            summary.append(
                f"(c) {impl} reshard to dim {dim}: {med[('dcp', dim)] / med[(impl, dim)]:.2f}x "
                f"DCP load speed, bytes read()/needed {row[3]}, from storage/needed {row[4]}"
            )
    return summary


def main(root: str, repeats: int, quick: bool) -> list[str]:
    summary = []
    if quick:
        summary += save_load_case("a", 8, 32 << 20, root, repeats)
        summary += save_load_case("b", 2000, 16 << 10, root, repeats)
    else:
        summary += save_load_case("a", 64, 32 << 20, root, repeats)
        summary += save_load_case("b", 20_000, 16 << 10, root, repeats)
    summary += reshard_case(root, repeats)
    return summary
