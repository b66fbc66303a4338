"""Seeded resharding fuzz: random tensors saved in random grids load bit-exact into any boxes.

Each seed saves a few tensors (random dtype, 0-4 dims with sizes such as 0, 1, 7 and 13,
prepended axes) from one process as every chunk of an uneven grid, with checksum tiles of
random size, items listed as packed columns or not, on local disk or ``memory://``; then loads them twice into random other boxes
(sub-boxes spanning many stored chunks, the stored grid itself, whole-tensor plain
templates, ``allow_shape_mismatch`` boxes reaching past the stored shape), whose tensors are
contiguous, transposed or strided slices of a larger buffer, with and without checksum
verification, and compares the bytes (NaN payloads and -0.0 included) with the global tensor.
``DCPB_RESHARD_SEEDS=a:b`` runs seeds ``a..b-1`` instead of the few the suite runs.
"""

from __future__ import annotations

import itertools
import os
import random
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import dcpbridge as db
import dcpbridge.engine.save as save_engine
from dcpbridge.storage.write.writer import FsspecCheckpointWriter
from tests.support.dist_pool import Rank

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
]
Box = tuple[tuple[int, ...], tuple[int, ...]]


def _seeds(default: range) -> list[int]:
    """The seeds to run: ``DCPB_RESHARD_SEEDS=a:b`` or ``default``."""
    spec = os.environ.get("DCPB_RESHARD_SEEDS")
    if not spec:
        return list(default)
    a, b = spec.split(":")
    return list(range(int(a), int(b)))


def random_tensor(rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (NaN payloads, -0.0, float8's NaN), bools 0 or 1."""
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    raw = torch.frombuffer(bytearray(rng.randbytes(nbytes)), dtype=torch.uint8) if n else None
    if raw is None:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        raw = raw & 1
    elif dtype == torch.float32 and rng.random() < 0.5:
        raw[0::7] = 0xFF  # NaNs with payloads
    return raw.view(dtype).reshape(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements in C order (compares NaN payloads and -0.0)."""
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))
    return flat.view(torch.uint8)


def uneven_split(rng: random.Random, n: int, many: bool) -> list[tuple[int, int]]:
    """``(start, length)`` pieces of ``[0, n)``: 1-4 uneven ones, or with ``many`` up to 400."""
    k = rng.randint(1, min(n, 4)) if n > 0 else 1
    if many and 100 <= n <= 5000 and rng.random() < 0.5:
        k = rng.randint(50, min(n, 400))
    cuts = sorted(rng.sample(range(1, n), k - 1)) if n > 1 and k > 1 else []
    bounds = [0, *cuts, n]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(len(bounds) - 1)]


def grid(rng: random.Random, shape: tuple[int, ...]) -> list[Box]:
    """The boxes of a random uneven grid over ``shape``."""
    boxes: list[Box] = [((), ())]
    for n in shape:
        cut = uneven_split(rng, n, len(shape) == 1)
        boxes = [((*o, a), (*s, b)) for o, s in boxes for a, b in cut]
    return boxes


def destination(rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor of ``shape``: contiguous, a permuted view, or a slice of a larger one."""
    mode = rng.randint(0, 2)
    if mode == 0 or not shape:
        return torch.zeros(shape, dtype=dtype)
    if mode == 1 and len(shape) >= 2:
        perm = list(range(len(shape)))
        rng.shuffle(perm)
        inverse = [perm.index(d) for d in range(len(shape))]
        return torch.zeros([shape[p] for p in perm], dtype=dtype).permute(inverse)
    if rng.random() < 0.5:
        big = torch.zeros([s * 2 + 1 for s in shape], dtype=dtype)
        return big[tuple(slice(0, 2 * s, 2) for s in shape)]
    big = torch.zeros([s + 3 for s in shape], dtype=dtype)
    return big[tuple(slice(1, 1 + s) for s in shape)]


def random_shape(rng: random.Random, big: bool) -> tuple[int, ...]:
    """0-4 dims of sizes like 0, 1, 7, 13; a 1-D tensor to cut into many chunks; or a few MiB."""
    if big:
        return rng.choice(
            [
                (rng.randint(1 << 20, 3 << 20),),
                (rng.randint(300, 1500), rng.randint(900, 2100)),
                (3, rng.randint(300, 700), rng.randint(400, 900)),
            ]
        )
    if rng.random() < 0.1:
        return (rng.randint(100, 3000),)
    sizes = [0, 1, 1, 2, 3, 5, 7, 13, 16]
    return tuple(
        rng.choice(sizes) if rng.random() < 0.9 else rng.randint(1, 40)
        for _ in range(rng.randint(0, 4))
    )


def random_state(
    rng: random.Random,
) -> tuple[dict[str, Any], dict[str, list[Box]], dict[str, Any]]:
    """1-4 random tensors as every chunk of uneven grids: ``{key: (global, prepended)}``, the
    boxes of each key and the state dict to save."""
    tensors: dict[str, Any] = {}
    stored: dict[str, list[Box]] = {}
    state: dict[str, Any] = {}
    big = rng.random() < 0.05
    for i in range(rng.randint(1, 4)):
        dtype = rng.choice(DTYPES)
        shape = random_shape(rng, big and i == 0)
        p = rng.randint(0, 2)
        pre = tuple(rng.randint(1, 3) for _ in range(p))
        full = random_tensor(rng, pre + shape, dtype)
        key = f"t{i}"
        shards = []
        for o, s in grid(rng, pre + shape):
            inner = tuple(slice(a, a + b) for a, b in zip(o[p:], s[p:]))
            ranges = [range(a, a + b) for a, b in zip(o[:p], s[:p])]
            for at in itertools.product(*ranges):  # size 1 along every prepended axis
                local = full[at + inner].clone()
                shards.append(
                    db.ShardedTensor.from_box(
                        key, local, pre + shape, at + o[p:], prepend_axis_num=p
                    )
                )
        rng.shuffle(shards)
        state[key] = shards
        tensors[key] = (full, p)
        stored[key] = [(sh.global_offset, (1,) * p + sh.local_shape) for sh in shards]
    return tensors, stored, state


def save_random(rng: random.Random, path: str) -> tuple[dict[str, Any], dict[str, list[Box]]]:
    """Save ``random_state``'s tensors; their globals and stored boxes."""
    tensors, stored, state = random_state(rng)
    db.save(state, path)
    return tensors, stored


def random_boxes(rng: random.Random, shape: tuple[int, ...], p: int) -> list[Box]:
    """1-3 random boxes of ``shape``, size 1 along the ``p`` prepended axes."""
    boxes = []
    for _ in range(rng.randint(1, 3)):
        o, s = [], []
        for d, n in enumerate(shape):
            if d < p:
                a, b = rng.randint(0, n - 1), 1
            elif rng.random() < 0.4:
                a, b = 0, n
            else:
                a = rng.randint(0, n)
                b = rng.randint(0, n - a)
            o.append(a)
            s.append(b)
        boxes.append((tuple(o), tuple(s)))
    return boxes


def near(rng: random.Random, box: Box, shape: tuple[int, ...], p: int) -> Box:
    """``box`` itself, or (one time in four) a box at its offset of other sizes."""
    if rng.random() < 0.75:
        return box
    o, s = box
    sizes = tuple(
        b if d < p else rng.randint(0, n - a) for d, (a, b, n) in enumerate(zip(o, s, shape))
    )
    return o, sizes


def request(
    rng: random.Random, key: str, full: torch.Tensor, p: int, boxes: list[Box], mismatch: bool
) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A template for ``boxes`` of ``key`` and its ``(destination, expected)`` pairs."""
    shape = tuple(full.shape)
    shards, pairs, offsets = [], [], {}
    for o, s in boxes:
        dst = destination(rng, s[p:], full.dtype)
        if mismatch:  # another template shape: the overlap read, the rest zero
            other = tuple(max(0, n + rng.randint(-2, 2)) for n in shape)
            s = tuple(rng.randint(0, n) for n in other)
            dst = destination(rng, s, full.dtype)
            o = tuple(rng.randint(0, n - b) for n, b in zip(other, s))
            padded = torch.zeros([max(a, b) for a, b in zip(shape, other)], dtype=full.dtype)
            padded[tuple(slice(0, n) for n in shape)] = full
            want = padded[tuple(slice(a, a + b) for a, b in zip(o, s))]
            shard = db.ShardedTensor.from_box(key, dst, other, o, allow_shape_mismatch=True)
        else:
            want = full[tuple(slice(a, a + b) for a, b in zip(o, s))].reshape(s[p:])
            shard = db.ShardedTensor.from_box(key, dst, shape, o, prepend_axis_num=p)
        if offsets.get(o, s) != s:  # boxes at one offset must agree in size (DCP's item index)
            continue
        offsets[o] = s
        shards.append(shard)
        pairs.append((dst, want))
        if rng.random() < 0.1:  # the same box twice, in another tensor
            again = destination(rng, tuple(dst.shape), dst.dtype)
            shards.append(
                db.ShardedTensor.from_box(
                    key,
                    again,
                    shard.global_shape,
                    shard.global_offset,
                    prepend_axis_num=shard.prepend_axis_num,
                    allow_shape_mismatch=shard.allow_shape_mismatch,
                )
            )
            pairs.append((again, want))
    if not shards:
        return None, []
    return (shards if len(shards) > 1 else shards[0]), pairs


def run_seed(seed: int, root: Path) -> int:
    """One seed: save, then two loads into random layouts; returns the boxes compared."""
    rng = random.Random(seed)
    local = rng.random() < 0.6
    path = str(root / f"s{seed}") if local else f"memory://reshard-fuzz/s{seed}"
    tensors, stored = save_random(rng, path)
    compared = 0
    try:
        for _ in range(2):
            template: dict[str, Any] = {}
            expected: list[tuple[str, torch.Tensor, torch.Tensor]] = []
            for key, (full, p) in tensors.items():
                if p == 0 and rng.random() < 0.1:  # the whole tensor as a plain template
                    dst = destination(rng, tuple(full.shape), full.dtype)
                    template[key] = dst
                    expected.append((key, dst, full))
                    continue
                mismatch = p == 0 and rng.random() < 0.15
                if rng.random() < 0.35:  # the stored grid itself, most of it, or boxes at
                    # its chunks' offsets shrunk or grown
                    boxes = [near(rng, b, tuple(full.shape), p) for b in stored[key]]
                    boxes = [b for b in boxes if rng.random() < 0.8]
                    mismatch = False
                else:
                    boxes = random_boxes(rng, tuple(full.shape), p)
                value, pairs = request(rng, key, full, p, boxes, mismatch)
                if value is not None:
                    template[key] = value
                    expected += [(key, d, w) for d, w in pairs]
            verify = rng.random() < 0.6
            db.load(template, path, verify_checksums=verify)
            for key, dst, want in expected:
                assert dst.shape == want.shape
                same = torch.equal(as_bytes(dst), as_bytes(want))
                assert same, f"seed {seed}: {key} {tuple(want.shape)} {want.dtype} {verify=}"
                compared += 1
    finally:
        if not local:
            fsspec.filesystem("memory").rm(path, recursive=True)
    return compared


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``db.save``'s writer with checksum tiles of the size set in the returned cell's first
    entry, its items as packed columns (however few) where the second is true."""
    cell: list[Any] = [None, False]

    class Writer(FsspecCheckpointWriter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if cell[0]:
                kwargs["checksum_block_size"] = cell[0]
            super().__init__(*args, **kwargs)
            self.columns = cell[1]

    monkeypatch.setattr(save_engine, "FsspecCheckpointWriter", Writer)
    return cell


@pytest.mark.parametrize("seed", _seeds(range(6)))
def test_random_reshards_are_bit_exact(seed: int, tmp_path: Path, small_tiles: list) -> None:
    """Random saves load bit-exact into random boxes, layouts and strides."""
    settings = random.Random(~seed)
    small_tiles[0] = settings.choice([None, None, 64, 1000, 4096, 65536, 100000])
    small_tiles[1] = settings.random() < 0.5
    assert run_seed(seed, tmp_path) >= 0


def test_zero_dim_and_large_tensors_reshard(tmp_path: Path, small_tiles: list) -> None:
    """A 0-dim tensor and ~6 MiB tensors (past the span and coalescing limits) load exactly."""
    rng = random.Random(7)
    scalar = random_tensor(rng, (), torch.float32)
    wide = random_tensor(rng, (1031, 1537), torch.float32)  # ~6 MiB, odd sizes
    long = random_tensor(rng, (3 << 20,), torch.bfloat16)
    rows, cols = [0, 301, 302, 1031], [0, 777, 1537]
    state = {
        "s": db.ShardedTensor.from_box("s", scalar.clone(), (), ()),
        "w": [
            db.ShardedTensor.from_box("w", wide[r0:r1, c0:c1].clone(), wide.shape, (r0, c0))
            for r0, r1 in itertools.pairwise(rows)
            for c0, c1 in itertools.pairwise(cols)
        ],
        "l": [
            db.ShardedTensor.from_box("l", long[a:b].clone(), long.shape, (a,))
            for a, b in itertools.pairwise([0, 1 << 20, (1 << 20) + 3, 3 << 20])
        ],
    }
    for tiles, verify in [(None, True), (4096, True), (4096, False)]:
        small_tiles[0] = tiles
        path = str(tmp_path / f"ck{tiles}{verify}")
        db.save(state, path)
        w_t = torch.zeros(1537, 1031).T[5:1000, 100:1500]  # transposed, spans 6 chunks
        l_t = torch.zeros(3 << 20, dtype=torch.bfloat16)[7 : 7 + (2 << 20) + 11]
        s_t = torch.zeros(())
        db.load(
            {
                "s": s_t,
                "w": db.ShardedTensor.from_box("w", w_t, wide.shape, (5, 100)),
                "l": db.ShardedTensor.from_box("l", l_t, long.shape, (999_999,)),
            },
            path,
            verify_checksums=verify,
        )
        assert torch.equal(as_bytes(s_t), as_bytes(scalar))
        assert torch.equal(as_bytes(w_t), as_bytes(wide[5:1000, 100:1500]))
        assert torch.equal(as_bytes(l_t), as_bytes(long[999_999 : 999_999 + (2 << 20) + 11]))


def local_shape(full: torch.Tensor, mesh: DeviceMesh, place: Any) -> tuple[int, ...]:
    """This rank's shape of ``full`` placed by ``place`` (torch's uneven Shard sizes)."""
    shape, _ = compute_local_shape_and_global_offset(full.shape, mesh, [place])
    return tuple(shape)


def _dtensor_reshard(r: Rank, path: str, seed: int) -> int:
    """Save random tensors in random uneven grids split over the ranks, load them as DTensors
    with random placements (local tensors strided or not, fully parallel or not); returns
    the tensors compared."""
    rng = random.Random(seed)
    mesh = DeviceMesh.from_group(r.group or dist.group.WORLD, "cpu")
    world = dist.get_world_size(r.group)
    fulls, state = {}, {}
    for i in range(3):
        dtype = rng.choice(DTYPES)
        shape = tuple(rng.choice([1, 2, 5, 7, 13]) for _ in range(rng.randint(1, 3)))
        full = random_tensor(rng, shape, dtype)
        boxes = grid(rng, shape)
        fulls[f"d{i}"] = full
        state[f"d{i}"] = [
            db.ShardedTensor.from_box(
                f"d{i}", full[tuple(slice(a, a + b) for a, b in zip(o, s))].clone(), shape, o
            )
            for j, (o, s) in enumerate(boxes)
            if j % world == r.rank
        ]
    db.save(state, path, process_group=r.group)
    template = {}
    for key, full in fulls.items():
        place = rng.choice([Replicate(), *(Shard(d) for d in range(full.ndim))])
        template[key] = DTensor.from_local(
            destination(rng, local_shape(full, mesh, place), full.dtype),
            mesh,
            [place],
            run_check=False,
            shape=full.shape,
            stride=full.stride(),
        )
    out = db.load(
        template,
        path,
        process_group=r.group,
        verify_checksums=rng.random() < 0.5,
        fully_parallel=rng.random() < 0.5,
    )
    for key, full in fulls.items():
        got = out[key]
        assert isinstance(got, DTensor) and got is template[key]
        shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, got.placements)
        want = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        assert torch.equal(as_bytes(got.to_local()), as_bytes(want)), (seed, key)
    return len(fulls)


@pytest.mark.parametrize("world", [2, 3])
def test_dtensor_templates_reshard_exactly(pool, tmp_path: Path, world: int) -> None:
    """Uneven grids saved by ``world`` ranks load bit-exact into DTensor shards."""
    for seed in _seeds(range(2)):
        path = str(tmp_path / f"w{world}s{seed}")
        assert pool.run(_dtensor_reshard, world, path, seed, timeout=60) == [3] * world


def _parallel_reshard(r: Rank, path: str, seed: int) -> int:
    """Every rank loads random boxes with ``fully_parallel``
    (some boxes asked by every rank, some by this rank only); returns the boxes compared."""
    shared = random.Random(seed)
    tensors, _, _ = random_state(shared)  # as the test saved them
    own = random.Random(seed * 1000 + r.rank)
    template: dict[str, Any] = {}
    expected = []
    for key, (full, p) in tensors.items():
        boxes = random_boxes(shared, tuple(full.shape), p) + random_boxes(own, tuple(full.shape), p)
        picked, seen = [], set()
        for o, s in boxes:
            if o not in seen:
                seen.add(o)
                picked.append((o, s))
        value, pairs = request(own, key, full, p, picked, False)
        if value is not None:
            template[key] = value
            expected += pairs
    db.load(
        template,
        path,
        process_group=r.group,
        fully_parallel=True,
        parallelization_group=r.group,
        verify_checksums=shared.random() < 0.5,
    )
    for dst, want in expected:
        assert torch.equal(as_bytes(dst), as_bytes(want)), (seed, r.rank)
    return len(expected)


@pytest.mark.parametrize("world", [2, 4])
def test_fully_parallel_loads_of_random_boxes_are_exact(pool, tmp_path: Path, world: int) -> None:
    """Boxes read by one rank and sent to the others arrive bit-exact."""
    for seed in _seeds(range(2)):
        path = str(tmp_path / f"p{world}s{seed}")
        save_random(random.Random(seed), path)
        counts = pool.run(_parallel_reshard, world, path, seed, timeout=60)
        assert len(counts) == world
