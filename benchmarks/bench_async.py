"""Async save: how long the caller is blocked, the optimizer step's wait in a training loop,
and host memory over many saves.

Stall: dcpbridge ``async_save`` (staging in the call, and with ``background_staging``) vs a
plain ``copy_`` of the same bytes into preallocated memory vs DCP's ``async_save`` (default: it
deep-copies the state on each call). Training loop: 2 gloo ranks whose step is a matmul loop
long enough to hide staging, saving through ``CheckpointManager`` with staging in the call and
in the background (the optimizer's step waits for it). Memory: peak and steady resident memory
of a process making 20 async saves of the same state.
"""

from __future__ import annotations

import logging
import os
import statistics
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

    staged: list[float] = []

    def background() -> float:
        path = fresh_dir(os.path.join(root, "background"))
        t0 = time.perf_counter()
        handle = db.async_save(sharded, path, background_staging=True)
        dt = time.perf_counter() - t0
        handle.wait_staged()
        staged.append(time.perf_counter() - t0)
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
    background()
    torch_dcp()
    staged.clear()
    runs = {"memcpy": memcpy, "dcpbridge": bridge, "dcpbridge background": background}
    med = alternate({**runs, "dcp": torch_dcp}, repeats)
    table(
        f"async save stall, {total / 2**30:.2f} GiB in 32 tensors (caller blocked)",
        [(name, f"{t * 1000:.1f} ms") for name, t in med.items()]
        + [("(background: call to staged)", f"{statistics.median(staged) * 1000:.1f} ms")],
        ("", "stall"),
    )
    return [
        f"async stall: dcpbridge {med['dcpbridge'] / med['memcpy']:.2f}x memcpy, "
        f"{med['dcpbridge'] / med['dcp']:.2f}x DCP's async_save stall",
        f"async stall with background staging: {med['dcpbridge background'] * 1000:.2f} ms "
        f"({med['dcpbridge background'] / med['dcpbridge']:.3f}x staging in the call)",
    ]


class _StagedTimes(logging.Handler):
    """Collects the seconds of each ``staged`` record (the copy itself) of the dcpbridge logger."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        figures = getattr(record, "dcpbridge", None)
        if figures and figures.get("event") == "staged":
            self.seconds.append(figures["seconds"]["staged"])


def _loop_worker(
    rank: int, world: int, root: str, total: int, steps: int, every: int, background: bool
) -> dict[str, list[float]]:
    """A training loop whose step is a matmul loop; saves every ``every`` steps; timings."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    count = 16
    params = [
        torch.nn.Parameter(torch.randn(total // 8 // count, generator=g)) for _ in range(count)
    ]
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)  # state: params + momentum = total
    a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
    marks: dict[str, float] = {}
    opt.register_step_pre_hook(lambda *_: marks.__setitem__("enter", time.perf_counter()))
    mgr = db.CheckpointManager(
        root,
        every=every,
        keep_last=1,
        async_save=True,
        optimizers=[opt],
        background_staging=background,
    )
    opt.register_step_pre_hook(lambda *_: marks.__setitem__("go", time.perf_counter()))
    handler = _StagedTimes()
    logging.getLogger("dcpbridge").addHandler(handler)
    logging.getLogger("dcpbridge").setLevel(logging.INFO)

    def state() -> dict:
        out = {}
        for i, p in enumerate(params):
            out[f"p{i}"] = db.ShardedTensor.from_rank_offsets(f"p{i}", p.detach(), (0, rank, world))
            buf = opt.state[p]["momentum_buffer"]
            out[f"m{i}"] = db.ShardedTensor.from_rank_offsets(f"m{i}", buf, (0, rank, world))
        return out

    def forward_backward(reps: int) -> None:
        for _ in range(reps):
            torch.mm(a, b)
        for p, gr in zip(params, grads):
            p.grad = gr

    t0 = time.perf_counter()
    forward_backward(50)
    reps = torch.tensor([max(1, int(50 * 0.15 / (time.perf_counter() - t0)))])  # ~150 ms
    dist.all_reduce(reps, op=dist.ReduceOp.MAX)  # the same step on both ranks
    out: dict[str, list[float]] = {
        "call": [],
        "wait": [],
        "commit": [],
        "compute": [],
        "exchange": [],
    }
    flag = torch.zeros(1)
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        forward_backward(int(reps))
        dist.all_reduce(flag)  # the loop's own collective, beside the background save's
        out["compute"].append(time.perf_counter() - t0)
        opt.step()
        if step > every:  # the first save allocates the staging buffer
            out["wait"].append(marks["go"] - marks["enter"])
        if step % every == 0 and step > every:
            t0 = time.perf_counter()
            mgr.wait()  # the previous save's commit (writes are section 3's subject), timed apart
            out["commit"].append(time.perf_counter() - t0)
            dist.barrier()  # the ranks' skew is not the call's cost
            t0 = time.perf_counter()
            dist.all_gather_object([None] * world, step)  # one exchange: the call holds one
            out["exchange"].append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            mgr.save(step, state())
            out["call"].append(time.perf_counter() - t0)
        else:
            mgr.save(step, state())
    mgr.close()
    out["staged"] = handler.seconds[1:]
    return out


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


def loop_case(root: str, quick: bool) -> list[str]:
    """The optimizer step's wait in a 2-rank loop: staging in the call vs in the background."""
    total, saves, every = ((256 << 20), 3, 6) if quick else ((512 << 20), 5, 8)
    steps = every * (saves + 1)
    rows, med = [], {}
    for label, background in (("in the call", False), ("background", True)):
        path = fresh_dir(os.path.join(root, f"loop-{background}"))
        per_rank = run(_loop_worker, 2, path, total, steps, every, background)
        # saves: the rank that waited longest at the step decides the loop's pace
        waits = [max(w) for w in zip(*(r["wait"][every::every] for r in per_rank))]
        calls = [max(c) for c in zip(*(r["call"] for r in per_rank))]
        staged = [max(s) for s in zip(*(r["staged"] for r in per_rank))]
        compute = statistics.median(per_rank[0]["compute"])
        commit = statistics.median(max(c) for c in zip(*(r["commit"] for r in per_rank)))
        exchange = statistics.median(max(c) for c in zip(*(r["exchange"] for r in per_rank)))
        med[label] = {
            "call": statistics.median(calls),
            "wait": statistics.median(waits),
            "staged": statistics.median(staged),
        }
        m = med[label]
        rows.append(
            (
                label,
                f"{compute * 1000:.0f} ms",
                f"{m['staged'] * 1000:.1f} ms",
                f"{m['call'] * 1000:.2f} ms",
                f"{m['wait'] * 1000:.2f} ms",
                f"{(m['call'] + m['wait']) / m['staged']:.3f}",
                f"{commit * 1000:.0f} ms",
                f"{exchange * 1000:.2f} ms",
            )
        )
    table(
        f"training loop, 2 ranks, {total >> 20} MiB of state per rank saved every {every} steps "
        f"(medians over saves 2-{saves + 1}, slowest rank)",
        rows,
        (
            "staging",
            "fwd/bwd",
            "staging copy",
            "save() call",
            "step() wait",
            "stall/staging",
            "prev. commit wait",
            "one all_gather",
        ),
    )
    bg, fg = med["background"], med["in the call"]
    return [
        f"loop with background staging: step() waits {bg['wait'] / bg['staged'] * 100:.1f}% of "
        f"the staging time (goal <= 10%), save() call {bg['call'] * 1000:.2f} ms; "
        f"stall {(bg['call'] + bg['wait']) / (fg['call'] + fg['wait']):.3f}x staging in the call"
    ]


def main(root: str, repeats: int, quick: bool) -> list[str]:
    total = (256 if quick else 1024) << 20
    return (
        stall_case(root, repeats, total)
        + loop_case(root, quick)
        + memory_case(root, 8 if quick else 20, total)
    )
