"""Timing helpers shared by the benchmarks: alternated repeats, medians, page-cache control."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any


def drop_page_cache() -> bool:
    """Flush dirty pages and drop the page cache (root only); True if the cache was dropped."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def proc_io() -> dict[str, int]:
    """This process's I/O counters: ``rchar``/``wchar`` (bytes through read and write
    syscalls, page cache hits included), ``read_bytes`` (fetched from storage, mapped pages
    included), ..."""
    with open("/proc/self/io") as f:
        return {name: int(value) for name, _, value in (line.partition(":") for line in f)}


@contextmanager
def timer(out: list[float]):
    t0 = time.perf_counter()
    yield
    out.append(time.perf_counter() - t0)


def alternate(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Run each contender ``repeats`` times in rotated order (ABC, BCA, CAB, ...); medians.

    Measured here: whatever runs right after a large fsync'd write is slowed by the disk
    still settling, so a fixed order biases one contender; rotation spreads it over all.
    """
    names = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            samples[name].append(runs[name]())
    return {name: statistics.median(v) for name, v in samples.items()}


def write_pieces(f: Any, data: memoryview, piece: int = 1 << 20) -> None:
    """Write ``data`` to unbuffered file ``f`` in calls of at most ``piece`` bytes (the raw
    limit's way: larger calls are slower on these VMs, see ``storage/write/writer.py``)."""
    for at in range(0, len(data), piece):
        f.write(data[at : at + piece])


def fresh_dir(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:6.2f} GB/s"


def table(title: str, rows: list[tuple[Any, ...]], header: tuple[str, ...]) -> None:
    print(f"\n## {title}")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, *rows):
        print("  " + "  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
