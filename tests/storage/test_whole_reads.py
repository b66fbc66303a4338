"""Whole-chunk reads planned as columns (``dcpbridge.storage.read.whole_reads``): taken when the
planner and reader are dcpbridge's own under its driver, items otherwise; bit-exact either way,
with every fallback and error as before."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpbridge as db
from dcpbridge.planners import ShardedLoadPlanner
from dcpbridge.planners.load_planner import plan_local_reads
from dcpbridge.planners.walk import iter_leaves
from dcpbridge.storage import FsspecCheckpointReader, StoredItem
from dcpbridge.storage.backends.store import LocalStorage
from dcpbridge.storage.read.whole_reads import WholeReads, whole_jobs

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _saved(path: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(3, 5, generator=g) for i in range(6)}
    state["half"] = torch.randn(4, 2, generator=g).to(torch.bfloat16)
    state["rows"] = torch.randn(4, 6, generator=g)
    sharded = {k: db.ShardedTensor.from_box(k, v, tuple(v.shape), (0, 0)) for k, v in state.items()}
    sharded["rows"] = db.ShardedTensor.from_box("rows", state["rows"][:2], (4, 6), (0, 0))
    sharded["rows2"] = db.ShardedTensor.from_box("rows", state["rows"][2:], (4, 6), (2, 0))
    sharded["obj"] = db.ShardedObject("obj", {"a": 1}, (1,), (0,))
    db.save(sharded, path)
    return state


def _box(key: str, data: torch.Tensor, shape: tuple[int, ...], offset: tuple[int, ...]):
    return db.ShardedTensor.from_box(key, data, shape, offset)


def test_whole_chunks_become_columns_and_everything_else_read_items(tmp_path):
    state = _saved(str(tmp_path))
    meta = FsspecCheckpointReader(str(tmp_path)).read_metadata()
    buffer = torch.zeros(5, 3)
    template = {
        "t0": _box("t0", torch.zeros(3, 5), (3, 5), (0, 0)),  # a stored chunk: a column
        "t1": _box("t1", torch.nn.Parameter(torch.zeros(3, 5)), (3, 5), (0, 0)),  # column
        "t2": _box("t2", buffer.t(), (3, 5), (0, 0)),  # not contiguous: items
        "half": _box("half", torch.zeros(4, 2), (4, 2), (0, 0)),  # cast: items
        "rows": _box("rows", torch.zeros(4, 6), (4, 6), (0, 0)),  # two chunks: items
        "rows-part": _box("rows", torch.zeros(2, 6), (4, 6), (2, 0)),  # a chunk: column
        "obj": db.ShardedObject("obj", None, (1,), (0,)),  # objects: items
    }
    out = plan_local_reads(iter_leaves(template), meta, allow_dtype_cast=True, whole_columns=True)
    assert out.whole is not None
    assert out.whole.keys == [("t0", (0, 0)), ("t1", (0, 0)), ("rows", (2, 0))]
    planned = sorted((i.storage_index.fqn, tuple(i.storage_offsets)) for i in out.items)
    assert planned == [
        ("half", (0, 0)),
        ("obj/shard_0_1", (0,)),
        ("rows", (0, 0)),
        ("rows", (0, 0)),
        ("t2", (0, 0)),
    ]
    assert plan_local_reads(iter_leaves(template), meta, allow_dtype_cast=True).whole is None

    loaded = db.load(template, str(tmp_path), allow_dtype_cast=True)
    for key in ("t0", "t1", "t2"):
        assert torch.equal(loaded[key].detach(), state[key]), key
    assert torch.equal(buffer, state["t2"].t())
    assert torch.equal(loaded["half"], state["half"].float())
    assert torch.equal(loaded["rows"], state["rows"])
    assert torch.equal(loaded["rows-part"], state["rows"][2:])
    assert loaded["obj"] == {"a": 1}


def test_one_box_requested_twice_is_read_once_and_copied(tmp_path):
    state = _saved(str(tmp_path))
    meta = FsspecCheckpointReader(str(tmp_path)).read_metadata()
    a, b, c = torch.zeros(3, 5), torch.zeros(3, 5), torch.zeros(5, 3)
    template = {
        "a": _box("t3", a, (3, 5), (0, 0)),
        "b": _box("t3", b, (3, 5), (0, 0)),
        "c": _box("t3", c.t(), (3, 5), (0, 0)),  # not plain: copied all the same
    }
    out = plan_local_reads(iter_leaves(template), meta, whole_columns=True)
    assert out.whole is not None and out.whole.keys == [("t3", (0, 0))] and not out.items
    assert [len(v) for v in out.whole.copies.values()] == [2]
    db.load(template, str(tmp_path))
    assert torch.equal(a, state["t3"]) and torch.equal(b, state["t3"])
    assert torch.equal(c.t(), state["t3"])
    bad = {"a": _box("t3", torch.zeros(3, 5), (3, 5), (0, 0))}
    bad["b"] = _box("t3", torch.zeros(3, 4), (3, 5), (0, 0))
    with pytest.raises(db.ShapeMismatchError, match="'t3'"):
        db.load(bad, str(tmp_path))


def test_plain_dcp_load_gets_read_items_from_our_planner(tmp_path):
    state = _saved(str(tmp_path))
    out = {k: torch.zeros_like(v) for k, v in state.items() if k.startswith("t")}
    planner = ShardedLoadPlanner()
    dcp.load(
        out, storage_reader=FsspecCheckpointReader(str(tmp_path)), planner=planner, no_dist=True
    )
    assert planner.whole_reads is None
    assert all(torch.equal(out[k], state[k]) for k in out)


def test_load_log_counts_the_bytes_read_as_columns(tmp_path, caplog):
    state = _saved(str(tmp_path))
    template = {k: _box(k, torch.zeros_like(v), tuple(v.shape), (0, 0)) for k, v in state.items()}
    with caplog.at_level(logging.INFO, logger="dcpbridge"):
        db.load(template, str(tmp_path))
    (record,) = [r for r in caplog.records if getattr(r, "dcpbridge", {}).get("event") == "loaded"]
    assert record.dcpbridge["bytes"] == sum(v.nbytes for v in state.values())


def test_a_flipped_byte_fails_the_column_read_naming_the_chunk(tmp_path):
    state = _saved(str(tmp_path))
    reader = FsspecCheckpointReader(str(tmp_path))
    item = reader.read_metadata().storage_data.items[("t4", (0, 0))]
    with open(os.path.join(str(tmp_path), item.file), "r+b") as f:
        f.seek(item.offset + 7)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    template = {k: _box(k, torch.zeros_like(v), tuple(v.shape), (0, 0)) for k, v in state.items()}
    with pytest.raises(db.ChecksumMismatchError, match=rf"'t4' chunk \[0, 0\] in {item.file}"):
        db.load(template, str(tmp_path))


def test_stored_items_that_disagree_with_the_columns_are_refused_by_name():
    target = torch.zeros(3, 5)
    reads = WholeReads([("w", (0, 0))], [target])
    with pytest.raises(db.CorruptCheckpointError, match=r"'w' chunk \[0, 0\]"):
        whole_jobs(reads, [None], block=0, tiled=True, url="ckpt")
    for stored in (
        StoredItem("f.bin", 0, 60, 0, None, (5, 3), torch.float32),  # another shape
        StoredItem("f.bin", 0, 60, 0, None, (3, 5), torch.int32),  # another dtype
        StoredItem("f.bin", 0, 64, 0, None, (3, 5), torch.float32),  # another byte count
        StoredItem("f.bin", 0, 60, 0),  # an object
    ):
        with pytest.raises(db.CorruptCheckpointError, match=r"'w' chunk \[0, 0\] in f\.bin"):
            whole_jobs(reads, [stored], block=0, tiled=True, url="ckpt")
    (job,) = whole_jobs(
        reads,
        [StoredItem("f.bin", 0, 60, 0, None, (3, 5), torch.float32)],
        block=0,
        tiled=True,
        url="ckpt",
    )
    assert job.dest is target and job.grid is None


def test_staged_small_reads_refuse_targets_that_are_not_the_stored_chunk(tmp_path):
    """The staged path copies raw bytes into its targets: one of another shape, dtype or
    layout (here a strided view of exactly the chunk's byte count) is refused by name."""
    state = _saved(str(tmp_path))
    reader = FsspecCheckpointReader(str(tmp_path))
    reader.set_up_storage_reader(reader.read_metadata(), True)
    wrong = (
        torch.zeros(5, 3),
        torch.zeros(15),
        torch.zeros(3, 5, dtype=torch.int32),
        torch.zeros(3, 6)[:, :5],
    )
    for target in wrong:
        with pytest.raises(db.CorruptCheckpointError, match=r"'t2' chunk \[0, 0\] in .*\.bin"):
            reader.read_whole(WholeReads([("t2", (0, 0))], [target]))
        assert not target.any()
    good = torch.zeros(3, 5)
    reader.read_whole(WholeReads([("t1", (0, 0)), ("t2", (0, 0))], [torch.zeros(3, 5), good]))
    assert torch.equal(good, state["t2"])


def test_add_records_only_the_stored_chunk_and_the_reader_reads_by_its_rows(tmp_path):
    """``WholeReads.add`` checks a target against the decoded chunk (dtype, sizes, plain CPU
    memory) and keeps its row and address; the reader then reads those entries without a
    lookup, and entries of another table (or none) are looked up and checked as before."""
    state = _saved(str(tmp_path))
    reader = FsspecCheckpointReader(str(tmp_path))
    meta = reader.read_metadata()
    reader.set_up_storage_reader(meta, True)
    chunks = meta.state_dict_metadata["t2"].chunks
    reads = WholeReads()
    wrong = (
        torch.zeros(5, 3),
        torch.zeros(15),
        torch.zeros(3, 5, dtype=torch.int32),
        torch.zeros(3, 6)[:, :5],
        torch.zeros(3, 5, device="meta"),
    )
    for target in wrong:
        assert not reads.add(("t2", (0, 0)), target, chunks)
    assert not reads.add(("t2", (1, 0)), torch.zeros(3, 5), chunks)  # no chunk at (1, 0)
    assert not reads.add(("t3", (0, 0)), torch.zeros(3, 5), chunks)  # t2's chunks, not t3's
    assert reads.keys == [] and reads.targets == []
    good = [torch.zeros(3, 5) for _ in range(3)]
    for i, target in enumerate(good):
        assert reads.add((f"t{i}", (0, 0)), target, meta.state_dict_metadata[f"t{i}"].chunks)
    table = meta.storage_data.items
    assert reads.checked(table) == ([0, 1, 2], [t.data_ptr() for t in good])
    assert reads.without([1]).checked(table) == ([0, 2], [good[0].data_ptr(), good[2].data_ptr()])
    assert WholeReads(list(reads.keys), list(reads.targets)).checked(table) is None  # not added
    reader.read_whole(reads)
    assert all(torch.equal(good[i], state[f"t{i}"]) for i in range(3))


def test_large_chunks_are_read_in_verified_slabs_and_a_flipped_byte_is_named(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(768, 1024, generator=g), "flat": torch.randn(655360, generator=g)}
    db.save(
        {k: _box(k, v, tuple(v.shape), (0,) * v.dim()) for k, v in state.items()}, str(tmp_path)
    )
    sizes: list[int] = []
    original = LocalStorage.fetch

    def spy(self, reads, threads):
        sizes.extend(sum(len(p) for p in r.parts if not isinstance(p, int)) for r in reads)
        return original(self, reads, threads)

    monkeypatch.setattr(LocalStorage, "fetch", spy)
    template = {
        k: _box(k, torch.zeros_like(v), tuple(v.shape), (0,) * v.dim()) for k, v in state.items()
    }
    loaded = db.load(template, str(tmp_path))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert sorted(sizes) == [(1 << 20) // 2] + [1 << 20] * 5  # 3 MiB and 2.5 MiB, in slabs

    index = FsspecCheckpointReader(str(tmp_path)).read_metadata().storage_data
    stored = index.items[("big", (0, 0))]
    with open(os.path.join(str(tmp_path), stored.file), "r+b") as f:
        f.seek(stored.offset + (3 << 20) // 2)  # the middle slab
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(db.ChecksumMismatchError, match=r"tensor 'big' chunk \[0, 0\].*block \d+"):
        db.load(template, str(tmp_path))


def test_plain_tensor_requests_the_column_path_refuses_are_planned_or_raise_as_before(tmp_path):
    """Plain tensors the fast column path refuses go through the general planner: a tensor
    that requires grad becomes a column through its detached view, a box of another shape
    read items; a wrong dtype or global shape raises exactly as that planner raises it."""
    state = _saved(str(tmp_path))
    meta = FsspecCheckpointReader(str(tmp_path)).read_metadata()
    grad = torch.zeros(3, 5, requires_grad=True)
    template = {
        "t0": _box("t0", torch.zeros(3, 5), (3, 5), (0, 0)),  # the one column
        "t1": _box("t1", grad, (3, 5), (0, 0)),  # requires grad: its detached view
        "t2": _box("t2", torch.zeros(3, 2), (3, 5), (0, 3)),  # part of a chunk: items
    }
    out = plan_local_reads(iter_leaves(template), meta, whole_columns=True)
    assert out.whole is not None and out.whole.keys == [("t0", (0, 0)), ("t1", (0, 0))]
    view = out.whole.targets[1]
    assert view is not grad and not view.requires_grad and view.data_ptr() == grad.data_ptr()
    assert [i.storage_index.fqn for i in out.items] == ["t2"]
    loaded = db.load(template, str(tmp_path))
    assert torch.equal(loaded["t1"].detach(), state["t1"])
    assert torch.equal(loaded["t2"], state["t2"][:, 3:])
    cases = [
        (torch.float64, (3, 5), db.DTypeMismatchError, "stored as torch.float32, requested as"),
        (torch.float32, (3, 6), db.ShapeMismatchError, "global shape in checkpoint is \\(3, 5\\)"),
    ]
    for dtype, shape, error, message in cases:
        data = torch.zeros(3, 5, dtype=dtype)
        with pytest.raises(error, match=f"'t3': {message}"):
            db.load({"t3": _box("t3", data, shape, (0, 0))}, str(tmp_path))
        assert not data.any()


@pytest.mark.parametrize("order", ["cast_first", "stored_first"])
def test_one_box_asked_in_two_dtypes_gets_the_stored_bytes_in_each(tmp_path, order):
    """A box asked for twice on one rank, once cast: the other copy gets the exact stored
    values, not the cast ones cast back (it was filled from the bf16 copy)."""
    w = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    db.save({"w": _box("w", w, (4, 8), (0, 0))}, str(tmp_path))
    low = _box("w", torch.zeros(2, 8, dtype=torch.bfloat16), (4, 8), (1, 0))
    exact = _box("w", torch.zeros(2, 8), (4, 8), (1, 0))
    pairs = [("low", low), ("exact", exact)]
    template = dict(pairs if order == "cast_first" else pairs[::-1])
    out = db.load(template, str(tmp_path), allow_dtype_cast=True)
    assert torch.equal(out["exact"].view(torch.int32), w[1:3].view(torch.int32))
    assert torch.equal(out["low"].view(torch.int16), w[1:3].bfloat16().view(torch.int16))
