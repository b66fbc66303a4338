"""Resuming a data position at 10^6 consumed samples: jump against replay.

One DP rank of eight (global batch 256, local 32) resumes a run that consumed 999,936
samples (3906 global batches) of a 2M-sample dataset, until it holds its first new batch:
(a) ``GlobalBatchSampler.load_state_dict`` and one batch through a DataLoader (the jump: one
permutation of the epoch, as any shuffled epoch start draws); (b) ``skip_first_batches``-style
skipping of the rank's 3906 batches of indices without loading them, over torch's
``BatchSampler(DistributedSampler)`` (the cheap variant); (c) replaying those batches through
the DataLoader (dataset and collate run for every skipped sample, as a loader whose sampler
cannot skip does). The dataset makes a 128-token sample per index: (c) is a floor for real
data, whose samples cost far more to read and decode.
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

import dcpbridge as db
from benchmarks.common import alternate, table

NUM_SAMPLES, GBS, DP = 2_000_000, 256, 8


class Tokens(Dataset):
    """A synthetic token dataset: sample ``i`` is 128 token ids."""

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((128,), i, dtype=torch.int64)


def _sampler() -> db.GlobalBatchSampler:
    return db.GlobalBatchSampler(NUM_SAMPLES, GBS, 0, DP, seed=1, dataset_id="tokens")


def _saved(batches: int) -> dict:
    s = _sampler()
    s._consumed = s._offset = batches * GBS  # the state a run of that many steps saved
    return s.state_dict()


def jump(state: dict, expect: list[int]) -> float:
    t0 = time.perf_counter()
    s = _sampler()
    s.load_state_dict(state)
    first = next(iter(DataLoader(Tokens(), batch_sampler=s)))
    took = time.perf_counter() - t0
    assert first[:, 0].tolist() == expect
    return took


def skip_indices(batches: int) -> float:
    t0 = time.perf_counter()
    sampler = DistributedSampler(range(NUM_SAMPLES), num_replicas=DP, rank=0, seed=1)
    it = iter(BatchSampler(sampler, GBS // DP, drop_last=True))
    for _ in range(batches):
        next(it)
    first = next(it)
    took = time.perf_counter() - t0
    assert len(first) == GBS // DP
    return took


def replay(batches: int, expect: list[int]) -> float:
    t0 = time.perf_counter()
    it = iter(DataLoader(Tokens(), batch_sampler=_sampler()))
    for _ in range(batches):
        next(it)
    first = next(it)
    took = time.perf_counter() - t0
    assert first[:, 0].tolist() == expect
    return took


def main(root: str, repeats: int, quick: bool) -> list[str]:
    batches = (100_000 if quick else 1_000_000) // GBS
    consumed = batches * GBS
    state = _saved(batches)
    expect = _sampler().global_batch(0, batches)[: GBS // DP]
    times = alternate(
        {
            "jump": lambda: jump(state, expect),
            "skip": lambda: skip_indices(batches),
            "replay": lambda: replay(batches, expect),
        },
        repeats,
    )
    j, s, r = times["jump"], times["skip"], times["replay"]
    restore = []
    for _ in range(max(repeats, 3)):
        t0 = time.perf_counter()
        _sampler().load_state_dict(state)
        restore.append(time.perf_counter() - t0)
    restore_us = sorted(restore)[len(restore) // 2] * 1e6
    table(
        f"(data) resume one DP rank of {DP} at {consumed:,} consumed samples "
        f"({batches} global batches of {GBS}), until its first new batch (medians)",
        [
            ("GlobalBatchSampler.load_state_dict (jump)", f"{j * 1e3:.1f} ms", "1.0x"),
            ("  of which load_state_dict alone", f"{restore_us:.0f} us", ""),
            ("skip batches of indices (skip_first_batches)", f"{s * 1e3:.1f} ms", f"{s / j:.1f}x"),
            ("replay batches through the DataLoader", f"{r * 1e3:.1f} ms", f"{r / j:.1f}x"),
        ],
        ("how", "time", "vs jump"),
    )
    return [
        f"(data) resume at {consumed:,} samples: jump {j * 1e3:.1f} ms (one epoch permutation; "
        f"load_state_dict {restore_us:.0f} us); skipping indices "
        f"{s * 1e3:.0f} ms ({s / j:.1f}x); replaying batches {r:.2f} s ({r / j:.0f}x)"
    ]
