"""Coordinator planning at scale, without a process group: the pure planning functions.

(d) 4096 ranks x 256 unique shards (1M chunks: 256 tensors, each split on dim 0 over every
rank, as FSDP does): seconds to build and validate the global metadata and encode the commit
document from every rank's plan and write results, its size, and the seconds a load takes to
decode and validate it. (e) 4096 ranks Megatron-style (TP 8 x PP 8 x DP 64, DP replicas not
written): seconds of the coordinator's global plan. (f) what carrying plans and write results
to the coordinator costs: pickled as columns, and as DCP's objects.
"""

from __future__ import annotations

import gc
import math
import pickle
import time

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from benchmarks.common import table
from dcpbridge.planners import build_metadata
from dcpbridge.planners.save_planner import LocalSummary, describe_plan
from dcpbridge.planners.wire import WireItems
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.document import (
    ITEM_ALIGN,
    StoredItem,
    data_file_name,
    decode_metadata,
)
from dcpbridge.storage.format.fields import dtype_name
from dcpbridge.storage.write.commit import index_results
from dcpbridge.storage.write.writer import new_save_id
from dcpbridge.storage.write.written import written_columns

DTYPE = torch.bfloat16
BLOCK = checksum.DEFAULT_BLOCK_SIZE
PROPERTIES = torch.distributed.checkpoint.metadata.TensorProperties(dtype=DTYPE)


def _clock() -> float:
    """CPU seconds of this process: planning is single-threaded, and on a shared machine
    wall time mostly measures the other processes."""
    return time.process_time()


def _item(key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]):
    return WriteItem(
        index=MetadataIndex(key, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
            properties=PROPERTIES,  # one object per dtype, as the planner shares them
            size=torch.Size(shape),
        ),
    )


def _plans(ranks: int, boxes) -> list[SavePlan]:
    """Each rank's plan as its ``ShardedSavePlanner.create_local_plan`` makes it (items,
    declarations, and the columns describing them): ``boxes(rank)`` yields (key, offsets,
    sizes, shape, written)."""
    plans = []
    for rank in range(ranks):
        summary = LocalSummary()
        items = []
        for key, offsets, sizes, shape, written in boxes(rank):
            summary.tensors[key] = (shape, dtype_name(DTYPE))
            if written:
                items.append(_item(key, offsets, sizes, shape))
        items = WireItems(items)  # as the planner's own list: pickled compactly
        describe_plan(items, summary)
        plans.append(SavePlan(items, planner_data=summary))
    return plans


def _results(plans: list[SavePlan], save_id: str) -> list[list[WriteResult]]:
    """What each rank's writer reports: its items packed into one file, one checksum per
    tile of each chunk (16 KiB chunks: one tile each), with the columns its
    ``FsspecCheckpointWriter.write_data`` attaches for a plan of dcpbridge's planner."""
    out = []
    digest = checksum.digests(checksum.flat_grid(1, 1), memoryview(b"x"))[0]
    for rank, plan in enumerate(plans):
        name, pos, results = data_file_name(rank, 0, save_id), 0, []
        for item in plan.items:
            sizes = tuple(item.tensor_data.chunk.sizes)
            nbytes = math.prod(sizes) * DTYPE.itemsize
            tiles = checksum.tensor_grid(sizes, DTYPE.itemsize, BLOCK, tiled=True).count
            stored = StoredItem(name, pos, nbytes, rank, (digest,) * tiles, sizes, DTYPE)
            results.append(WriteResult(item.index, nbytes, stored))
            pos += -(-nbytes // ITEM_ALIGN) * ITEM_ALIGN
        planned = plan.planner_data.columns.digest  # what the planner's plan_digest gives
        out.append(written_columns(results, range(len(results)), planned))
    return out


def _fsdp(ranks: int, tensors: int, rows: int, cols: int):
    def boxes(rank: int):
        for t in range(tensors):
            shape = (ranks * rows, cols)
            yield f"layers.{t}.weight", (rank * rows, 0), (rows, cols), shape, True

    return boxes


def _megatron(tp: int, pp: int, dp: int, layers: int, h: int):
    """Stacked layer keys (a prepended layer axis), split on TP, one PP stage's layers each."""
    names = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    rows = {"linear_qkv": 3 * h, "linear_proj": h, "linear_fc1": 4 * h, "linear_fc2": h}

    def boxes(rank: int):
        t, p, d = rank % tp, rank // tp % pp, rank // (tp * pp)
        for name in names:
            n = rows[name]
            shape = (pp * layers, n, h)
            for layer in range(layers):
                offsets = (p * layers + layer, t * n // tp, 0)
                yield f"decoder.layers.{name}.weight", offsets, (1, n // tp, h), shape, d == 0

    return boxes


def million_chunks() -> tuple[float, float, float, int]:
    """(plan seconds, encode seconds, decode seconds, metadata bytes) at 4096 x 256."""
    plans = _plans(4096, _fsdp(4096, 256, 8, 1024))
    save_id = new_save_id()
    results = _results(plans, save_id)
    gc.collect()
    t0 = _clock()
    metadata = build_metadata(plans)
    t1 = _clock()
    raw = index_results(metadata, results, save_id=save_id, checksums=True)
    t2 = _clock()
    decoded = decode_metadata(raw, where="bench")
    t3 = _clock()
    assert len(decoded.state_dict_metadata) == 256
    return t1 - t0, t2 - t1, t3 - t2, len(raw)


def transport(ranks: int = 256) -> tuple[float, float, int]:
    """CPU seconds to pickle and unpickle ``ranks`` ranks' plans and write results (256
    shards each) as they travel to the coordinator, and the same as plain lists of DCP's
    objects (what they cost before they travelled as columns); and the items moved."""
    plans = _plans(ranks, _fsdp(ranks, 256, 8, 1024))
    results = _results(plans, new_save_id())
    gc.collect()
    t0 = _clock()
    for plan, written in zip(plans, results):
        pickle.loads(pickle.dumps(plan)).planner_data.columns.describes(plan)
        len(pickle.loads(pickle.dumps(written)))
    t1 = _clock()
    for plan, written in zip(plans, results):
        pickle.loads(pickle.dumps(list(plan.items)))
        pickle.loads(pickle.dumps(list(written)))
    return t1 - t0, _clock() - t1, sum(len(p.items) for p in plans)


def megatron_plan() -> float:
    plans = _plans(4096, _megatron(8, 8, 64, 16, 1024))
    gc.collect()
    t0 = _clock()
    build_metadata(plans)
    return _clock() - t0


def main(root: str, repeats: int, quick: bool) -> list[str]:
    gc_was = gc.isenabled()
    gc.disable()  # as save/load run planning
    try:
        runs = [million_chunks() for _ in range(1 if quick else repeats)]
        mega = sorted(megatron_plan() for _ in range(1 if quick else repeats))
        moved = [transport(32 if quick else 256) for _ in range(1 if quick else repeats)]
    finally:
        if gc_was:
            gc.enable()
    plan, enc, dec, size = (sorted(r[i] for r in runs)[len(runs) // 2] for i in range(4))
    table(
        "(d) coordinator planning without a process group (CPU seconds, medians)",
        [
            (
                "1M chunks: 4096 ranks x 256 shards",
                f"{plan:.2f}s",
                f"{enc:.2f}s",
                f"{dec:.2f}s",
                f"{size / 2**20:.1f} MiB",
            ),
            (
                "Megatron-style 4096 ranks (TP8 PP8 DP64)",
                f"{mega[len(mega) // 2]:.2f}s",
                "",
                "",
                "",
            ),
        ],
        ("case", "global plan", "encode", "decode", "metadata"),
    )
    packed, plain = (sorted(m[i] for m in moved)[len(moved) // 2] for i in range(2))
    items = moved[0][2]
    table(
        "(f) plans and write results pickled to the coordinator and back (CPU seconds)",
        [(f"{items:,} items", f"{packed:.2f}s", f"{plain:.2f}s", f"{plain / packed:.1f}x")],
        ("case", "as columns", "as DCP objects", "ratio"),
    )
    return [
        f"(d) 1M chunks: plan {plan + enc:.2f}s (validate {plan:.2f}s + encode {enc:.2f}s), "
        f"metadata {size / 2**20:.1f} MiB, decode {dec:.2f}s",
        f"(e) Megatron-style 4096 ranks: global plan {mega[len(mega) // 2]:.2f}s",
        f"(f) {items:,} plan items and write results to the coordinator: {packed:.2f}s as "
        f"columns, {plain:.2f}s as DCP objects ({plain / packed:.1f}x)",
    ]
