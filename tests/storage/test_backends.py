"""One storage test matrix over local disk, memory:// and S3 (a real SeaweedFS server)."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from threading import current_thread
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpbridge as db
from dcpbridge.planners import ShardedLoadPlanner
from dcpbridge.storage import FsspecCheckpointReader, FsspecCheckpointWriter
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.backends.store import RangeRead, ScatterRead
from dcpbridge.storage.format.paths import resolve
from dcpbridge.storage.write import writer as writer_mod
from dcpbridge.storage.write.commit import remove_stale_files
from tests.support import layouts as L
from tests.support.backends import Backend
from tests.support.dist_pool import Rank

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

COMMON = {"iteration": 77, "args": {"lr": 1e-4}}


def layout_state(layout: str, ranks: list[int], *, fill: bool = True) -> dict[str, Any]:
    """The shards the given ranks hold in ``layout`` (all of them: one process saves for all)."""
    make = L.shard if fill else L.template
    return {
        f"{key}.{rank}.{i}": make(key, box)
        for key in L.TENSORS
        for rank in ranks
        for i, box in enumerate(L.boxes(layout, key, rank))
    }


def check_loaded(out: dict[str, Any], tmpl: dict[str, Any]) -> int:
    for name, sh in tmpl.items():
        box = (sh.global_offset, sh.local_shape)
        assert torch.equal(out[name], L.expected(sh.key, box)), f"{name} {box} differs"
    return len(tmpl)


def all_ranks(layout: str) -> list[int]:
    return list(range(L.LAYOUTS[layout][0]))


def save_one_process(b: Backend, name: str, layout: str = "rows2", **kw: Any) -> None:
    """One process saves a whole layout (one data file unless ``thread_count`` says more)."""
    sd = {"common": COMMON, **layout_state(layout, all_ranks(layout))}
    kw.setdefault("thread_count", 1)
    db.save(sd, b.url(name), storage_options=b.storage_options, **kw)


def load_one_process(b: Backend, name: str, layout: str = "cols4", **kw: Any) -> int:
    tmpl = layout_state(layout, all_ranks(layout), fill=False)
    out = db.load(tmpl, b.url(name), storage_options=b.storage_options, **kw)
    assert out["common"] == COMMON
    return check_loaded(out, tmpl)


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize(("src", "dst"), [("rows2", "cols4"), ("interleaved2", "grid4")])
def test_round_trip_with_resharding_in_one_process(backend, src, dst):
    save_one_process(backend, "ck", src, thread_count=2)
    assert load_one_process(backend, "ck", dst) == len(L.TENSORS) * 4
    meta = db.load_tensors_metadata(backend.url("ck"), storage_options=backend.storage_options)
    assert {k: v.global_shape for k, v in meta.items()} == {
        k: shape for k, (shape, _) in L.TENSORS.items()
    }
    common = db.load_common_state_dict(backend.url("ck"), storage_options=backend.storage_options)
    assert common == {"common": COMMON}


def save_ranks(r: Rank, url: str, options: dict[str, Any], layout: str, threads: int) -> None:
    sd = {"common": COMMON, **layout_state(layout, [r.rank])}
    db.save(sd, url, process_group=r.group, storage_options=options, thread_count=threads)


def load_ranks(r: Rank, url: str, options: dict[str, Any], layout: str) -> int:
    tmpl = layout_state(layout, [r.rank], fill=False)
    out = db.load(tmpl, url, process_group=r.group, storage_options=options)
    assert out["common"] == COMMON
    return check_loaded(out, tmpl)


@pytest.mark.parametrize("backend_name", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_round_trip_with_resharding_across_processes(request, pool, backend_name):
    """2 ranks save (two files each), 4 ranks load another layout, then one plain process.

    memory:// is private to each process, so only shared storage takes part.
    """
    b = _shared_backend(request, backend_name)
    url = b.url("ck")
    pool.run(save_ranks, 2, url, b.storage_options, "rows2", 2)
    assert len(b.data_names("ck")) == 4
    counts = pool.run(load_ranks, 4, url, b.storage_options, "cols4")
    assert sum(counts) == len(L.TENSORS) * 4
    assert load_one_process(b, "ck", "whole1") == len(L.TENSORS)


def _shared_backend(request: pytest.FixtureRequest, name: str) -> Backend:
    from tests.support.backends import local_backend, s3_backend

    if name == "local":
        return local_backend(request.getfixturevalue("tmp_path"))
    return s3_backend(request.getfixturevalue("s3_server"))


# -- the commit protocol ------------------------------------------------------------------------


class SimulatedCrash(BaseException):
    """The process dies (like SystemExit): no failure handling runs, so nothing is cleaned up."""


def save_crashing_before_commit(b: Backend, name: str, **kw: Any) -> None:
    """A save that writes all its data, then dies before writing the commit object."""

    def finish(self, metadata, results):
        raise SimulatedCrash("killed before commit")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FsspecCheckpointWriter, "finish", finish)
        mp.setattr(FsspecCheckpointWriter, "abort", lambda self: None)  # nor cleans up
        with pytest.raises(SimulatedCrash):
            save_one_process(b, name, **kw)
    writer_mod._UNFINISHED.clear()  # what the dead process knew of its save died with it


def test_data_without_commit_object_is_an_incomplete_checkpoint(backend):
    save_crashing_before_commit(backend, "ck", thread_count=2)
    assert len(backend.data_names("ck")) == 2
    assert "dcpbridge.json" not in backend.names("ck")
    with pytest.raises(db.IncompleteCheckpointError, match="incomplete checkpoint") as info:
        load_one_process(backend, "ck")
    assert backend.data_names("ck")[0] in str(info.value)
    with pytest.raises(db.IncompleteCheckpointError):
        db.load_tensors_metadata(backend.url("ck"), storage_options=backend.storage_options)


def test_missing_commit_object_after_a_complete_save(backend):
    save_one_process(backend, "ck")
    backend.delete("ck", "dcpbridge.json")
    with pytest.raises(db.IncompleteCheckpointError, match="incomplete checkpoint"):
        load_one_process(backend, "ck")


def test_not_a_checkpoint(backend):
    with pytest.raises(db.NotACheckpointError, match="no such checkpoint directory"):
        load_one_process(backend, "nowhere")
    backend.write("other", "notes.txt", b"not a checkpoint")
    with pytest.raises(db.NotACheckpointError, match=r"dcpbridge\.json is missing"):
        load_one_process(backend, "other")


def save_with_failing_rank(r: Rank, url: str, options: dict[str, Any]) -> str:
    """Rank 1's object cannot be pickled: every rank fails while planning, nothing is written."""
    sd = layout_state("rows2", [r.rank])
    if r.rank == 1:
        sd["bad"] = db.ShardedObject("bad", lambda: 0, (1,), (0,))
    with pytest.raises(Exception, match="bad") as info:
        db.save(sd, url, process_group=r.group, storage_options=options, thread_count=1)
    return str(info.value)


@pytest.mark.parametrize("backend_name", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_failing_rank_leaves_old_checkpoint_loadable(request, pool, backend_name):
    b = _shared_backend(request, backend_name)
    url = b.url("ck")
    pool.run(save_ranks, 2, url, b.storage_options, "rows2", 1)
    before = b.names("ck")
    errors = pool.run(save_with_failing_rank, 2, url, b.storage_options)
    assert errors[0] == errors[1] and "rank 1" in errors[0]
    assert b.names("ck") == before  # refused while planning: nothing written
    if b.s3 is not None:  # no pending upload either
        assert b.s3.multipart_uploads(b.bucket) == []
    assert sum(pool.run(load_ranks, 2, url, b.storage_options, "cols2")) == 2 * len(L.TENSORS)
    pool.run(save_ranks, 2, url, b.storage_options, "rows2", 1)
    after = b.names("ck")
    assert len(after) == len(before) and set(after).isdisjoint(set(before) - {"dcpbridge.json"})


def test_failed_resaves_keep_the_previous_checkpoint(backend):
    save_one_process(backend, "ck")
    first = backend.names("ck")
    # 1) all data of a new save written, crash before the commit: the old one still loads
    save_crashing_before_commit(backend, "ck", thread_count=2)
    assert len(backend.data_names("ck")) == 3
    assert load_one_process(backend, "ck") == len(L.TENSORS) * 4
    crashed = set(backend.data_names("ck")) - set(first)
    # 2) a save that fails while writing: same, and it removes what it wrote
    bad = {**layout_state("rows2", [0, 1]), "x": db.ShardedObject("x", lambda: 0, (1,), (0,))}
    with pytest.raises(db.SerializationError, match="'x/shard_0_1'"):
        db.save(bad, backend.url("ck"), storage_options=backend.storage_options)
    assert set(backend.data_names("ck")) == {n for n in first if n.endswith(".bin")} | crashed
    assert load_one_process(backend, "ck") == len(L.TENSORS) * 4
    # 3) a successful save replaces it and removes the files of the checkpoint it replaced;
    # the crashed save's files are not known to be dead (a save may still be writing them)
    save_one_process(backend, "ck")
    after = backend.names("ck")
    assert len(after) == len(first) + len(crashed) == 4
    assert set(after) & set(first) == {"dcpbridge.json"} and crashed < set(after)
    assert load_one_process(backend, "ck") == len(L.TENSORS) * 4


def test_stale_files_are_removed_after_commit(backend):
    save_one_process(backend, "ck", thread_count=3)
    assert len(backend.data_names("ck")) == 3
    stale_temp = "dcpbridge.json.tmp-0123456789abcdef"
    backend.write("ck", stale_temp, b"{}")
    backend.write("ck", "user-notes.txt", b"kept")
    save_one_process(backend, "ck", thread_count=1)
    assert len(backend.data_names("ck")) == 1
    assert set(backend.names("ck")) == {
        "dcpbridge.json",
        "user-notes.txt",
        *backend.data_names("ck"),
    }
    assert load_one_process(backend, "ck") == len(L.TENSORS) * 4


@pytest.mark.parametrize(("name", "other"), [("ck?", "ckA"), ("ck*", "ckAB"), ("ck[1]", "ck1")])
def test_cleanup_in_a_root_with_glob_characters_touches_only_that_root(backend, name, other):
    """Removing the replaced checkpoint's files must take the root literally, never as a
    pattern: a copy of the checkpoint in a folder the pattern matches keeps its files."""
    save_one_process(backend, name)
    first = backend.data_names(name)
    for f in backend.names(name):
        backend.write(other, f, backend.read(name, f))
    save_one_process(backend, name)  # replaces the first save and removes its files
    assert backend.names(other) == sorted(["dcpbridge.json", *first])
    assert load_one_process(backend, other) == len(L.TENSORS) * 4
    assert len(backend.data_names(name)) == 1 and backend.data_names(name) != first
    assert load_one_process(backend, name) == len(L.TENSORS) * 4


def test_listing_a_spread_checkpoint_leaves_out_a_nested_checkpoints_folders(backend):
    """Only the root's own spread folders (root/pXX) hold its files: a checkpoint nested in
    it (root/ema/pXX) is not listed, so stale-file cleanup never deletes its data."""
    fs, root = backend.fs(), backend.path("ck")
    own, nested = "__0_0.aaaaaaaaaaaaaaaa.bin", "__0_0.bbbbbbbbbbbbbbbb.bin"
    for path in (f"{root}/p0/{own}", f"{root}/ema/p1/{nested}", f"{root}/ema/dcpbridge.json"):
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(path, b"x")
    fs.invalidate_cache()
    store = storage_for(resolve(backend.url("ck"), backend.storage_options))
    assert sorted(store.list_names()) == [own, "ema"]
    assert store.file_sizes() == {own: 1}
    remove_stale_files(store, save_id="")
    fs.invalidate_cache()
    assert fs.cat_file(f"{root}/ema/p1/{nested}") == b"x"
    assert not fs.exists(f"{root}/p0/{own}")


# -- bytes on the wire --------------------------------------------------------------------------

ROWS, COLS = 64, 8192  # two chunks of 32 rows x 32 KiB (1 MiB each)


def _save_two_chunks(b: Backend, name: str) -> torch.Tensor:
    full = torch.randn(ROWS, COLS)
    sd = {
        f"p{i}": db.ShardedTensor.from_rank_offsets("w", full.chunk(2)[i].clone(), (0, i, 2))
        for i in range(2)
    }
    db.save(sd, b.url(name), storage_options=b.storage_options)
    return full


@pytest.mark.parametrize("verify", [False, True])
def test_ranged_reads_fetch_only_the_needed_bytes(request, backend, verify):
    full = _save_two_chunks(backend, "ck")
    proxy = None
    options = backend.storage_options
    if backend.s3 is not None:  # count what actually crosses the wire
        proxy = request.getfixturevalue("s3_proxy")
        options = backend.s3.storage_options(endpoint_url=proxy.endpoint_url)

    def read(rows: slice, cols: slice) -> int:
        piece = full[rows, cols]
        offset = (rows.start, cols.start)
        req = {"w": db.ShardedTensor.from_box("w", torch.zeros_like(piece), full.shape, offset)}
        reader = FsspecCheckpointReader(
            backend.url("ck"), storage_options=options, verify_checksums=verify
        )
        if proxy is not None:
            proxy.reset_counters()
        dcp.load(req, storage_reader=reader, planner=ShardedLoadPlanner())
        assert torch.equal(req["w"].data, piece)
        if proxy is not None:
            body = proxy.bytes_to_clients - reader.bytes_read - _metadata_size(backend)
            assert 0 < body < 4096 * len(proxy.requests), (proxy.requests, body)
        return reader.bytes_read

    rows = read(slice(40, 48), slice(0, COLS))  # 8 rows of chunk 1: one contiguous range
    assert rows == (1 << 20 if verify else 8 * COLS * 4)  # checksums cover whole 1 MiB blocks
    cols = read(slice(0, ROWS), slice(2048, 4096))  # a quarter of every row
    assert 2 * 1024 * 4 * ROWS <= cols <= ROWS * COLS * 4


def _metadata_size(b: Backend) -> int:
    return len(b.read("ck", "dcpbridge.json"))


# -- big files, hostile keys --------------------------------------------------------------------


def test_large_file_integrity_and_multipart_parts(request, backend):
    """A 23 MiB tensor with 5 MiB parts: 5 parts, at most 3 in flight; small files: one PUT."""
    b = backend
    if b.s3 is not None:
        from tests.support.backends import s3_backend

        b = s3_backend(b.s3, default_block_size=5 << 20, max_concurrency=3)
    big = torch.randn(23 << 18)  # 23 MiB
    sd = {
        "big": db.ShardedTensor.from_box("big", big, tuple(big.shape), (0,)),
        "small": db.ShardedTensor.from_box("small", torch.arange(5.0), (5,), (0,)),
    }
    db.save(sd, b.url("ck"), storage_options=b.storage_options, thread_count=2)
    out = db.load(
        {
            "big": db.ShardedTensor.from_box("big", torch.zeros_like(big), tuple(big.shape), (0,)),
            "small": db.ShardedTensor.from_box("small", torch.zeros(5), (5,), (0,)),
        },
        b.url("ck"),
        storage_options=b.storage_options,
    )
    assert torch.equal(out["big"], big) and torch.equal(out["small"], torch.arange(5.0))
    if b.s3 is not None:
        listing = b.s3.client().list_objects_v2(Bucket=b.bucket, Prefix="area/ck/")["Contents"]
        objects = sorted((o["Size"], o["ETag"].strip('"')) for o in listing)
        assert objects[-1][0] >= 23 << 20 and objects[-1][1].endswith("-5")  # ceil(23 / 5) parts
        assert all("-" not in etag for _, etag in objects[:-1]), objects  # one PUT each
        assert b.s3.multipart_uploads(b.bucket) == []


HOSTILE = ["../../escape", "/etc/passwd", "s3://other-bucket/x", "a/../../b", "..", "~/x"]


def test_hostile_keys_never_leave_the_checkpoint(backend):
    sd = {
        f"t{i}": db.ShardedTensor.from_box(k, torch.full((3,), float(i)), (3,), (0,))
        for i, k in enumerate(HOSTILE)
    }
    sd.update({f"o{i}": db.ShardedObject(k, {"i": i}, (1,), (0,)) for i, k in enumerate(HOSTILE)})
    db.save(sd, backend.url("ck"), storage_options=backend.storage_options, thread_count=1)
    prefix = backend.path("ck") + "/"
    everything = backend.everything()
    assert len(everything) == 2 and all(p.startswith(prefix) for p in everything), everything
    if backend.s3 is not None:
        assert "other-bucket" not in backend.s3.buckets()
    tmpl = {
        f"t{i}": db.ShardedTensor.from_box(k, torch.zeros(3), (3,), (0,))
        for i, k in enumerate(HOSTILE)
    }
    tmpl.update({f"o{i}": db.ShardedObject(k, None, (1,), (0,)) for i, k in enumerate(HOSTILE)})
    out = db.load(tmpl, backend.url("ck"), storage_options=backend.storage_options)
    for i in range(len(HOSTILE)):
        assert torch.equal(out[f"t{i}"], torch.full((3,), float(i))) and out[f"o{i}"] == {"i": i}


def test_corrupted_or_truncated_object_is_detected(backend):
    save_one_process(backend, "ck")
    doc = json.loads(backend.read("ck", "dcpbridge.json"))
    file = doc["tensors"]["w"]["chunks"][0]["file"]
    data = bytearray(backend.read("ck", file))
    data[doc["tensors"]["w"]["chunks"][0]["offset"] + 5] ^= 0x01
    backend.write("ck", file, bytes(data))
    with pytest.raises(db.ChecksumMismatchError, match=file):
        load_one_process(backend, "ck")
    for keep in (len(data) - 7, len(data) // 2):  # a range cut short; ranges past the end
        backend.write("ck", file, bytes(data[:keep]))
        with pytest.raises(
            db.CorruptCheckpointError,
            match=rf"{file}, which has only {keep} bytes \(a truncated file",
        ):
            load_one_process(backend, "ck", verify_checksums=False)


def test_async_save_then_resave(backend):
    """async_save commits from its background thread; a later save of the same structure
    replaces it and removes the old files."""
    sd = {"common": COMMON, **layout_state("rows2", [0, 1])}
    handle = db.async_save(
        sd, backend.url("ck"), storage_options=backend.storage_options, thread_count=2
    )
    handle.result()
    first = backend.names("ck")
    assert len(first) == 3 and load_one_process(backend, "ck") == len(L.TENSORS) * 4
    save_one_process(backend, "ck")
    after = backend.names("ck")
    assert len(after) == 2 and set(after) & set(first) == {"dcpbridge.json"}
    assert load_one_process(backend, "ck") == len(L.TENSORS) * 4


def test_scatter_reads_fill_their_parts_and_skip_the_gaps(backend):
    """One request serves several buffers of a file in order; the bytes between are dropped."""
    data = os.urandom(300_000)
    fs = backend.fs()
    fs.makedirs(backend.path("ck"), exist_ok=True)
    path = backend.path("ck", "blob")
    fs.pipe_file(path, data)
    store = storage_for(resolve(backend.url("ck"), backend.storage_options))
    a, b, c, d = bytearray(1000), bytearray(70_000), bytearray(5), bytearray(3)
    done: list[str] = []
    parts = [memoryview(a), 5000, memoryview(b), 200_000, memoryview(c)]
    store.fetch(
        [
            ScatterRead(path, 10, parts, lambda: done.append("scatter")),
            RangeRead(path, 299_997, memoryview(d), lambda: done.append("range")),
        ],
        threads=2,
    )
    assert sorted(done) == ["range", "scatter"]
    assert a == data[10:1010] and b == data[6010:76_010] and c == data[276_010:276_015]
    assert d == data[-3:]
    with pytest.raises(db.StorageError, match="short read"):
        store.fetch([ScatterRead(path, 299_000, [memoryview(bytearray(500)), 600])], threads=1)


def test_local_reads_run_on_kept_threads_and_a_failure_waits_for_the_others(tmp_path):
    """Threaded local reads run on reader threads kept between fetches (none started per
    fetch), and a failed read is raised only once the fetch's other reads have ended."""
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(4 << 20))  # enough work to pay for 2 threads (see fetch)
    store = storage_for(resolve(str(tmp_path)))
    threads: list[threading.Thread] = []

    def seen(delay: float = 0.0) -> None:
        time.sleep(delay)
        threads.append(threading.current_thread())

    def reads(tail: int) -> list[RangeRead]:  # two batches: the first 3 MiB, then a tail
        return [
            RangeRead(str(path), 0, memoryview(bytearray(3 << 20)), lambda: seen(0.2)),
            RangeRead(str(path), 3 << 20, memoryview(bytearray((1 << 20) + tail)), seen),
        ]

    with pytest.raises(db.StorageError, match="short read"):
        store.fetch(reads(200), threads=2)  # the tail runs past the end of the file
    assert len(threads) == 1  # the slow read had ended
    before = set(threading.enumerate())
    for _ in range(2):
        store.fetch(reads(-96), threads=2)
    assert len(threads) == 5 and all(t in before for t in threads[1:])
    assert all(t.name.startswith("dcpb-read") for t in threads)


def test_local_fetches_start_threads_only_for_work_that_pays_for_them(tmp_path):
    """A few small reads (a small checkpoint's) run on the calling thread; many reads are
    shared between threads, each read done once, into its own buffer."""
    data = os.urandom(1 << 16)
    path = str(tmp_path / "blob")
    with open(path, "wb") as f:
        f.write(data)
    store = storage_for(resolve(str(tmp_path)))

    def fetch(count: int, size: int) -> set[str]:
        threads: list[str] = []
        bufs = [bytearray(size) for _ in range(count)]
        reads = [
            RangeRead(path, i * size, memoryview(b), lambda: threads.append(current_thread().name))
            for i, b in enumerate(bufs)
        ]
        store.fetch(reads, threads=4)
        assert len(threads) == count
        assert all(b == data[i * size : (i + 1) * size] for i, b in enumerate(bufs))
        return set(threads)

    assert fetch(3, 100) == {current_thread().name}
    assert all(name.startswith("dcpb-read") for name in fetch(256, 256))


class _ClientError(Exception):
    """An error of a storage client library other than botocore's (gcsfs's ``HttpError``)."""


_ClientError.__module__ = "gcsfs.retry"


def test_a_storage_client_s_own_errors_are_storage_errors_naming_the_url():
    """Rule 2: a client library's error (gcsfs, Azure, ...) out of the filesystem reached the
    caller as itself; it is a StorageError naming the URL, the original its cause, and the
    folder holds no commit."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class Flaky(MemoryFileSystem):
        protocol = "flakyclient"
        store: dict = {}  # its own, not the memory:// store
        pseudo_dirs = [""]

        def _open(self, path, mode="rb", **kwargs):
            if "w" in mode and path.endswith(".bin"):
                raise _ClientError("503 backend unavailable")
            return super()._open(path, mode, **kwargs)

    fsspec.register_implementation("flakyclient", Flaky, clobber=True)
    url = "flakyclient://bucket/ck"
    with pytest.raises(db.StorageError, match="flakyclient://bucket/ck") as raised:
        db.save({"w": torch.ones(3)}, url)
    assert isinstance(raised.value.__cause__, _ClientError)
    assert not [p for p in Flaky.store if p.endswith("dcpbridge.json")]


class _FilesystemBug(RuntimeError):
    """What a custom filesystem raises that is neither an OSError nor a known client's."""


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_any_exception_of_a_custom_filesystem_is_a_storage_error_naming_the_url(tmp_path, kind):
    """Rule 2: a custom fsspec filesystem's own exception (a ``RuntimeError`` out of its
    ``open``, its ``ls``) reached the caller of a save or load as itself, naming no URL. It is
    a StorageError naming the URL now, the original its ``__cause__``."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem
    from fsspec.implementations.memory import MemoryFileSystem

    failing = {"on": ""}  # "w": opening data files to write fails, "later": their writes
    # fail, "r": every read fails

    def check(path: str, mode: str) -> None:
        if failing["on"] == "w" and "w" in mode and path.endswith(".bin"):
            raise _FilesystemBug("cannot write today")
        if failing["on"] == "r" and "r" in mode:
            raise _FilesystemBug("cannot read today")

    def write_fails(data: object) -> None:
        raise _FilesystemBug("cannot write today")

    class CustomMemory(MemoryFileSystem):
        protocol = "custommemfs"
        store: dict = {}  # its own, not the memory:// store
        pseudo_dirs = [""]

        def _open(self, path, mode="rb", **kwargs):
            check(path, mode)
            f = super()._open(path, mode, **kwargs)
            if failing["on"] == "later" and "w" in mode and path.endswith(".bin"):
                f.write = write_fails  # the open succeeds, its writes fail
            return f

        def cat_file(self, path, start=None, end=None, **kwargs):  # reads skip ``_open``
            check(path, "rb")
            return super().cat_file(path, start, end, **kwargs)

    class CustomLocal(LocalFileSystem):
        protocol = "customlocalfs"

        def ls(self, path, detail=False, **kwargs):
            check(f"{path}/.bin", failing["on"])  # a listing fails whenever anything fails
            return super().ls(path, detail=detail, **kwargs)

    custom = CustomMemory if kind == "memory" else CustomLocal
    fsspec.register_implementation(custom.protocol, custom, clobber=True)
    url = f"{custom.protocol}://{tmp_path}/ck" if kind == "local" else "custommemfs://bucket/ck"
    for how in ("w", "later") if kind == "memory" else ("w",):
        failing["on"] = how
        with pytest.raises(db.StorageError, match=re.escape(url)) as raised:
            db.save({"w": torch.arange(3.0)}, url)
        assert isinstance(raised.value.__cause__, _FilesystemBug), raised.value
        assert "cannot write today" in str(raised.value)
    failing["on"] = ""
    db.save({"w": torch.arange(3.0)}, url)
    failing["on"] = "r"
    with pytest.raises(db.StorageError, match=re.escape(url)) as raised:
        db.load({"w": torch.zeros(3)}, url)
    assert isinstance(raised.value.__cause__, _FilesystemBug), raised.value
    assert "cannot read today" in str(raised.value)
    failing["on"] = ""
    assert torch.equal(db.load({"w": torch.zeros(3)}, url)["w"], torch.arange(3.0))


def test_a_custom_filesystem_behind_an_fsspec_wrapper_raises_storage_errors_too():
    """Rule 2: a custom filesystem reached through fsspec's ``DirFileSystem`` (``dir::``
    URLs; the caching filesystems wrap alike) counted as fsspec's own, so its exceptions
    reached the caller of a save or load as themselves. What a wrapper wraps decides now."""
    import fsspec
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem
    from fsspec.implementations.memory import MemoryFileSystem

    from dcpbridge.storage.errors import foreign_filesystem

    failing = {"on": ""}

    class Wrapped(MemoryFileSystem):
        protocol = "wrappedmemfs"
        store: dict = {}  # its own, not the memory:// store
        pseudo_dirs = [""]

        def _open(self, path, mode="rb", **kwargs):
            if failing["on"] == "w" and "w" in mode and path.endswith(".bin"):
                raise _FilesystemBug("cannot write today")
            return super()._open(path, mode, **kwargs)

        def cat_file(self, path, start=None, end=None, **kwargs):
            if failing["on"] == "r":
                raise _FilesystemBug("cannot read today")
            return super().cat_file(path, start, end, **kwargs)

    assert foreign_filesystem(DirFileSystem(path="/base", fs=Wrapped()))
    assert not foreign_filesystem(DirFileSystem(path="/base", fs=LocalFileSystem()))
    fsspec.register_implementation(Wrapped.protocol, Wrapped, clobber=True)
    url, options = "dir::wrappedmemfs://bucket", {"dir": {"path": "/base"}}
    db.save({"w": torch.arange(3.0)}, f"{url}/ck", storage_options=options)
    failing["on"] = "w"
    with pytest.raises(db.StorageError, match=re.escape(f"{url}/other")) as raised:
        db.save({"w": torch.arange(3.0)}, f"{url}/other", storage_options=options)
    assert isinstance(raised.value.__cause__, _FilesystemBug), raised.value
    failing["on"] = "r"
    with pytest.raises(db.StorageError, match=re.escape(f"{url}/ck")) as raised:
        db.load({"w": torch.zeros(3)}, f"{url}/ck", storage_options=options)
    assert isinstance(raised.value.__cause__, _FilesystemBug), raised.value
    failing["on"] = ""
    got = db.load({"w": torch.zeros(3)}, f"{url}/ck", storage_options=options)["w"]
    assert torch.equal(got, torch.arange(3.0))
