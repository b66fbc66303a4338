"""An FSDP2 (fully_shard, DTensor) training loop checkpointed by dcpbridge.CheckpointManager.

    torchrun --nproc-per-node 2 examples/fsdp2_loop.py --root /tmp/ckpt/fsdp --steps 20

Runs on CPU with gloo. Run it again with a larger --steps (or another --nproc-per-node): it
resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import dcpbridge as db


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="checkpoints/fsdp")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    mgr = db.CheckpointManager(args.root, every=5, keep_last=2)
    start = 0
    if mgr.latest_step() is not None:
        model_sd, optim_sd = get_state_dict(model, opt)  # templates in this job's layout
        loaded = mgr.load({"model": model_sd, "optim": optim_sd})
        set_state_dict(
            model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
        )
        start = loaded["step"]
        if rank == 0:
            print(f"resumed from step {start}")

    for step in range(start + 1, args.steps + 1):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        model_sd, optim_sd = get_state_dict(model, opt)
        mgr.save(step, {"model": model_sd, "optim": optim_sd, "step": step})
    mgr.close()
    if rank == 0:
        print(f"step {args.steps} loss {loss.item():.6f} checkpoints {mgr.all_steps()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
