"""Range planning and checksum tiles as pure functions: no files, no process group."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import xxhash

from dcpbridge.storage.backends.costs import LOCAL_READ_COSTS, OBJECT_STORE_READ_COSTS, ReadCosts
from dcpbridge.storage.errors import ChecksumMismatchError
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.checksum import (
    Grid,
    Hasher,
    digests,
    flat_grid,
    tensor_grid,
    tensor_tiles,
)
from dcpbridge.storage.read.read_plan import ReadTuning, coalesce, plan_chunk_read


def _flat_blocks(data: memoryview, block: int) -> list[str]:
    """Format 2's digests: one per ``block`` bytes of the item."""
    if not len(data):
        return [xxhash.xxh3_64_hexdigest(b"")]
    return [xxhash.xxh3_64_hexdigest(data[s : s + block]) for s in range(0, len(data), block)]


def test_tiles_split_columns_into_groups_and_rows_to_the_block():
    assert tensor_tiles((1024, 4096), 4, 1 << 20) == (64, 512)  # 8 column groups, 128 KiB
    assert tensor_tiles((32, 64), 4, 1 << 20) == (32, 64)  # 8 KiB: one tile
    assert tensor_tiles((100_000, 16), 4, 1 << 20) == (16384, 16)  # rows too narrow to split
    assert tensor_tiles((8, 1024, 128), 2, 1 << 20) == (4, 128, 128)
    assert tensor_tiles((3000,), 4, 1 << 20) == (1 << 18,)  # 1-D: format 2's flat blocks
    assert tensor_tiles((), 8, 1 << 20) == ()


@pytest.mark.parametrize("seed", range(6))
def test_digests_streamed_and_verified_agree_and_format_2_is_a_grid(seed):
    rng = random.Random(seed)
    for _ in range(60):
        sizes = tuple(rng.choice([0, 1, 3, 8, 64, 100]) for _ in range(rng.randint(0, 3)))
        itemsize = rng.choice([1, 2, 4, 8])
        block = rng.choice([64, 1000, 4096, 1 << 16])
        nbytes = math.prod(sizes) * itemsize
        data = memoryview(np.random.default_rng(seed).integers(0, 255, nbytes, np.uint8).tobytes())
        # format 2 chunks, seen as a grid over their elements where rows fit blocks
        assert digests(tensor_grid(sizes, itemsize, block, tiled=False), data) == _flat_blocks(
            data, block
        )
        grid = tensor_grid(sizes, itemsize, block, tiled=True)
        whole = digests(grid, data)
        assert len(whole) == grid.count
        h = Hasher(grid)
        pos = 0
        while pos < nbytes:  # pieces of any size
            n = rng.randint(1, max(1, nbytes // 3))
            h.update(data[pos : pos + n])
            pos += n
        assert h.finish() == tuple(whole)
        if not nbytes or not sizes:
            continue
        offsets = [rng.randrange(s) for s in sizes]
        lengths = [rng.randint(1, s - o) for s, o in zip(sizes, offsets)]
        lo, n = grid.widen(offsets, lengths)
        arr = np.frombuffer(data, np.uint8).reshape(*sizes[:-1], sizes[-1] * itemsize)
        index = tuple(slice(a, a + b) for a, b in zip(lo[:-1], n[:-1]))
        part = np.ascontiguousarray(
            arr[(*index, slice(lo[-1] * itemsize, (lo[-1] + n[-1]) * itemsize))]
        )
        checksum.verify(grid, memoryview(part).cast("B"), lo, n, whole, what="x")
        bad = bytearray(part.tobytes())
        bad[rng.randrange(len(bad))] ^= 1
        with pytest.raises(checksum.ChecksumMismatchError, match=r"in x, block \d+"):
            checksum.verify(grid, memoryview(bad), lo, n, whole, what="x")


def test_column_slice_with_checksums_reads_only_its_bytes():
    sizes, itemsize = (1024, 4096), 4
    grid = tensor_grid(sizes, itemsize, 1 << 20, tiled=True)
    plan = plan_chunk_read(
        sizes, itemsize, (0, 1024), (1024, 1024), grid=grid, min_piece_bytes=4096
    )
    assert not plan.widened and plan.bounce_bytes == 0
    assert sum(p.stop - p.start for p in plan.pieces) == 1024 * 1024 * 4  # exactly the request
    assert [(p.start, p.at) for p in plan.pieces[:2]] == [(4096, 0), (4096 + 16384, 4096)]
    # format 2's 1 MiB blocks hold 64 whole rows: the same slice reads every row entirely
    legacy = tensor_grid(sizes, itemsize, 1 << 20, tiled=False)
    old = plan_chunk_read(
        sizes, itemsize, (0, 1024), (1024, 1024), grid=legacy, min_piece_bytes=4096
    )
    assert old.box == ((0, 0), sizes) and old.widened


def test_unaligned_request_widens_to_tiles_and_bytes_grids_to_the_chunk():
    sizes = (1024, 4096)
    grid = Grid(sizes, 4, (64, 512))
    plan = plan_chunk_read(sizes, 4, (10, 100), (5, 10), grid=grid, min_piece_bytes=0)
    assert plan.box == ((0, 0), (64, 512)) and plan.widened and plan.verify_box == plan.box
    odd = flat_grid(7 * 3000 * 4, 1 << 20)  # format 2 blocks that cut rows
    plan = plan_chunk_read((7, 3000), 4, (2, 0), (1, 3000), grid=odd, min_piece_bytes=0)
    assert plan.box == ((0, 0), (7, 3000)) and plan.verify_box == ((0,), (7 * 3000 * 4,))
    assert plan_chunk_read(sizes, 4, (0, 0), (0, 5), grid=grid, min_piece_bytes=0).pieces == ()


def test_coalesce_joins_close_ranges_of_a_file_up_to_a_size():
    ranges = [("a", i * 100, i * 100 + 60, i) for i in range(10)] + [("b", 0, 10, "b")]
    reqs = coalesce(ranges, merge_gap=40, max_request=500)
    assert [(r.file, r.start, r.stop, [m[2] for m in r.members]) for r in reqs] == [
        ("a", 0, 460, [0, 1, 2, 3, 4]),
        ("a", 500, 960, [5, 6, 7, 8, 9]),
        ("b", 0, 10, ["b"]),
    ]
    assert len(coalesce(ranges, merge_gap=39, max_request=500)) == 11  # gaps of 40 stay apart
    big = coalesce([("a", 0, 1000, 0), ("a", 1000, 1010, 1)], merge_gap=10, max_request=500)
    assert len(big) == 2  # a range over the request size is a request of its own
    overlap = coalesce([("a", 0, 100, 0), ("a", 50, 80, 1)], merge_gap=10, max_request=500)
    assert len(overlap) == 2  # two reads of the same bytes are never joined


def test_chunk_list_holds_exactly_its_boxes_for_one_chunk_many_and_none():
    """``holds`` answers one-chunk tensors from bulk lists and others row by row: the same
    exact-box answer either way, and a chunkless tensor holds nothing."""
    from dcpbridge.storage.format.table import ChunkList, PlannedBoxes

    shapes = [(4, 6), (8, 2), (), (0, 3), (5,)]
    counts = np.array([1, 2, 1, 0, 1], dtype=np.int64)
    offsets = np.array([[0, 0], [0, 0], [4, 0], [0, 0], [0, 0]], dtype=np.int64)
    sizes = np.array([[4, 6], [4, 2], [4, 2], [1, 1], [5, 1]], dtype=np.int64)
    boxes = PlannedBoxes(shapes, counts, offsets, sizes, checked=True)
    whole, rows, scalar, chunkless, flat = (ChunkList(boxes, t) for t in range(5))
    assert whole.holds((0, 0), (4, 6))
    assert not whole.holds((0, 0), (4, 5)) and not whole.holds((0, 1), (4, 6))
    assert not whole.holds((0,), (4,))  # fewer dims than the tensor: not its box
    assert rows.holds((0, 0), (4, 2)) and rows.holds((4, 0), (4, 2))
    assert not rows.holds((0, 0), (8, 2)) and not rows.holds((2, 0), (4, 2))
    assert scalar.holds((), ())
    assert not chunkless.holds((0, 0), (0, 3))
    assert flat.holds((0,), (5,)) and not flat.holds((0,), (4,))


# -- the cost model: exact ranges or joined reads ---------------------------------------------


def test_read_costs_join_gaps_cheaper_than_a_request():
    costs = ReadCosts(request_seconds=20e-6, byte_seconds=0.25e-9, max_request=1 << 20)
    assert costs.break_even_gap == 80_000
    assert ReadTuning.for_costs(costs) == ReadTuning(
        min_piece_bytes=4096, merge_gap=80_000, max_request=1 << 20, max_amplification=2.0
    )
    assert LOCAL_READ_COSTS.break_even_gap == 80_000  # local disk: ~80 KB per syscall
    assert OBJECT_STORE_READ_COSTS.break_even_gap == 2_886_597  # S3: ~2.9 MB per GET
    with pytest.raises(ValueError, match="read costs"):
        ReadCosts(request_seconds=1.0, byte_seconds=0.0)


def test_coalesce_joins_no_more_than_the_amplification_allows():
    ranges = [("a", i * 100, i * 100 + 50, i) for i in range(4)]  # 50 needed, 50 skipped
    joined = coalesce(ranges, merge_gap=50, max_request=1000, max_amplification=2.0)
    assert [(r.start, r.stop, [m[2] for m in r.members]) for r in joined] == [
        (0, 350, [0, 1, 2, 3])
    ]
    # 25 needed of every 100: two joined read 2.5x, three 3x, four 3.25x
    quarter = [("a", i * 100, i * 100 + 25, i) for i in range(4)]
    reqs = coalesce(quarter, merge_gap=75, max_request=1000, max_amplification=2.0)
    assert [(r.start, r.stop) for r in reqs] == [(0, 25), (100, 125), (200, 225), (300, 325)]
    reqs = coalesce(quarter, merge_gap=75, max_request=1000, max_amplification=3.0)
    assert [(r.start, r.stop) for r in reqs] == [(0, 225), (300, 325)]
    assert len(coalesce(quarter, merge_gap=74, max_request=1000)) == 4  # gap over break-even


def test_column_slice_is_read_as_joined_spans_when_gaps_cost_less_than_requests():
    """Rows of 16 KiB, half of each needed: gaps of 8 KiB. Joined: spans of at most
    ``max_request`` bytes of whole rows, into bounce buffers; exact: one range per row."""
    sizes, itemsize = (8, 4096), 4
    tuning = ReadTuning(min_piece_bytes=4096, merge_gap=8192, max_request=3 * 16384)
    plan = plan_chunk_read(
        sizes, itemsize, (0, 2048), (8, 2048), grid=None, min_piece_bytes=4096, tuning=tuning
    )
    assert [
        (p.start, p.stop, p.at, p.extent.box_offsets, p.extent.box_lengths) for p in plan.pieces
    ] == [
        (8192, 8192 + 2 * 16384 + 8192, None, (0, 0), (3, 2048)),
        (8192 + 3 * 16384, 8192 + 5 * 16384 + 8192, None, (3, 0), (3, 2048)),
        (8192 + 6 * 16384, 8192 + 7 * 16384 + 8192, None, (6, 0), (2, 2048)),
    ]
    exact = [(r * 16384 + 8192, r * 16384 + 16384, r * 8192) for r in range(8)]
    for costly in (
        ReadTuning(4096, merge_gap=8191, max_request=3 * 16384),  # the gap costs more
        ReadTuning(4096, merge_gap=8192, max_request=3 * 16384, max_amplification=1.5),
    ):
        plan = plan_chunk_read(
            sizes, itemsize, (0, 2048), (8, 2048), grid=None, min_piece_bytes=4096, tuning=costly
        )
        assert [(p.start, p.stop, p.at) for p in plan.pieces] == exact
    # a quarter of each row: joining would read ~4x the need, so every row stays exact
    quarter = plan_chunk_read(
        sizes,
        itemsize,
        (0, 1024),
        (8, 1024),
        grid=None,
        min_piece_bytes=4096,
        tuning=ReadTuning(4096, 1 << 20, 1 << 20),
    )
    assert len(quarter.pieces) == 8 and all(p.at is not None for p in quarter.pieces)


def test_backends_state_their_read_costs(tmp_path):
    from dcpbridge.storage.backends import storage_for
    from dcpbridge.storage.format.paths import resolve

    local = storage_for(resolve(str(tmp_path)))
    assert local.read_costs() is LOCAL_READ_COSTS
    assert ReadTuning.for_storage(local).merge_gap == 80_000
    memory = storage_for(resolve("memory://costs"))
    assert memory.read_costs() is OBJECT_STORE_READ_COSTS


@pytest.mark.parametrize("tiled", [True, False])
def test_copy_verified_delivers_the_box_bit_exact_and_names_a_bad_tile(tiled):
    """A tile-aligned box copied tile by tile through a hashed scratch buffer equals the box
    (format 4 tiles, and flat blocks cutting rows over the whole chunk); a flipped byte inside
    the box raises naming its tile, one outside it is not this copy's concern."""
    sizes, block = (64, 256), 8 << 10
    data = np.random.default_rng(0).integers(0, 256, math.prod(sizes) * 4, np.uint8)
    grid = tensor_grid(sizes, 4, block, tiled=True) if tiled else flat_grid(len(data), 5000)
    expected = digests(grid, memoryview(data))
    lo, n = grid.widen((8, 64), (16, 128)) if tiled else ((0,), (grid.sizes[0],))
    out = bytearray(math.prod(n) * grid.itemsize)
    checksum.copy_verified(grid, data, memoryview(out), lo, n, expected, what="w")
    rows = data.reshape(sizes[0], sizes[1] * 4)
    box = rows[lo[0] : lo[0] + n[0], lo[1] * 4 : (lo[1] + n[1]) * 4] if tiled else data
    assert bytes(out) == box.tobytes()
    bad = data.copy()
    if tiled:
        bad[(lo[0] + n[0]) * sizes[1] * 4 + 5] ^= 1  # first row below the box
        checksum.copy_verified(grid, bad, memoryview(out), lo, n, expected, what="w")
        assert bytes(out) == box.tobytes()
    bad[(lo[0] + 3) * sizes[1] * 4 + (lo[1] * 4 if tiled else 0) + 1] ^= 1  # in the box
    with pytest.raises(ChecksumMismatchError, match=r"checksum mismatch in w, block \d+"):
        checksum.copy_verified(grid, bad, memoryview(out), lo, n, expected, what="w")


def _tile_by_tile(grid: Grid, data: np.ndarray) -> list[str]:
    """Reference digests: every tile cut out of the item by numpy slicing, in tile order."""
    arr = data.reshape(*grid.sizes[:-1], grid.sizes[-1] * grid.itemsize)
    out = []
    for _, (lo, n) in grid.tiles((0,) * len(grid.sizes), grid.sizes):
        index = tuple(slice(o, o + k) for o, k in zip(lo[:-1], n[:-1]))
        index += (slice(lo[-1] * grid.itemsize, (lo[-1] + n[-1]) * grid.itemsize),)
        out.append(xxhash.xxh3_64_hexdigest(np.ascontiguousarray(arr[index])))
    return out


@pytest.mark.parametrize(
    ("sizes", "itemsize", "block"),
    [((1000, 1024), 4, 1 << 20), ((90, 256, 4), 2, 8192), ((37, 512), 8, 1 << 14)],
)
def test_column_group_tiles_hashed_by_tile_row_match_tile_by_tile(sizes, itemsize, block):
    """Chunks whose tiles cut dims 0 and 1 (column groups, the last tile row shorter): whole
    rows are hashed one tile at a time through a gathering copy; the digests equal each
    tile's cut out alone, whole-row boxes verify, and a flipped byte names its tile."""
    grid = tensor_grid(sizes, itemsize, block, tiled=True)
    groups = checksum.column_groups(grid)
    assert groups > 1 and sizes[0] % grid.tile[0]  # column groups, a shorter last tile row
    data = np.random.default_rng(1).integers(0, 256, grid.nbytes, np.uint8)
    expected = _tile_by_tile(grid, data)
    assert digests(grid, memoryview(data)) == expected
    row = grid.nbytes // sizes[0]
    first, rows = grid.tile[0], sizes[0] - grid.tile[0]  # from the second tile row to the end
    part = memoryview(data[first * row :])
    box = ((first,) + (0,) * (len(sizes) - 1), (rows, *sizes[1:]))
    checksum.verify(grid, part, *box, expected, what="w")
    bad = data[first * row :].copy()
    bad[row + row // groups * (groups - 1) + 1] ^= 1  # second row, last column group
    with pytest.raises(ChecksumMismatchError, match=rf"in w, block {2 * groups - 1} "):
        checksum.verify(grid, memoryview(bad), *box, expected, what="w")


@pytest.mark.parametrize(
    ("sizes", "itemsize", "block"),
    [((1000, 1024), 4, 1 << 20), ((70, 256, 8), 4, 1 << 16), ((100, 512), 8, 1 << 16)],
)
def test_copy_verified_by_tile_rows_delivers_the_box_and_lands_no_row_with_a_bad_tile(
    sizes, itemsize, block
):
    """Column-group tiles are copied a tile row at a time: the box (middle column groups,
    rows to the shorter last tile row) arrives bit-exact; a flipped byte in the box raises
    naming its tile, and nothing of that tile row lands (the rows before it do); a flipped
    byte in a column group outside the box is not this copy's concern."""
    grid = tensor_grid(sizes, itemsize, block, tiled=True)
    groups = checksum.column_groups(grid)
    assert groups >= 4
    data = np.random.default_rng(2).integers(0, 256, grid.nbytes, np.uint8)
    expected = digests(grid, memoryview(data))
    lo, n = grid.widen((grid.tile[0], grid.tile[1]), (sizes[0] - grid.tile[0], 2 * grid.tile[1]))
    assert lo[0] + n[0] == sizes[0] and n[1] == 2 * grid.tile[1]
    row, piece = grid.nbytes // sizes[0], grid.nbytes // sizes[0] // groups
    want = data.reshape(sizes[0], row)[lo[0] :, piece : 3 * piece]
    out = np.full(want.size, 7, np.uint8)
    checksum.copy_verified(grid, data, memoryview(out), lo, n, expected, what="w")
    assert np.array_equal(out.reshape(want.shape), want)
    bad = data.copy()
    bad[(lo[0] + 1) * row + 3 * piece] ^= 1  # second row of the box, the group after it
    checksum.copy_verified(grid, bad, memoryview(out), lo, n, expected, what="w")
    assert np.array_equal(out.reshape(want.shape), want)
    bad[(lo[0] + grid.tile[0] + 2) * row + 2 * piece + 1] ^= 1  # 2nd tile row, 2nd tile
    out[:] = 7
    tile = 2 * groups + 2
    with pytest.raises(ChecksumMismatchError, match=rf"in w, block {tile} \(elements \["):
        checksum.copy_verified(grid, bad, memoryview(out), lo, n, expected, what="w")
    landed = out.reshape(want.shape)
    assert np.array_equal(landed[: grid.tile[0]], want[: grid.tile[0]])
    assert (landed[grid.tile[0] :] == 7).all()
