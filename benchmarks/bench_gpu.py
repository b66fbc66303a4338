"""GPU-resident state (one process, bf16 on ``cuda:0``): dcpbridge vs plain DCP vs the limits.

Rows, measured in one run for each target directory (``/dev/shm`` when present, then the
scratch directory on disk): pinned device-to-host and host-to-device copy bandwidth; raw write
(+fsync) and read of the same bytes from/to a pinned host buffer, and the same bytes written
as 8 files at once (about the most this storage takes); plain DCP ``save`` and
dcpbridge ``save`` from GPU tensors; dcpbridge ``async_save`` (the caller's stall and the time
to durable); loads into GPU tensors by both. Skipped, with a line saying so, without CUDA.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

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


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


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
    dirs = {n: os.path.join(root, f"gpu-{n}") for n in ("raw", "raw8", "dcp", "dcpbridge", "async")}

    def fresh(name: str) -> str:
        path = fresh_dir(dirs[name])
        os.sync()
        return path

    def raw_save() -> None:
        path = fresh("raw")
        with open(os.path.join(path, "raw.bin"), "wb", buffering=0) as f:
            write_pieces(f, memoryview(host.numpy()))
            os.fsync(f.fileno())

    def raw_parallel_save(files: int = 8) -> None:
        """The storage's limit: the same bytes as ``files`` files written and fsynced at once."""
        path, per = fresh("raw8"), -(-total // files)
        view = memoryview(host.numpy())

        def one(i: int) -> None:
            with open(os.path.join(path, f"{i}.bin"), "wb", buffering=0) as f:
                write_pieces(f, view[i * per : (i + 1) * per])
                os.fsync(f.fileno())

        with ThreadPoolExecutor(files) as pool:
            list(pool.map(one, range(files)))

    def raw_load() -> None:
        with open(os.path.join(dirs["raw"], "raw.bin"), "rb", buffering=0) as f:
            f.readinto(memoryview(host.numpy()))

    def dcp_save() -> None:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(fresh("dcp")), no_dist=True)

    def bridge_save() -> None:
        db.save(_sharded(tensors), fresh("dcpbridge"))

    def bridge_save_2_files() -> None:
        """The writer's default before it chose its files by bytes and cores."""
        db.save(_sharded(tensors), fresh("dcpbridge"), thread_count=2)

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

    saves = {
        "raw": raw_save,
        "raw 8 files": raw_parallel_save,
        "dcp": dcp_save,
        "dcpbridge": bridge_save,
        "dcpbridge 2 files": bridge_save_2_files,
        "async": bridge_async,
    }
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
        f"{save['dcpbridge 2 files'] / save['dcpbridge']:.2f}x 2 files, "
        f"{save['raw'] / save['dcpbridge']:.2f}x raw write+fsync, "
        f"{save['raw 8 files'] / save['dcpbridge']:.2f}x raw in 8 parallel files "
        f"(the storage's limit is {save['dcp'] / save['raw 8 files']:.2f}x DCP)",
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
    alone = [step() for _ in range(40)]

    rounds = 3 if quick else 5

    def during_save(start) -> tuple[float, float, list[float], float]:
        """(first save to durable, call stall, the steps run during the saves, save to durable)
        of saves begun by ``start(path)``, which returns a callable saying they are done."""
        t0 = time.perf_counter()
        done = start(fresh_dir(os.path.join(root, "gpu-train-1")))  # allocates staging buffers
        while not done():
            time.sleep(0.001)
        first = time.perf_counter() - t0
        stalls, totals, during = [], [], []
        for _ in range(rounds):
            path = fresh_dir(os.path.join(root, "gpu-train-2"))
            os.sync()
            t0 = time.perf_counter()
            done = start(path)
            stalls.append(time.perf_counter() - t0)
            n = len(during)
            while not done() or len(during) < n + 3:
                during.append(step())
            totals.append(time.perf_counter() - t0)
            alone.extend(step() for _ in range(len(during) - n))  # as many steps without a save
        return first, _median(stalls), during, _median(totals)

    def by_async_save(writer: str):
        def start(path: str):
            handle = db.async_save(state(), path, writer=writer)
            return handle.done

        return start

    managers: list[db.CheckpointManager] = []

    def by_manager(path: str):
        # background staging: the call returns at once, the copies overlap the next forward
        # and backward, and the optimizer's step waits for them on the GPU
        if managers:
            managers.pop().close()
        mgr = db.CheckpointManager(
            path,
            every=1,
            async_save=True,
            optimizers=[opt],
            background_staging=True,
            writer="process",
        )
        managers.append(mgr)
        mgr.save(1, state())
        return lambda: not mgr.saving

    runs = {
        "async_save, writer=thread": during_save(by_async_save("thread")),
        "async_save, writer=process": during_save(by_async_save("process")),
        "manager, background staging, writer=process": during_save(by_manager),
    }
    managers.pop().close()
    base = _mean(alone)
    rows = [("step alone (mean)", f"{base * 1000:.2f} ms")]
    for name, (first, stall, during, total) in runs.items():
        rows += [
            (f"{name}: step during the saves (mean)", f"{_mean(during) * 1000:.2f} ms"),
            ("  steps during the saves", str(len(during))),
            ("  save call (buffers reused)", f"{stall * 1000:.2f} ms"),
            ("  first save, to durable", f"{first:.2f} s"),
            ("  save to durable", f"{total:.2f} s"),
        ]
    table(
        f"GPU training loop with an async_save of its {nbytes / 2**30:.2f} GiB state",
        rows,
        ("", "value"),
    )
    return [
        f"gpu training step slowdown during the save, {name}: "
        f"{(_mean(during) / base - 1) * 100:+.1f}% (call {stall * 1000:.2f} ms, "
        f"{total:.2f} s to durable)"
        for name, (_, stall, during, total) in runs.items()
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
