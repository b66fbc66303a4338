"""Reshard a tensor-parallel checkpoint for another layout, sharing the work between workers.

    torchrun --nproc-per-node 2 examples/reshard_job.py --root /tmp/ckpt/reshard

Saves a TP=2 checkpoint, rewrites it for TP=4 (each target rank's rows one stored chunk, so a
TP=4 load reads one contiguous range per tensor), and checks the result. The same job from a
shell:  torchrun --nproc-per-node 2 -m dcpbridge.tools.cli reshard SRC DST --layout tp4.yaml
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import dcpbridge as db
from dcpbridge.tools.cli import main as dcpbridge_cli

TP4_LAYOUT = """\
world_size: 4
rules:
  - {match: "*.weight", split: {axis: 0, parts: 4}}
  - {match: "*", replicate: true}
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="checkpoints/reshard")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    src, dst = os.path.join(args.root, "tp2"), os.path.join(args.root, "tp4")
    layout = os.path.join(args.root, "tp4.yaml")

    full = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    mine = full.chunk(world)[rank].clone()
    db.save(
        {"fc.weight": db.ShardedTensor.from_rank_offsets("fc.weight", mine, (0, rank, world))}, src
    )
    if rank == 0:
        with open(layout, "w") as f:
            f.write(TP4_LAYOUT)
    dist.barrier()

    code = dcpbridge_cli(["reshard", src, dst, "--layout", layout, "--force", "--no-progress"])
    assert code == 0, code

    # Every TP=4 rank's rows are now one stored chunk; any layout still loads it.
    stored = db.load_tensors_metadata(dst)["fc.weight"]
    back = db.load(
        {
            "fc.weight": db.ShardedTensor.from_rank_offsets(
                "fc.weight", torch.zeros_like(mine), (0, rank, world)
            )
        },
        dst,
    )
    assert stored.global_shape == (32, 16) and torch.equal(back["fc.weight"], mine)
    if rank == 0:
        print(f"resharded {src} -> {dst} for 4 ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
