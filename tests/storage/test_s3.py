"""The S3 backend against a real S3 server: multipart uploads, ranged reads, retries, options."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from typing import Any

import fsspec
import pytest
import s3fs
import torch
import torch.distributed.checkpoint as dcp

import dcpbridge as db
from dcpbridge.storage import FsspecCheckpointReader, FsspecCheckpointWriter
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.backends.deadlines import RequestBudget, RequestTimeoutError
from dcpbridge.storage.backends.s3 import MultipartWriter, S3Storage, S3Transfer, split_parts
from dcpbridge.storage.backends.store import RangeRead
from dcpbridge.storage.format.paths import resolve
from tests.support.s3_server import DEAD_ENDPOINT

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MiB = 1 << 20


# -- configuration (no server needed) -------------------------------------------------------


def test_transfer_settings_come_from_s3fs_options():
    plain = fsspec.filesystem("s3", skip_instance_cache=True)
    assert S3Transfer.from_fs(plain) == S3Transfer()
    tuned = fsspec.filesystem(
        "s3", default_block_size=8 * MiB, max_concurrency=3, skip_instance_cache=True
    )
    assert S3Transfer.from_fs(tuned) == S3Transfer(part_size=8 * MiB, concurrency=3)
    with pytest.raises(ValueError, match="between 5 MiB and 5 GiB"):
        S3Transfer(part_size=MiB)
    with pytest.raises(ValueError, match="max_concurrency"):
        S3Transfer(concurrency=0)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("default_block_size", "8388608"),
        ("default_block_size", 8e6),
        ("default_block_size", True),
        ("max_concurrency", "4"),
        ("max_concurrency", 2.5),
    ],
)
def test_wrong_types_of_s3fs_transfer_options_raise_a_checkpoint_error(option, value):
    """Options from a config file may be strings or floats: refused up front by name, not a
    TypeError here or in the middle of a save."""
    with pytest.raises(db.InvalidArgumentError, match=rf"s3://bucket/ck|S3 {option} must be an"):
        storage_for(resolve("s3://bucket/ck", {option: value, "skip_instance_cache": True}))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"client_kwargs": "abc"}, "client_kwargs must be a mapping"),
        ({"config_kwargs": "x"}, "config_kwargs must be a mapping"),
        ({"config_kwargs": {"retries": "x"}}, "config_kwargs is not a valid botocore Config"),
        ({"key": 5}, "key must be a string, got int"),
        ({"client_kwargs": {"endpoint_url": "localhost:9000"}}, "endpoint_url 'localhost:9000'"),
        ({"client_kwargs": {"endpoint_url": "http://[::1"}}, r"endpoint_url 'http://\[::1'"),
        ({"endpoint_url": "minio:9000"}, "endpoint_url 'minio:9000' is not a URL"),
        ({"client_kwargs": {"endpoint_url": 9000}}, "endpoint_url must be a string, got int"),
    ],
)
def test_s3fs_client_options_of_the_wrong_type_raise_a_checkpoint_error(tmp_path, extra, message):
    """Not a bare AttributeError / TypeError from s3fs building its client mid-save."""
    url = "s3://bucket/ck"
    with pytest.raises(db.InvalidArgumentError, match=f"^{url}: storage option {message}"):
        db.save(
            {"t": torch.arange(4.0)}, url, storage_options={**extra, "skip_instance_cache": True}
        )


@pytest.mark.parametrize(
    ("url", "options", "cause"),
    [
        ("s3://bucket/ck", {"max_concurrency": "4"}, TypeError),
        ("nope://bucket/ck", {}, ValueError),
    ],
)
def test_a_location_fsspec_cannot_open_raises_a_checkpoint_error(url, options, cause):
    """An unknown protocol or a filesystem option of the wrong type names the location."""
    with pytest.raises(db.InvalidArgumentError, match=f"^{url}: cannot open") as info:
        resolve(url, {**options, "skip_instance_cache": True})
    assert type(info.value.__cause__) is cause


def test_timeout_settings_and_the_cleanup_budget():
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    settings = {"request_timeout": 9, "cleanup_timeout": 2}
    assert S3Transfer.from_fs(fs, settings) == S3Transfer(request_timeout=9, cleanup_timeout=2)
    for bad in ({"cleanup_timeout": 0}, {"cleanup_timeout": "5"}, {"request_timeout": True}):
        with pytest.raises(db.InvalidArgumentError, match="timeout"):
            S3Transfer.from_fs(fs, bad)
    budget = RequestBudget(request_timeout=9, cleanup_timeout=0.2)
    assert budget.timeout() == 9
    first = budget.timed_out(9, "GET")
    assert "no answer within 9 s (GET; storage option request_timeout)" in str(first)
    assert 0 < budget.timeout() <= 0.2  # later requests share the 0.2 s cleanup budget
    later = budget.timed_out(0.1, "list")
    assert "cleanup budget" in str(later) and "cleanup_timeout = 0.2 s" in str(later)
    time.sleep(0.25)
    assert budget.timeout() == 0
    with pytest.raises(RequestTimeoutError, match=r"abort not sent.*budget .* is spent"):
        asyncio.run(budget.bounded(asyncio.sleep(1), "abort"))  # never started, never awaited
    budget.restart()
    assert budget.timeout() == 9


def test_part_sizes_grow_so_ten_thousand_parts_cover_any_object():
    t = S3Transfer(part_size=5 * MiB)
    assert [t.part_size_for(n) for n in (1, 1000, 1001, 2001)] == [
        5 * MiB,
        5 * MiB,
        10 * MiB,
        20 * MiB,
    ]
    assert sum(t.part_size_for(n) for n in range(1, 10_001)) > 4 << 40  # S3 max: 5 TiB
    assert S3Transfer(part_size=64 * MiB).part_size_for(10_000) == 5 << 30  # S3 max part
    fixed = S3Transfer(part_size=5 * MiB, fixed_part_size=True)
    assert fixed.part_size_for(9999) == 5 * MiB


def test_s3_urls_get_the_s3_backend():
    assert isinstance(storage_for(resolve("s3://bucket/ck")), S3Storage)
    assert not isinstance(storage_for(resolve("memory://ck")), S3Storage)


# -- the server -----------------------------------------------------------------------------


@pytest.fixture
def bucket(s3_server) -> str:
    return s3_server.new_bucket()


def _fs(s3_server, *, private: bool = False, **options: Any) -> Any:
    """An s3fs instance for the server; ``private`` ones can carry spies without leaking."""
    return fsspec.filesystem(
        "s3", skip_instance_cache=private, **s3_server.storage_options(**options)
    )


def _spy_concurrency(monkeypatch, fs: Any, method: str) -> dict[str, int]:
    """Record how many ``method`` requests ``fs`` has in flight at once (at most)."""
    seen = {"now": 0, "max": 0, "calls": 0}
    real = fs._call_s3

    async def call(name: str, *args: Any, **kwargs: Any) -> Any:
        if name != method:
            return await real(name, *args, **kwargs)
        seen["now"] += 1
        seen["calls"] += 1
        seen["max"] = max(seen["max"], seen["now"])
        try:
            await asyncio.sleep(0.01)  # let the others start
            return await real(name, *args, **kwargs)
        finally:
            seen["now"] -= 1

    monkeypatch.setattr(fs, "_call_s3", call)
    return seen


@pytest.mark.s3
@pytest.mark.parametrize(
    ("size", "parts"),
    [(0, 0), (1000, 0), (5 * MiB - 1, 0), (5 * MiB, 1), (5 * MiB + 1, 2), (17 * MiB + 123, 4)],
)
def test_multipart_writer_round_trips_any_size(s3_server, bucket, size, parts):
    fs = _fs(s3_server)
    data = os.urandom(size)
    with MultipartWriter(fs, f"{bucket}/obj", S3Transfer(part_size=5 * MiB, concurrency=2)) as f:
        pos = 0
        for step in (777_777, 3 * MiB, 6 * MiB, 1, 10 * MiB):  # odd writes across part edges
            f.write(memoryview(data)[pos : pos + step])
            pos += step
        f.write(data[pos:])
    assert fs.cat_file(f"{bucket}/obj") == data
    etag = s3_server.client().head_object(Bucket=bucket, Key="obj")["ETag"].strip('"')
    assert etag.endswith(f"-{parts}") if parts else "-" not in etag  # single PUT below a part
    assert s3_server.multipart_uploads(bucket) == []


@pytest.mark.s3
def test_parts_upload_concurrently_within_the_bound(s3_server, bucket, monkeypatch):
    fs = _fs(s3_server, private=True)
    seen = _spy_concurrency(monkeypatch, fs, "upload_part")
    data = os.urandom(40 * MiB)
    with MultipartWriter(fs, f"{bucket}/obj", S3Transfer(part_size=5 * MiB, concurrency=3)) as f:
        f.write(data)
    assert seen["calls"] == 8 and seen["max"] == 3
    assert fs.cat_file(f"{bucket}/obj") == data


@pytest.mark.s3
def test_ranged_reads_run_concurrently_within_the_bound(s3_server, bucket, monkeypatch):
    data = os.urandom(24 * MiB)
    fs = _fs(s3_server, private=True, default_block_size=5 * MiB, max_concurrency=4)
    fs.pipe_file(f"{bucket}/ck/blob", data)
    store = storage_for(resolve(f"s3://{bucket}/ck", fs.storage_options))
    seen = _spy_concurrency(monkeypatch, store.fs, "get_object")
    outs = [memoryview(bytearray(n)) for n in (12 * MiB, 11 * MiB, 3)]
    done: list[int] = []
    reads = [
        RangeRead(f"{bucket}/ck/blob", start, out, lambda i=i: done.append(i))
        for i, (start, out) in enumerate(zip((0, 12 * MiB, 24 * MiB - 3), outs))
    ]
    store.fetch(reads, threads=1)
    assert sorted(done) == [0, 1, 2]
    assert b"".join([outs[0], outs[1]]) == data[: 23 * MiB] and outs[2] == data[-3:]
    assert seen["calls"] == 3 + 3 + 1 and seen["max"] == 4  # 5 MiB pieces, 4 in flight


@pytest.mark.s3
def test_failed_write_aborts_the_upload_and_keeps_the_old_object(s3_server, bucket):
    fs = _fs(s3_server)
    fs.pipe_file(f"{bucket}/obj", b"old")

    def write_then_fail() -> None:
        with MultipartWriter(fs, f"{bucket}/obj", S3Transfer(part_size=5 * MiB)) as f:
            f.write(os.urandom(12 * MiB))  # two parts are on their way
            assert s3_server.multipart_uploads(bucket) == ["obj"]
            raise RuntimeError("producer failed")

    with pytest.raises(RuntimeError, match="producer failed"):
        write_then_fail()
    assert s3_server.multipart_uploads(bucket) == []
    assert fs.cat_file(f"{bucket}/obj") == b"old"


# -- retries --------------------------------------------------------------------------------

RETRIES = {"retries": {"max_attempts": 4, "mode": "standard"}}


def _state(n: int, fill: bool = True) -> dict[str, db.ShardedTensor]:
    torch.manual_seed(0)
    big = torch.randn(3 * MiB) if fill else torch.zeros(3 * MiB)  # 12 MiB: 3 parts of 5 MiB
    return {f"t{n}": db.ShardedTensor.from_box("big", big, tuple(big.shape), (0,))}


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["slowdown", "internal", "reset"])
def test_transient_failures_are_retried_by_botocore(s3_server, s3_proxy, bucket, kind, caplog):
    options = s3_server.storage_options(
        endpoint_url=s3_proxy.endpoint_url, default_block_size=5 * MiB, config_kwargs=RETRIES
    )
    url = f"s3://{bucket}/ck"
    put = s3_proxy.inject("PUT", "partNumber=2", kind, times=2)
    get = s3_proxy.inject("GET", "ck/__0_0", kind, times=2)
    caplog.set_level(logging.DEBUG, logger="botocore.retries.standard")
    db.save(_state(0), url, storage_options=options)
    out = db.load(_state(0, fill=False), url, storage_options=options)
    assert torch.equal(out["t0"], _state(0)["t0"].data)
    assert put.hits == get.hits == 2
    assert sum("partNumber=2" in r for r in s3_proxy.requests) >= 3  # the part went up again
    assert "Retry needed" in caplog.text  # botocore's standard retry mode did it
    assert s3_server.multipart_uploads(bucket) == []


@pytest.mark.s3
def test_persistent_failure_fails_the_save_cleanly(s3_server, s3_proxy, bucket):
    url = f"s3://{bucket}/ck"
    direct = s3_server.storage_options(default_block_size=5 * MiB)
    db.save(_state(0), url, storage_options=direct)
    options = s3_server.storage_options(
        endpoint_url=s3_proxy.endpoint_url,
        default_block_size=5 * MiB,
        config_kwargs={"retries": {"max_attempts": 0, "mode": "standard"}},  # s3fs still retries
    )
    s3_proxy.inject("PUT", "partNumber=2", "slowdown", times=1000)
    with pytest.raises(OSError, match=r"uploading part 2 of .*/ck/__0_0\..*\.bin failed"):
        db.save(_state(1), url, storage_options=options)
    assert s3_server.multipart_uploads(bucket) == []
    out = db.load(_state(0, fill=False), url, storage_options=direct)  # the old one is intact
    assert torch.equal(out["t0"], _state(0)["t0"].data)


# -- storage options ------------------------------------------------------------------------


@pytest.mark.s3
def test_storage_options_survive_reset_and_dcp(s3_server, bucket):
    options = s3_server.storage_options(config_kwargs=RETRIES)
    writer = FsspecCheckpointWriter(storage_options=options)
    reader = FsspecCheckpointReader(storage_options=options)
    for first, second in [("a", "b"), ("b", "a")]:
        for io in (writer, reader):
            io.reset(f"s3://{bucket}/{first}")
            io.reset(f"s3://{bucket}/{second}")
            fs = io.location.fs
            assert fs.client_kwargs["endpoint_url"] == s3_server.endpoint_url
            assert fs.key == s3_server.access_key and fs.config_kwargs == RETRIES
    # plain DCP hands the checkpoint id to reset(): the endpoint and keys must stay
    sd = {"w": torch.arange(10.0), "step": 3}
    dcp.save(sd, checkpoint_id=f"s3://{bucket}/dcp", storage_writer=writer)
    out = {"w": torch.zeros(10), "step": 0}
    dcp.load(out, checkpoint_id=f"s3://{bucket}/dcp", storage_reader=reader)
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 3
    assert s3_server.keys(bucket)[-1] == "dcp/dcpbridge.json"


def test_environment_points_nowhere_without_options():
    """A client that lost its options finds no credentials and a dead endpoint, never AWS."""
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError

    assert not [k for k in os.environ if k.startswith(("AWS_ACCESS", "AWS_SECRET", "AWS_SESSION"))]
    fast = {"connect_timeout": 1, "retries": {"max_attempts": 0}}
    with pytest.raises(NoCredentialsError):
        fsspec.filesystem("s3", skip_instance_cache=True, config_kwargs=fast).ls("some-bucket")
    keyed = fsspec.filesystem(
        "s3", key="k", secret="s", skip_instance_cache=True, config_kwargs=fast
    )
    with pytest.raises(EndpointConnectionError, match=re.escape(DEAD_ENDPOINT)):
        keyed.ls("some-bucket")


@pytest.mark.s3
def test_small_reads_and_listing_see_other_writers(s3_server, bucket):
    """One GET per small file (empty ones too); listings are never served from a stale cache."""
    options = s3_server.storage_options()
    store = storage_for(resolve(f"s3://{bucket}/ck", options))
    assert store.list_names() == [] and not store.exists("a")
    other = _fs(s3_server, private=True)  # another process, in effect
    other.pipe({f"{bucket}/ck/a": b"", f"{bucket}/ck/b": b"xyz"})
    assert store.exists("a") and store.list_names() == ["a", "b"]
    assert store.read_file(f"{bucket}/ck/a") == b"" and store.read_file(f"{bucket}/ck/b") == b"xyz"
    other.rm(f"{bucket}/ck/a")
    assert not store.exists("a") and store.list_names() == ["b"]


# -- many small tensors: coalesced reads ----------------------------------------------------


@pytest.mark.s3
@pytest.mark.parametrize("verify", [True, False])
def test_small_tensors_load_in_few_coalesced_gets(s3_server, s3_proxy, bucket, verify):
    """2,000 tensors of 16 KiB: adjacent chunks of a file come back in one ranged GET each
    (bounded in size), straight into their tensors, bit-exact, checksums on or off."""
    url = f"s3://{bucket}/ck"
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(4096, generator=g) for _ in range(2000)]

    def state(data: list[torch.Tensor]) -> dict[str, db.ShardedTensor]:
        return {
            f"t{i}": db.ShardedTensor.from_box(f"t{i}", t, (4096,), (0,))
            for i, t in enumerate(data)
        }

    db.save(state(tensors), url, storage_options=s3_server.storage_options(), thread_count=2)
    options = s3_server.storage_options(endpoint_url=s3_proxy.endpoint_url)
    out = db.load(
        state([torch.empty(4096) for _ in tensors]),
        url,
        storage_options=options,
        verify_checksums=verify,
    )
    assert all(torch.equal(out[f"t{i}"].data, t) for i, t in enumerate(tensors))
    data_gets = [r for r in s3_proxy.requests if r.startswith("GET ") and ".bin" in r]
    assert 2 <= len(data_gets) <= 40, data_gets  # 32 MiB in 2 files: 16 MiB requests at most


@pytest.mark.s3
def test_a_large_tensor_loads_in_part_sized_gets(s3_server, s3_proxy, bucket):
    """One 24 MiB chunk read whole is fetched as part-sized ranged GETs in parallel (not one
    long GET), bit-exact, checksums verified."""
    url = f"s3://{bucket}/ck"
    t = torch.randn(6 << 20, generator=torch.Generator().manual_seed(1))
    box = {"w": db.ShardedTensor.from_box("w", t, tuple(t.shape), (0,))}
    db.save(box, url, storage_options=s3_server.storage_options())
    s3_proxy.requests.clear()
    options = s3_server.storage_options(
        endpoint_url=s3_proxy.endpoint_url, default_block_size=5 * MiB
    )
    dest = torch.empty_like(t)
    db.load(
        {"w": db.ShardedTensor.from_box("w", dest, tuple(t.shape), (0,))},
        url,
        storage_options=options,
    )
    assert torch.equal(dest, t)
    data_gets = [r for r in s3_proxy.requests if r.startswith("GET ") and ".bin" in r]
    assert len(data_gets) == 5, data_gets  # ceil(24 MiB / 5 MiB)


def test_scatter_parts_split_into_back_to_back_part_sized_requests():
    a, b = memoryview(bytearray(range(10))), memoryview(bytearray(range(100, 104)))
    spans = split_parts(50, [a, 3, b, 2], 4)
    shown = [(s, [p if isinstance(p, int) else bytes(p) for p in ps]) for s, ps in spans]
    assert shown == [
        (50, [bytes(range(4))]),
        (54, [bytes(range(4, 8))]),
        (58, [bytes(range(8, 10)), 2]),
        (62, [1, bytes(range(100, 103))]),
        (66, [bytes([103]), 2]),  # a trailing skip stays: the file must hold those bytes
    ]


# -- answers that do not match the request --------------------------------------------------


@pytest.mark.s3
def test_a_ranged_get_answered_with_the_whole_object_raises(s3_server, s3_proxy, bucket):
    """A store that ignores Range (200 and the whole object) must not have the object's first
    bytes land where bytes 100.. belong: the read fails naming the file."""
    whole = bytes(range(256)) * 4
    _fs(s3_server).pipe(f"{bucket}/ck/f.bin", whole)
    options = s3_server.storage_options(endpoint_url=s3_proxy.endpoint_url)
    store = storage_for(resolve(f"s3://{bucket}/ck", options))
    s3_proxy.inject("GET", "f.bin", "whole", body=whole)
    buf = bytearray(16)
    with pytest.raises(db.StorageError, match=r"f\.bin asked for bytes 100\.\.116 .*ignored Range"):
        store.fetch([RangeRead(f"{bucket}/ck/f.bin", 100, memoryview(buf))], 1)
    store.fetch([RangeRead(f"{bucket}/ck/f.bin", 100, memoryview(buf))], 1)  # honoured now
    assert bytes(buf) == whole[100:116]
    s3_proxy.inject("GET", "f.bin", "whole", body=whole)
    store.fetch([RangeRead(f"{bucket}/ck/f.bin", 0, memoryview(buf))], 1)  # from 0: correct
    assert bytes(buf) == whole[:16]


@pytest.mark.s3
def test_a_load_through_a_store_that_ignores_range_fails(s3_server, s3_proxy, bucket):
    """Checksums off, the second tensor of a file loaded alone: never the first one's bytes."""
    url = f"s3://{bucket}/ck"
    a, b = torch.arange(4096.0), torch.arange(4096.0) + 1e6
    state = {
        "a": db.ShardedTensor.from_box("a", a, (4096,), (0,)),
        "b": db.ShardedTensor.from_box("b", b, (4096,), (0,)),
    }
    db.save(state, url, storage_options=s3_server.storage_options(), thread_count=1)
    fs = _fs(s3_server)
    for data in [k for k in fs.ls(f"{bucket}/ck") if k.endswith(".bin")]:
        name = data.rsplit("/", 1)[1]
        s3_proxy.inject("GET", name, "whole", body=fs.cat_file(data), times=100)
    options = s3_server.storage_options(endpoint_url=s3_proxy.endpoint_url)
    dest = torch.zeros(4096)
    with pytest.raises(db.StorageError, match=r"\.bin asked for bytes \d+\.\.\d+ .*ignored Range"):
        db.load(
            {"b": db.ShardedTensor.from_box("b", dest, (4096,), (0,))},
            url,
            storage_options=options,
            verify_checksums=False,
        )


@pytest.mark.s3
def test_listing_a_referenced_checkpoint_is_bounded_by_request_timeout(s3_server, s3_proxy):
    """Loading an incremental checkpoint lists the sibling it references; a store that stalls
    on that listing fails the load within request_timeout + cleanup_timeout, naming the URL."""
    bucket = s3_server.new_bucket()
    direct = s3_server.storage_options()
    base, ad = torch.arange(64.0).reshape(8, 8), torch.ones(2, 8)
    db.save({"base": base, "ad": ad}, f"s3://{bucket}/s1", storage_options=direct)
    url = f"s3://{bucket}/s2"
    db.save(
        {"base": base, "ad": ad + 1}, url, storage_options=direct, reuse_from=f"s3://{bucket}/s1"
    )
    options = {
        **s3_server.storage_options(endpoint_url=s3_proxy.endpoint_url),
        "request_timeout": 2,
        "cleanup_timeout": 1,
    }
    s3_proxy.inject("GET", "prefix=s1", "freeze")
    out: dict[str, Any] = {}

    def load() -> None:
        try:
            db.load(
                {"base": torch.zeros(8, 8), "ad": torch.zeros(2, 8)}, url, storage_options=options
            )
            out["result"] = "loaded"
        except Exception as e:
            out["result"] = e

    start = time.monotonic()
    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(15)
    assert s3_proxy.frozen.is_set()
    assert not worker.is_alive(), f"still waiting after {time.monotonic() - start:.0f} s"
    err = out["result"]
    assert isinstance(err, db.StorageError) and url in str(err), err
    assert "no answer within 2 s" in str(err)


@pytest.mark.s3
def test_a_location_with_a_version_id_is_refused_before_writing(s3_server, bucket):
    """s3fs cuts keys at '?versionId=': saving to s3://b/ck?versionId=1 wrote every file over
    the object ck (a user's object there was lost) and then failed."""
    options = s3_server.storage_options()
    _fs(s3_server).pipe(f"{bucket}/ck", b"user data")
    url = f"s3://{bucket}/ck?versionId=1"
    with pytest.raises(db.InvalidArgumentError, match=r"versionId=1: an S3 checkpoint location"):
        db.save({"t": torch.arange(4.0)}, url, storage_options=options)
    assert s3_server.keys(bucket) == ["ck"]
    assert _fs(s3_server).cat_file(f"{bucket}/ck") == b"user data"


@pytest.mark.s3
def test_a_reader_sees_a_commit_another_process_replaced(s3_server, bucket):
    """Looking up the commit file (and any file's size) never answers from a listing this
    process cached: a checkpoint re-saved by another process loads as its new self."""
    url = f"s3://{bucket}/ck"
    options = s3_server.storage_options()
    db.save({"w": torch.full((4,), 1.0)}, url, storage_options=options)

    def load() -> torch.Tensor:
        out = {"w": torch.zeros(4)}
        reader = FsspecCheckpointReader(url, storage_options=options)
        dcp.load(out, storage_reader=reader, planner=db.ShardedLoadPlanner(), no_dist=True)
        return out["w"]

    assert torch.equal(load(), torch.full((4,), 1.0))  # lists the folder (sizes of its files)
    store = storage_for(resolve(url, options))
    old_size = store.file_size(f"{bucket}/ck/dcpbridge.json")
    other = s3_server.storage_options(skip_instance_cache=True)  # another process, in effect
    db.save({"w": torch.full((4,), 2.0), "pad": torch.zeros(3)}, url, storage_options=other)
    assert torch.equal(load(), torch.full((4,), 2.0))
    fresh = _fs(s3_server, private=True).size(f"{bucket}/ck/dcpbridge.json")
    assert fresh != old_size and store.file_size(f"{bucket}/ck/dcpbridge.json") == fresh
    assert store.info(f"{bucket}/ck/dcpbridge.json")["size"] == fresh


def _refuse_deletes(monkeypatch, ending: str) -> list[str]:
    """Make every s3fs multi-object delete refuse the keys ending with ``ending`` the way S3
    does per key (200 OK, the key under ``Errors``); the other keys are deleted for real."""
    refused: list[str] = []
    real = s3fs.S3FileSystem._call_s3

    async def call(fs: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if method != "delete_objects":
            return await real(fs, method, *args, **kwargs)
        delete = kwargs["Delete"]
        keep = [o for o in delete["Objects"] if o["Key"].endswith(ending)]
        rest = [o for o in delete["Objects"] if o not in keep]
        refused.extend(o["Key"] for o in keep)
        out = {}
        if rest:
            out = await real(fs, method, *args, **{**kwargs, "Delete": {**delete, "Objects": rest}})
        errors = [{"Key": o["Key"], "Code": "InternalError", "Message": "try again"} for o in keep]
        return {**out, "Errors": [*out.get("Errors", []), *errors]}

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call)
    return refused


@pytest.mark.s3
def test_retention_never_leaves_a_commit_without_its_data(s3_server, bucket, monkeypatch, caplog):
    """A multi-object delete that refuses some keys (S3 answers 200 and lists them) raises:
    retention stops before deleting the data of a step whose commit file is still there."""
    options = s3_server.storage_options(config_kwargs={"retries": {"max_attempts": 2}})
    root = f"s3://{bucket}/run"
    refused = _refuse_deletes(monkeypatch, "dcpbridge.json")
    mgr = db.CheckpointManager(
        root, every=1, keep_last=1, async_save=False, storage_options=options
    )
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    mgr.close()
    assert refused == ["run/step_00000001/dcpbridge.json"]
    assert "run/step_00000001/dcpbridge.json: InternalError" in caplog.text
    assert mgr.all_steps() == [1, 2]
    for step in mgr.all_steps():  # every step that looks complete loads
        out = db.load({"w": torch.zeros(4)}, mgr.step_url(step), storage_options=options)
        assert torch.equal(out["w"], torch.full((4,), float(step)))
    store = storage_for(resolve(mgr.step_url(1), options))
    with pytest.raises(db.StorageError, match=r"step_00000001/dcpbridge\.json: InternalError"):
        store.remove_folder()  # what it could delete is gone; what it could not, named
    assert s3_server.keys(bucket)[0] == "run/step_00000001/dcpbridge.json"


@pytest.mark.s3
def test_an_upload_from_the_local_tier_that_fails_creates_no_object(
    s3_server, bucket, tmp_path, monkeypatch
):
    """Persisting a local step's file to S3: a read of the local file that fails part-way
    aborts the upload, so no object with the first part of its bytes appears."""
    from dcpbridge.engine import local_persist

    source = tmp_path / "__0_0.0123456789abcdef.bin"
    source.write_bytes(os.urandom(12 * MiB))
    local = resolve(str(tmp_path))
    store = storage_for(resolve(f"s3://{bucket}/ck", s3_server.storage_options()))

    def copy_then_fail(src: Any, dst: Any, length: int = 0) -> None:
        dst.write(src.read(MiB))
        raise OSError("local disk gone")

    monkeypatch.setattr(local_persist.shutil, "copyfileobj", copy_then_fail)
    with pytest.raises(OSError, match="local disk gone"):
        local_persist._upload_file(local, str(source), store, f"{bucket}/ck/{source.name}")
    assert s3_server.keys(bucket) == [] and s3_server.multipart_uploads(bucket) == []


@pytest.mark.s3
def test_a_connection_cut_mid_body_on_every_try_raises_a_storage_error(s3_server, s3_proxy, bucket):
    """Ranged GETs whose connection dies in the middle of the body are retried, then fail
    as a StorageError naming the URL and file (not aiohttp's payload error)."""
    url = f"s3://{bucket}/ck"
    db.save(_state(0), url, storage_options=s3_server.storage_options())
    options = s3_server.storage_options(
        endpoint_url=s3_proxy.endpoint_url,
        config_kwargs={"retries": {"max_attempts": 1, "mode": "standard"}},
    )
    cut = s3_proxy.inject("GET", "ck/__0_0", "cut", times=1000)
    with pytest.raises(db.StorageError, match=rf"{url}: read {bucket}/ck/__0_0\.") as got:
        db.load(_state(0, fill=False), url, storage_options=options)
    assert cut.hits >= 2 and got.value.__cause__ is not None
    s3_proxy.inject("GET", "ck/__0_0", "cut", times=1)  # once: the retry reads it whole
    cut.times = cut.hits
    out = db.load(_state(0, fill=False), url, storage_options=options)
    assert torch.equal(out["t0"], _state(0)["t0"].data)


@pytest.mark.s3
def test_removing_tensors_keeps_files_a_sibling_committed_since_references(s3_server, bucket):
    """remove_sharded_tensors looks up each sibling's commit file afresh: a sibling this
    process listed before another process committed it still keeps the files it references."""
    a, b = torch.arange(64 * 1024.0), -torch.arange(64 * 1024.0)
    options = s3_server.storage_options()
    step_1, step_2 = f"s3://{bucket}/run/step_1", f"s3://{bucket}/run/step_2"
    db.save({"a": a, "b": b}, step_1, storage_options=options, thread_count=2)
    other = s3_server.storage_options(skip_instance_cache=True)  # another process, in effect
    _fs(s3_server, private=True).pipe_file(f"{bucket}/run/step_2/manager.json", b"{}")
    with pytest.raises(db.NotACheckpointError):  # listed here before its save commits
        db.load({"a": torch.zeros_like(a)}, step_2, storage_options=options)
    db.save({"a": a, "b": b}, step_2, storage_options=other, reuse_from=step_1)
    dropped = db.remove_sharded_tensors(step_1, "b", storage_options=options)
    assert dropped == ["b"]
    out = db.load(
        {"a": torch.zeros_like(a), "b": torch.zeros_like(b)}, step_2, storage_options=options
    )
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b)


@pytest.mark.s3
def test_fsck_of_a_frozen_store_fails_within_the_request_timeout(s3_server, s3_proxy, bucket):
    """fsck's listings (and retention's, of incremental steps) are S3 requests like any
    other: a store that stops answering fails them within the timeouts, naming the URL."""
    from dcpbridge.engine.incremental import files_in, fsck

    root = f"s3://{bucket}/run"
    options = s3_server.storage_options(
        endpoint_url=s3_proxy.endpoint_url, request_timeout=2, cleanup_timeout=1
    )
    db.save({"w": torch.arange(8.0)}, f"{root}/a", storage_options=options)
    s3_proxy.inject("GET", "list-type=2", "freeze")
    for call in (lambda: fsck(root, options), lambda: files_in(resolve(f"{root}/a", options))):
        began = time.monotonic()
        with pytest.raises(
            db.StorageError, match=rf"{root}(/a)?: list: RequestTimeoutError: no answer within 2 s"
        ):
            call()
        assert time.monotonic() - began < 10


@pytest.mark.s3
def test_a_commit_whose_answer_was_lost_keeps_its_data_when_it_cannot_be_read_back(
    s3_server, bucket, monkeypatch, caplog
):
    """The commit PUT landed but its answer never came, and the cleanup's read of the commit
    file fails too: whether the save committed is unknown, so its data files stay (deleting
    them would leave a commit file naming files that are gone)."""
    url = f"s3://{bucket}/ck"
    options = s3_server.storage_options()
    real = s3fs.S3FileSystem._call_s3
    faults = {"put": 0, "get": 0}

    async def call(fs: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        commit = kwargs.get("Key", "").endswith("dcpbridge.json")
        if commit and method == "get_object" and faults["put"] and not faults["get"]:
            faults["get"] += 1  # the cleanup's read, after the failed commit
            raise OSError("InternalError reading the commit back")
        out = await real(fs, method, *args, **kwargs)
        if commit and method == "put_object" and not faults["put"]:
            faults["put"] += 1
            raise OSError("connection reset after the PUT landed")
        return out

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call)
    with pytest.raises(db.StorageError, match=rf"{url}: commit dcpbridge\.json: .*PUT landed"):
        db.save({"w": torch.arange(8.0)}, url, storage_options=options)
    assert faults == {"put": 1, "get": 1}
    assert "InternalError reading the commit back" in caplog.text
    monkeypatch.undo()
    out = db.load({"w": torch.zeros(8)}, url, storage_options=options)  # it did commit
    assert torch.equal(out["w"], torch.arange(8.0))


@pytest.mark.s3
def test_removing_tensors_on_a_frozen_store_fails_within_the_request_timeout(
    s3_server, s3_proxy, bucket
):
    """remove_sharded_tensors lists the checkpoints beside it with bounded requests: a store
    that stops answering fails it within the timeouts, naming the URL, and changes nothing."""
    url = f"s3://{bucket}/run/step_1"
    options = s3_server.storage_options(
        endpoint_url=s3_proxy.endpoint_url, request_timeout=2, cleanup_timeout=1
    )
    a, b = torch.arange(64 * 1024.0), -torch.arange(64 * 1024.0)
    db.save({"a": a, "b": b}, url, storage_options=options, thread_count=2)
    s3_proxy.inject("GET", "list-type=2", "freeze")
    began = time.monotonic()
    with pytest.raises(db.StorageError, match=rf"{url}: list the checkpoints beside it: .*2 s"):
        db.remove_sharded_tensors(url, "b", storage_options=options)
    assert time.monotonic() - began < 10
    s3_proxy.frozen.clear()
    out = db.load({"b": torch.zeros_like(b)}, url, storage_options=s3_server.storage_options())
    assert torch.equal(out["b"], b)


@pytest.mark.s3
def test_a_safetensors_header_read_that_fails_raises_a_storage_error(s3_server, s3_proxy, bucket):
    """Reading a safetensors file's header on S3: a failing GET raises a StorageError naming
    the URL and file (not a bare OSError), and a frozen store fails within the timeouts."""
    from safetensors.torch import save

    url = f"s3://{bucket}/hf"
    _fs(s3_server).pipe_file(f"{bucket}/hf/model.safetensors", save({"w": torch.arange(4.0)}))
    options = s3_server.storage_options(
        endpoint_url=s3_proxy.endpoint_url,
        request_timeout=6,
        cleanup_timeout=2,
        config_kwargs={"retries": {"max_attempts": 1}},
    )
    assert torch.equal(
        db.open_source(url, storage_options=options).read("w", (0,), (4,)), torch.arange(4.0)
    )
    failing = s3_proxy.inject("GET", "/hf/model.safetensors", "internal", times=1000)
    with pytest.raises(db.StorageError, match=rf"^{url}: read model\.safetensors: OSError"):
        db.open_source(url, storage_options=options)
    failing.times = failing.hits
    s3_proxy.inject("GET", "/hf/model.safetensors", "freeze")
    began = time.monotonic()
    with pytest.raises(db.StorageError, match=rf"^{url}: read model\.safetensors: RequestTimeout"):
        db.open_source(url, storage_options=options)
    assert time.monotonic() - began < 15
