"""Fully-parallel save/load with DP=4 full replicas: bytes and seconds per rank, on vs off."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import dcpbridge as db
from benchmarks.common import drop_page_cache, fresh_dir, proc_io, table
from benchmarks.launch import run


def _io() -> tuple[int, int]:
    got = proc_io()
    return got["rchar"], got["wchar"]


def _model(total: int) -> dict[str, torch.Tensor]:
    """Transformer-like sizes (one embedding, many layer matrices, small norms)."""
    g = torch.Generator().manual_seed(0)
    h = 1024
    shapes = {"embedding": (total // 8 // (4 * h), h)}
    per_layer = 12 * h * h * 4
    for i in range(max(1, (total - total // 8) // per_layer)):
        shapes |= {f"l{i}.qkv": (3 * h, h), f"l{i}.fc1": (4 * h, h), f"l{i}.fc2": (h, 4 * h)}
        shapes |= {f"l{i}.proj": (h, h), f"l{i}.norm": (h,)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _worker(rank: int, world: int, root: str, total: int, repeats: int) -> dict:
    model = _model(total)
    sharded = {
        k: db.ShardedTensor.from_box(k, t, tuple(t.shape), (0,) * t.ndim, replica_id=rank)
        for k, t in model.items()
    }
    out: dict[str, list[tuple[float, int]]] = {}
    for _ in range(repeats):
        for fp in (False, True):
            path = os.path.join(root, f"fp{int(fp)}")
            if rank == 0:
                fresh_dir(path)
                os.sync()
            dist.barrier()
            (r0, w0), t0 = _io(), time.perf_counter()
            db.save(sharded, path, fully_parallel=fp)
            dt, (_, w1) = time.perf_counter() - t0, _io()
            out.setdefault(f"save fp={fp}", []).append((dt, w1 - w0))
            if rank == 0:
                drop_page_cache()
            dist.barrier()
            tmpl = {
                k: db.ShardedTensor.from_box(k, torch.empty_like(t), tuple(t.shape), (0,) * t.ndim)
                for k, t in model.items()
            }
            (r0, _), t0 = _io(), time.perf_counter()
            loaded = db.load(tmpl, path, fully_parallel=fp)
            dt, (r1, _) = time.perf_counter() - t0, _io()
            assert all(torch.equal(loaded[k], t) for k, t in model.items())
            out.setdefault(f"load fp={fp}", []).append((dt, r1 - r0))
    return out


def main(root: str, repeats: int, quick: bool) -> list[str]:
    total = (128 if quick else 512) << 20
    root = fresh_dir(os.path.join(root, "fully_parallel"))
    per_rank = run(_worker, 4, root, total, repeats)
    rows, med = [], {}
    for case in per_rank[0]:
        secs = [sorted(t for t, _ in r[case])[repeats // 2] for r in per_rank]
        nbytes = [r[case][-1][1] for r in per_rank]
        med[case] = max(secs)
        rows.append(
            (
                case,
                " ".join(f"{b / 2**20:7.1f}" for b in nbytes),
                " ".join(f"{s:.3f}" for s in secs),
                f"{max(secs):.3f}",
            )
        )
    table(
        f"fully parallel, DP=4 full replicas of {total >> 20} MiB (per rank: MiB moved, seconds)",
        rows,
        ("case", "MiB r0 r1 r2 r3", "seconds r0..r3", "slowest"),
    )
    return [
        f"fully parallel save: {med['save fp=False'] / med['save fp=True']:.2f}x faster than "
        f"rank-0-writes (DP=4)",
        f"fully parallel load: {med['load fp=False'] / med['load fp=True']:.2f}x faster than "
        f"every-rank-reads (DP=4)",
    ]
