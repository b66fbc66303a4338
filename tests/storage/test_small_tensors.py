"""Many small tensors: the whole-chunk fast paths of load (one lookup per request, whole-item
reads joined into one preadv, one hash per tile) and of save, checked bit for bit."""

from __future__ import annotations

import io
import os

import pytest
import torch

import dcpbridge as db
from dcpbridge.planners.load_planner import plan_local_reads
from dcpbridge.planners.walk import iter_leaves
from dcpbridge.storage import FsspecCheckpointReader
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.format.document import StoredItem
from dcpbridge.storage.format.paths import resolve
from dcpbridge.storage.read.delivery import WholeJob, run_jobs
from dcpbridge.storage.read.read_plan import ReadTuning

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.bool, torch.int64)
SHAPES = ((), (7,), (3, 5), (2, 3, 4), (1, 1))


def _state(count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``count`` small tensors of mixed dtypes and shapes (more than a packed table's threshold)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(count):
        dtype, shape = DTYPES[i % len(DTYPES)], SHAPES[i % len(SHAPES)]
        t = torch.randn(shape, generator=g, dtype=torch.float64) * 100
        out[f"layer{i}.w"] = (t > 0) if dtype == torch.bool else t.to(dtype)
    return out


def _sharded(tensors: dict[str, torch.Tensor]) -> dict[str, db.ShardedTensor]:
    return {
        k: db.ShardedTensor.from_box(k, t, tuple(t.shape), (0,) * t.ndim)
        for k, t in tensors.items()
    }


def _stored(path: str, key: str, ndim: int) -> StoredItem:
    reader = FsspecCheckpointReader(path)
    return reader.read_metadata().storage_data.items[(key, (0,) * ndim)]


def _flip_byte(path: str, item: StoredItem, at: int) -> None:
    with open(os.path.join(path, item.file), "r+b") as f:
        f.seek(item.offset + at)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))


def test_many_small_tensors_of_mixed_dtypes_round_trip_bit_exact(tmp_path):
    state = _state(1500)
    db.save(_sharded(state), str(tmp_path))
    out = {k: torch.empty_like(v) for k, v in state.items()}
    db.load(_sharded(out), str(tmp_path))
    for k, v in state.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k


def test_non_contiguous_and_subclass_destinations_are_filled_bit_exact(tmp_path):
    state = {
        f"m{i}": torch.randn(6, 4, generator=torch.Generator().manual_seed(i)) for i in range(40)
    }
    db.save(_sharded(state), str(tmp_path))
    # transposed views (not contiguous), slices of a bigger buffer, and Parameters
    buffers = {k: torch.zeros(4, 6) for k in list(state)[:10]}
    dests = {k: b.t() for k, b in buffers.items()}
    big = torch.zeros(10, 6, 8)
    dests.update({k: big[i, :, 2:6] for i, k in enumerate(list(state)[10:20])})
    dests.update({k: torch.nn.Parameter(torch.zeros(6, 4)) for k in list(state)[20:]})
    assert not any(dests[k].is_contiguous() for k in list(state)[:20])
    db.load(_sharded(dests), str(tmp_path))
    for k, v in state.items():
        assert torch.equal(dests[k].detach(), v), k
    for i, k in enumerate(list(state)[10:20]):
        assert torch.equal(big[i, :, 2:6], state[k]) and not big[i, :, :2].any()


def test_a_flipped_byte_in_one_small_item_names_it(tmp_path):
    state = _state(1200)
    db.save(_sharded(state), str(tmp_path))
    victim = "layer601.w"
    _flip_byte(str(tmp_path), _stored(str(tmp_path), victim, state[victim].ndim), 0)
    out = {k: torch.empty_like(v) for k, v in state.items()}
    with pytest.raises(db.ChecksumMismatchError) as info:
        db.load(_sharded(out), str(tmp_path))
    assert repr(victim) in str(info.value) and ".bin" in str(info.value)
    out = {k: torch.empty_like(v) for k, v in state.items()}  # without verification it loads
    db.load(_sharded(out), str(tmp_path), verify_checksums=False)
    assert not torch.equal(out[victim], state[victim])
    assert all(torch.equal(out[k], v) for k, v in state.items() if k != victim)


def test_whole_items_of_many_tiles_are_verified_tile_by_tile(tmp_path):
    state = {f"big{i}": torch.randn(512, 2048) for i in range(3)}  # 4 MiB: several tiles each
    db.save(_sharded(state), str(tmp_path))
    out = {k: torch.empty_like(v) for k, v in state.items()}
    db.load(_sharded(out), str(tmp_path))
    assert all(torch.equal(out[k], v) for k, v in state.items())
    item = _stored(str(tmp_path), "big1", 2)
    assert item.checksums is not None and len(item.checksums) > 1
    _flip_byte(str(tmp_path), item, item.nbytes - 1)  # the last tile
    with pytest.raises(db.ChecksumMismatchError, match="'big1'"):
        db.load(_sharded({k: torch.empty_like(v) for k, v in state.items()}), str(tmp_path))


def test_a_truncated_data_file_raises(tmp_path):
    state = _state(1100)
    db.save(_sharded(state), str(tmp_path))
    item = _stored(str(tmp_path), "layer7.w", state["layer7.w"].ndim)
    data = os.path.join(str(tmp_path), item.file)
    os.truncate(data, os.path.getsize(data) - 100)
    with pytest.raises(db.CheckpointError, match=item.file):
        db.load(_sharded({k: torch.empty_like(v) for k, v in state.items()}), str(tmp_path))


def test_a_request_that_is_a_stored_chunk_is_one_whole_read_item(tmp_path):
    halves = torch.arange(40.0).reshape(4, 10)
    top = db.ShardedTensor.from_box("w", halves[:2], (4, 10), (0, 0))
    bottom = db.ShardedTensor.from_box("w", halves[2:], (4, 10), (2, 0))
    db.save({"top": top, "bottom": bottom}, str(tmp_path / "a"))
    meta = FsspecCheckpointReader(str(tmp_path / "a")).read_metadata()
    same = {"w": db.ShardedTensor.from_box("w", torch.zeros(2, 10), (4, 10), (0, 0))}
    (item,) = plan_local_reads(iter_leaves(same), meta).items
    assert item.storage_index == item.dest_index
    assert tuple(item.storage_offsets) == (0, 0) and tuple(item.lengths) == (2, 10)
    inside = {"w": db.ShardedTensor.from_box("w", torch.zeros(1, 4), (4, 10), (1, 3))}
    (part,) = plan_local_reads(iter_leaves(inside), meta).items
    assert tuple(part.storage_offsets) == (1, 3) and tuple(part.lengths) == (1, 4)


@pytest.mark.parametrize("max_request", [1 << 20, 300, 1])
def test_whole_reads_are_joined_within_the_request_limit(tmp_path, max_request):
    """Items with gaps between them, read as few requests as ``max_request`` allows."""
    path = str(tmp_path / "f.bin")
    blob = bytes(range(256)) * 8
    with open(path, "wb") as f:
        f.write(blob)
    spans = [(0, 100), (100, 164), (200, 300), (1000, 1100), (1100, 1101)]
    got: dict[int, torch.Tensor] = {}
    jobs = []
    for i, (lo, hi) in enumerate(spans):
        dest = torch.zeros(hi - lo, dtype=torch.uint8)
        view = memoryview(dest.numpy()).cast("B")
        stored = StoredItem("f.bin", lo, hi - lo, 0)
        jobs.append(WholeJob(stored, view, dest, lambda t, i=i: got.__setitem__(i, t), None, str))
    jobs.reverse()  # any order
    loc = resolve(str(tmp_path))
    tuning = ReadTuning(min_piece_bytes=0, merge_gap=100, max_request=max_request)
    fetched = run_jobs(jobs, storage_for(loc), loc.data_path, tuning, threads=2)
    for i, (lo, hi) in enumerate(spans):
        assert bytes(got[i].numpy()) == blob[lo:hi]
    assert fetched >= sum(hi - lo for lo, hi in spans)
    if max_request == 1:
        assert fetched == sum(hi - lo for lo, hi in spans)


def test_batch_lookup_answers_exactly_as_one_by_one(tmp_path):
    """``ItemTable.get_many`` (a load's one lookup of all its reads) equals ``get`` key by key:
    one-chunk and many-chunk tensors, scalars, objects, and keys the table does not hold."""
    state = _sharded(_state(40))
    rows = torch.arange(24.0).reshape(6, 4)
    for i in range(3):  # one tensor stored as three row chunks
        state[f"split{i}"] = db.ShardedTensor.from_box(
            "split", rows[2 * i : 2 * i + 2], (6, 4), (2 * i, 0)
        )
    state["obj"] = db.ShardedObject("obj", {"a": 1}, (1,), (0,))
    db.save(state, str(tmp_path))
    table = FsspecCheckpointReader(str(tmp_path)).read_metadata().storage_data.items
    held = list(table)
    absent = [
        ("nope", (0,)),
        ("split", (1, 0)),  # between chunks of a many-chunk tensor
        ("layer1.w", (1,)),  # wrong offset of a one-chunk tensor
        ("layer2.w", (0,)),  # a 2-d tensor asked with one offset
        ("layer1.w", (0, 0)),  # a 1-d tensor asked with two
        ("layer1.w", None),  # a tensor asked as an object
        ("obj/shard_0_1", (0,)),  # an object asked as a tensor
        ("missing-object", None),
    ]
    keys = held[::-1] + absent + held[:3]
    got = table.get_many(keys)
    assert got == [table.get(k) for k in keys]
    assert all(item is not None for item in got[: len(held)])
    assert got[len(held) : len(held) + len(absent)] == [None] * len(absent)
    first = got[len(held) - 1]  # held[0]: a tensor chunk
    assert first.checksums and first.sizes is not None and first.dtype is not None
    assert table.get_many([]) == []


def test_local_files_are_written_in_calls_of_at_most_one_mib(tmp_path, monkeypatch):
    """Coalesced small items and a large tensor reach the kernel in writes of <= 1 MiB (bigger
    writes make ext4 use 2 MiB page-cache folios, measured 3-4x slower to write on these VMs)."""
    from dcpbridge.storage.backends.store import LocalStorage
    from dcpbridge.storage.write import coalesce

    sizes: list[int] = []

    class Recording(io.FileIO):
        def write(self, b):  # type: ignore[override]
            sizes.append(len(memoryview(b)))
            return super().write(b)

    monkeypatch.setattr(LocalStorage, "open_write", lambda self, path: Recording(path, "wb"))
    state = _state(700)  # ~700 small items, coalesced
    g = torch.Generator().manual_seed(1)
    state |= {f"small{i}": torch.randn(4096, generator=g) for i in range(600)}  # 9.4 MiB
    state["big"] = torch.randn(3 << 18, generator=g)  # 3 MiB, one item
    db.save(_sharded(state), tmp_path)
    assert sizes and max(sizes) == coalesce._WRITE_PIECE == 1 << 20
    out = {k: torch.empty_like(v) for k, v in state.items()}
    db.load(_sharded(out), tmp_path)
    for k, v in state.items():
        assert torch.equal(out[k], v), k


def test_staged_small_items_span_many_batches_and_bad_bytes_never_reach_the_target(
    tmp_path, monkeypatch
):
    """Small items are read as file spans into a staging buffer of a few KiB (many batches
    reusing it), verified there, and copied on; a damaged item's target keeps its bytes."""
    from dcpbridge.storage.read import span_reads

    monkeypatch.setattr(span_reads, "SPAN_BUDGET", 4096)
    state = _state(1100, seed=3)
    db.save(_sharded(state), str(tmp_path))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    db.load(_sharded(out), str(tmp_path))
    assert all(out[k].dtype == v.dtype and torch.equal(out[k], v) for k, v in state.items())
    victim = "layer503.w"  # float64 (2, 3, 4)
    item = _stored(str(tmp_path), victim, state[victim].ndim)
    _flip_byte(str(tmp_path), item, item.nbytes // 2)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(db.ChecksumMismatchError, match=f"'{victim}'.*{item.file}"):
        db.load(_sharded(out), str(tmp_path))
    assert not out[victim].any()


def test_staged_spans_are_one_verify_slab_each_where_the_storage_has_slabs():
    """On storage that verifies in slabs (local disk) a span is at most one slab and a batch
    one slab per thread (staging stays in cache); elsewhere spans join up to ``max_request``."""
    import numpy as np

    from dcpbridge.storage.read import span_reads

    n, size = 64, 16 << 10  # 1 MiB of back-to-back 16 KiB items in one file
    file, start = np.zeros(n, np.int64), np.arange(n, dtype=np.int64) * size
    nbytes = np.full(n, size, np.int64)
    local = ReadTuning(min_piece_bytes=0, merge_gap=0, max_request=8 << 20, verify_slab=256 << 10)
    remote = ReadTuning(min_piece_bytes=0, merge_gap=0, max_request=8 << 20)
    assert span_reads._spans(file, start, nbytes, local) == [(i, i + 16) for i in (0, 16, 32, 48)]
    assert span_reads._spans(file, start, nbytes, remote) == [(0, n)]
    assert span_reads._budget(local, 3) == 3 * (256 << 10)
    assert span_reads._budget(remote, 3) == span_reads.SPAN_BUDGET


@pytest.mark.parametrize("block", [0, 64])
def test_batched_appends_write_and_report_exactly_what_item_by_item_appends_do(block):
    """``append_items`` (small plain CPU chunks appended inline) writes the same bytes and
    reports the same results as ``append_item`` item by item, for the items it takes and for
    those it hands on: a non-contiguous tensor, a chunk of several checksum tiles (64-byte
    blocks), a large chunk, an empty one, a parameter, an object, and data of the wrong size
    (which raises the same error both ways)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from dcpbridge.planners.save_planner import _tensor_item
    from dcpbridge.storage.write import coalesce
    from dcpbridge.storage.write import items as appending

    g = torch.Generator().manual_seed(5)
    datas = [
        torch.randn(3, 5, generator=g),
        torch.randn(5, 4, generator=g).t(),  # non-contiguous
        torch.randn(40, generator=g, dtype=torch.float64),  # 320 bytes: 5 tiles of 64
        torch.randn(300 << 10, generator=g).to(torch.bfloat16),  # large: written through
        torch.zeros(0, 3),
        torch.nn.Parameter(torch.randn(2, 2, generator=g)),
        io.BytesIO(b"an object"),
        torch.arange(7, dtype=torch.int8),
    ]
    items = [
        WriteItem(index=MetadataIndex(f"k{i}"), type=WriteItemType.BYTE_IO)
        if isinstance(d, io.BytesIO)
        else _tensor_item(f"k{i}", (0,) * d.ndim, tuple(d.shape), tuple(d.shape), d.dtype)
        for i, d in enumerate(datas)
    ]

    def written(append) -> tuple[bytes, list]:
        sink = io.BytesIO()
        out = coalesce.CoalescingFile(sink)
        results = append(out)
        out.flush()
        return sink.getvalue(), results

    batched = written(lambda out: appending.append_items(out, "f", items, datas, 3, block))
    single = written(
        lambda out: [
            appending.append_item(out, "f", it, d, 3, block) for it, d in zip(items, datas)
        ]
    )
    assert batched == single
    assert [r.storage_data.checksums is None for r in batched[1]] == [not block] * len(items)
    assert not block or len(batched[1][2].storage_data.checksums) == 5  # several tiles
    wrong = [_tensor_item("w", (0,), (4,), (4,), torch.float32)]  # planned 4, resolved 3
    for append in (
        appending.append_items,
        lambda *a: [appending.append_item(*a[:2], wrong[0], a[3][0], *a[4:])],
    ):
        with pytest.raises(
            db.InvalidArgumentError, match="'w' at offsets \\[0\\]: resolved data has 12"
        ):
            append(coalesce.CoalescingFile(io.BytesIO()), "f", wrong, [torch.zeros(3)], 0, block)


def _mixed_template(state: dict[str, torch.Tensor], split: torch.Tensor) -> dict[str, object]:
    """A load template of ``state``'s keys as plain shards, with: a box asked for twice, plain
    tensors, a shard with grad, a box that is one stored chunk of ``split`` and one that spans
    both of its chunks."""
    keys = list(state)
    out: dict[str, object] = _sharded({k: torch.zeros_like(state[k]) for k in keys[:-20]})
    again = keys[3]
    out["again"] = db.ShardedTensor.from_box(
        again, torch.zeros_like(state[again]), state[again].shape, (0,) * state[again].ndim
    )
    out.update({k: torch.zeros_like(state[k]) for k in keys[-20:-1]})  # plain tensors
    last = keys[-1]
    grad = torch.nn.Parameter(torch.zeros(state[last].shape, dtype=torch.float64))
    out["grad"] = db.ShardedTensor.from_box(last, grad, tuple(grad.shape), (0,) * grad.ndim)
    out["chunk"] = db.ShardedTensor.from_box("split", torch.zeros(2, 10), (4, 10), (2, 0))
    out["across"] = db.ShardedTensor.from_box("split", torch.zeros(2, 4), (4, 10), (1, 3))
    return out


def test_plain_shards_are_planned_as_columns_beside_every_other_kind_of_request(tmp_path):
    """Among many plain shards: a box asked for twice, plain tensors, a shard with grad and a
    tensor saved in two chunks. The plain shards (once each) and the stored chunk go to the
    whole-chunk columns in one batch, the repeat becomes a copy, the shard with grad a column
    entry of the general path, the box across two chunks read items; a load fills every one
    bit for bit."""
    state = _state(120, seed=5)
    state["layer119.w"] = state["layer119.w"].double()
    split = torch.arange(40.0).reshape(4, 10)
    saved: dict[str, object] = dict(_sharded(state))
    saved["top"] = db.ShardedTensor.from_box("split", split[:2], (4, 10), (0, 0))
    saved["bottom"] = db.ShardedTensor.from_box("split", split[2:], (4, 10), (2, 0))
    db.save(saved, str(tmp_path))
    meta = FsspecCheckpointReader(str(tmp_path)).read_metadata()
    template = _mixed_template(state, split)
    shards = [v for k, v in template.items() if isinstance(v, db.ShardedTensor)]
    local = plan_local_reads((), meta, whole_columns=True, shards=shards)
    keys = list(state)
    assert local.whole is not None
    assert [k for k, _ in local.whole.keys] == [*keys[:-20], "split", keys[-1]]
    assert local.whole.targets[-1].data_ptr() == template["grad"].data.data_ptr()  # detached
    ((at, [copy]),) = local.whole.copies.items()
    assert at == 3 and copy.data_ptr() == template["again"].data.data_ptr()
    assert [i.dest_index.fqn for i in local.items] == ["split", "split"]  # across both chunks
    assert local.requested == {*keys[:-20], keys[-1], "split"}

    loaded = db.load(template, str(tmp_path))
    for k in keys[:-20]:
        assert torch.equal(loaded[k], state[k]) and loaded[k] is template[k].data, k
    assert torch.equal(loaded["again"], state[keys[3]])
    for k in keys[-20:-1]:
        assert torch.equal(loaded[k], state[k]) and loaded[k] is template[k], k
    assert torch.equal(loaded["grad"].detach(), state[keys[-1]])
    assert torch.equal(loaded["chunk"], split[2:]) and torch.equal(
        loaded["across"], split[1:3, 3:7]
    )


@pytest.mark.parametrize("wrong", ["dtype", "shape"])
def test_one_plain_shard_whose_stored_dtype_or_shape_differs_raises_naming_it(tmp_path, wrong):
    """Among many plain shards planned as columns, one whose template disagrees with what is
    stored raises the general path's error, naming it."""
    state = _state(150, seed=6)
    db.save(_sharded(state), str(tmp_path))
    victim = "layer77.w"  # int64 (3, 5)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    if wrong == "dtype":
        out[victim] = torch.zeros(3, 5, dtype=torch.float16)
        error, match = (
            db.DTypeMismatchError,
            "'layer77.w': stored as torch.int64, requested as torch.float16",
        )
    else:
        out[victim] = torch.zeros(3, 4, dtype=torch.int64)
        error, match = (
            db.ShapeMismatchError,
            r"'layer77.w': global shape in checkpoint is \(3, 5\), requested \(3, 4\)",
        )
    with pytest.raises(error, match=match):
        db.load(_sharded(out), str(tmp_path))


def test_spans_join_items_exactly_as_coalesce_does():
    """``span_reads._spans`` (columns, one search per span) cuts the same requests as
    ``coalesce`` for random items: gaps, overlaps, several files, every limit."""
    import random

    import numpy as np

    from dcpbridge.storage.read import span_reads
    from dcpbridge.storage.read.read_plan import coalesce

    rng = random.Random(0)
    for _ in range(400):
        rows, ends = [], {}
        for f in sorted(rng.randint(0, 2) for _ in range(rng.randint(0, 40))):
            at = max(0, ends.get(f, 0) + rng.choice([0, 0, 0, 1, 64, 500, 5000, -3]))
            size = rng.choice([1, 16, 1000, 4096, 20000])
            rows.append((f, at, size))
            ends[f] = at + size
        rows.sort()
        file, start, size = (np.array([r[i] for r in rows], np.int64) for i in range(3))
        tuning = ReadTuning(
            4096,
            merge_gap=rng.choice([0, 10, 600, 8000]),
            max_request=rng.choice([1, 5000, 30000, 100000]),
            max_amplification=rng.choice([1.0, 1.5, float("inf")]),
            verify_slab=rng.choice([0, 20000]),
        )
        most = min(tuning.max_request, tuning.verify_slab or tuning.max_request)
        requests = coalesce(
            [(f, a, a + n, i) for i, (f, a, n) in enumerate(rows)],
            merge_gap=tuning.merge_gap,
            max_request=most,
            max_amplification=tuning.max_amplification,
        )
        expected = [(r.members[0][2], r.members[-1][2] + 1) for r in requests]
        assert span_reads._spans(file, start, size, tuning) == expected


def test_spans_of_larger_items_are_read_into_their_targets_skipping_gaps(tmp_path, monkeypatch):
    """Spans whose items are all >= DIRECT_ITEM bytes land straight in their targets (one
    scatter read each, the bytes of items not asked for skipped), tinier ones are staged:
    both bit-exact; a flipped byte in a direct item fails the load naming it and its file."""
    from dcpbridge.storage.read import span_reads

    g = torch.Generator().manual_seed(7)
    sizes = (1024, 4096, 1536)  # float32 elements: 4, 16 and 6 KiB, all read in place
    state = {f"big{i}": torch.randn(sizes[i % 3], generator=g) for i in range(600)}
    state.update({f"tiny{i}": torch.randn(5, generator=g) for i in range(600)})  # staged
    db.save(_sharded(state), str(tmp_path))
    spans = {"in_place": 0, "deliver": 0}  # spans read into their targets, spans staged
    for method in spans:
        original = getattr(span_reads._Sorted, method)

        def counted(self, *args, _method=method, _original=original):
            spans[_method] += 1
            return _original(self, *args)

        monkeypatch.setattr(span_reads._Sorted, method, counted)
    wanted = [k for i, k in enumerate(state) if i % 3]  # every third item left: gaps
    out = {k: torch.zeros_like(state[k]) for k in wanted}
    db.load(_sharded(out), str(tmp_path), strict="assume_ok_unexpected")
    assert all(torch.equal(out[k], state[k]) for k in wanted)
    assert spans["in_place"] > 0 and spans["deliver"] > 0

    victim = "big301"  # 16 KiB
    item = _stored(str(tmp_path), victim, 1)
    _flip_byte(str(tmp_path), item, item.nbytes - 3)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(db.ChecksumMismatchError, match=f"'{victim}'.*{item.file}"):
        db.load(_sharded(out), str(tmp_path))
