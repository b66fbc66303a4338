"""Mapped local files: items populated before they are handed out, and the prefetch thread
that populates the coming items ahead of them (no process group)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from dcpbridge.storage.backends import storage_for, store
from dcpbridge.storage.errors import StorageError
from dcpbridge.storage.format.paths import resolve


class Recorder:
    """A ``populate`` that records its calls, fails where told, and says when a call came."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.came = threading.Semaphore(0)
        self.fail_at = fail_at

    def __call__(self, path: str, lo: int, hi: int) -> None:
        self.calls.append((path, lo, hi))
        self.came.release()
        if len(self.calls) == self.fail_at:
            raise OSError(5, "Input/output error")

    def wait(self, calls: int) -> None:
        for _ in range(calls):
            assert self.came.acquire(timeout=30)


RANGES = [("a", 0, 10), ("b", 100, 110), ("c", 0, 10)]


def test_prefetch_stays_within_its_bytes_ahead_of_the_items_taken(monkeypatch):
    """Ranges are populated in order, in pieces, and no range is started that would end more
    than ``ahead`` bytes beyond the ranges taken (one always may: the next)."""
    monkeypatch.setattr(store, "_PREFETCH_PIECE", 4)
    rec = Recorder()
    pf = store._Prefetch(RANGES, rec, ahead=10)
    rec.wait(3)  # range a, in three pieces; b would end 20 bytes beyond nothing taken
    pf.stop()
    assert rec.calls == [("a", 0, 4), ("a", 4, 8), ("a", 8, 10)]

    rec = Recorder()
    pf = store._Prefetch(RANGES, rec, ahead=10)
    pf.taken()  # a is being copied: b ends 10 beyond it, c 20
    rec.wait(6)
    pf.stop()
    assert [c[0] for c in rec.calls] == ["a"] * 3 + ["b"] * 3
    assert rec.calls[3:] == [("b", 100, 104), ("b", 104, 108), ("b", 108, 110)]

    rec = Recorder()
    pf = store._Prefetch(RANGES, rec, ahead=0)
    for _ in RANGES:
        pf.taken()
    rec.wait(9)  # all taken: every range may start, whatever ``ahead`` says
    pf.stop()
    assert len(rec.calls) == 9


def test_a_failed_populate_ends_the_prefetch_and_is_left_to_the_caller():
    rec = Recorder(fail_at=1)
    pf = store._Prefetch(RANGES, rec, ahead=1 << 30)
    rec.wait(1)
    pf.stop()  # returns: the thread ended on the failure, populating nothing more
    assert rec.calls == [("a", 0, 10)]


def _live_prefetch_threads() -> int:
    return sum(t.name == "dcpb-prefetch" for t in threading.enumerate())


def test_prefetched_items_are_the_file_bytes_and_the_thread_ends_with_the_mappings(
    tmp_path, monkeypatch
):
    """With the prefetch on (any size), items come back bit-exact from two files, and leaving
    the mappings stops the thread; an item past a file's end raises ``StorageError``."""
    monkeypatch.setattr(store, "PREFETCH_MIN", 0)
    monkeypatch.setattr(store, "PREFETCH_AHEAD", 1 << 16)
    rng = np.random.default_rng(3)
    data = {name: rng.integers(0, 256, 300_000, np.uint8) for name in ("x.bin", "y.bin")}
    for name, arr in data.items():
        arr.tofile(tmp_path / name)
    local = storage_for(resolve(str(tmp_path)))
    items = [("x.bin", 0, 100_000), ("y.bin", 50_000, 200_000), ("x.bin", 200_000, 100_000)]
    before = _live_prefetch_threads()
    with local.mapped_files() as maps:
        assert maps is not None
        paths = {name: os.path.join(tmp_path, name) for name in data}
        maps.prefetch([(paths[f], at, at + n) for f, at, n in items])
        for f, at, n in items:
            got = maps.item(paths[f], at, n, (0, n))
            assert got is not None and np.array_equal(got, data[f][at : at + n])
            del got
        with pytest.raises(StorageError, match=r"x\.bin holds 300000 bytes, fewer than 300001"):
            maps.item(paths["x.bin"], 1, 300_000, (0, 1))
    assert _live_prefetch_threads() == before
