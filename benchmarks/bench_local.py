"""The local tier (issue 27): its pure decisions at 1,024 and 16,384 simulated ranks, and
restores of one state from the local tier, the persistent tier on disk and on S3, against a
raw read of the same bytes from tmpfs.

Simulation (no processes): ``ranks_per_node=8``, one data file per rank, seeded random node
losses (the lost nodes come back empty). Per rank, what each rank of a real job computes:
the placement of copies (every rank's targets and each node's space need), the agreement on
the newest recoverable step (one ``newest_recoverable`` over every rank's report, plus the
bytes of those reports: what the all-gather moves to each rank) and the restore read plan
(this rank's sources and merged extents, and the turned-around transfers of every rank's
requests). Times are CPU seconds of this process (the machine is shared; wall time is
noise here). Then how often the newest step stays recoverable when 1 or 2 random nodes are
lost, with replicas 1 and 2, against what the ring placement predicts.

Measured restore (gloo ranks on this machine, nodes simulated by ``{node}`` directories in
/dev/shm with 2 ranks each): one save makes a persistent step on local disk, a local step
(with copies) and, separately, a persistent step on the local S3 server. Then, alternated:
the local tier (own parts), the local tier with one node's directory wiped (its parts come
from the copies), the persistent tier on disk, on S3, and a raw read of each rank's own
data files from /dev/shm. Plus the local tier's restore at 2, 4 and 8 ranks, the local
save's stall (copies behind) against a memcpy of the rank's share, and the bytes sent to
peers against replicas x state.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import random
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import xxhash

import dcpbridge as db
from benchmarks.common import table
from benchmarks.launch import run
from dcpbridge.engine import collectives
from dcpbridge.engine.local_plan import (
    Extent,
    LocalStep,
    Nodes,
    choose_sources,
    copy_targets,
    lacking_space,
    merge_extents,
    newest_recoverable,
    transfers,
    writer_rank,
)
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.checksum import DEFAULT_BLOCK_SIZE as BLOCK
from dcpbridge.storage.format.document import DATA_FILE_RE, decode_metadata
from tests.support.s3_server import run_seaweedfs, scrub_aws_environment, weed_binary

warnings.filterwarnings("ignore")
MiB = 1 << 20
DOC = "dcpbridge.json"
RPN = 8  # ranks per simulated node
RAW, HASHED = "raw tmpfs read", "raw tmpfs read + xxh3"
TILES = "raw tmpfs read + xxh3 of each tile"


# -- simulation of the pure functions ----------------------------------------------------------


def _cpu(fn: Any) -> tuple[float, Any]:
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


def _reports(
    world: int, replicas: int, lost: set[int], unpickled: bool = False
) -> list[list[LocalStep]]:
    """What each rank reports of its node's directory: one file per rank, its copies placed
    by ``copy_targets``; lost nodes report nothing (replaced, empty). ``unpickled``: each
    rank's own objects, as the all-gather delivers them (for timing)."""
    nodes = Nodes(world, RPN)
    files = [f"__{r}_0.distcp" for r in range(world)]
    held: list[dict[str, int]] = [{DOC: 4096} for _ in range(nodes.count)]
    for r in range(world):
        for holder in (r, *copy_targets(r, nodes, replicas)):
            held[nodes.node_of(holder)][files[r]] = 64 * MiB
    steps = [LocalStep(6, "save", "digest", world, h) for h in held]
    out = [[] if nodes.node_of(r) in lost else [steps[nodes.node_of(r)]] for r in range(world)]
    return [pickle.loads(pickle.dumps(x)) for x in out] if unpickled else out


def _read_plan(world: int, chosen: Any, rank: int) -> dict[int, list[Extent]]:
    """Rank ``rank``'s requests in a shifted layout: the second half of its old file and the
    first half of the next rank's."""
    mine, nxt = f"__{rank}_0.distcp", f"__{(rank + 1) % world}_0.distcp"
    sources = choose_sources([mine, nxt], rank, chosen)
    out: dict[int, list[Extent]] = {}
    for e in merge_extents([Extent(mine, 32 * MiB, 32 * MiB), Extent(nxt, 0, 32 * MiB)]):
        if sources[e.name] != rank:
            out.setdefault(sources[e.name], []).append(e)
    return out


def simulate(world: int, replicas: int, seed: int) -> dict[str, float]:
    """One job of ``world`` ranks with 2 random nodes lost: CPU seconds per function."""
    nodes = Nodes(world, RPN)
    shares = [64 * MiB] * world
    t_place, _ = _cpu(
        lambda: (
            [copy_targets(r, nodes, replicas) for r in range(world)],
            lacking_space(shares, [1 << 40] * world, nodes, replicas),
        )
    )
    lost = set(random.Random(seed).sample(range(nodes.count), 2 if replicas > 1 else 1))
    reports = _reports(world, replicas, lost, unpickled=True)
    gathered = sum(len(pickle.dumps(r)) for r in reports)
    t_agree, chosen = _cpu(lambda: newest_recoverable(reports, DOC))
    assert chosen is not None and chosen.step == 6
    t_mine, _ = _cpu(lambda: _read_plan(world, chosen, nodes.lead(min(lost))))
    requests = [_read_plan(world, chosen, r) for r in range(world)]
    t_turn, plan = _cpu(lambda: transfers(requests))
    assert sum(len(v) for v in plan.values()) > 0
    return {
        "place": t_place,
        "agree": t_agree,
        "read plan": t_mine + t_turn,
        "gathered MB": gathered / 1e6,
    }


def recoverable_share(world: int, replicas: int, lost: int, trials: int, seed: int) -> float:
    """How often the newest local step stays recoverable when ``lost`` random nodes die."""
    nodes = Nodes(world, RPN)
    rng = random.Random(seed)
    ok = 0
    for _ in range(trials):
        gone = set(rng.sample(range(nodes.count), lost))
        ok += newest_recoverable(_reports(world, replicas, gone), DOC) is not None
    return ok / trials


def expected_share(world: int, replicas: int, lost: int) -> float:
    """What the placement predicts: the share of ``lost``-node sets that contain no rank's
    whole set of holding nodes (exact when every such set has ``lost`` nodes or more)."""
    nodes = Nodes(world, RPN)
    holding = {
        frozenset(nodes.node_of(h) for h in (r, *copy_targets(r, nodes, replicas)))
        for r in range(world)
    }
    if lost < min(map(len, holding)):
        return 1.0
    if any(len(h) != lost for h in holding):
        return float("nan")
    return 1 - len(holding) / math.comb(nodes.count, lost)


def simulation(quick: bool) -> list[str]:
    rows, summary = [], []
    for world in (1024, 16384):
        times = {r: simulate(world, r, seed=world + r) for r in (1, 2)}
        for r, t in times.items():
            rows.append(
                (
                    world,
                    r,
                    f"{t['place'] * 1e3:.1f}",
                    f"{t['agree'] * 1e3:.1f}",
                    f"{t['read plan'] * 1e3:.1f}",
                    f"{t['gathered MB']:.1f}",
                )
            )
        worst = max(max(t["place"], t["agree"], t["read plan"]) for t in times.values())
        trials = (50 if quick else 200) if world <= 1024 else (4 if quick else 8)
        shares = []
        for r in (1, 2):
            for lost in (1, 2):
                got = recoverable_share(world, r, lost, trials, seed=7 * world + 3 * r + lost)
                shares.append(
                    f"r={r} lost={lost}: {got:.0%} ({expected_share(world, r, lost):.1%} expected)"
                )
        summary.append(
            f"local tier pure functions at {world} ranks: slowest {worst:.3f} CPU s per call "
            "(target < 1 s at 16,384)"
        )
        summary.append(
            f"local step recoverable at {world} ranks ({trials} seeded trials each): "
            + "; ".join(shares)
        )
    table(
        f"local tier decisions, {RPN} ranks per node, random node losses; CPU ms per rank",
        rows,
        ("ranks", "replicas", "place copies", "agree", "read plan", "all-gather MB"),
    )
    return summary


# -- measured restore on gloo ranks ------------------------------------------------------------


def _state(rank: int, world: int, total: int, tensors: int = 8) -> dict[str, Any]:
    """``total`` bytes of float32 in ``tensors`` tensors split on dim 0 over the ranks."""
    rows = total // tensors // 4 // 1024
    out: dict[str, Any] = {}
    for i in range(tensors):
        local = torch.empty(rows // world, 1024)
        local.uniform_(generator=torch.Generator().manual_seed(1000 * i + rank))
        out[f"layer{i}"] = db.ShardedTensor.from_rank_offsets(f"layer{i}", local, (0, rank, world))
    return out


def _template(rank: int, world: int, state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: db.ShardedTensor.from_rank_offsets(k, torch.zeros_like(v.data), (0, rank, world))
        for k, v in state.items()
    }


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in a:
        assert torch.equal(a[k].data, b[k].data), k


def _timed(fn: Any, state: dict[str, Any]) -> float:
    """Seconds of ``fn()`` on every rank; what it loaded (if anything) is then checked
    bit-exact against ``state``, outside the timing (the raw reads check nothing)."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    seconds = time.perf_counter() - t0
    if out is not None:
        _equal(out, state)
    return seconds


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                got[line.split(":")[0]] = int(line.split()[1]) * 1024
    return got["VmRSS"], got["VmHWM"]


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
    except OSError:
        pass


def restore_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of a measured restore (see the module docstring); ``cfg['full']`` adds the
    other tiers and the save measurements to the local tier's restore."""
    rpn = 1 if world == 2 else 2
    local = os.path.join(cfg["shm"], "node{node}")
    sent = [0]
    original = collectives.SideGroup.exchange

    def counting(self: Any, sends: list, recvs: list) -> None:
        sent[0] += sum(t.numel() * t.element_size() for t, _, _ in sends)
        return original(self, sends, recvs)

    collectives.SideGroup.exchange = counting  # type: ignore[method-assign]
    state = _state(rank, world, cfg["total"])
    share = sum(v.data.nbytes for v in state.values())
    mgr = db.CheckpointManager(
        cfg["disk"],
        every=1,
        local_dir=local,
        local_every=1,
        replicas=1,
        ranks_per_node=rpn,
        async_save=True,
    )
    mgr.save(1, state)  # persistent step 1 on disk and local step 1 (copies behind)
    mgr.wait()
    out: dict[str, Any] = {"share": share}
    template = _template(rank, world, state)
    results: dict[str, list[float]] = {}

    def local_tier() -> Any:
        return mgr.load(template)

    mine = os.path.join(local.replace("{node}", str(rank // rpn)), "step_00000001")
    own = [
        os.path.join(mine, n)
        for n in sorted(os.listdir(mine))
        if DATA_FILE_RE.match(n) and writer_rank(n) == rank
    ]
    buf = torch.zeros(sum(os.path.getsize(p) for p in own), dtype=torch.uint8)  # touched
    assert buf.numel() >= share, (own, buf.numel(), share)  # the raw read reads them all
    view = memoryview(buf.numpy())

    def raw(hashed: bool = False) -> None:
        """This rank's own data files into one buffer, in blocks of the checksum block
        size, each hashed (xxh3) right after it is read when ``hashed``."""
        for p in own:
            with open(p, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                for at in range(0, size, BLOCK):
                    piece = view[at : min(at + BLOCK, size)]
                    f.readinto(piece)
                    if hashed:
                        xxhash.xxh3_64_intdigest(piece)

    tiles = _tile_reads(mine, {os.path.basename(p) for p in own}, view)
    runs = {
        "local": local_tier,
        RAW: raw,
        HASHED: lambda: raw(hashed=True),
        TILES: tiles,
    }
    if cfg["full"]:
        victim = local.replace("{node}", "1")
        kept = victim + ".kept"
        if rank == 0:
            shutil.copytree(victim, kept)
        dist.barrier()

        def wipe(back: bool) -> None:
            dist.barrier()
            if rank == 0 and back:
                shutil.copytree(kept, victim)
            elif rank == 0:
                shutil.rmtree(victim)
            dist.barrier()

        runs.update(
            {
                "local, one node wiped": local_tier,
                "persistent, disk": lambda: mgr.load(template, step=1),
            }
        )
        if cfg["s3"] is not None:
            s3 = db.CheckpointManager(cfg["s3"], every=1, storage_options=cfg["s3_options"])
            s3.save(1, state)
            runs["persistent, S3"] = lambda: s3.load(template)
    names = list(runs)
    for i in range(cfg["repeats"]):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            wiped = name == "local, one node wiped"
            if wiped:
                wipe(back=False)
            results.setdefault(name, []).append(_timed(runs[name], state))
            if wiped:
                wipe(back=True)
    out["restore"] = {k: statistics.median(v) for k, v in results.items()}
    if cfg["full"]:
        out.update(_stall(rank, world, cfg, state, share, rpn, sent))
        out.update(_loop_stall(world, cfg, state, rpn))
    mgr.close()
    collectives.SideGroup.exchange = original  # type: ignore[method-assign]
    return out


def _tile_reads(step_dir: str, own: set[str], view: memoryview) -> Any:
    """What verifying the rank's own chunks costs at the least: each chunk read into ``view``
    one row of checksum tiles at a time (a format 4 chunk of this state has column-group
    tiles: a tile's rows are not contiguous), each tile gathered by one copy into a scratch
    buffer and hashed (xxh3), as a restore must before it hands the bytes over."""
    with open(os.path.join(step_dir, DOC), "rb") as f:
        index = decode_metadata(f.read(), where=step_dir).storage_data
    items = sorted(
        (it.file, it.offset, it.nbytes, tuple(it.sizes), it.dtype.itemsize)
        for it in index.items.values()
        if it.file in own and it.sizes
    )
    scratch = torch.empty(BLOCK, dtype=torch.uint8).numpy()

    def read() -> None:
        pos = 0
        for name, offset, nbytes, sizes, itemsize in items:
            grid = checksum.tensor_grid(sizes, itemsize, BLOCK, tiled=True)
            groups = checksum.column_groups(grid)
            assert groups > 1, grid  # the state's chunks: column-group tiles
            row = nbytes // sizes[0]
            piece = row // groups
            with open(os.path.join(step_dir, name), "rb", buffering=0) as f:
                for first in range(0, sizes[0], grid.tile[0]):
                    n = min(grid.tile[0], sizes[0] - first)
                    out = view[pos : pos + n * row]
                    f.seek(offset + first * row)
                    f.readinto(out)
                    arr = np.frombuffer(out, np.uint8).reshape(n, groups, piece)
                    tile = scratch[: n * piece].reshape(n, piece)
                    for j in range(groups):
                        np.copyto(tile, arr[:, j])
                        xxhash.xxh3_64_intdigest(tile)
                    pos += n * row

    return read


def _local_only(cfg: dict[str, Any], name: str, rpn: int, **kw: Any) -> db.CheckpointManager:
    """A manager that saves local steps only (every step, copies behind), in ``name{node}``."""
    return db.CheckpointManager(
        os.path.join(cfg["disk"], f"never-{name}"),
        every=1 << 30,
        local_dir=os.path.join(cfg["shm"], name + "{node}"),
        local_every=1,
        replicas=1,
        ranks_per_node=rpn,
        async_save=True,
        **kw,
    )


def _stall(
    rank: int,
    world: int,
    cfg: dict[str, Any],
    state: dict[str, Any],
    share: int,
    rpn: int,
    sent: list[int],
) -> dict[str, Any]:
    """The local save's stall (local steps only, copies behind) against a memcpy of the
    rank's share into preallocated memory (both after a barrier: all ranks copying at once),
    its bytes sent and its peak extra RSS."""
    mgr = _local_only(cfg, "stall", rpn)
    flat = torch.empty(share, dtype=torch.uint8)
    views, pos = [], 0
    for v in state.values():
        views.append(flat[pos : pos + v.data.nbytes].view(torch.float32).view(v.data.shape))
        pos += v.data.nbytes
    memcpy, stall, peaks, sends = [], [], [], []
    for step in range(1, 2 + cfg["repeats"]):
        dist.barrier()  # every rank copies at once, as every rank stages at once in the save
        t0 = time.perf_counter()
        for dst, v in zip(views, state.values(), strict=True):
            dst.copy_(v.data)
        memcpy.append(time.perf_counter() - t0)
        dist.barrier()
        sent[0] = 0
        rss, _ = _rss()
        _reset_peak()
        t0 = time.perf_counter()
        mgr.save(step, state)
        stall.append(time.perf_counter() - t0)
        mgr.wait()
        peaks.append(_rss()[1] - rss)
        sends.append(sent[0])
    mgr.close()
    return {  # the first save (warm-up: side group, directories) left out
        "memcpy": statistics.median(memcpy[1:]),
        "stall": statistics.median(stall[1:]),
        "sent": sends[-1],
        "peak": max(peaks[1:]),
    }


def _loop_stall(world: int, cfg: dict[str, Any], state: dict[str, Any], rpn: int) -> dict[str, Any]:
    """What a training loop sees with the staging behind too (``background_staging``): steps
    of a fixed compute (matmuls) and the optimizer's step, with a local save in the call
    before it or without one, alternated, each after the previous local step finished
    (outside the timing). Timed: the save call, the optimizer's wait for the staging, and
    the whole step (its growth includes the tier's thread taking cores from the compute)."""
    params = [torch.nn.Parameter(v.data) for v in state.values()]  # the state, no grads
    opt = torch.optim.SGD(params, lr=0.1)
    marks: dict[str, float] = {}
    opt.register_step_pre_hook(lambda *_: marks.__setitem__("enter", time.perf_counter()))
    mgr = _local_only(cfg, "loop", rpn, background_staging=True, optimizers=[opt])
    opt.register_step_pre_hook(lambda *_: marks.__setitem__("go", time.perf_counter()))
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    got: dict[str, list[float]] = {"call": [], "wait": [], "with": [], "without": []}
    saved = 0
    for i in range(2 * (1 + cfg["repeats"])):
        save = i % 2 == 0
        mgr.wait()
        dist.barrier()
        t0 = time.perf_counter()
        if save:
            saved += 1
            mgr.save(saved, state)
            call = time.perf_counter() - t0
        for _ in range(40 * 8 // world):  # the same work on the 2 cores at any world size
            torch.mm(a, a)
        opt.step()
        step = time.perf_counter() - t0
        if i < 2:  # the first save allocates the staging buffer
            continue
        got["with" if save else "without"].append(step)
        if save:
            got["call"].append(call)
            got["wait"].append(marks["go"] - marks["enter"])
    mgr.close()
    return {f"loop {k}": statistics.median(v) for k, v in got.items()}


def _s3_server(workdir: Path) -> Any:
    """The local S3 server, or None (its rows skipped) where ``weed`` is not installed."""
    try:
        weed_binary()
    except RuntimeError:
        print("\n(local: S3 rows skipped: the SeaweedFS binary 'weed' is not installed)")
        return contextlib.nullcontext()
    return run_seaweedfs(workdir)


def measured(repeats: int, quick: bool, total: int | None = None) -> list[str]:
    scrub_aws_environment()
    total = total or (64 if quick else 1024) * MiB
    big = 4 if quick else 8
    summary = []
    with (
        tempfile.TemporaryDirectory(prefix="dcpb-local-bench-") as tmp,
        _s3_server(Path(tmp) / "s3") as server,
    ):
        rows, by_world, loads = [], {}, {}
        for world in (2, 4) if quick else (2, 4, 8):
            shm = tempfile.mkdtemp(prefix="dcpb-local-bench-", dir="/dev/shm")
            try:
                cfg = {
                    "shm": shm,
                    "disk": os.path.join(tmp, f"disk{world}"),
                    "s3": None if server is None else f"s3://{server.new_bucket()}/ckpt",
                    # one part upload in flight per rank: 8 ranks x the default stall the
                    # local SeaweedFS on 2 cores past the request timeout (measured)
                    "s3_options": None
                    if server is None
                    else {**server.storage_options(), "max_concurrency": 1},
                    "total": total,
                    "full": world == big,
                    "repeats": repeats,
                }
                before = os.getloadavg()[0]
                by_world[world] = run(restore_rank, world, cfg)
                loads[world] = (before, os.getloadavg()[0])
            finally:
                shutil.rmtree(shm, ignore_errors=True)
            w = {
                k: max(r["restore"][k] for r in by_world[world])
                for k in ("local", RAW, HASHED, TILES)
            }
            rows.append(
                (
                    world,
                    f"{w['local']:.3f}",
                    f"{w[RAW]:.3f}",
                    f"{w[HASHED]:.3f}",
                    f"{w[TILES]:.3f}",
                    f"{w['local'] / w[RAW]:.2f}x",
                    f"{w['local'] / w[TILES]:.2f}x",
                    f"{w[TILES] / w[RAW]:.2f}x",
                    f"{loads[world][0]:.1f} / {loads[world][1]:.1f}",
                )
            )
        table(
            f"local tier restore of {total / 2**30:.3f} GiB against each rank reading its own "
            "files raw from tmpfs (in checksum blocks, with or without xxh3 of each; tiles: a "
            "row of checksum tiles at a time, each tile gathered and hashed, the least a "
            "verified read does), medians of alternated runs, seconds (slowest rank)",
            rows,
            (
                "ranks",
                "local",
                "raw",
                "raw+xxh3",
                "raw+tiles",
                "local/raw",
                "local/raw+tiles",
                "raw+tiles/raw",
                "load avg",
            ),
        )
        res = by_world[big]
        sec = {k: max(r["restore"][k] for r in res) for k in res[0]["restore"]}
        table(
            f"restore of {total / 2**30:.3f} GiB on {big} ranks ({big // 2} nodes of 2), "
            "medians, seconds",
            [(k, f"{v:.3f}", f"{total / v / 1e9:.2f} GB/s") for k, v in sec.items()],
            ("from", "seconds", "speed"),
        )
        loc = sec["local"]
        shares = [r["share"] for r in res]
        sent = sum(r["sent"] for r in res)
        stall = max(r["stall"] for r in res)
        memcpy = max(r["memcpy"] for r in res)
        loop = {k: max(r[k] for r in res) for k in res[0] if k.startswith("loop ")}
        loop["blocked"] = max(r["loop call"] + r["loop wait"] for r in res)
        loop["grown"] = loop["loop with"] - loop["loop without"]
        summary += [
            f"local restore ({big} ranks, {total / 2**30:.3f} GiB): "
            + (
                f"{sec['persistent, S3'] / loc:.1f}x faster than S3 (target >= 5x), "
                if "persistent, S3" in sec
                else "S3 skipped, "
            )
            + f"{sec['persistent, disk'] / loc:.2f}x faster than the "
            f"persistent tier on disk, {loc / sec[RAW]:.2f}x the raw tmpfs read "
            f"(target <= 1.5x), {loc / sec[HASHED]:.2f}x the raw read + xxh3 of the same bytes "
            f"(raw + xxh3 alone: {sec[HASHED] / sec[RAW]:.2f}x raw), {loc / sec[TILES]:.2f}x "
            f"the raw read + xxh3 of every checksum tile (that alone: {sec[TILES] / sec[RAW]:.2f}x "
            f"raw, the least a verified read of these column-group tiles costs; load avg "
            f"{loads[big][0]:.1f} / {loads[big][1]:.1f} before / after)",
            f"local restore with one node wiped: {sec['local, one node wiped'] / loc:.2f}x the "
            "time of the full local restore",
            "local restore seconds by ranks: "
            + ", ".join(
                f"{w}: {max(r['restore']['local'] for r in by_world[w]):.3f}" for w in by_world
            ),
            f"local save stall (local step only, copies behind): {stall / memcpy:.2f}x a "
            f"memcpy of the rank's share ({stall:.3f} s vs {memcpy:.3f} s; target <= 1.0x)",
            "with the staging behind too (background_staging, a loop of matmul steps): the "
            f"save call plus the optimizer's wait {loop['blocked'] / memcpy:.2f}x the memcpy "
            f"({loop['loop call']:.3f} + {loop['loop wait']:.3f} s); the step grew by "
            f"{loop['grown'] / memcpy:.2f}x the memcpy ({loop['loop with']:.3f} s with a "
            f"save, {loop['loop without']:.3f} s without; the tier's thread takes the same "
            "2 cores as the compute)",
            f"bytes sent to peers per save: {sent / sum(shares):.2f}x the state "
            f"(replicas=1: target 1.00x); peak extra RSS per rank "
            f"{max(r['peak'] for r in res) / max(shares):.2f}x its share",
        ]
    return summary


def main(root: str, repeats: int, quick: bool) -> list[str]:
    return simulation(quick) + measured(repeats, quick)
