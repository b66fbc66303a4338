"""S3 save/load on a local SeaweedFS: dcpbridge vs raw s3fs requests vs torch's FsspecWriter,
and issue 17's rows: loads of 2,000 x 64 KiB (1 process and 2 ranks) and 16 x 32 MiB against
AWS's s3torchconnector (``pip install -e '.[bench]'``) and raw s3fs, with the GETs each makes
(counted by a proxy in an extra, untimed load).

The same tensors go up and come back four ways, interleaved, with the order rotated (and
reversed on odd rounds) between rounds; each round's ratios compare runs of that round only.

- raw objects: one object per tensor, ``fs.pipe`` / ``fs.cat`` with s3fs's defaults
- raw parts:   part-sized objects with as many requests in flight as dcpbridge uses
  (``fs.pipe`` / ``fs.cat_ranges`` with ``batch_size``); "raw" is the faster of the two
- dcpbridge:   ``dcpbridge.save`` / ``dcpbridge.load`` through ``S3Storage``
- torch:       DCP with ``FsspecWriter`` (``sync_files=False``, its best case on S3) /
  ``FsspecReader``

dcpbridge and torch load into one set of tensors made and touched before the rounds (a
training job loads into memory it already uses; first-touch faults of 1 GiB of fresh memory
made single loads here vary 1.0-2.6 s); the raw shapes return new bytes, as their API does.

A load counts the best of ``--loads`` tries. Each save also records the CPU seconds of this
process and of the server: on one machine they share the cores, which bounds any client's
save speed (printed as the ceiling next to torch's speed). Standalone:
``python benchmarks/bench_s3.py [--gib 1] [--rounds 3] [--part-mib 16] [--concurrency 8]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

import dcpbridge as db
from benchmarks.common import table
from dcpbridge.storage.backends.s3 import S3Transfer
from tests.support.s3_server import REGION, run_seaweedfs, scrub_aws_environment

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
MiB = 1 << 20
CONTENDERS = ("raw", "rawparts", "dcpbridge", "torch")


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Contenders:
    """The four ways to move the same tensors to and from prefixes of one bucket."""

    def __init__(self, server: Any, tensors: list[torch.Tensor], threads: int, **opts: Any):
        self.server_pid = server.pid
        self.opts = server.storage_options(**opts)
        self.fs = fsspec.filesystem("s3", **self.opts)
        self.transfer = S3Transfer.from_fs(self.fs)
        self.bucket = server.new_bucket()
        self.tensors, self.threads = tensors, threads
        self.blobs = [t.numpy().tobytes() for t in tensors]
        self.dests = [torch.empty_like(t).zero_() for t in tensors]  # see the module docstring
        part = self.transfer.part_size
        self.pieces = [
            memoryview(b)[lo : lo + part].tobytes()
            for b in self.blobs
            for lo in range(0, len(b), part)
        ]

    def _url(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def clear(self, name: str) -> None:
        if self.fs.exists(f"{self.bucket}/{name}"):
            self.fs.rm(f"{self.bucket}/{name}", recursive=True)
        self.fs.invalidate_cache()

    def raw_save(self) -> None:
        self.fs.pipe({f"{self.bucket}/raw/t{i}": b for i, b in enumerate(self.blobs)})

    def raw_load(self) -> None:
        out = self.fs.cat([f"{self.bucket}/raw/t{i}" for i in range(len(self.blobs))])
        assert sum(map(len, out.values())) == sum(map(len, self.blobs))

    def rawparts_save(self) -> None:
        pieces = {f"{self.bucket}/rawparts/p{i}": b for i, b in enumerate(self.pieces)}
        self.fs.pipe(pieces, batch_size=self.transfer.concurrency)

    def rawparts_load(self) -> None:
        paths = [f"{self.bucket}/rawparts/p{i}" for i in range(len(self.pieces))]
        ends = [len(p) for p in self.pieces]
        out = self.fs.cat_ranges(
            paths, [0] * len(paths), ends, batch_size=self.transfer.concurrency
        )
        assert sum(map(len, out)) == sum(ends)

    def _sharded(self, data: list[torch.Tensor]) -> dict[str, Any]:
        return {
            f"t{i}": db.ShardedTensor.from_box(f"t{i}", t, tuple(t.shape), (0,))
            for i, t in enumerate(data)
        }

    def dcpbridge_save(self) -> None:
        sd = self._sharded(self.tensors)
        db.save(sd, self._url("dcpbridge"), storage_options=self.opts, thread_count=self.threads)

    def dcpbridge_load(self) -> None:
        db.load(self._sharded(self.dests), self._url("dcpbridge"), storage_options=self.opts)

    def torch_save(self) -> None:
        url = self._url("torch")
        writer = FsspecWriter(url, sync_files=False, thread_count=self.threads, **self.opts)
        dcp.save({f"t{i}": t for i, t in enumerate(self.tensors)}, storage_writer=writer)

    def torch_load(self) -> None:
        out = {f"t{i}": d for i, d in enumerate(self.dests)}
        dcp.load(out, storage_reader=FsspecReader(self._url("torch"), **self.opts))

    def _timed_load(self, name: str) -> float:
        """One load by ``name``, timed; the destinations are cleared before and checked after."""
        for d in self.dests:
            d.zero_()
        seconds = _timed(getattr(self, f"{name}_load"))
        if name in ("dcpbridge", "torch"):
            assert all(map(torch.equal, self.dests, self.tensors)), f"{name} loaded wrong data"
        return seconds

    def round(self, order: list[str], loads: int) -> dict[str, float]:
        seconds: dict[str, float] = {}
        for name in order:
            self.clear(name)
            client, server = time.process_time(), _cpu_seconds(self.server_pid)
            seconds[f"{name} save"] = _timed(getattr(self, f"{name}_save"))
            seconds[f"{name} save client cpu"] = time.process_time() - client
            seconds[f"{name} save server cpu"] = _cpu_seconds(self.server_pid) - server
            seconds[f"{name} load"] = min(self._timed_load(name) for _ in range(loads))
            self.clear(name)
        return seconds


def _ratios(sec: dict[str, float], op: str) -> tuple[float, float]:
    """dcpbridge's speed-up over the faster raw shape and over torch, for ``op`` in a round."""
    ours = sec[f"dcpbridge {op}"]
    return min(sec[f"raw {op}"], sec[f"rawparts {op}"]) / ours, sec[f"torch {op}"] / ours


def s3_case(
    total: int, rounds: int, *, tensors: int = 16, threads: int = 2, loads: int = 2, **opts: Any
) -> list[str]:
    scrub_aws_environment()  # never real AWS, whatever this machine's environment says
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(total // tensors // 4, generator=g) for _ in range(tensors)]
    nbytes = sum(t.numel() * 4 for t in data)
    with (
        tempfile.TemporaryDirectory(prefix="dcpb-s3-bench-") as tmp,
        run_seaweedfs(Path(tmp)) as server,
    ):
        c = Contenders(server, data, threads, **opts)
        c.raw_save()  # warm-up: the server grows its first volumes here, untimed
        c.clear("raw")
        results = []
        for i in range(rounds):
            order = list(CONTENDERS[i % 4 :] + CONTENDERS[: i % 4])
            results.append(c.round(order[::-1] if i % 2 else order, loads))
    rows = []
    for i, sec in enumerate(results, 1):
        for op in ("save", "load"):
            vs_raw, vs_torch = _ratios(sec, op)
            speeds = [f"{nbytes / sec[f'{n} {op}'] / 1e9:.3f}" for n in CONTENDERS]
            rows.append((f"round {i}", op, *speeds, f"{vs_raw:.2f}x", f"{vs_torch:.2f}x"))
    table(
        f"S3 (local SeaweedFS) {nbytes / 2**30:.2f} GiB in {tensors} tensors, {c.transfer}, "
        f"{threads} file(s) per rank; GB/s",
        rows,
        ("", "", "raw objects", "raw parts", "dcpbridge", "torch", "vs raw", "vs torch"),
    )
    summary = [_save_ceiling(results, nbytes)]
    for op in ("save", "load"):
        vs_raw = statistics.median(_ratios(sec, op)[0] for sec in results)
        vs_torch = statistics.median(_ratios(sec, op)[1] for sec in results)
        summary.append(
            f"S3 {op}: dcpbridge {vs_raw:.2f}x raw s3fs (target >= 0.8x), "
            f"{vs_torch:.2f}x torch FsspecWriter/Reader (target >= 1.5x)"
        )
    return summary


def _save_ceiling(results: list[dict[str, float]], nbytes: int) -> str:
    """Why the save ratio over torch is bounded here: CPU per GB of client and server.

    Client and server share this machine's cores, so no client can save faster than
    ``cores / (client + server CPU-s per GB)``; set against torch's speed, that bounds any
    client's ratio over torch in this setup.
    """
    gb = nbytes / 1e9
    cores = os.cpu_count() or 1
    rows, per_gb = [], {}
    for n in CONTENDERS:
        client = statistics.median(sec[f"{n} save client cpu"] for sec in results) / gb
        server = statistics.median(sec[f"{n} save server cpu"] for sec in results) / gb
        wall = statistics.median(sec[f"{n} save"] for sec in results)
        busy = (client + server) * gb / (wall * cores)
        per_gb[n] = client + server
        rows.append((n, f"{client:.2f}", f"{server:.2f}", f"{busy:.0%}"))
    table(
        f"S3 save CPU cost (medians over rounds, {cores} cores shared by client and server)",
        rows,
        ("", "client CPU-s/GB", "server CPU-s/GB", "cores busy"),
    )
    ceiling = cores / per_gb["dcpbridge"]
    torch_speed = gb / statistics.median(sec["torch save"] for sec in results)
    return (
        f"S3 save ceiling here: {ceiling:.3f} GB/s for dcpbridge's CPU cost "
        f"(cores / client+server CPU-s per GB) = {ceiling / torch_speed:.2f}x torch's speed"
    )


# -- issue 17: many small tensors and a few large ones, against s3torchconnector ------------

SMALL, SMALL_BYTES, LARGE, LARGE_BYTES = 2000, 64 << 10, 16, 32 << 20
LOADERS = ("dcpbridge", "s3torchconnector", "raw s3fs")


def _s3tc() -> Any:
    """s3torchconnector's DCP reader/writer classes (the ``bench`` extra), or None."""
    try:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    except ImportError:
        return None

    def make(cls: Any, url: str, endpoint: str) -> Any:
        config = S3ClientConfig(force_path_style=True)
        obj = cls(REGION, url, s3client_config=config)
        obj.fs._client = S3Client(
            REGION, endpoint=endpoint, s3client_config=config
        )  # a local server
        return obj

    return lambda url, endpoint, write: make(
        S3StorageWriter if write else S3StorageReader, url, endpoint
    )


class Loads:
    """Save ``count`` tensors of ``nbytes`` once per library, then time loads of them into
    preallocated tensors; rank ``rank`` of ``world`` holds every ``world``-th tensor."""

    def __init__(
        self,
        opts: dict[str, Any],
        endpoint: str,
        bucket: str,
        count: int,
        nbytes: int,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.opts, self.endpoint, self.bucket = opts, endpoint, bucket
        self.rank, self.world = rank, world
        g = torch.Generator().manual_seed(0)
        every = [torch.randn(nbytes // 4, generator=g) for _ in range(count)]
        self.mine = {i: every[i] for i in range(rank, count, world)}
        self.fs = fsspec.filesystem("s3", **opts)
        self.s3tc = _s3tc()

    def _url(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def _sharded(self, empty: bool) -> dict[str, Any]:
        return {
            f"t{i}": db.ShardedTensor.from_box(
                f"t{i}", torch.empty_like(t) if empty else t, tuple(t.shape), (0,)
            )
            for i, t in self.mine.items()
        }

    def save(self, who: str) -> float:
        t0 = time.perf_counter()
        if who == "dcpbridge":
            db.save(self._sharded(False), self._url("db"), storage_options=self.opts)
        elif who == "s3torchconnector":
            writer = self.s3tc(self._url("tc"), self.endpoint, True)
            dcp.save({f"t{i}": t for i, t in self.mine.items()}, storage_writer=writer)
        else:
            self.fs.pipe(
                {f"{self.bucket}/raw/t{i}": t.numpy().tobytes() for i, t in self.mine.items()}
            )
        return time.perf_counter() - t0

    def load(self, who: str, endpoint: str | None = None) -> float:
        t0 = time.perf_counter()
        if who == "dcpbridge":
            opts = (
                self.opts
                if endpoint is None
                else {
                    **self.opts,
                    "client_kwargs": {**self.opts["client_kwargs"], "endpoint_url": endpoint},
                }
            )
            out = db.load(self._sharded(True), self._url("db"), storage_options=opts)
            got = {i: out[f"t{i}"].data for i in self.mine}
        elif who == "s3torchconnector":
            reader = self.s3tc(self._url("tc"), endpoint or self.endpoint, False)
            got = {i: torch.empty_like(t) for i, t in self.mine.items()}
            dcp.load({f"t{i}": t for i, t in got.items()}, storage_reader=reader)
        else:
            fs = (
                self.fs
                if endpoint is None
                else fsspec.filesystem(
                    "s3",
                    skip_instance_cache=True,
                    **{
                        **self.opts,
                        "client_kwargs": {**self.opts["client_kwargs"], "endpoint_url": endpoint},
                    },
                )
            )
            blobs = fs.cat([f"{self.bucket}/raw/t{i}" for i in self.mine])
            got = {
                i: torch.frombuffer(
                    bytearray(blobs[f"{self.bucket}/raw/t{i}"]), dtype=torch.float32
                )
                for i in self.mine
            }
        seconds = time.perf_counter() - t0
        assert all(torch.equal(got[i], t) for i, t in self.mine.items()), who  # bit-exact
        return seconds


def _contenders() -> tuple[str, ...]:
    return LOADERS if _s3tc() is not None else ("dcpbridge", "raw s3fs")


def _rounds(loads: Loads, rounds: int, barrier: Callable[[], None]) -> dict[str, list[float]]:
    """``rounds`` rotated rounds of a save then a load with each contender; seconds each."""
    names = _contenders()
    out: dict[str, list[float]] = {f"{n} save": [] for n in names} | {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            barrier()
            out[f"{n} save"].append(loads.save(n))
            barrier()
            out[n].append(loads.load(n))
    return out


def _rank_rounds(
    rank: int,
    world: int,
    opts: dict,
    endpoint: str,
    bucket: str,
    count: int,
    nbytes: int,
    rounds: int,
) -> dict[str, list[float]]:
    import torch.distributed as dist

    scrub_aws_environment()
    os.environ.update(AWS_ACCESS_KEY_ID=opts["key"], AWS_SECRET_ACCESS_KEY=opts["secret"])
    loads = Loads(opts, endpoint, bucket, count, nbytes, rank, world)
    return _rounds(loads, rounds, dist.barrier)


def _gets(proxy: Any, loads: list[Loads], who: str) -> int:
    """GETs the server saw for one untimed load by every rank (through a counting proxy)."""
    proxy.reset_counters()
    for one in loads:
        one.load(who, proxy.endpoint_url)
    return sum(r.startswith("GET ") for r in proxy.requests)


@contextlib.contextmanager
def server_for_ranks(prefix: str) -> Iterator[Any]:
    """A SeaweedFS in a temp folder whose credentials spawned ranks inherit (never real AWS)."""
    scrub_aws_environment()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp, run_seaweedfs(Path(tmp)) as server:
        os.environ.update(
            AWS_ACCESS_KEY_ID=server.access_key, AWS_SECRET_ACCESS_KEY=server.secret_key
        )
        yield server


def issue17_case(rounds: int, quick: bool) -> list[str]:
    """The issue-17 rows: dcpbridge, s3torchconnector (if installed) and raw s3fs loads of
    2,000 x 64 KiB (1 process and 2 ranks) and 16 x 32 MiB, with GET counts, in one run."""
    from benchmarks.launch import run
    from tests.support.s3_proxy import FaultProxy

    scrub_aws_environment()
    cases = [
        ("2,000 x 64 KiB", SMALL, SMALL_BYTES, 1),
        ("2,000 x 64 KiB", SMALL, SMALL_BYTES, 2),
        ("16 x 32 MiB", LARGE, LARGE_BYTES // (4 if quick else 1), 1),
    ]
    rows, summary = [], []
    names = _contenders()
    with server_for_ranks("dcpb-s3-17-") as server:
        opts = server.storage_options()
        for label, count, nbytes, world in cases:
            bucket = server.new_bucket()
            args = (opts, server.endpoint_url, bucket, count, nbytes, rounds)
            if world == 1:
                loads = Loads(opts, server.endpoint_url, bucket, count, nbytes)
                per_rank = [_rounds(loads, rounds, lambda: None)]
            else:
                per_rank = run(_rank_rounds, world, *args)
            proxy = FaultProxy(server.endpoint_url)
            try:
                gets = {}
                ranks = [
                    Loads(opts, server.endpoint_url, bucket, count, nbytes, r, world)
                    for r in range(world)
                ]
                gets = {n: _gets(proxy, ranks, n) for n in names}
            finally:
                proxy.close()
            # a round's time is its slowest rank's
            sec = {
                k: [max(p[k][i] for p in per_rank) for i in range(len(per_rank[0][k]))]
                for k in per_rank[0]
            }
            med = {k: statistics.median(v) for k, v in sec.items()}
            for n in names:
                rows.append(
                    (
                        label,
                        f"{world}",
                        n,
                        f"{med[n]:.3f} s",
                        f"{gets[n]}",
                        f"{med[f'{n} save']:.3f} s",
                    )
                )
            vs = [f"{med[n] / med['dcpbridge']:.2f}x {n}" for n in names if n != "dcpbridge"]
            vs += [
                f"save {med[f'{n} save'] / med['dcpbridge save']:.2f}x {n}"
                for n in names
                if n != "dcpbridge"
            ]
            summary.append(
                f"S3 load {label}, {world} rank(s): dcpbridge {med['dcpbridge']:.3f} s in "
                f"{gets['dcpbridge']} GETs = " + ", ".join(vs) + " speed"
            )
    table(
        f"S3 (local SeaweedFS) loads into preallocated tensors, medians of {rounds} rotated rounds"
        + ("" if "s3torchconnector" in names else " (s3torchconnector not installed)"),
        rows,
        ("load", "ranks", "library", "load", "GETs", "save"),
    )
    return summary


def main(root: str, repeats: int, quick: bool) -> list[str]:
    return issue17_case(repeats, quick) + s3_case((256 if quick else 1024) * MiB, repeats)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    ap.add_argument("--tensors", type=int, default=16, help="number of equal tensors")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loads", type=int, default=2, help="loads per save (the best counts)")
    ap.add_argument("--threads", type=int, default=2, help="files per rank (ours and torch's)")
    ap.add_argument("--part-mib", type=int, default=0, help="S3 part size (default: ours)")
    ap.add_argument("--concurrency", type=int, default=0, help="requests in flight per file")
    args = ap.parse_args()
    opts: dict[str, Any] = {}
    if args.part_mib:
        opts["default_block_size"] = args.part_mib * MiB
    if args.concurrency:
        opts["max_concurrency"] = args.concurrency
    lines = s3_case(
        int(args.gib * (1 << 30)),
        args.rounds,
        tensors=args.tensors,
        threads=args.threads,
        loads=args.loads,
        **opts,
    )
    print("\n## summary (same-run ratios, medians over rounds; >1 means dcpbridge is faster)")
    for line in lines:
        print("  " + line)
