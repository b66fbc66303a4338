"""Loads across dtypes: casts torch cannot make or that drop data, and quantized stored tensors,
refused naming the key before anything is read (one process, real files)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcpbridge as db
from dcpbridge.storage.format import sign_document


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


def test_a_quantized_tensor_of_a_dcp_checkpoint_is_refused_by_key(tmp_path):
    """torch's ``dcp.save`` stores a quantized tensor (its scale inside the chunk's pickle);
    its dtype in ``.metadata`` made a load, a cast or a source read fail inside torch
    (``INTERNAL ASSERT FAILED ... UnknownQuantizer``). Each raises ``DTypeMismatchError``
    naming the key; the checkpoint's other tensors load bit-exact."""
    w = torch.randn(4, 4)
    q = torch.quantize_per_tensor(torch.randn(4, 4), 0.1, 3, torch.qint8)
    path = str(tmp_path)
    dcp.save({"q": q, "w": w}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    match = "'q': stored as a quantized torch.qint8 tensor"
    with pytest.raises(db.DTypeMismatchError, match=match):
        db.load({"q": torch.zeros(4, 4)}, path)
    with pytest.raises(db.DTypeMismatchError, match=match):
        db.load(
            {"q": db.ShardedTensor.from_box("q", torch.zeros(4, 4), (4, 4), (0, 0))},
            path,
            allow_dtype_cast=True,
        )
    with pytest.raises(db.DTypeMismatchError, match=match):
        db.open_source(path).read("q", (0, 0), (4, 4))
    assert torch.equal(db.load({"w": torch.zeros(4, 4)}, path)["w"], w)


@pytest.mark.parametrize(
    ("saved", "name"),
    [
        (torch.float32, "qint32"),
        (torch.uint8, "qint8"),
        (torch.uint8, "quint8"),
        (torch.uint8, "quint4x2"),
        (torch.uint8, "quint2x4"),
    ],
)
def test_a_dcpbridge_document_naming_a_quantized_dtype_is_refused(tmp_path, saved, name):
    """dcpbridge never writes a quantized dtype; a (re-signed) document naming one of the
    same element size loaded ``qint32`` as a quantized tensor without its scale. The document
    is refused as corrupt, naming the dtype."""
    db.save({"x": _bytes_of(saved, (3, 4))}, str(tmp_path))
    doc = json.loads((tmp_path / "dcpbridge.json").read_text())
    doc["tensors"]["x"]["dtype"] = name
    (tmp_path / "dcpbridge.json").write_bytes(sign_document(doc))
    with pytest.raises(db.CorruptCheckpointError, match=f"unknown dtype '{name}'"):
        db.load({"x": torch.zeros(3, 4, dtype=saved)}, str(tmp_path))


def test_plain_dcp_load_of_another_dtype_through_the_reader_raises_a_checkpoint_error(tmp_path):
    """``dcp.load`` with DCP's default planner asks dcpbridge's reader for the template's
    dtype; the reader reads the stored dtype only and raised a bare ``RuntimeError`` (inside
    DCP's ``CheckpointException``). It raises ``InvalidArgumentError`` naming the key, both
    dtypes and the way to convert; the template is left as it was."""
    db.save({"x": torch.arange(12.0).reshape(3, 4)}, str(tmp_path))
    template = {"x": torch.zeros(3, 4, dtype=torch.bfloat16)}
    with pytest.raises(CheckpointException) as e:
        dcp.load(template, storage_reader=db.FsspecCheckpointReader(str(tmp_path)), no_dist=True)
    ((error, _),) = e.value.failures.values()
    assert isinstance(error, db.InvalidArgumentError), error
    assert "'x': planner resolved a torch.bfloat16 tensor" in str(error)
    assert "allow_dtype_cast=True" in str(error)
    assert not template["x"].any()
