"""Column-split resharding: 2 ranks save split on dim 0, N ranks load split on dim 1.

Each stored row is cut into N pieces, one per loading rank. Contenders, same run:
- dcpbridge: local files are mapped, a thread populates the coming boxes' pages ahead of the
  copies (a cold load's disk reads overlap them), and each tile row of checksum tiles of the
  box is gathered into a scratch buffer, verified and copied on (no read syscalls, the bytes
  between pieces never touched);
- dcpbridge-pread: the same load with mapping off (preads joined by the storage's cost model
  into spans of at most 2x the bytes needed, copied out of a bounce buffer): the path before;
- DCP: DTensor Shard(0) saved and loaded into DTensor Shard(1) (whole stored chunks read);
- raw: the ranks read dcpbridge's data files once between them in large reads, no copies
  into tensors (the storage's limit for these bytes: every stored byte is needed by one rank);
- torch_checkpointing 0.1.1 (Meta; ``pip install -e '.[bench]'``, else "skipped: not
  installed"): ``CheckpointManager`` with ``ItemSpec(resharder=DefaultResharder())``, sync
  saves with ``use_direct_io=False`` (its default fails on ext4) and one shim: its metadata
  all-gather asks for CUDA tensors, replaced by ``all_gather_object`` on CPU for the save.
Loads run cold (page cache dropped, where the machine allows it) and warm, contenders rotated
between rounds; bytes summed over the ranks and divided by the bytes the ranks need: "read()"
counts read/pread syscalls (``rchar``: a mapped file's pages are not counted), "disk" the
storage reads of a cold load (``read_bytes``, page cache misses, mapped pages included).
Cases: (d) 2 -> 2 ranks, Shard(0) -> Shard(1); (e) TP 2 -> 4 on dim 1; (s3) case d with a
quarter of the bytes on the local S3 server (SeaweedFS), dcpbridge against DCP's FsspecReader,
GETs and bytes counted by a proxy in one extra, untimed load each.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dcpbridge as db
from benchmarks.common import drop_page_cache, fresh_dir, proc_io, table
from benchmarks.launch import run

TC = "torch_checkpointing"


def _have_tc() -> bool:
    return importlib.util.find_spec(TC) is not None


def _impls() -> tuple[str, ...]:
    return ("dcpbridge", "dcpbridge-pread", "dcp", "raw") + ((TC,) if _have_tc() else ())


def _raw_read(root: str, rank: int, world: int, piece: int = 8 << 20) -> None:
    """The storage's limit for these bytes: the ranks read dcpbridge's data files once between
    them, each a contiguous 1/world of their bytes, in large reads into one reused buffer."""
    folder = os.path.join(root, "dcpbridge")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".bin"))
    sizes = [os.path.getsize(os.path.join(folder, f)) for f in files]
    total = sum(sizes)
    lo, hi = total * rank // world, total * (rank + 1) // world
    buf = bytearray(piece)
    at = 0
    for name, size in zip(files, sizes):
        start, end = max(lo, at), min(hi, at + size)
        if start < end:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                pos = start - at
                while pos < end - at:
                    pos += os.preadv(fd, [memoryview(buf)[: min(piece, end - at - pos)]], pos)
            finally:
                os.close(fd)
        at += size


def _full(i: int, rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(i))


def _io() -> tuple[int, int]:
    """(rchar, read_bytes) of this process: bytes through read syscalls, bytes from storage."""
    got = proc_io()
    return got.get("rchar", 0), got.get("read_bytes", 0)


@contextlib.contextmanager
def _no_mapping() -> Iterator[None]:
    """dcpbridge as it read before mapped files: preads joined by the cost model."""
    from dcpbridge.storage.backends.store import LocalStorage

    before = LocalStorage.mapped_files
    LocalStorage.mapped_files = lambda self: contextlib.nullcontext()  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalStorage.mapped_files = before  # type: ignore[method-assign]


def _tc_manager() -> Any:
    """A torch_checkpointing manager that reshards, saving synchronously without O_DIRECT
    (built per save: a reused one writes its resharding metadata only on its first save)."""
    from torch_checkpointing import CheckpointManager, ItemSpec, SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    return CheckpointManager(
        CheckpointManager.Config(
            items={"model": ItemSpec(resharder=DefaultResharder())},
            save=SyncCheckpointSaverConfig(),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )


def _tc_cpu_gather() -> None:
    """The shim: torch_checkpointing's metadata all-gather on CPU (its own asks for CUDA)."""
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    def gather(self: Any, data: Any, process_group: Any = None) -> dict[int, Any]:
        out: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(out, data, group=process_group)
        return dict(enumerate(out))

    DefaultMetadataManager._all_gather_pickled_data = gather  # type: ignore[method-assign]


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
    if _have_tc():
        _tc_cpu_gather()
        manager = _tc_manager()
        manager.save(os.path.join(root, "tc"), {"model": dt})
        manager.close()


def _state(impl: str, local: dict[str, torch.Tensor], rank: int, world: int) -> Any:
    """The load template of ``impl``: DTensors Shard(1) (DCP, torch_checkpointing) or
    dcpbridge ShardedTensors split on dim 1, over the tensors ``local``."""
    if impl in ("dcp", TC):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))
        return {
            k: DTensor.from_local(t, mesh, [Shard(1)], run_check=False) for k, t in local.items()
        }
    return {k: db.ShardedTensor.from_rank_offsets(k, t, (1, rank, world)) for k, t in local.items()}


def _load(
    rank: int, world: int, root: str, count: int, rows: int, cols: int, repeats: int
) -> dict[tuple[str, str], list[tuple[float, int, int]]]:
    want = {f"w{i}": _full(i, rows, cols).chunk(world, dim=1)[rank] for i in range(count)}
    impls = _impls()
    out: dict[tuple[str, str], list[tuple[float, int, int]]] = {}
    for r in range(repeats):
        order = impls[r % len(impls) :] + impls[: r % len(impls)]  # no one always first
        for kind in ("cold", "warm"):
            for impl in order:
                local = {k: torch.zeros_like(v) for k, v in want.items()}
                state = _state(impl, local, rank, world)
                if kind == "cold" and rank == 0:
                    drop_page_cache()
                elif kind == "warm":  # this contender's own files in the cache
                    _timed_part(impl, state, root, rank, world)
                dist.barrier()
                (rchar, disk), t0 = _io(), time.perf_counter()
                _timed_part(impl, state, root, rank, world)
                after = _io()
                dist.barrier()  # a load's time is its slowest rank's
                out.setdefault((impl, kind), []).append(
                    (time.perf_counter() - t0, after[0] - rchar, after[1] - disk)
                )
                if impl != "raw":
                    assert all(torch.equal(local[k], want[k]) for k in want), (impl, kind)
    return out


def _timed_part(impl: str, state: dict[str, Any], root: str, rank: int, world: int) -> None:
    if impl == "raw":
        _raw_read(root, rank, world)
    else:
        _run(impl, state, root)


def _run(impl: str, state: dict[str, Any], root: str) -> None:
    if impl == "dcp":
        dcp.load(state, storage_reader=dcp.FileSystemReader(os.path.join(root, "dcp")))
    elif impl == "dcpbridge":
        db.load(state, os.path.join(root, "dcpbridge"))
    elif impl == TC:
        manager = _tc_manager()
        manager.load(os.path.join(root, "tc"), into={"model": state})
        manager.close()
    else:
        with _no_mapping():
            db.load(state, os.path.join(root, "dcpbridge"))


def column_case(
    label: str, root: str, loaders: int, count: int, rows: int, cols: int, repeats: int
) -> list[str]:
    root = fresh_dir(os.path.join(root, f"columns-{label}"))
    run(_save, 2, root, count, rows, cols)
    load_avg = os.getloadavg()[0]
    per_rank = run(_load, loaders, root, count, rows, cols, repeats)
    needed = count * rows * cols * 4  # every element is needed by exactly one rank
    med: dict[tuple[str, str], float] = {}
    amp: dict[tuple[str, str, int], float] = {}
    for key in per_rank[0]:
        med[key] = statistics.median(t for t, _, _ in per_rank[0][key])
        for field in (1, 2):
            total = [sum(r[key][i][field] for r in per_rank) for i in range(repeats)]
            amp[(*key, field)] = statistics.median(total) / needed
    impls = _impls()
    table(
        f"({label}) column split: 2 ranks Shard(0) -> {loaders} ranks Shard(1), "
        f"{count} x {rows}x{cols} float32 = {needed / 2**20:.0f} MiB; medians of {repeats}, "
        f"load average {load_avg:.1f} -> {os.getloadavg()[0]:.1f}",
        [
            (
                impl,
                f"{med[(impl, 'cold')]:.3f}s",
                f"{amp[(impl, 'cold', 1)]:.2f}x / {amp[(impl, 'cold', 2)]:.2f}x",
                f"{med[(impl, 'warm')]:.3f}s",
                f"{amp[(impl, 'warm', 1)]:.2f}x",
            )
            for impl in impls
        ],
        ("impl", "cold load", "read() / disk vs needed", "warm load", "read() vs needed"),
    )
    out = []
    for kind in ("cold", "warm"):
        ours = med[("dcpbridge", kind)]
        vs = [f"{med[('dcp', kind)] / ours:.2f}x DCP"]
        vs.append(
            f"{med[(TC, kind)] / ours:.2f}x {TC}" if TC in impls else f"{TC} skipped: not installed"
        )
        vs.append(f"{med[('dcpbridge-pread', kind)] / ours:.2f}x dcpbridge-pread")
        out.append(
            f"({label}) column split 2 -> {loaders} {kind}: dcpbridge {ours:.3f}s = "
            + ", ".join(vs)
            + f" load speed (target >= 1.5x DCP and {TC}); "
            + f"{med[('raw', kind)] / ours:.2f}x the speed of a raw read of the stored bytes; "
            + f"load average {load_avg:.1f}"
        )
    return out


# -- S3 --------------------------------------------------------------------------------------

S3_IMPLS = ("dcpbridge", "dcp")


def _s3_opts(opts: dict[str, Any], endpoint: str | None) -> dict[str, Any]:
    if endpoint is None:
        return opts
    return {**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": endpoint}}


def _s3_save(
    rank: int, world: int, opts: dict[str, Any], url: str, count: int, rows: int, cols: int
) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    local = {f"w{i}": _full(i, rows, cols).chunk(world)[rank].clone() for i in range(count)}
    sd = {k: db.ShardedTensor.from_rank_offsets(k, t, (0, rank, world)) for k, t in local.items()}
    db.save(sd, f"{url}/dcpbridge", storage_options=opts)
    dt = {k: DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for k, t in local.items()}
    dcp.save(dt, storage_writer=FsspecWriter(f"{url}/dcp", sync_files=False, **opts))


def _s3_run(impl: str, state: Any, url: str, opts: dict[str, Any]) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    if impl == "dcpbridge":
        db.load(state, f"{url}/dcpbridge", storage_options=opts)
    else:
        dcp.load(state, storage_reader=FsspecReader(f"{url}/dcp", **opts))


def _s3_load(
    rank: int,
    world: int,
    opts: dict[str, Any],
    url: str,
    proxies: dict[str, str],
    count: int,
    rows: int,
    cols: int,
    repeats: int,
) -> dict[str, list[float]]:
    want = {f"w{i}": _full(i, rows, cols).chunk(world, dim=1)[rank] for i in range(count)}
    out: dict[str, list[float]] = {impl: [] for impl in S3_IMPLS}
    for impl in S3_IMPLS:  # untimed: each library's first S3 client and imports
        local = {k: torch.zeros_like(v) for k, v in want.items()}
        _s3_run(impl, _state(impl, local, rank, world), url, opts)
    for r in range(repeats):
        for impl in S3_IMPLS[r % 2 :] + S3_IMPLS[: r % 2]:
            local = {k: torch.zeros_like(v) for k, v in want.items()}
            state = _state(impl, local, rank, world)
            dist.barrier()
            t0 = time.perf_counter()
            _s3_run(impl, state, url, opts)
            dist.barrier()
            out[impl].append(time.perf_counter() - t0)
            assert all(torch.equal(local[k], want[k]) for k in want), impl
    for impl in S3_IMPLS:  # once more through this contender's counting proxy, untimed
        local = {k: torch.zeros_like(v) for k, v in want.items()}
        _s3_run(impl, _state(impl, local, rank, world), url, _s3_opts(opts, proxies[impl]))
        dist.barrier()
    return out


def s3_column_case(count: int, rows: int, cols: int, repeats: int) -> list[str]:
    from benchmarks.bench_s3 import server_for_ranks
    from tests.support.s3_proxy import FaultProxy

    needed = count * rows * cols * 4
    with server_for_ranks("dcpb-columns-s3-") as server:
        opts = server.storage_options()
        url = f"s3://{server.new_bucket()}/ck"
        run(_s3_save, 2, opts, url, count, rows, cols)
        proxies = {impl: FaultProxy(server.endpoint_url) for impl in S3_IMPLS}
        try:
            load_avg = os.getloadavg()[0]
            endpoints = {impl: p.endpoint_url for impl, p in proxies.items()}
            per_rank = run(_s3_load, 2, opts, url, endpoints, count, rows, cols, repeats)
            gets = {i: sum(r.startswith("GET ") for r in p.requests) for i, p in proxies.items()}
            sent = {impl: p.bytes_to_clients for impl, p in proxies.items()}
        finally:
            for p in proxies.values():
                p.close()
    med = {impl: statistics.median(per_rank[0][impl]) for impl in S3_IMPLS}
    table(
        f"(s3) column split on S3 (local SeaweedFS): 2 ranks Shard(0) -> 2 ranks Shard(1), "
        f"{needed / 2**20:.0f} MiB; medians of {repeats}, load average {load_avg:.1f}",
        [
            (impl, f"{med[impl]:.3f}s", f"{gets[impl]}", f"{sent[impl] / needed:.2f}x")
            for impl in S3_IMPLS
        ],
        ("impl", "load", "GETs (one load, both ranks)", "bytes sent vs needed"),
    )
    return [
        f"(s3) column split 2 -> 2 on S3: dcpbridge {med['dcpbridge']:.3f}s in "
        f"{gets['dcpbridge']} GETs = {med['dcp'] / med['dcpbridge']:.2f}x DCP load speed "
        f"({gets['dcp']} GETs; target >= 1.5x); bytes {sent['dcpbridge'] / needed:.2f}x needed "
        f"(DCP {sent['dcp'] / needed:.2f}x)"
    ]


def main(root: str, repeats: int, quick: bool) -> list[str]:
    count, rows, cols = (2, 2048, 4096) if quick else (8, 4096, 4096)  # 64 MiB / 512 MiB
    summary = column_case("d", root, 2, count, rows, cols, repeats)
    summary += column_case("e", root, 4, count, rows, cols, repeats)
    # a quarter of the bytes on S3: the local server shares the 2 cores (512 MiB uploads
    # stalled past the request timeout on a loaded machine)
    summary += s3_column_case(max(1, count // 4), rows, cols, repeats)
    return summary
