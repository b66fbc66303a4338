"""Sizes past 32-bit limits: items past 4 GiB in a data file, chunks of more than 2**31 elements.

A checkpoint of 4+ GiB per rank is cheap to build here: its data file is sparse (zeros but for
marked bytes) and its document is encoded by ``encode_metadata`` from checksums computed tile
by tile, so loads of boxes around the 2**31 and 2**32 marks run the real reader (ranged reads,
mapped copies, checksum tiles) without writing or reading gigabytes. The pure functions that
carry such sizes (packed columns, tile counts, read plans, ranged GETs) are checked too.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

import dcpbridge as db
from dcpbridge.storage.backends.s3 import _check_range, split_parts
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format import document as fmt
from dcpbridge.storage.format.table import StoredItem, pack_column, unpack_column
from dcpbridge.storage.format.tiling import tile_counts
from dcpbridge.storage.read.read_plan import ReadTuning, coalesce, plan_chunk_read
from tests.support.dist_pool import Rank

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BLOCK = 1 << 20
SAVE_ID = "b16f11e5"
DATA = fmt.data_file_name(0, 0, SAVE_ID)
N1 = (1 << 32) + (3 << 20) + 5  # a 1-D uint8 chunk past 4 GiB, not a whole number of tiles
R, C = 65_600, 65_600  # a 2-D uint8 tensor of 4.3e9 elements in two chunks...
SPLIT = 32_800  # ...of more than 2**31 elements each, the second at element 2**31 and past
SMALL = torch.arange(1000, dtype=torch.int64) * 7919 - 3_000_000  # stored after them all


BOXES = [
    ("big1", ((1 << 32) - 100_000,), (300_000,)),  # across byte 2**32 of the file
    ("big1", ((1 << 31) - 70,), (141,)),  # across element 2**31
    ("big1", (N1 - 5000,), (5000,)),  # the chunk's last (partial) tile
    ("big2", (SPLIT - 2, 0), (5, C)),  # whole rows across the two chunks
    ("big2", (R - 40, 30_001), (40, 777)),  # a column slice at the end (mapped copy)
    ("big2", ((1 << 31) // C - 1, 12_345), (3, 20_000)),  # around element 2**31
]


def _marks(sizes: tuple[int, ...], at: tuple[int, ...], seed: int) -> dict[int, int]:
    """Marked bytes of a chunk of ``sizes`` at ``at``: around 2**31, 2**32 and its ends, at
    the corners and middle of each box of ``BOXES`` it meets, and random ones."""
    n = math.prod(sizes)
    rng = np.random.default_rng(seed)
    near = [0, 1, 63, 64, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 32) + 1]
    spots = [p for p in near if p < n] + [n - 1, n - 2] + rng.integers(0, n, 40).tolist()
    strides = [math.prod(sizes[d + 1 :]) for d in range(len(sizes))]
    for _, offsets, lengths in BOXES:
        if len(offsets) != len(sizes):
            continue
        lo = [max(o, c) for o, c in zip(offsets, at)]
        hi = [min(o + k, c + s) for o, k, c, s in zip(offsets, lengths, at, sizes)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        for corner in (
            [a for a in lo],
            [b - 1 for b in hi],
            [(a + b) // 2 for a, b in zip(lo, hi)],
        ):
            spots.append(sum((x - c) * st for x, c, st in zip(corner, at, strides)))
    return {int(p): int(v) for p, v in zip(spots, rng.integers(1, 256, len(spots)))}


def _coords(pos: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d in range(len(sizes)):
        step = math.prod(sizes[d + 1 :])
        out.append(pos // step)
        pos %= step
    return tuple(out)


def _digests(sizes: tuple[int, ...], marks: dict[int, int]) -> tuple[str, ...]:
    """The format 4 checksums of a uint8 chunk of ``sizes`` holding zeros but for ``marks``."""
    grid = checksum.tensor_grid(sizes, 1, BLOCK, tiled=True)
    counts = grid.counts
    by_tile: dict[int, list[tuple[tuple[int, ...], int]]] = {}
    for pos, value in marks.items():
        at = _coords(pos, sizes)
        flat = 0
        for i, t, c in zip(at, grid.tile, counts):
            flat = flat * c + i // t
        by_tile.setdefault(flat, []).append((at, value))
    zeros: dict[int, str] = {}
    out: list[str] = [""] * grid.count
    for index, (lo, n) in grid.tiles((0,) * len(sizes), sizes):
        if index not in by_tile:
            size = math.prod(n)
            if size not in zeros:
                zeros[size] = xxhash.xxh3_64_hexdigest(bytes(size))
            out[index] = zeros[size]
            continue
        tile = np.zeros(n, np.uint8)
        for at, value in by_tile[index]:
            tile[tuple(a - b for a, b in zip(at, lo))] = value
        out[index] = xxhash.xxh3_64_hexdigest(tile.tobytes())
    return tuple(out)


def _expected(
    sizes: tuple[int, ...], marks: dict[int, int], offsets: list[int], lengths: list[int]
) -> torch.Tensor:
    """Box ``offsets``+``lengths`` of a chunk of ``sizes`` holding zeros but for ``marks``."""
    out = np.zeros(lengths, np.uint8)
    for pos, value in marks.items():
        at = _coords(pos, sizes)
        if all(o <= a < o + n for a, o, n in zip(at, offsets, lengths)):
            out[tuple(a - o for a, o in zip(at, offsets))] = value
    return torch.from_numpy(out)


def _chunks() -> dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], dict[int, int]]]:
    """The large checkpoint's uint8 chunks: (key, offsets) -> (sizes, marks)."""
    return {
        ("big1", (0,)): ((N1,), _marks((N1,), (0,), 1)),
        ("big2", (0, 0)): ((SPLIT, C), _marks((SPLIT, C), (0, 0), 2)),
        ("big2", (SPLIT, 0)): ((R - SPLIT, C), _marks((R - SPLIT, C), (SPLIT, 0), 3)),
    }


def _want(fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """What box ``offsets``+``lengths`` of tensor ``fqn`` of the large checkpoint holds."""
    want = torch.zeros(lengths, dtype=torch.uint8)
    for (key, chunk_at), (sizes, marks) in _chunks().items():
        if key != fqn:
            continue
        lo = [max(o, c) for o, c in zip(offsets, chunk_at)]
        hi = [min(o + n, c + s) for o, n, c, s in zip(offsets, lengths, chunk_at, sizes)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        part = _expected(
            sizes, marks, [a - c for a, c in zip(lo, chunk_at)], [b - a for a, b in zip(lo, hi)]
        )
        want[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))] = part
    assert want.any()  # the box holds marked bytes: a misplaced read cannot pass as zeros
    return want


def _align(n: int) -> int:
    return -(-n // fmt.ITEM_ALIGN) * fmt.ITEM_ALIGN


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A checkpoint with one sparse 8.6 GB data file: ``big1`` (1-D, N1 bytes) at 0, the two
    chunks of ``big2`` (R x C) after it, then ``small``; each item's marks."""
    path = tmp_path_factory.mktemp("large") / "ck"
    path.mkdir()
    chunks = _chunks()
    small = memoryview(SMALL.numpy()).cast("B")
    items: dict = {}
    at = 0
    fd = os.open(path / DATA, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for key, (sizes, marks) in chunks.items():
            nbytes = math.prod(sizes)
            items[key] = StoredItem(DATA, at, nbytes, 0, _digests(sizes, marks))
            for pos, value in marks.items():
                os.pwrite(fd, bytes([value]), at + pos)
            at = _align(at + nbytes)
        items[("small", (0,))] = StoredItem(
            DATA, at, len(small), 0, checksum.item_digests(small, (1000,), torch.int64, BLOCK)
        )
        os.pwrite(fd, small, at)
    finally:
        os.close(fd)
    assert items[("small", (0,))].offset > 1 << 33
    state = {
        "big1": TensorStorageMetadata(
            TensorProperties(dtype=torch.uint8),
            torch.Size([N1]),
            [ChunkStorageMetadata(torch.Size([0]), torch.Size([N1]))],
        ),
        "big2": TensorStorageMetadata(
            TensorProperties(dtype=torch.uint8),
            torch.Size([R, C]),
            [
                ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([SPLIT, C])),
                ChunkStorageMetadata(torch.Size([SPLIT, 0]), torch.Size([R - SPLIT, C])),
            ],
        ),
        "small": TensorStorageMetadata(
            TensorProperties(dtype=torch.int64),
            torch.Size([1000]),
            [ChunkStorageMetadata(torch.Size([0]), torch.Size([1000]))],
        ),
    }
    index = fmt.StorageIndex(
        items=items,
        save_id=SAVE_ID,
        files=(DATA,),
        checksum_algorithm=checksum.ALGORITHM,
        checksum_block_size=BLOCK,
    )
    metadata = Metadata(state_dict_metadata=state, storage_data=index)
    yield {"path": path, "metadata": metadata, "items": items, "chunks": chunks}
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("columns", [False, True], ids=["rows", "columns"])
def test_documents_keep_offsets_sizes_and_counts_past_32_bits(large, columns):
    """Item offsets past 2**33, byte counts past 2**32 and chunk sizes and offsets past 2**31
    elements come back exactly from both document layouts, with every checksum."""
    raw = fmt.encode_metadata(large["metadata"], columns=columns)
    assert (b'"items"' in raw) is columns
    got = fmt.decode_metadata(raw, where="large").storage_data.items
    for (fqn, offsets), item in large["items"].items():
        stored = got[(fqn, offsets)]
        assert (stored.file, stored.offset, stored.nbytes, stored.rank) == (
            item.file,
            item.offset,
            item.nbytes,
            item.rank,
        )
        assert stored.checksums == item.checksums
    assert got[("big2", (SPLIT, 0))].sizes == (R - SPLIT, C)
    assert got[("big1", (0,))].sizes == (N1,)
    size = os.path.getsize(large["path"] / DATA)
    fmt.check_stored_ranges(got, {DATA: size}, "large")
    with pytest.raises(db.CorruptCheckpointError, match=r"which has only \d+ bytes"):
        fmt.check_stored_ranges(got, {DATA: size - 1}, "large")
    with pytest.raises(db.CorruptCheckpointError, match=r"which has only \d+ bytes"):
        fmt.check_stored_ranges(got, {DATA: size - (1 << 32)}, "large")  # not read mod 2**32


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
@pytest.mark.parametrize("columns", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("box", BOXES, ids=[f"{b[0]}@{b[1]}+{b[2]}" for b in BOXES])
def test_loads_of_boxes_past_4_gib_are_exact(large, columns, box, verify):
    """Narrowed loads of boxes around the 2**31 and 2**32 marks of a 8.6 GB data file read
    exactly the stored bytes (verified against their tiles' checksums, or copied unverified)."""
    path = large["path"]
    (path / fmt.METADATA_FILE).write_bytes(fmt.encode_metadata(large["metadata"], columns=columns))
    fqn, offsets, lengths = box
    shape = (N1,) if fqn == "big1" else (R, C)
    want = _want(fqn, offsets, lengths)
    template = db.ShardedTensor.from_box(
        fqn, torch.full(lengths, 7, dtype=torch.uint8), shape, offsets
    )
    out = db.load(
        {"t": template, "small": torch.zeros(1000, dtype=torch.int64)},
        str(path),
        verify_checksums=verify,
    )
    assert torch.equal(out["t"], want)
    assert torch.equal(out["small"], SMALL)


def _load_box(r: Rank, path: str) -> bool:
    """Load this rank's box of ``BOXES`` (rank 0: across byte 2**32, rank 1: the column slice
    at the end) in a load of all ranks; whether it came back exact."""
    fqn, offsets, lengths = BOXES[(0, 4)[r.rank]]
    shape = (N1,) if fqn == "big1" else (R, C)
    data = torch.full(lengths, 7, dtype=torch.uint8)
    out = db.load(
        {"t": db.ShardedTensor.from_box(fqn, data, shape, offsets)}, path, process_group=r.group
    )
    return torch.equal(out["t"], _want(fqn, offsets, lengths))


def test_ranks_load_boxes_past_4_gib(large, pool):
    """Two ranks plan and read boxes past 4 GiB and 2**31 elements together (plans and
    metadata exchanged between ranks keep those offsets)."""
    path = large["path"]
    (path / fmt.METADATA_FILE).write_bytes(fmt.encode_metadata(large["metadata"], columns=True))
    assert pool.run(_load_box, 2, str(path), timeout=120) == [True, True]


def test_an_incremental_save_references_an_item_past_8_gib(large):
    """An unchanged chunk stored past byte 2**33 of the previous checkpoint's data file is
    referenced at that exact offset, and a load through the reference reads it back."""
    path = large["path"]
    (path / fmt.METADATA_FILE).write_bytes(fmt.encode_metadata(large["metadata"], columns=True))
    nxt = path.parent / "next"
    try:
        db.save({"small": SMALL.clone()}, str(nxt), reuse_from=str(path))
        index = fmt.decode_metadata((nxt / fmt.METADATA_FILE).read_bytes(), where="next")
        item = index.storage_data.items[("small", (0,))]
        assert (item.file, item.offset) == (f"../ck/{DATA}", large["items"][("small", (0,))].offset)
        out = db.load({"small": torch.zeros(1000, dtype=torch.int64)}, str(nxt))
        assert torch.equal(out["small"], SMALL)
    finally:
        shutil.rmtree(nxt, ignore_errors=True)


def test_packed_columns_keep_values_past_32_bits():
    values = np.array([0, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 40) + 3, 1 << 62])
    entry = pack_column(values)
    assert entry["type"] == "<u8"
    assert unpack_column(entry, "x").tolist() == values.tolist()
    assert pack_column(np.array([(1 << 32) - 1]))["type"] == "<u4"
    assert unpack_column(pack_column(np.array([1 << 32])), "x").tolist() == [1 << 32]


@pytest.mark.parametrize(
    ("sizes", "itemsize"),
    [
        ((N1,), 1),
        (((1 << 31) + 1,), 2),
        ((SPLIT, C), 1),
        ((R - SPLIT, C), 1),
        ((3, (1 << 31) + 7), 1),
        (((1 << 31) + 7, 3), 4),
        ((65_537, 8, 8193), 2),
        ((1 << 20, 1 << 20, 5), 8),
    ],
)
def test_tile_counts_of_huge_chunks_agree_with_their_grids(sizes, itemsize):
    """The array count of a chunk's checksum tiles (what a decoded table expects) equals its
    grid's, for chunks of more than 2**31 elements or 2**32 bytes."""
    grid = checksum.tensor_grid(sizes, itemsize, BLOCK, tiled=True)
    width = 3
    padded = np.ones((1, width), np.int64)
    padded[0, : len(sizes)] = sizes
    got = tile_counts(padded, np.array([len(sizes)]), np.array([itemsize]), BLOCK)
    assert got.tolist() == [grid.count]
    assert grid.count == math.prod(-(-s // t) for s, t in zip(sizes, grid.tile))


def test_read_plans_and_requests_past_4_gib():
    """A box of a chunk past 4 GiB plans its exact item bytes; requests keep their file
    offsets; a ranged GET past 4 GiB is split and checked exactly."""
    sizes = (SPLIT, C)
    grid = checksum.tensor_grid(sizes, 1, BLOCK, tiled=True)
    read = plan_chunk_read(sizes, 1, (SPLIT - 3, 10), (2, 100), grid=grid, min_piece_bytes=4 << 10)
    first = (SPLIT - 3) // grid.tile[0] * grid.tile[0] * C
    assert read.pieces[0].start == first
    assert read.span[1] == (SPLIT - 1) * C + grid.tile[1]
    base = 5 << 30
    requests = coalesce(
        [("f", base + p.start, base + p.stop, i) for i, p in enumerate(read.pieces)],
        merge_gap=1 << 20,
        max_request=1 << 62,
    )
    assert requests[0].start == base + first
    assert [m[:2] for r in requests for m in r.members] == [
        (base + p.start, base + p.stop) for p in read.pieces
    ]
    tuning = ReadTuning(min_piece_bytes=0, merge_gap=0, max_request=1 << 62)
    assert tuning.max_request > 1 << 32
    view = memoryview(bytearray(3 << 20))
    spans = split_parts(base, [view[: 1 << 20], 1 << 20, view[1 << 20 :]], 1 << 21)
    assert [s for s, _ in spans] == [base, base + (2 << 20)]
    end = base + (4 << 20)
    _check_range({"ContentRange": f"bytes {base}-{end - 1}/{1 << 34}"}, "p", base, end)
    low = base - (1 << 32)
    with pytest.raises(OSError, match="asked for bytes"):
        _check_range({"ContentRange": f"bytes {low}-{low + 9}/{1 << 34}"}, "p", base, base + 10)


def test_large_fixture_file_is_sparse(large):
    """The fixture's data file is over 8 GiB long but holds almost no blocks on disk."""
    st = os.stat(large["path"] / DATA)
    assert st.st_size > 1 << 33
    assert st.st_blocks * 512 < 64 << 20


@pytest.mark.slow
def test_a_save_past_4_gib_loads_back_exactly(tmp_path):
    """A real save of a 4.3 GB uint8 tensor of more than 2**32 elements (tiled checksums of 8
    column groups) and small tensors after it in the same data file; loads of rows across byte
    2**32, a column slice of its last rows and the small tensors are bit-exact (~20 s)."""
    rows, cols = 33_000, 131_136
    period = 1_000_003  # prime: a byte read from the wrong place differs
    pattern = torch.randint(0, 256, (period,), dtype=torch.uint8, generator=torch.Generator())
    flat = torch.empty(rows * cols, dtype=torch.uint8)
    whole = flat.numel() // period
    flat[: whole * period].view(whole, period).copy_(pattern.expand(whole, period))
    flat[whole * period :] = pattern[: flat.numel() - whole * period]
    big = flat.view(rows, cols)
    small = {f"s{i}": torch.arange(100 + i, dtype=torch.int32) * (i + 3) for i in range(3)}
    path = tmp_path / "ck"
    state = {"big": db.ShardedTensor.from_box("big", big, (rows, cols), (0, 0)), **small}
    try:
        _save_and_load(path, state, big, small)
    finally:  # pytest keeps the last runs' folders: not 4 GB of them
        shutil.rmtree(path, ignore_errors=True)


def _save_and_load(path: Path, state: dict, big: torch.Tensor, small: dict) -> None:
    rows, cols = big.shape
    db.save(state, str(path), thread_count=1)
    items = fmt.decode_metadata((path / fmt.METADATA_FILE).read_bytes(), where="ck").storage_data
    placed = items.items[("s0", (0,))]
    assert placed.file == items.items[("big", (0, 0))].file and placed.offset > 1 << 32
    r0 = (1 << 32) // cols - 3
    for offsets, lengths in [((r0, 0), (7, cols)), ((rows - 9, 70_001), (9, 4099))]:
        template = db.ShardedTensor.from_box(
            "big", torch.zeros(lengths, dtype=torch.uint8), (rows, cols), offsets
        )
        out = db.load({"big": template}, str(path))
        box = big[offsets[0] : offsets[0] + lengths[0], offsets[1] : offsets[1] + lengths[1]]
        assert torch.equal(out["big"], box)
    out = db.load({k: torch.zeros_like(v) for k, v in small.items()}, str(path))
    assert all(torch.equal(out[k], v) for k, v in small.items())
