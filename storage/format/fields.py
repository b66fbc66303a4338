"""Readers of a metadata document's JSON fields: each checks a type and range before use and
raises ``CorruptCheckpointError`` naming the field (shared by the packed and row layouts)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from dcpbridge.storage.errors import CorruptCheckpointError
from dcpbridge.storage.format.table import MAX_NDIM, MAX_SIZE, TensorHeader

_DTYPES: dict[str, torch.dtype] = {}
# Tensors of these dtypes are only meaningful with their scale and zero point, which no stored
# tensor entry records: dcpbridge refuses to save them, and a document naming one is corrupt.
QUANTIZED_DTYPES = frozenset(
    {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
)

_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (as ``dtype_name`` writes it); refuses anything else."""
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is not None:
        return dtype
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if (
        not isinstance(dtype, torch.dtype)
        or dtype_name(dtype) != name
        or dtype.itemsize < 1
        or dtype in QUANTIZED_DTYPES
    ):
        raise CorruptCheckpointError(f"unknown dtype {_show(name)}")
    _DTYPES[name] = dtype
    return dtype


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(value: Any, what: str, lo: int = 0, hi: int = MAX_SIZE) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise CorruptCheckpointError(
            f"{what} must be an integer in [{lo}, {hi}], got {_show(value)}"
        )
    return value


def _ints(values: Any, what: str, n: int | None = None) -> list[int]:
    if type(values) is not list or (n is not None and len(values) != n):
        need = f"{n} integers" if n is not None else "integers"
        raise CorruptCheckpointError(f"{what} must be a list of {need}, got {_show(values)}")
    if len(values) > MAX_NDIM:
        raise CorruptCheckpointError(f"{what} has {len(values)} dimensions (at most {MAX_NDIM})")
    return [_int(v, what) for v in values]


def _dict(value: Any, what: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise CorruptCheckpointError(f"{what} must be a JSON object, got {_show(value)}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if type(value) is not list:
        raise CorruptCheckpointError(f"{what} must be a JSON list, got {_show(value)}")
    return value


def _field(entry: dict[str, Any], name: str, what: str) -> Any:
    if name not in entry:
        raise CorruptCheckpointError(f"{what}: field {name!r} is missing")
    return entry[name]


def _plain_shape(shape: Any) -> bool:
    """A list of at most MAX_NDIM ints in [0, MAX_SIZE] (a plain loop: the per-tensor check)."""
    if type(shape) is not list or len(shape) > MAX_NDIM:
        return False
    for v in shape:
        if type(v) is not int or not 0 <= v <= MAX_SIZE:
            break
    else:
        return True
    return False


def tensor_headers(
    names: Sequence[Any], dtypes: Sequence[Any], shapes: Sequence[Any]
) -> list[TensorHeader]:
    """Validated tensor headers: string names, known dtypes, shapes of at most 2**62 bytes."""
    out = []
    for name, dtype_text, shape in zip(names, dtypes, shapes):
        if type(name) is not str:
            raise CorruptCheckpointError(f"tensor name {_show(name)} is not a string")
        dtype = parse_dtype(dtype_text)
        if not _plain_shape(shape):  # checked again, naming the tensor on failure
            what = f"tensor {name!r}"
            if type(shape) is not list or len(shape) > MAX_NDIM:
                shape = _ints(shape, f"{what} shape")
            if not all(type(v) is int and 0 <= v <= MAX_SIZE for v in shape):
                _ints(shape, f"{what} shape")
        n = math.prod(shape)
        if n > MAX_SIZE or n * dtype.itemsize > MAX_SIZE:
            raise CorruptCheckpointError(f"tensor {name!r} shape: {shape} elements are too many")
        out.append(TensorHeader(name, dtype, tuple(shape)))
    return out


def check_names(tensors: Sequence[str], objects: Sequence[str]) -> None:
    """Every stored name appears once (a tensor and an object may not share one)."""
    if len(set(tensors)) != len(tensors):
        raise CorruptCheckpointError("a tensor is listed twice")
    seen = set(tensors)
    for fqn in objects:
        if type(fqn) is not str:
            raise CorruptCheckpointError(f"object name {_show(fqn)} is not a string")
        if fqn in seen:
            raise CorruptCheckpointError(f"{fqn!r} is both a tensor and an object")
        seen.add(fqn)
