"""``make demo``: train a TP=2 toy model, checkpoint it, reload on 1 and 4 ranks, then use the CLI.

Run with ``python -m dcpbridge.demo [CHECKPOINT_ROOT]`` (default ``./checkpoints``).
"""

from __future__ import annotations

import atexit
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing

import dcpbridge as db

HIDDEN, FFN, BATCH, STEPS = 64, 256, 32, 20
# model key -> (global shape, tensor-parallel split axis or None for replicated)
PARAMS = {
    "mlp.fc1.weight": ((FFN, HIDDEN), 0),  # column-parallel
    "mlp.fc1.bias": ((FFN,), 0),
    "mlp.fc2.weight": ((HIDDEN, FFN), 1),  # row-parallel
    "mlp.fc2.bias": ((HIDDEN,), None),  # replicated over TP
}


def _local_shape(shape: tuple[int, ...], axis: int | None, tp: int) -> tuple[int, ...]:
    if axis is None:
        return shape
    return tuple(s // tp if d == axis else s for d, s in enumerate(shape))


def _shard(
    key: str, tensor: torch.Tensor, axis: int | None, tp: int, tp_rank: int
) -> db.ShardedTensor:
    if axis is None:  # replicated: every TP rank holds it, TP rank 0 writes it
        return db.ShardedTensor.from_rank_offsets(key, tensor, replica_id=tp_rank)
    return db.ShardedTensor.from_rank_offsets(key, tensor, (axis, tp_rank, tp))


def state_template(tp: int, tp_rank: int, params: dict | None, optim: dict | None) -> dict:
    """Model + Adam state as a sharded state dict; optimizer state shards like its parameter."""
    sd: dict = {"model": {}, "optimizer": {}}
    for key, (shape, axis) in PARAMS.items():
        local = params[key].detach() if params else torch.zeros(_local_shape(shape, axis, tp))
        sd["model"][key] = _shard(key, local, axis, tp, tp_rank)
        for name in ("exp_avg", "exp_avg_sq"):
            state = optim[key][name] if optim else torch.zeros_like(local)
            skey = f"optimizer.state.{name}.{key}"
            sd["optimizer"][skey] = _shard(skey, state, axis, tp, tp_rank)
    return sd


def train_and_save(rank: int, world: int, ckpt: str) -> dict:
    """TP=world training with Adam; saves model + optimizer state + common state."""
    torch.manual_seed(0)
    full = {k: torch.randn(shape) / math.sqrt(shape[-1]) for k, (shape, _) in PARAMS.items()}
    params = {
        k: torch.nn.Parameter(t.chunk(world, axis)[rank].clone() if axis is not None else t.clone())
        for (k, (_, axis)), t in zip(PARAMS.items(), full.values())
    }
    opt = torch.optim.Adam(params.values(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, HIDDEN, generator=g)
        target = torch.sin(x)
        h = torch.nn.functional.gelu(x @ params["mlp.fc1.weight"].T + params["mlp.fc1.bias"])
        partial = h @ params["mlp.fc2.weight"].T
        summed = partial.detach().clone()
        dist.all_reduce(summed)
        y = partial + (summed - partial).detach() + params["mlp.fc2.bias"]
        loss = torch.nn.functional.mse_loss(y, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    optim = {k: opt.state[p] for k, p in params.items()}
    sd = state_template(world, rank, params, optim)
    sd["common"] = {"iteration": STEPS, "losses": losses, "adam_step": STEPS}
    n_bytes = sum(p.numel() * 4 * 3 for p in params.values())
    dist.barrier()
    t0 = time.perf_counter()
    db.save(sd, ckpt)
    seconds = time.perf_counter() - t0
    shards = {
        sh.key: (sh.global_offset, sh.data.clone())
        for part in ("model", "optimizer")
        for sh in sd[part].values()
    }
    return {"seconds": seconds, "bytes": n_bytes, "shards": shards, "losses": losses}


def load_shards(rank: int, world: int, ckpt: str) -> dict:
    sd = state_template(world, rank, None, None)
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    out = db.load(sd, ckpt)
    seconds = time.perf_counter() - t0
    shards = {
        sh.key: (sh.global_offset, out[part][name])
        for part in ("model", "optimizer")
        for name, sh in sd[part].items()
    }
    return {"seconds": seconds, "shards": shards, "common": out["common"]}


def _assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for res in per_rank:
        for key, (offset, data) in res["shards"].items():
            shape = PARAMS[key.split(".", 3)[-1] if key.startswith("optimizer") else key][0]
            t = full.setdefault(key, torch.full(shape, float("nan")))
            t[tuple(slice(o, o + s) for o, s in zip(offset, data.shape))] = data
    return full


LAYOUT_TP4 = """\
# The demo MLP and its Adam state for tensor parallelism 4 (rank r owns part r).
world_size: 4
rules:
  - match: ["mlp.fc1.*", "optimizer.state.*.mlp.fc1.*"]   # column-parallel: rows split
    split: {axis: 0}
  - match: ["mlp.fc2.weight", "optimizer.state.*.mlp.fc2.weight"]   # row-parallel: columns
    split: {axis: 1}
  - match: "*"                    # mlp.fc2.bias (+ its state): replicated, rank 0 stores it
    replicate: true
"""


def _rank_main(rank: int, nprocs: int, folder: str, fn: Callable[..., dict], ckpt: str) -> None:
    import torch.distributed.checkpoint

    rendezvous = f"file://{os.path.join(folder, 'rendezvous')}"
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=nprocs)
    torch.save(fn(rank, nprocs, ckpt), os.path.join(folder, f"{rank}.pt"))
    dist.destroy_process_group()
    atexit._run_exitfuncs()  # then leave without interpreter teardown, which gloo can abort
    os._exit(0)


def run(fn: Callable[..., dict], nprocs: int, ckpt: str) -> list[Any]:
    """``fn(rank, nprocs, ckpt)`` on ``nprocs`` spawned gloo processes; results in rank order."""
    with tempfile.TemporaryDirectory(prefix="dcpbridge-demo-") as folder:
        torch.multiprocessing.spawn(_rank_main, (nprocs, folder, fn, ckpt), nprocs=nprocs)
        return [torch.load(os.path.join(folder, f"{r}.pt")) for r in range(nprocs)]


def cli(*args: str) -> None:
    """Run the ``dcpbridge`` command as a user would, echoing it and its output."""
    print(f"\n$ dcpbridge {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "dcpbridge.tools.cli", *args], check=True)


def main(argv: list[str]) -> int:
    root = argv[0] if argv else "./checkpoints"
    ckpt = os.path.join(root, f"iter_{STEPS:07d}")
    print(f"dcpbridge demo: training a TP=2 MLP with Adam for {STEPS} steps, saving to {ckpt}")
    saved = run(train_and_save, 2, ckpt)
    truth = _assemble(saved)
    print(f"  loss {saved[0]['losses'][0]:.4f} -> {saved[0]['losses'][-1]:.4f}")
    rows = [
        (
            "TP=2 (save)",
            2,
            len(truth),
            sum(r["bytes"] for r in saved),
            max(r["seconds"] for r in saved),
        )
    ]

    single = load_shards(0, 1, ckpt)  # one plain process, no process group
    four = run(load_shards, 4, ckpt)
    for label, results in (("TP=1 (load)", [single]), ("TP=4 (load)", four)):
        got = _assemble(results)
        bad = [k for k in truth if not torch.equal(got[k], truth[k])]
        if bad or results[0]["common"]["iteration"] != STEPS:
            print(f"  MISMATCH after {label}: {bad}")
            return 1
        rows.append((label, len(results), len(got), rows[0][3], max(r["seconds"] for r in results)))
    print(f"\n  {'layout':<12} {'procs':>5} {'keys':>5} {'bytes':>10} {'seconds':>8}")
    for label, procs, keys, nbytes, seconds in rows:
        print(f"  {label:<12} {procs:>5} {keys:>5} {nbytes:>10,} {seconds:>8.3f}")
    print("\n  reloaded with 1 and 4 processes: every tensor bit-exact with what TP=2 saved")

    layout = os.path.join(root, "layout_tp4.yaml")
    with open(layout, "w") as f:
        f.write(LAYOUT_TP4)
    tp4, hf = os.path.join(root, "tp4"), os.path.join(root, "hf")
    cli("inspect", ckpt)
    # --force: a second ``make demo`` replaces the outputs of the first
    cli("reshard", ckpt, tp4, "--layout", layout, "--no-progress", "--force")
    cli("validate", "--checksums", tp4)
    cli(
        "convert",
        tp4,
        hf,
        "--to",
        "safetensors",
        "--max-shard-size",
        "256KB",
        "--no-progress",
        "--force",
    )
    print(f"\n  {hf}: {sorted(os.listdir(hf))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
