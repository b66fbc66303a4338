"""S3 save/load throughput on a local SeaweedFS: dcpbridge vs raw s3fs vs torch's FsspecWriter.

Writes the same bytes three ways in each round (the order rotates between rounds) and prints
each round's throughputs and the same-round ratios, then the medians over rounds:

- raw:   the faster of two plain s3fs request shapes over the same bytes: one object per
  tensor (``fs.pipe`` / ``fs.cat`` with s3fs's defaults), or part-sized objects with as many
  requests in flight as ours (``fs.pipe`` / ``fs.cat_ranges`` with ``batch_size``)
- ours:  ``dcpbridge.save`` / ``dcpbridge.load`` through ``S3ByteIO``
- torch: ``torch.distributed.checkpoint`` with ``FsspecWriter`` (sync_files=False, its best
  case on S3) / ``FsspecReader``

Run from the repository root: ``python benchmarks/s3_bench.py [--gib 1] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

import dcpbridge as db
from storage.s3 import S3Transfer
from tests.s3_server import run_seaweedfs, scrub_aws_environment

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
MiB = 1 << 20


def make_tensors(total: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(total // count // 4, generator=g) for _ in range(count)]


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Variants:
    """The three ways to move the same tensors to and from one S3 prefix."""

    def __init__(
        self,
        fs: Any,
        opts: dict[str, Any],
        bucket: str,
        tensors: list[torch.Tensor],
        transfer: S3Transfer,
    ):
        self.fs, self.opts, self.bucket, self.tensors = fs, opts, bucket, tensors
        self.blobs = [t.numpy().tobytes() for t in tensors]
        self.transfer = transfer
        part = transfer.part_size
        self.pieces = [
            memoryview(b)[lo : lo + part].tobytes()
            for b in self.blobs
            for lo in range(0, len(b), part)
        ]
        self.threads = 1

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def clear(self, name: str) -> None:
        if self.fs.exists(f"{self.bucket}/{name}"):
            self.fs.rm(f"{self.bucket}/{name}", recursive=True)
        self.fs.invalidate_cache()

    # -- raw s3fs ---------------------------------------------------------------------------

    def raw_save(self) -> None:
        self.fs.pipe({f"{self.bucket}/raw/t{i}": b for i, b in enumerate(self.blobs)})

    def raw_load(self) -> None:
        out = self.fs.cat([f"{self.bucket}/raw/t{i}" for i in range(len(self.blobs))])
        assert sum(len(v) for v in out.values()) == sum(len(b) for b in self.blobs)

    def rawparts_save(self) -> None:
        self.fs.pipe(
            {f"{self.bucket}/rawparts/p{i}": b for i, b in enumerate(self.pieces)},
            batch_size=self.transfer.concurrency,
        )

    def rawparts_load(self) -> None:
        paths = [f"{self.bucket}/rawparts/p{i}" for i in range(len(self.pieces))]
        ends = [len(p) for p in self.pieces]
        out = self.fs.cat_ranges(
            paths, [0] * len(paths), ends, batch_size=self.transfer.concurrency
        )
        assert sum(len(v) for v in out) == sum(ends)

    # -- dcpbridge --------------------------------------------------------------------------

    def _sharded(self, data: list[torch.Tensor]) -> dict[str, Any]:
        return {
            f"t{i}": db.ShardedTensor.from_box(f"t{i}", t, tuple(t.shape), (0,))
            for i, t in enumerate(data)
        }

    def ours_save(self) -> None:
        db.save(
            self._sharded(self.tensors),
            self.url("ours"),
            storage_options=self.opts,
            thread_count=self.threads,
        )

    def ours_load(self) -> None:
        out = db.load(
            self._sharded([torch.empty_like(t) for t in self.tensors]),
            self.url("ours"),
            storage_options=self.opts,
        )
        assert torch.equal(out["t0"], self.tensors[0])

    # -- torch's FsspecWriter / FsspecReader ------------------------------------------------

    def torch_save(self) -> None:
        writer = FsspecWriter(
            self.url("torch"), sync_files=False, thread_count=self.threads, **self.opts
        )
        dcp.save({f"t{i}": t for i, t in enumerate(self.tensors)}, storage_writer=writer)

    def torch_load(self) -> None:
        out = {f"t{i}": torch.empty_like(t) for i, t in enumerate(self.tensors)}
        dcp.load(out, storage_reader=FsspecReader(self.url("torch"), **self.opts))
        assert torch.equal(out["t0"], self.tensors[0])


def one_round(v: Variants, order: list[str], loads: int) -> dict[str, float]:
    """Save then load with each variant; a load's time is the best of ``loads`` tries."""
    seconds: dict[str, float] = {}
    for name in order:
        v.clear(name)
        seconds[f"{name} save"] = timed(getattr(v, f"{name}_save"))
        seconds[f"{name} load"] = min(timed(getattr(v, f"{name}_load")) for _ in range(loads))
        v.clear(name)
    return seconds


def report(rounds: list[dict[str, float]], nbytes: int, *, medians: bool) -> None:
    def gbps(s: float) -> float:
        return nbytes / s / 1e9

    rows = []
    for i, sec in enumerate(rounds, 1):
        for op in ("save", "load"):
            objects, parts, ours, tch = (
                sec[f"{n} {op}"] for n in ("raw", "rawparts", "ours", "torch")
            )
            raw = min(objects, parts)
            print(
                f"round {i} {op}: raw {gbps(raw):.3f} (objects {gbps(objects):.3f}, "
                f"parts {gbps(parts):.3f})  ours {gbps(ours):.3f}  torch {gbps(tch):.3f} GB/s  "
                f"ours/raw {raw / ours:.2f}x  ours/torch {tch / ours:.2f}x",
                flush=True,
            )
            rows.append((op, raw / ours, tch / ours, gbps(ours)))
    if not medians:
        return
    for op in ("save", "load"):
        mine = [r for r in rows if r[0] == op]
        print(
            f"median {op}: ours {statistics.median(r[3] for r in mine):.3f} GB/s, "
            f"ours/raw {statistics.median(r[1] for r in mine):.2f}x (target >= 0.8x), "
            f"ours/torch-FsspecWriter {statistics.median(r[2] for r in mine):.2f}x "
            "(target >= 1.5x)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    ap.add_argument("--tensors", type=int, default=16, help="number of equal tensors")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loads", type=int, default=2, help="loads per save (best counts)")
    ap.add_argument("--threads", type=int, default=1, help="files per rank (ours and torch)")
    ap.add_argument("--part-mib", type=int, default=0, help="S3 part size (default: ours)")
    ap.add_argument("--concurrency", type=int, default=0, help="requests in flight per file")
    args = ap.parse_args()

    scrub_aws_environment()
    total = int(args.gib * (1 << 30))
    tensors = make_tensors(total, args.tensors)
    nbytes = sum(t.numel() * 4 for t in tensors)
    with (
        tempfile.TemporaryDirectory(prefix="dcpb-s3-bench-") as tmp,
        run_seaweedfs(Path(tmp)) as server,
    ):
        extra: dict[str, Any] = {}
        if args.part_mib:
            extra["default_block_size"] = args.part_mib * MiB
        if args.concurrency:
            extra["max_concurrency"] = args.concurrency
        opts = server.storage_options(**extra)
        bucket = server.new_bucket()
        fs = fsspec.filesystem("s3", **opts)
        v = Variants(fs, opts, bucket, tensors, S3Transfer.from_fs(fs))
        v.threads = args.threads
        print(
            f"{nbytes / 2**30:.2f} GiB in {len(tensors)} tensors, SeaweedFS at "
            f"{server.endpoint_url}, threads={args.threads}, {v.transfer}"
        )
        v.raw_save()  # warm-up: the server grows its first volumes here, untimed
        v.clear("raw")
        order = ["raw", "ours", "rawparts", "torch"]
        rounds = []
        for i in range(args.rounds):
            turn = order[i % 4 :] + order[: i % 4]
            turn = turn[::-1] if i % 2 else turn
            print(f"(round {i + 1} order: {turn})", flush=True)
            rounds.append(one_round(v, turn, args.loads))
            report(rounds[-1:], nbytes, medians=False)
        print(f"--- medians over {len(rounds)} rounds ---")
        report(rounds, nbytes, medians=True)


if __name__ == "__main__":
    main()
