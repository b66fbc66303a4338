"""``device_copy.carry``: order, packing, slicing and the host-memory bound of staged bytes.

On a CPU machine the staging predicate picks CPU tensors, so the same slab logic the writer
uses for CUDA tensors runs with synchronous copies (tests/e2e/test_gpu.py runs it on a GPU).
"""

from __future__ import annotations

import io

import pytest
import torch

from dcpbridge.storage.backends import device_copy
from dcpbridge.storage.errors import InvalidArgumentError


def _staged(data: object) -> bool:
    return isinstance(data, torch.Tensor)


def _items() -> list[tuple[str, object]]:
    g = torch.Generator().manual_seed(3)
    return [
        ("small", torch.randn(10, generator=g)),
        ("object", io.BytesIO(b"not staged")),
        ("big", torch.randn(1000, generator=g)),  # 4000 bytes: spans several 1 KiB slabs
        ("empty", torch.empty(0)),
        ("bf16", torch.randn(7, 3, generator=g).to(torch.bfloat16)),
        ("transposed", torch.arange(12, dtype=torch.int32).reshape(3, 4).t()),
        ("flag", torch.tensor([True, False, True])),
        ("tail", torch.randn(300, generator=g)),
    ]


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(("slab_bytes", "slabs"), [(1024, 1), (1024, 3), (64, 2), (1 << 20, 2)])
def test_every_item_arrives_in_order_with_exact_bytes(slab_bytes, slabs):
    items = _items()
    got: dict[str, bytes] = {}
    order: list[str] = []
    for piece in device_copy.carry(items, stage=_staged, slab_bytes=slab_bytes, slabs=slabs):
        if piece.view is None:
            assert piece.first and piece.last
            order.append(piece.tag)
            got[piece.tag] = piece.data.getvalue()
            continue
        assert len(piece.view) <= slab_bytes
        if piece.first:
            order.append(piece.tag)
            got[piece.tag] = b""
        got[piece.tag] += bytes(piece.view)  # the view is only valid until the next piece
    assert order == [k for k, _ in items]
    for key, data in items:
        want = data.getvalue() if isinstance(data, io.BytesIO) else _bytes_of(data)
        assert got[key] == want, key


@pytest.mark.parametrize("slabs", [1, 2, 4])
def test_staged_bytes_ahead_of_the_consumer_stay_within_the_slabs(slabs):
    slab_bytes = 1000
    tensors = [
        (i, torch.full((n,), i, dtype=torch.uint8))
        for i, n in enumerate([300] * 20 + [5000, 10, 2500])
    ]
    pulled = 0

    def source():
        nonlocal pulled
        for tag, t in tensors:
            pulled += t.numel()
            yield tag, t

    consumed = 0
    for piece in device_copy.carry(source(), stage=_staged, slab_bytes=slab_bytes, slabs=slabs):
        consumed += len(piece.view)
        # bytes pulled but not yet handed over all sit in slabs (the last pulled item may be
        # waiting for a slab, hence one item of slack)
        assert pulled - consumed <= slabs * slab_bytes + 5000
        assert bytes(piece.view) == bytes([piece.tag]) * len(piece.view)
    assert consumed == pulled == sum(t.numel() for _, t in tensors)


def test_unstaged_items_pass_through_untouched():
    t = torch.ones(4)
    pieces = list(device_copy.carry([("a", t)]))  # CPU tensors are not device tensors
    assert len(pieces) == 1 and pieces[0].data is t and pieces[0].view is None


def test_bad_slab_settings_are_refused():
    with pytest.raises(InvalidArgumentError, match="slab_bytes and slabs"):
        list(device_copy.carry([("a", torch.ones(1))], stage=_staged, slabs=0))


def test_a_save_through_the_carried_path_records_each_items_place_and_digests(
    tmp_path, monkeypatch
):
    """The writer's device path (staged items' results) run on host tensors: every item's
    place, rank and digests are recorded where the reader looks (it once swapped the rank
    and the digests, so every save from a GPU failed at commit)."""
    import dcpbridge as db

    monkeypatch.setattr(device_copy, "on_device", _staged)
    g = torch.Generator().manual_seed(5)
    tensors = {
        "w": torch.randn(300, 70, generator=g),
        "b": torch.randn(70, generator=g).to(torch.bfloat16),
    }
    state = {
        k: db.ShardedTensor.from_box(k, v, tuple(v.shape), (0,) * v.dim())
        for k, v in tensors.items()
    }
    db.save({**state, "step": 3}, str(tmp_path))
    monkeypatch.undo()
    out = db.load(
        {
            k: db.ShardedTensor.from_box(k, torch.zeros_like(v), tuple(v.shape), (0,) * v.dim())
            for k, v in tensors.items()
        },
        str(tmp_path),
    )
    for k, v in tensors.items():
        assert torch.equal(out[k], v), k
    assert out["step"] == 3
