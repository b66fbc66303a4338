"""A rank whose object store stalls (connections accepted, never answered) fails the save or
load on every rank within ``request_timeout``, naming the rank and URL; nothing is committed,
the previous checkpoint still loads and the next save succeeds."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

import pytest
import torch

import dcpbridge as db
from tests.support.dist_pool import Rank

pytestmark = [pytest.mark.s3, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

TIMEOUT = 2.0  # seconds: the bound under test (the pool gives each run 60 s)


class StallingEndpoint:
    """An HTTP endpoint that accepts connections and reads requests but never answers."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint_url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="stall").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._held.append(conn)  # kept open, never written to

    def close(self) -> None:
        self._listener.close()
        for conn in self._held:
            with contextlib.suppress(OSError):
                conn.close()


@pytest.fixture
def stall() -> Any:
    s = StallingEndpoint()
    yield s
    s.close()


def _state(r: Rank, value: float, fill: bool = True) -> dict[str, Any]:
    local = torch.full((4, 8), value + r.rank) if fill else torch.zeros(4, 8)
    return {"w": db.ShardedTensor.from_rank_offsets("w", local, (0, r.rank, r.size)), "step": value}


def save_or_error(r: Rank, url: str, options: list[dict[str, Any]], value: float) -> str:
    try:
        db.save(_state(r, value), url, process_group=r.group, storage_options=options[r.rank])
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


def load_or_error(r: Rank, url: str, options: list[dict[str, Any]], value: float) -> str:
    try:
        out = db.load(
            _state(r, 0, fill=False), url, process_group=r.group, storage_options=options[r.rank]
        )
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    assert torch.equal(out["w"].data, torch.full((4, 8), value + r.rank)) and out["step"] == value
    return "loaded"


@pytest.mark.parametrize("world", [2, 4])
def test_a_stalled_rank_fails_save_and_load_everywhere_in_bounded_time(
    pool, s3_server, stall, world
):
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/ck"
    good = s3_server.storage_options(request_timeout=TIMEOUT)
    bad = s3_server.storage_options(endpoint_url=stall.endpoint_url, request_timeout=TIMEOUT)
    stalled = world - 1
    options = [bad if rank == stalled else good for rank in range(world)]
    assert pool.run(save_or_error, world, url, [good] * world, 1.0) == ["saved"] * world
    before = s3_server.keys(bucket)

    for op in (save_or_error, load_or_error):  # every rank raises, naming the rank and URL
        results = pool.run(op, world, url, options, 2.0 if op is save_or_error else 1.0)
        for text in results:
            assert text.startswith("StorageError"), text
            assert f"rank {stalled}: {url}" in text and f"no answer within {TIMEOUT:g} s" in text

    assert s3_server.keys(bucket) == before  # nothing committed, no data left behind
    assert s3_server.multipart_uploads(bucket) == []
    assert pool.run(load_or_error, world, url, [good] * world, 1.0) == ["loaded"] * world
    assert pool.run(save_or_error, world, url, [good] * world, 3.0) == ["saved"] * world
    assert pool.run(load_or_error, world, url, [good] * world, 3.0) == ["loaded"] * world
