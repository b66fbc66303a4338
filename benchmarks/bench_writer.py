"""Writes that compete with training: how much a Python-heavy CPU training step slows down
while a background save writes, and how long that save takes.

One process trains a small MLP (many small ops, plus Python work per step, about 30 ms a
step, one intra-op thread) and saves 256 MiB (1 GiB without ``--quick``) of other state with
``async_save(background_staging=True)``, written by the thread writer or by the writer process
(``writer="process"``, what the default ``"auto"`` takes for a save this size). Per
contender, the loop's mean step time while the save is in flight is compared with the steps
right before it (no save running); contenders alternate and each figure is the median over
rounds.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings

import torch

import dcpbridge as db
from benchmarks.common import fresh_dir, table
from benchmarks.launch import run
from dcpbridge.engine.writer_process import choose_writer

warnings.filterwarnings("ignore")


class _Trainer:
    """A small MLP trained on random batches, with per-step Python bookkeeping."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(12):
            layers += [torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.LayerNorm(128)]
        self.model = torch.nn.Sequential(*layers)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=False)
        self.x = torch.randn(32, 128, generator=g)
        self.y = torch.randn(32, 128, generator=g)
        self.log: dict[str, float] = {}

    def step(self) -> None:
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        for i in range(3000):  # what loops do besides: metrics, data bookkeeping
            self.log[f"m{i % 64}"] = self.log.get(f"m{i % 64}", 0.0) * 0.9 + i * 0.1


def _state(total: int, count: int) -> dict[str, db.ShardedTensor]:
    g = torch.Generator().manual_seed(1)
    out = {}
    for i in range(count):
        t = torch.randn(total // count // 4, generator=g)
        out[f"w{i}"] = db.ShardedTensor.from_box(f"w{i}", t, tuple(t.shape), (0,))
    return out


def _schedstat() -> tuple[float, float]:
    """This thread's seconds on a CPU and waiting for one (Linux ``schedstat``)."""
    with open("/proc/thread-self/schedstat") as f:
        ran, waited, _ = f.read().split()
    return int(ran) / 1e9, int(waited) / 1e9


class _Steps:
    """Per step: wall seconds, and seconds blocked (neither running nor runnable: waiting for
    the GIL, mostly) — the part a writer process removes, whatever the machine's load."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.blocked: list[float] = []
        self.waited: list[float] = []

    def step(self, trainer: _Trainer) -> None:
        ran0, waited0 = _schedstat()
        t0 = time.perf_counter()
        trainer.step()
        wall = time.perf_counter() - t0
        ran, waited = _schedstat()
        self.wall.append(wall)
        self.blocked.append(max(0.0, wall - (ran - ran0) - (waited - waited0)))
        self.waited.append(waited - waited0)

    def tail(self) -> _Steps:
        """The last two thirds (settled after whatever ran before)."""
        out = _Steps()
        cut = len(self.wall) // 3
        out.wall, out.blocked, out.waited = self.wall[cut:], self.blocked[cut:], self.waited[cut:]
        return out


def _steps_for(trainer: _Trainer, seconds: float) -> _Steps:
    steps = _Steps()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        steps.step(trainer)
    return steps


def _worker(
    rank: int, world: int, root: str, total: int, rounds: int, writers: list[str]
) -> dict[str, dict[str, list[float]]]:
    """Per writer, per round: the slowdown of the mean step during a save, the time blocked
    per step before and during it, and the save's time."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a group per writer: each keeps its saver, staging buffers and (process) writer process
    groups = {w: dist.new_group([0]) for w in writers}
    trainer = _Trainer()
    state = _state(total, 32)
    fields = ("slowdown", "save", "step", "steps", "blocked", "blocked_base", "waited")
    out: dict[str, dict[str, list[float]]] = {w: {k: [] for k in fields} for w in writers}

    def one(writer: str, record: bool) -> None:
        path = fresh_dir(os.path.join(root, writer))
        os.sync()
        base = _steps_for(trainer, 0.6).tail()
        t0 = time.perf_counter()
        handle = db.async_save(
            state, path, process_group=groups[writer], background_staging=True, writer=writer
        )
        during = _Steps()
        while not handle.done():
            during.step(trainer)
        saved = time.perf_counter() - t0
        handle.result()
        if record:
            base_mean = statistics.fmean(base.wall)
            row = out[writer]
            row["slowdown"].append(statistics.fmean(during.wall) / base_mean - 1)
            row["save"].append(saved)
            row["step"].append(base_mean)
            row["steps"].append(len(during.wall))
            row["blocked"].append(statistics.fmean(during.blocked))
            row["blocked_base"].append(statistics.fmean(base.blocked))
            row["waited"].append(statistics.fmean(during.waited) - statistics.fmean(base.waited))

    _steps_for(trainer, 1.0)  # warm up the step
    for w in writers:  # warm each writer once: buffers, processes, first-touch pages
        one(w, False)
    for r in range(rounds):
        for w in writers[r % len(writers) :] + writers[: r % len(writers)]:
            one(w, True)
    return out


def main(root: str, repeats: int, quick: bool) -> list[str]:
    total = (256 if quick else 1024) << 20
    rounds = max(5, 2 * repeats)
    writers = ["thread", "process"]
    res = run(_worker, 1, fresh_dir(os.path.join(root, "writer")), total, rounds, writers)[0]
    med = {w: {k: statistics.median(v) for k, v in res[w].items()} for w in writers}
    table(
        f"training step while a background save writes {total >> 20} MiB "
        f"(1 process, medians of {rounds} alternated rounds)",
        [
            (
                w,
                f"{m['step'] * 1000:.1f} ms",
                f"{m['slowdown'] * 100:+.1f}%",
                f"{m['blocked_base'] * 1000:.2f} ms",
                f"{m['blocked'] * 1000:.2f} ms",
                f"{m['waited'] * 1000:+.1f} ms",
                f"{m['steps']:.0f}",
                f"{m['save']:.2f} s",
            )
            for w, m in med.items()
        ],
        (
            "writer",
            "step, no save",
            "step slowdown during save",
            "blocked/step, no save",
            "blocked/step during save",
            "CPU wait/step, change",
            "steps during save",
            "save",
        ),
    )
    thread, process = med["thread"], med["process"]
    default = choose_writer("auto", "dcpbridge", root, total, started=False)
    return [
        f"the default writer (writer='auto') for this {total >> 20} MiB save: {default}",
        f"step slowdown during a background save: thread writer "
        f"{thread['slowdown'] * 100:+.1f}%, writer process {process['slowdown'] * 100:+.1f}% "
        f"(goal <= 5%); blocked (GIL) per step during it: {thread['blocked'] * 1000:.2f} ms vs "
        f"{process['blocked'] * 1000:.2f} ms",
        f"background save time, writer process vs thread: {process['save'] / thread['save']:.2f}x "
        f"({process['save']:.2f} s vs {thread['save']:.2f} s)",
    ]
