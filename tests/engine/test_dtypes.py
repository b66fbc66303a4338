"""Loads across dtypes: casts torch cannot make or that drop data, refused naming the key before
anything is read (one process, real files)."""

from __future__ import annotations

import pytest
import torch

import dcpbridge as db


def _bytes_of(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` holding every byte value in turn."""
    n = torch.Size(shape).numel() * dtype.itemsize
    return (torch.arange(n) % 256).to(torch.uint8).view(dtype).reshape(shape)


def _st(t: torch.Tensor) -> db.ShardedTensor:
    return db.ShardedTensor.from_rank_offsets("x", t)


@pytest.mark.parametrize(
    ("stored", "requested"),
    [
        (torch.bits8, torch.uint8),
        (torch.float32, torch.bits16),
        (torch.float4_e2m1fn_x2, torch.float32),
        (torch.complex64, torch.float32),
        (torch.complex128, torch.bfloat16),
    ],
    ids=str,
)
def test_a_cast_that_cannot_keep_the_values_is_refused_by_key(tmp_path, stored, requested):
    """``allow_dtype_cast=True`` into or out of a dtype torch has no conversion for (bits,
    float4) raised torch's ``NotImplementedError`` from inside the read; a complex checkpoint
    cast into a real template dropped the imaginary parts with only torch's warning. Both
    raise ``DTypeMismatchError`` naming the key and dtypes, the template left as it was."""
    db.save({"x": _st(_bytes_of(stored, (3, 4)))}, str(tmp_path))
    template = _bytes_of(requested, (3, 4)).clone()
    before = template.view(torch.uint8).clone()
    with pytest.raises(db.DTypeMismatchError, match=f"'x': stored as {stored}") as err:
        db.load({"x": _st(template)}, str(tmp_path), allow_dtype_cast=True)
    assert f"cannot be cast to {requested}" in str(err.value)
    assert torch.equal(template.view(torch.uint8), before)


def test_a_real_checkpoint_still_casts_into_a_complex_template(tmp_path):
    """The casts that keep every stored value still convert: real into complex."""
    w = torch.randn(3, 4)
    db.save({"x": _st(w)}, str(tmp_path))
    out = db.load(
        {"x": _st(torch.zeros(3, 4, dtype=torch.complex64))}, str(tmp_path), allow_dtype_cast=True
    )["x"]
    assert torch.equal(out.real, w) and not out.imag.any()
