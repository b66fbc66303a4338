from __future__ import annotations

import torch
import torch.distributed as dist


def _sum_ranks(r):
    t = torch.tensor([r.rank + 1])
    dist.all_reduce(t, group=r.group)
    return t


def test_pool_runs_on_subgroups(pool):
    assert [int(x) for x in pool.run(_sum_ranks, 2)] == [3, 3]
    assert [int(x) for x in pool.run(_sum_ranks, 4, default_group=True)] == [10] * 4
