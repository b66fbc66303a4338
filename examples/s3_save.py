"""Save sharded state to S3 (or any S3-compatible store) and load it back, from every rank.

    AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \
    torchrun --nproc-per-node 2 examples/s3_save.py s3://bucket/run --endpoint-url http://minio:9000

Credentials come from the usual AWS chain (environment, profile, instance role). The bucket
must exist. The retry settings below fail within seconds when the endpoint is down.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import dcpbridge as db


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url", help="s3://bucket/prefix")
    parser.add_argument("--endpoint-url", help="S3-compatible endpoint (default: AWS)")
    parser.add_argument("--region", default="us-east-1")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    options = {
        "client_kwargs": {"endpoint_url": args.endpoint_url, "region_name": args.region},
        "config_kwargs": {
            "connect_timeout": 5,
            "read_timeout": 60,
            "retries": {"max_attempts": 3, "mode": "standard"},
        },
    }
    weight = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8).chunk(world)[rank].clone()
    state = {"w": db.ShardedTensor.from_rank_offsets("w", weight, (0, rank, world)), "step": 100}

    mgr = db.CheckpointManager(args.url, storage_options=options, async_save=False)
    mgr.save(100, state, force=True)
    template = {
        "w": db.ShardedTensor.from_rank_offsets("w", torch.zeros_like(weight), (0, rank, world))
    }
    loaded = mgr.load(template)
    assert torch.equal(loaded["w"], weight) and loaded["step"] == 100
    mgr.close()
    if rank == 0:
        print(f"saved and loaded {mgr.step_url(100)}; steps {mgr.all_steps()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
