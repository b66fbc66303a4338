"""Write results reported as columns: the commit document's item table is the one the
``WriteResult`` objects give, a save that takes this path loads bit-exact, and results
that do not belong to the validated plan are read item by item (with the same errors)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pickle
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpbridge as db
import dcpbridge.storage.format.document as fmt
import dcpbridge.storage.write.written as written
from dcpbridge.planners import ShardedLoadPlanner, ShardedSavePlanner
from dcpbridge.storage import FsspecCheckpointReader, FsspecCheckpointWriter
from dcpbridge.storage.errors import InvalidArgumentError
from dcpbridge.storage.format.document import sign_document
from dcpbridge.storage.write.written import WrittenResults, written_table
from tests.support import layouts as L
from tests.support.dist_pool import Rank

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

_COLUMNS = ("counts", "file", "offset", "nbytes", "rank", "offsets", "sizes", "checksums")


def _state() -> dict:
    """Many small tensors of several dtypes and dims, a 0-d one, and objects."""
    g = torch.Generator().manual_seed(7)
    sd: dict = {f"p{i}": torch.randn(3, i + 1, generator=g) for i in range(9)}
    sd["big"] = torch.randn(70_000, generator=g).to(torch.bfloat16)  # more than one tile
    sd["ids"] = torch.arange(24, dtype=torch.int64).reshape(2, 3, 4)
    sd["scalar"] = torch.tensor(2.5)
    sd["opt"] = {"step": 11, "lr": [0.1, 0.2]}
    return sd


def _write(path: str, sd: dict, threads: int = 3):
    """Plan, write and index ``sd`` by DCP's steps in one process: (metadata, results)."""
    planner = ShardedSavePlanner()
    writer = FsspecCheckpointWriter(path, thread_count=threads)
    planner.set_up_planner(sd, is_coordinator=True)
    writer.set_up_storage_writer(True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([local])
    plans = writer.prepare_global_plan(plans)
    plan = dataclasses.replace(local, storage_data=plans[0].storage_data, planner_data=None)
    results = writer.write_data(planner.finish_plan(plan), planner).wait()
    return writer, metadata, results


def _same_tables(a, b) -> None:
    for column in _COLUMNS:
        assert np.array_equal(getattr(a, column), getattr(b, column)), column
    assert (a.tensors, a.shapes, a.dtypes, a.objects, a.files) == (
        b.tensors,
        b.shapes,
        b.dtypes,
        b.objects,
        b.files,
    )


def test_columns_give_the_table_the_objects_give_and_load_bit_exact(tmp_path):
    sd = _state()
    writer, metadata, results = _write(str(tmp_path), sd)
    assert isinstance(results, WrittenResults) and results.columns is not None
    assert len(set(results.columns.files)) == 3  # three files: positions are interleaved
    by_columns = written_table(metadata, [results], checksums=True)
    by_objects = written_table(metadata, [list(results)], checksums=True)
    _same_tables(by_columns, by_objects)
    assert pickle.loads(pickle.dumps(results)).columns.digest == results.columns.digest
    writer.finish(metadata, [results])
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}
    out["opt"] = {"step": 0, "lr": [0.0, 0.0]}
    dcp.load(out, storage_reader=FsspecCheckpointReader(str(tmp_path)))
    for key, value in sd.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(out[key], value) and out[key].dtype == value.dtype, key
    assert out["opt"] == sd["opt"]


def test_results_of_another_plan_are_read_item_by_item(tmp_path):
    _, metadata, results = _write(str(tmp_path / "a"), _state())
    expected = written_table(metadata, [list(results)], checksums=True)
    foreign = WrittenResults(results)
    foreign.columns = dataclasses.replace(results.columns, digest=b"another plan")
    _same_tables(written_table(metadata, [foreign], checksums=True), expected)
    twice = WrittenResults(results)  # one position reported twice, one never
    position = results.columns.position.copy()
    position[1] = position[0]
    twice.columns = dataclasses.replace(results.columns, position=position)
    _same_tables(written_table(metadata, [twice], checksums=True), expected)


def test_missing_results_are_refused_naming_the_key(tmp_path):
    _, metadata, results = _write(str(tmp_path), _state(), threads=1)
    row = [r.index.fqn for r in results].index("p4")
    short = WrittenResults(results[:row] + results[row + 1 :])
    keep = np.arange(len(results)) != row
    c = results.columns
    short.columns = dataclasses.replace(
        c,
        position=c.position[keep],
        file=c.file[keep],
        offset=c.offset[keep],
        nbytes=c.nbytes[keep],
        rank=c.rank[keep],
        sums=np.delete(c.sums, row),  # one tile each: small tensors
        sum_counts=c.sum_counts[keep],
    )
    with pytest.raises(
        InvalidArgumentError,
        match=r"no stored bytes for some chunks of tensor 'p4': 1 planned, 0 written",
    ):
        fmt.encode_metadata(_indexed(metadata, short))


def _indexed(metadata, results):
    from dcpbridge.storage.format.document import StorageIndex

    table = written_table(metadata, [results], checksums=True)
    metadata.storage_data = StorageIndex(
        items=table,
        save_id="5eed",
        files=table.files,
        checksum_algorithm="xxh3_64",
        checksum_block_size=1 << 20,
        world_size=1,
    )
    return metadata


@contextlib.contextmanager
def _counting_tables() -> Iterator[dict[str, int]]:
    """Count, on the coordinator, which way each commit's item table is made."""
    made = {"columns": 0, "objects": 0}
    real = written.columns_table

    def counted(*args, **kwargs):
        table = real(*args, **kwargs)
        made["columns" if table is not None else "objects"] += 1
        return table

    written.columns_table = counted
    try:
        yield made
    finally:
        written.columns_table = real


def _grid4(r: Rank) -> dict:
    return {
        key: [L.shard(key, box) for box in L.boxes("grid4", key, r.rank)]
        for key in ("w", "w_bf16", "idx", "vec")
    }


def _loads_rows4(r: Rank, path: str) -> None:
    """The grid4 save loads bit-exact as rows4 shards."""
    template = {
        key: [L.template(key, box) for box in L.boxes("rows4", key, r.rank)]
        for key in ("w", "w_bf16", "idx", "vec")
    }
    loaded = db.load(template, path, process_group=r.group)
    for key in ("w", "w_bf16", "idx", "vec"):
        for box, got in zip(L.boxes("rows4", key, r.rank), loaded[key]):
            assert torch.equal(got.data, L.expected(key, box)), key


def _save_sharded(r: Rank, path: str) -> dict:
    """``db.save`` on every rank, counting on the coordinator which way the table was made."""
    with _counting_tables() as made:
        db.save({**_grid4(r), "step": 5}, path, process_group=r.group, thread_count=2)
    _loads_rows4(r, path)
    return made


@pytest.mark.timeout(180)
def test_a_multi_rank_save_indexes_its_results_as_columns(pool, tmp_path):
    made = pool.run(_save_sharded, 4, str(tmp_path / "ckpt"))
    assert made[0] == {"columns": 1, "objects": 0}
    assert all(m == {"columns": 0, "objects": 0} for m in made[1:])


def test_dcp_save_with_our_planner_and_writer_round_trips(tmp_path):
    sd = _state()
    dcp.save(
        sd,
        storage_writer=FsspecCheckpointWriter(str(tmp_path), thread_count=2),
        planner=ShardedSavePlanner(),
    )
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}
    out["opt"] = {"step": 0, "lr": [0.0, 0.0]}
    dcp.load(
        out, storage_reader=FsspecCheckpointReader(str(tmp_path)), planner=ShardedLoadPlanner()
    )
    for key, value in sd.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(out[key], value), key
    assert out["opt"] == sd["opt"]


def _item_less() -> ShardedSavePlanner:
    """A planner that plans no item for 0-element ShardedTensors, as ``db.save``'s does (its
    document records every declared tensor; DCP's own writers get one empty chunk each)."""
    planner = ShardedSavePlanner()
    planner.plans_empty_chunks = False
    return planner


def _empty_shards(fill: float) -> dict:
    """Megatron-style ShardedTensors with no elements: ``_item_less`` plans no item of them."""
    e, f = torch.full((0, 3), fill), torch.full((5, 0), fill, dtype=torch.bfloat16)
    return {k: db.ShardedTensor.from_rank_offsets(k, v) for k, v in {"e": e, "f": f}.items()}


def test_a_packed_document_without_item_bytes_loads(tmp_path):
    """A save whose tensors are all empty, its items listed as packed columns (as a local
    step's always are): the empty checksums column was packed in the narrowest width, 1 byte,
    which the load refused (``CorruptCheckpointError: items checksums: unknown column type
    '<u1'``), so dcpbridge wrote a checkpoint it could not read. Checksums pack as 8 bytes.
    (Empty plain tensors and DTensors are planned as one empty chunk, as DCP's planner does;
    Megatron-style ShardedTensors with no elements plan none in ``db.save``.)"""
    path = str(tmp_path / "ck")
    writer = FsspecCheckpointWriter(path)
    writer.columns = True
    state = _empty_shards(0)
    dcp.save(state, storage_writer=writer, planner=_item_less(), no_dist=True)
    out = db.load(_empty_shards(1), path)
    assert out["e"].shape == (0, 3) and out["f"].shape == (5, 0)
    assert fmt.unpack_column(_document(path)["items"]["checksums"], "c", checksums=True).size == 0


def _document(path: str) -> dict:
    with open(f"{path}/dcpbridge.json") as f:
        return json.load(f)


def _rewrite_checksums(path: str, column: dict) -> None:
    """Replace the document's checksums column by ``column`` (signed again)."""
    doc = _document(path)
    doc.pop("digest")
    doc["items"]["checksums"] = column
    with open(f"{path}/dcpbridge.json", "wb") as f:
        f.write(sign_document(doc))


_EMPTY_U1 = {"type": "<u1", "count": 0, "zlib": False, "data": ""}


def _packed_save(path: str, state: dict) -> None:
    writer = FsspecCheckpointWriter(path)
    writer.columns = True
    dcp.save(state, storage_writer=writer, planner=_item_less(), no_dist=True)


def test_an_older_empty_one_byte_checksums_column_loads(tmp_path):
    """Checkpoints of item-less saves written before the checksums column was always 8
    bytes wide carry an empty '<u1' one: it holds no checksum, and none is needed, so the
    load reads them (it raised ``CorruptCheckpointError: unknown column type '<u1'``)."""
    path = str(tmp_path / "ck")
    _packed_save(path, _empty_shards(0))
    _rewrite_checksums(path, _EMPTY_U1)
    out = db.load(_empty_shards(1), path)
    assert out["e"].shape == (0, 3) and out["f"].shape == (5, 0)


@pytest.mark.parametrize("width", ["<u1", "<u8"])
def test_an_empty_checksums_column_where_items_hold_bytes_is_refused(tmp_path, width):
    """An empty checksums column in a document whose items hold bytes never loads them
    unverified: ``CorruptCheckpointError``, whatever the empty column's width."""
    path = str(tmp_path / "ck")
    w = torch.arange(12.0).reshape(3, 4)
    _packed_save(path, {"w": w})
    _rewrite_checksums(path, {**_EMPTY_U1, "type": width})
    with pytest.raises(db.CorruptCheckpointError, match="checksum"):
        db.load({"w": torch.zeros(3, 4)}, path)
    with pytest.raises(db.CorruptCheckpointError, match="checksum"):
        db.load({"w": torch.zeros(3, 4)}, path, verify_checksums=False)


def test_plans_and_results_travel_as_plain_columns_and_come_back_equal(tmp_path):
    """A local plan's items and a rank's write results pickle (on their way to the
    coordinator) as parallel lists of plain values: the received items and results equal the
    sent ones field for field, the plan's columns still describe the received list, and the
    table joined from received results is the one the objects give."""
    from dcpbridge.planners.wire import ReceivedItems, WireItems
    from dcpbridge.storage.write.written import PackedResults

    sd = _state()
    planner = ShardedSavePlanner()
    planner.set_up_planner(sd, is_coordinator=True)
    plan = planner.create_local_plan()
    assert isinstance(plan.items, WireItems)
    got = pickle.loads(pickle.dumps(plan))
    assert isinstance(got.items, ReceivedItems) and len(got.items) == len(plan.items)
    assert list(got.items) == list(plan.items)
    assert got.items[0] is got.items[0] and got.items[-1] == plan.items[-1]
    assert got.planner_data.columns.describes(got)  # columns and plan share the list
    assert list(pickle.loads(pickle.dumps(got.items))) == list(plan.items)
    back = planner.finish_plan(dataclasses.replace(got, planner_data=None))
    assert back.items is plan.items  # this rank's own list: its results go by position

    _, metadata, results = _write(str(tmp_path), sd)
    received = pickle.loads(pickle.dumps(results))
    assert isinstance(received, PackedResults) and list(received) == list(results)
    assert received.columns.digest == results.columns.digest
    _same_tables(
        written_table(metadata, [received], checksums=True),
        written_table(metadata, [list(results)], checksums=True),
    )
    foreign = pickle.loads(pickle.dumps(WrittenResults(results)))  # no columns: item by item
    assert foreign.columns is None
    _same_tables(
        written_table(metadata, [foreign], checksums=True),
        written_table(metadata, [list(results)], checksums=True),
    )


def _dcp_save_sharded(r: Rank, path: str) -> dict:
    """Plain ``dcp.save`` with our planner and writer on every rank, counting on the
    coordinator which way the commit's table was made."""
    with _counting_tables() as made:
        dcp.save(
            _grid4(r),
            storage_writer=FsspecCheckpointWriter(path, thread_count=2),
            planner=ShardedSavePlanner(),
            process_group=r.group,
        )
    _loads_rows4(r, path)
    return made


@pytest.mark.timeout(180)
def test_a_multi_rank_plain_dcp_save_indexes_its_results_as_columns(pool, tmp_path):
    """DCP scatters each rank's items back to it: the planner hands the writer its own list
    again, so results go by position there too."""
    made = pool.run(_dcp_save_sharded, 4, str(tmp_path / "ckpt"))
    assert made[0] == {"columns": 1, "objects": 0}
