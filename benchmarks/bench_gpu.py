"""GPU-resident state (one process, bf16 on ``cuda:0``): dcpbridge vs plain DCP vs the limits.

Rows, measured in one run for each target directory (``/dev/shm`` when present, then the
scratch directory on disk): pinned device-to-host and host-to-device copy bandwidth; raw write
(+fsync) and read of the same bytes from/to a pinned host buffer; plain DCP ``save`` and
dcpbridge ``save`` from GPU tensors; dcpbridge ``async_save`` (the caller's stall and the time
to durable); loads into GPU tensors by both. Skipped, with a line saying so, without CUDA.
"""

from __future__ import annotations

import gc
import os
import shutil
import time

import torch
import torch.distributed.checkpoint as dcp

import dcpbridge as db
from benchmarks.common import alternate, drop_page_cache, fresh_dir, gbps, table, write_pieces


def _state(total: int, count: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    n = total // count // 2
    return {
        f"layer{i}.weight": torch.randn(n, generator=g, device="cuda", dtype=torch.bfloat16)
        for i in range(count)
    }


def _sharded(tensors: dict[str, torch.Tensor]) -> dict[str, db.ShardedTensor]:
    return {k: db.ShardedTensor.from_box(k, t, tuple(t.shape), (0,)) for k, t in tensors.items()}


def _copy_bandwidth(total: int) -> tuple[float, float]:
    """Seconds of one pinned D2H and one pinned H2D copy of ``total`` bytes."""
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    host.copy_(dev, non_blocking=True)  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    d2h = time.perf_counter() - t0
    t0 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return d2h, time.perf_counter() - t0


def _timed(fn) -> float:
    gc.collect()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def target_case(
    label: str, root: str, tensors: dict[str, torch.Tensor], repeats: int, cold_loads: bool
) -> list[str]:
    total = sum(t.nbytes for t in tensors.values())
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    dirs = {n: os.path.join(root, f"gpu-{n}") for n in ("raw", "dcp", "dcpbridge", "async")}

    def fresh(name: str) -> str:
        path = fresh_dir(dirs[name])
        os.sync()
        return path

    def raw_save() -> None:
        path = fresh("raw")
        with open(os.path.join(path, "raw.bin"), "wb", buffering=0) as f:
            write_pieces(f, memoryview(host.numpy()))
            os.fsync(f.fileno())

    def raw_load() -> None:
        with open(os.path.join(dirs["raw"], "raw.bin"), "rb", buffering=0) as f:
            f.readinto(memoryview(host.numpy()))

    def dcp_save() -> None:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(fresh("dcp")), no_dist=True)

    def bridge_save() -> None:
        db.save(_sharded(tensors), fresh("dcpbridge"))

    stalls: list[float] = []

    def bridge_async() -> None:
        path = fresh("async")
        t0 = time.perf_counter()
        handle = db.async_save(_sharded(tensors), path)
        stalls.append(time.perf_counter() - t0)
        handle.result()

    out = {k: torch.empty_like(t) for k, t in tensors.items()}

    def dcp_load() -> None:
        dcp.load(out, storage_reader=dcp.FileSystemReader(dirs["dcp"]), no_dist=True)

    def bridge_load() -> None:
        db.load(_sharded(out), dirs["dcpbridge"])

    saves = {"raw": raw_save, "dcp": dcp_save, "dcpbridge": bridge_save, "async": bridge_async}
    for fn in saves.values():  # warm: pinned pools, CUDA contexts, first file creation
        fn()
    stalls.clear()
    save = alternate({n: (lambda fn=fn: _timed(fn)) for n, fn in saves.items()}, repeats)
    loads = {"raw": raw_load, "dcp": dcp_load, "dcpbridge": bridge_load}
    warm = alternate({n: (lambda fn=fn: _timed(fn)) for n, fn in loads.items()}, repeats)
    assert all(torch.equal(out[k], tensors[k]) for k in tensors), "a load returned wrong data"
    cold: dict[str, float] = {}
    if cold_loads and drop_page_cache():
        cold = alternate(
            {n: (lambda fn=fn: (drop_page_cache(), _timed(fn))[1]) for n, fn in loads.items()},
            repeats,
        )
    stall = sorted(stalls)[len(stalls) // 2]
    rows = [(f"save {n}", f"{t:.3f}s", gbps(total, t)) for n, t in save.items()]
    rows.append(("async_save stall", f"{stall * 1000:.1f} ms", ""))
    rows += [(f"load warm {n}", f"{t:.3f}s", gbps(total, t)) for n, t in warm.items()]
    rows += [(f"load cold {n}", f"{t:.3f}s", gbps(total, t)) for n, t in cold.items()]
    table(f"GPU state on {label}: {total / 2**30:.2f} GiB bf16", rows, ("", "time", "rate"))
    summary = [
        f"gpu {label} save: dcpbridge {save['dcp'] / save['dcpbridge']:.2f}x DCP, "
        f"{save['async'] / save['dcpbridge']:.2f}x async+wait, "
        f"{save['raw'] / save['dcpbridge']:.2f}x raw write+fsync",
        f"gpu {label} async stall {stall * 1000:.1f} ms",
        f"gpu {label} load warm: dcpbridge {warm['dcp'] / warm['dcpbridge']:.2f}x DCP, "
        f"{warm['raw'] / warm['dcpbridge']:.2f}x raw read",
    ]
    if cold:
        summary.append(
            f"gpu {label} load cold: dcpbridge {cold['dcp'] / cold['dcpbridge']:.2f}x DCP, "
            f"{cold['raw'] / cold['dcpbridge']:.2f}x raw read"
        )
    return summary


def training_slowdown(root: str, quick: bool) -> list[str]:
    """Step time of a GPU training loop alone and while an ``async_save`` of its state runs."""
    torch.manual_seed(0)
    width, depth = (2048, 4) if quick else (4096, 8)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(width, width, device="cuda", dtype=torch.bfloat16) for _ in range(depth)]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(8192, width, device="cuda", dtype=torch.bfloat16)

    def step() -> float:
        t0 = time.perf_counter()
        model(batch).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def state() -> dict:
        flat = {f"model.{k}": v for k, v in model.state_dict().items()}
        for i, s in enumerate(opt.state.values()):
            flat.update({f"opt.{i}.{k}": v for k, v in s.items() if v.dim() > 0})
        return {
            k: db.ShardedTensor.from_box(k, v, tuple(v.shape), (0,) * v.dim())
            for k, v in flat.items()
        }

    for _ in range(5):
        step()  # warm: kernels, optimizer state
    nbytes = sum(t.data.nbytes for t in state().values())
    alone = [step() for _ in range(20)]
    path = fresh_dir(os.path.join(root, "gpu-train"))
    t0 = time.perf_counter()
    db.async_save(state(), path).result()  # the first save allocates the pinned buffers
    first = time.perf_counter() - t0
    path = fresh_dir(os.path.join(root, "gpu-train-2"))
    os.sync()
    t0 = time.perf_counter()
    handle = db.async_save(state(), path)
    stall = time.perf_counter() - t0
    during: list[float] = []
    while not handle.done() or len(during) < 3:
        during.append(step())
    total = time.perf_counter() - t0
    handle.result()
    # background staging through the manager: the call returns at once, the next step waits
    mgr = db.CheckpointManager(
        fresh_dir(os.path.join(root, "gpu-train-bg")),
        every=1,
        async_save=True,
        optimizers=[opt],
        background_staging=True,
    )
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    mgr.save(1, state())
    bg_call = time.perf_counter() - t0
    bg_step = step()  # includes the hook's wait for staging
    mgr.close()
    base = sorted(alone)[len(alone) // 2]
    mean_during = sum(during) / len(during)
    table(
        f"GPU training loop with an async_save of its {nbytes / 2**30:.2f} GiB state",
        [
            ("step alone (median)", f"{base * 1000:.1f} ms"),
            ("step during the save (mean)", f"{mean_during * 1000:.1f} ms"),
            ("steps during the save", str(len(during))),
            ("async_save call (pinned buffers reused)", f"{stall * 1000:.1f} ms"),
            ("first async_save, to durable", f"{first:.2f} s"),
            ("save to durable", f"{total:.2f} s"),
            ("manager save, background staging: call", f"{bg_call * 1000:.2f} ms"),
            ("  next step (waits for staging)", f"{bg_step * 1000:.1f} ms"),
        ],
        ("", "value"),
    )
    return [
        f"gpu training step slowdown during async_save: {(mean_during / base - 1) * 100:+.1f}% "
        f"(stall {stall * 1000:.1f} ms of a {total:.2f} s save)",
        f"gpu background staging: save() call {bg_call * 1000:.2f} ms, next step "
        f"{(bg_step - base) * 1000:+.1f} ms over a step alone",
    ]


def main(root: str, repeats: int, quick: bool) -> list[str]:
    if not torch.cuda.is_available():
        print("\n## GPU: skipped (no CUDA device on this machine)")
        return ["gpu: skipped (no CUDA device)"]
    total, count = (256 << 20, 16) if quick else (2 << 30, 64)
    tensors = _state(total, count)
    d2h, h2d = _copy_bandwidth(total)
    table(
        f"pinned copies of {total / 2**30:.2f} GiB",
        [("device to host", gbps(total, d2h)), ("host to device", gbps(total, h2d))],
        ("", "rate"),
    )
    summary = [f"gpu pinned D2H {gbps(total, d2h).strip()}, H2D {gbps(total, h2d).strip()}"]
    summary += training_slowdown(root, quick)
    targets = []
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 5 * total:
        targets.append(("/dev/shm", "/dev/shm/dcpb-bench-gpu"))  # four copies of the state
    else:
        print("\n## GPU on /dev/shm: skipped (missing or too small)")
    targets.append(("disk", os.path.join(root, "gpu")))
    for label, path in targets:
        os.makedirs(path, exist_ok=True)
        try:
            summary += target_case(label, path, tensors, repeats, cold_loads=label == "disk")
        finally:
            if label == "/dev/shm":
                shutil.rmtree(path, ignore_errors=True)
    return summary
