"""A Megatron-style tensor-parallel training loop checkpointed by dcpbridge.CheckpointManager.

    torchrun --nproc-per-node 2 examples/megatron_tp_loop.py --root /tmp/ckpt/tp --steps 20

Run it again with a larger --steps: it resumes from the newest complete checkpoint (in any
tensor-parallel size: the checkpoint stores global tensors, each rank reads its own rows).
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist

import dcpbridge as db


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="checkpoints/tp")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")  # "cpu:gloo,cuda:nccl" on GPUs
    rank, tp = dist.get_rank(), dist.get_world_size()

    # A column-parallel linear layer: each rank holds a block of the output rows.
    full = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    weight = torch.nn.Parameter(full.chunk(tp)[rank].clone())
    opt = torch.optim.AdamW([weight], lr=1e-2)

    def state(step: int) -> dict:
        model = {
            "fc.weight": db.ShardedTensor.from_rank_offsets("fc.weight", weight, (0, rank, tp))
        }
        return {
            "model": model,
            "optimizer": db.optimizer_sharded_state_dict(opt, model),
            "step": step,
        }

    mgr = db.CheckpointManager(args.root, every=5, keep_last=2)  # async by default
    start = 0
    if mgr.latest_step() is not None:
        db.init_optimizer_state(opt)
        loaded = mgr.load(state(0))
        db.load_optimizer_state(opt, loaded["optimizer"])
        start = loaded["step"]
        if rank == 0:
            print(f"resumed from step {start}")

    for step in range(start + 1, args.steps + 1):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
        loss = (x @ weight.T).pow(2).sum() / (8 * 64)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mgr.save(step, state(step))
    mgr.close()  # waits for the last background save

    rows = [torch.empty_like(weight.data) for _ in range(tp)]
    dist.all_gather(rows, weight.data)
    if rank == 0:
        digest = hashlib.sha256(torch.cat(rows).numpy().tobytes()).hexdigest()[:16]
        print(f"step {args.steps} weights {digest} checkpoints {mgr.all_steps()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
