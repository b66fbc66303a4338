"""Async save: how long the caller is blocked, and host memory over many saves.

Stall: dcpbridge ``async_save`` vs a plain ``copy_`` of the same bytes into preallocated memory
vs DCP's ``async_save`` (default: it deep-copies the state on each call). Memory: peak and
steady resident memory of a process making 20 async saves of the same state.
"""

from __future__ import annotations

import os
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

import dcpbridge as db
from benchmarks.common import alternate, fresh_dir, table
from benchmarks.launch import run

warnings.filterwarnings("ignore")


def _state(total: int, count: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(total // count // 4, generator=g) for i in range(count)}


def stall_case(root: str, repeats: int, total: int) -> list[str]:
    tensors = _state(total, 32)
    sharded = {k: db.ShardedTensor.from_box(k, t, tuple(t.shape), (0,)) for k, t in tensors.items()}
    # the same bytes into one preallocated, pre-faulted flat buffer (what staging reuses)
    flat = torch.zeros(
        sum(t.numel() * t.element_size() for t in tensors.values()), dtype=torch.uint8
    )
    views, pos = {}, 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        views[k] = flat[pos : pos + n].view(t.dtype).view(t.shape)
        pos += n

    def memcpy() -> float:
        t0 = time.perf_counter()
        for k, t in tensors.items():
            views[k].copy_(t)
        return time.perf_counter() - t0

    def bridge() -> float:
        path = fresh_dir(os.path.join(root, "bridge"))
        t0 = time.perf_counter()
        handle = db.async_save(sharded, path)
        dt = time.perf_counter() - t0
        handle.result()
        return dt

    def torch_dcp() -> float:
        path = fresh_dir(os.path.join(root, "dcp"))
        t0 = time.perf_counter()
        fut = dcp.async_save(tensors, checkpoint_id=path)
        dt = time.perf_counter() - t0
        fut.result()
        return dt

    memcpy()  # warm every contender once: first touches, the staging buffer's allocation
    bridge()
    torch_dcp()
    med = alternate({"memcpy": memcpy, "dcpbridge": bridge, "dcp": torch_dcp}, repeats)
    table(
        f"async save stall, {total / 2**30:.2f} GiB in 32 tensors (caller blocked)",
        [(name, f"{t * 1000:.1f} ms") for name, t in med.items()],
        ("", "stall"),
    )
    return [
        f"async stall: dcpbridge {med['dcpbridge'] / med['memcpy']:.2f}x memcpy, "
        f"{med['dcpbridge'] / med['dcp']:.2f}x DCP's async_save stall"
    ]


def _memory_worker(rank: int, world: int, root: str, total: int, saves: int) -> list[int]:
    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith(field))

    tensors = _state(total, 32)
    sharded = {k: db.ShardedTensor.from_box(k, t, tuple(t.shape), (0,)) for k, t in tensors.items()}
    base = status("VmRSS")
    rss = []
    for i in range(saves):
        next(iter(tensors.values()))[0] = i
        db.async_save(sharded, root).result()
        rss.append(status("VmRSS"))
    return [base, status("VmHWM"), *rss]


def memory_case(root: str, saves: int, total: int) -> list[str]:
    path = fresh_dir(os.path.join(root, "mem"))
    base, peak, *rss = run(_memory_worker, 1, path, total, saves)[0]
    growth = max(rss[2:]) - min(rss[2:])
    table(
        f"host memory over {saves} async saves of {total >> 20} MiB (one process)",
        [
            ("resident before saves (state allocated)", f"{base >> 20} MiB"),
            ("peak resident", f"{peak >> 20} MiB"),
            ("peak - before", f"{(peak - base) >> 20} MiB"),
            ("resident drift, saves 3..N", f"{growth >> 20} MiB"),
        ],
        ("", "value"),
    )
    return [
        f"async memory: peak {(peak - base) >> 20} MiB above the state over {saves} saves "
        f"(target <= state {total >> 20} MiB + 64 MiB), drift {growth >> 20} MiB"
    ]


def main(root: str, repeats: int, quick: bool) -> list[str]:
    total = (256 if quick else 1024) << 20
    return stall_case(root, repeats, total) + memory_case(root, 8 if quick else 20, total)
