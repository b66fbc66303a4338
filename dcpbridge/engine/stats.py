"""What a save or load did, reported as one INFO record of the ``dcpbridge`` logger: bytes,
files, seconds per phase and throughput, so users can see where the time goes.

The record's ``dcpbridge`` attribute holds the same figures as a dict (for log handlers that
collect metrics). Saves are reported by the coordinator (totals over all ranks), loads by
every rank for its own reads; background staging is reported when it ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

log = logging.getLogger("dcpbridge")
T = TypeVar("T")


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "n/a"


def human_bytes(n: float) -> str:
    """``n`` bytes as people read them: ``123 B``, ``1.5 MiB``... up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def report(
    what: str, url: str, phases: dict[str, float], measure: Callable[[], tuple[int, int]]
) -> None:
    """Log one INFO record: ``what`` (saved/loaded/staged) ``url`` with its figures;
    ``measure`` (bytes, files) runs only when the record is logged."""
    if not log.isEnabledFor(logging.INFO):
        return
    nbytes, files = measure()
    total = sum(phases.values())
    figures = {"url": url, "bytes": nbytes, "files": files, "seconds": phases}
    figures["throughput_gbps"] = nbytes / total / 1e9 if total > 0 else None
    steps = ", ".join(f"{name} {s:.3f}s" for name, s in phases.items())
    where = f" in {files} file(s)" if files else ""
    log.info(
        "dcpbridge %s %s: %s%s; %s; %s",
        what,
        url,
        human_bytes(nbytes),
        where,
        steps,
        _rate(nbytes, total),
        extra={"dcpbridge": {"event": what, **figures}},
    )


def written(results: Iterable[Any]) -> tuple[int, int]:
    """(bytes, files) of DCP ``WriteResult``s gathered from every rank (lists of lists)."""
    nbytes, files = 0, set()
    for rank_results in results:
        for r in rank_results or ():
            nbytes += int(getattr(r, "size_in_bytes", 0) or 0)
            data = getattr(r, "storage_data", None)
            name = getattr(data, "file", None) or getattr(data, "relative_path", None)
            if name is not None:
                files.add(name)
    return nbytes, len(files)


def timed(what: str, url: str, fn: Callable[[], T], nbytes: Callable[[T], int]) -> T:
    """Run ``fn`` and report it as one phase ``what`` (e.g. staging) of ``url``."""
    start = time.perf_counter()
    out = fn()
    report(what, url, {what: time.perf_counter() - start}, lambda: (nbytes(out), 0))
    return out


def read_bytes(plan: Any, metadata: Any) -> int:
    """Tensor bytes a DCP ``LoadPlan`` reads (objects are not counted)."""
    total = 0
    for item in plan.items:
        md = metadata.state_dict_metadata.get(item.storage_index.fqn)
        props = getattr(md, "properties", None)
        if props is not None:
            n = props.dtype.itemsize
            for length in item.lengths:
                n *= int(length)
            total += n
    return total


def tensor_bytes(shards: Iterable[Any]) -> int:
    """Bytes of the tensors that ``shards`` (ShardedTensors, objects) hold."""
    total = 0
    for s in shards:
        data = getattr(s, "data", None)
        if hasattr(data, "element_size"):
            total += data.numel() * data.element_size()
    return total
