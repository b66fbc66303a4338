"""Deterministic global tensors and the boxes each rank holds in a named layout."""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable

import torch

from dcpbridge import ShardedTensor
from dcpbridge.formats.layout import even_pieces

Box = tuple[tuple[int, ...], tuple[int, ...]]

# key -> (global shape, dtype)
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "vec": ((10,), torch.float32),
    "w": ((12, 8), torch.float32),
    "w_bf16": ((12, 8), torch.bfloat16),
    "idx": ((12, 6), torch.int64),
}


def full(
    key: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The global tensor for ``key``: random values seeded by the key, so bit-exact checks bite."""
    if shape is None or dtype is None:
        shape, dtype = TENSORS[key]
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


def split(n: int, bounds: list[int]) -> list[tuple[int, int]]:
    """(start, length) pieces of ``range(n)`` cut at ``bounds``."""
    edges = [0, *bounds, n]
    return [(a, b - a) for a, b in itertools.pairwise(edges)]


def along(shape: tuple[int, ...], dim: int, pieces: list[tuple[int, int]]) -> list[Box]:
    boxes = []
    for start, size in pieces:
        offsets = [0] * len(shape)
        sizes = list(shape)
        offsets[dim], sizes[dim] = start, size
        boxes.append((tuple(offsets), tuple(sizes)))
    return boxes


def _rows(parts: int) -> Callable[[tuple[int, ...], int, int], list[Box]]:
    return lambda shape, rank, n: [along(shape, 0, even_pieces(shape[0], parts))[rank]]


def _cols(parts: int) -> Callable[[tuple[int, ...], int, int], list[Box]]:
    def f(shape: tuple[int, ...], rank: int, n: int) -> list[Box]:
        dim = 1 if len(shape) > 1 else 0
        return [along(shape, dim, even_pieces(shape[dim], parts))[rank]]

    return f


def _uneven_pieces(bounds_1d: list[int]) -> Callable[[tuple[int, ...], int, int], list[Box]]:
    """Dim-0 pieces cut at fixed fractions of the length, zero-size pieces included."""

    def f(shape: tuple[int, ...], rank: int, n: int) -> list[Box]:
        cuts = [min(b * shape[0] // 10, shape[0]) for b in bounds_1d]
        return [along(shape, 0, split(shape[0], cuts))[rank]]

    return f


def _grid(shape: tuple[int, ...], rank: int, n: int) -> list[Box]:
    if len(shape) == 1:
        return [along(shape, 0, even_pieces(shape[0], 4))[rank]]
    r, c = divmod(rank, 2)
    (ro, rs), (co, cs) = even_pieces(shape[0], 2)[r], even_pieces(shape[1], 2)[c]
    return [((ro, co) + (0,) * (len(shape) - 2), (rs, cs, *shape[2:]))]


def _interleaved(shape: tuple[int, ...], rank: int, n: int) -> list[Box]:
    """Each of 2 ranks holds two non-adjacent dim-0 pieces (several shards of one key)."""
    pieces = along(shape, 0, even_pieces(shape[0], 4))
    return [pieces[rank], pieces[rank + 2]]


def _whole(shape: tuple[int, ...], rank: int, n: int) -> list[Box]:
    return [((0,) * len(shape), shape)]


# layout name -> (ranks, boxes of a global shape held by a rank)
LAYOUTS: dict[str, tuple[int, Callable[[tuple[int, ...], int, int], list[Box]]]] = {
    "uneven3": (3, _uneven_pieces([4, 4])),  # [0:4] [4:4] (empty) [4:10]
    "uneven4": (4, _uneven_pieces([1, 7, 7])),  # [0:1] [1:7] [7:7] (empty) [7:10]
    "rows2": (2, _rows(2)),
    "rows3": (3, _uneven_pieces([4, 7])),
    "rows4": (4, _rows(4)),
    "cols2": (2, _cols(2)),
    "cols4": (4, _cols(4)),
    "grid4": (4, _grid),
    "interleaved2": (2, _interleaved),
    "whole1": (1, _whole),
}


def boxes(layout: str, key: str, rank: int) -> list[Box]:
    nranks, fn = LAYOUTS[layout]
    return fn(TENSORS[key][0], rank, nranks)


def shard(key: str, box: Box, *, replica_id: int | tuple[int, ...] = 0) -> ShardedTensor:
    offsets, sizes = box
    data = full(key)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()
    return ShardedTensor.from_box(key, data, TENSORS[key][0], offsets, replica_id=replica_id)


def template(key: str, box: Box) -> ShardedTensor:
    shape, dtype = TENSORS[key]
    offsets, sizes = box
    return ShardedTensor.from_box(key, torch.full(sizes, 7, dtype=dtype), shape, offsets)


def expected(key: str, box: Box) -> torch.Tensor:
    offsets, sizes = box
    return full(key)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
